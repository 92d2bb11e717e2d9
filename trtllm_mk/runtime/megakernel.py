"""Python host side of the megakernel: bind weights, KV cache and activation buffers by device
pointer, pack the kernel's Params struct once, and launch decode steps on a CUDA stream.

The step state (tokens, positions, step counter) lives on the device, so a step is only a launch:
it can be captured in a CUDA graph, called from a torch custom op or from the TensorRT plugin.
"""
from __future__ import annotations

import weakref

from dataclasses import dataclass, fields
from pathlib import Path

import torch

from .. import seam
from ..codegen import KERNEL_NAME, KernelLayout
from ..errors import EngineError
from ..kv_cache import PagedKVCache
from ..model.spec import ModelSpec
from ..quant.kernel_layout import kernel_tensors
from ..schedule import Schedule
from ..sampling import MAX_TOP_LOGPROBS
from ..seam import (CAND_HIST_BINS, ERROR_CODES, ERROR_FIELDS, ERROR_WORDS, SAMPLING_SLOT_BYTES, TRACE_SM_WORDS, TRACE_WORDS,
                    error_word)

# mk::Params and mk::LayerWeights are described once, in trtllm_mk/seam.py.
PARAM_FIELDS = [f.name for f in seam.PARAMS]
LAYER_FIELDS = [(w.field, w.hf_suffix) for w in seam.LAYER_WEIGHTS]
SCALE_FIELDS = [(w.field, w.hf_suffix) for w in seam.LAYER_SCALES]


def load_runtime():
    """The compiled runtime extension, or a clear error saying how to get it."""
    try:
        from .. import _mkrt  # type: ignore[attr-defined]
    except ImportError as e:
        raise EngineError("the megakernel runtime (trtllm_mk._mkrt) is not built: install on a machine with the "
                          f"CUDA toolkit (pip install -e .) ({e})") from None
    return _mkrt


# buffers of tagged words (graph.tasks Event.polled): int64, an fp32 value under its (step, layer) tag
# each (mk::st_tagged); int32, a bf16 value under the tag's low 16 bits (mk::st_tagged_bf16)
TAGGED_BUFFERS = ("qkv", "act")


@dataclass
class DecodeBuffers:
    x: torch.Tensor
    qkv: torch.Tensor
    part_o: torch.Tensor
    part_ml: torch.Tensor
    attn_out: torch.Tensor
    act: torch.Tensor
    logits: torch.Tensor
    lm_val: torch.Tensor
    lm_idx: torch.Tensor
    tokens: torch.Tensor
    pos: torch.Tensor
    history: torch.Tensor
    counters: torch.Tensor
    control: torch.Tensor
    error: torch.Tensor   # pinned host memory: readable after a kernel trap killed the context
    sampling: torch.Tensor   # [B, SAMPLING_SLOT_BYTES] mk::SamplingSlot per row (zero: greedy)
    lm_lse: torch.Tensor
    logprobs: torch.Tensor   # [B, 1 + MAX_TOP_LOGPROBS]
    top_ids: torch.Tensor    # [B, MAX_TOP_LOGPROBS]
    cand_hist: torch.Tensor  # [B, CAND_HIST_BINS], zero between steps
    router_logits: torch.Tensor | None   # mixture of experts (kinds/route.py; None: dense): [B, E]
    moe_slot: torch.Tensor | None        # [NSLOT]
    moe_w: torch.Tensor | None           # [NSLOT, B]
    moe_act: torch.Tensor | None         # [NSLOT, B, I]
    moe_xn: torch.Tensor | None          # [B, H]
    router_acc: torch.Tensor | None      # [L, B, E, ROUTER_ACC_STRIDE] int64 (fixed point, word 0)
    expert_sum: torch.Tensor | None      # [L + 1, B, H] int64 (fixed point), zero between steps

    def values(self, name: str) -> torch.Tensor:
        """Buffer ``name`` as fp32 values: a tagged buffer (TAGGED_BUFFERS) holds each value in the low
        half of its word."""
        t = getattr(self, name)
        if name not in TAGGED_BUFFERS:
            return t
        if t.dtype == torch.int64:
            return (t & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
        return ((t & 0xFFFF) << 16).view(torch.float32)

    @classmethod
    def allocate(cls, spec: ModelSpec, batch: int, schedule: Schedule, layout: KernelLayout,
                 device: torch.device, peer_alloc=None) -> "DecodeBuffers":
        """``peer_alloc(shape, dtype)``: where the buffers other ranks write into live (seam.PEER_FIELDS;
        tensor parallelism over several GPUs: memory every rank can reach); zero-filled."""
        f32 = dict(dtype=torch.float32, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        tagged = dict(dtype=torch.int64, device=device)   # tagged words (mk::st_tagged): zero holds no tag
        S, G = schedule.plan.attn_splits, spec.group_size
        qkvr = spec.num_kv_heads * (G + 2) * spec.head_dim
        tiles = layout.tensor_parallel * layout.n_lm_tiles   # every rank's LM-head tiles

        def shared(shape, dtype):
            if peer_alloc is None:
                return torch.zeros(shape, dtype=dtype, device=device)
            return peer_alloc(shape, dtype).zero_()

        return cls(
            x=shared((batch, spec.hidden_size), torch.int64),   # fixed point
            qkv=torch.zeros(batch, qkvr, **tagged),
            part_o=torch.empty(batch, spec.num_kv_heads, S, G, spec.head_dim, **f32),
            part_ml=torch.empty(batch, spec.num_kv_heads, S, G, 2, **f32),
            attn_out=torch.empty(batch, spec.q_size, **f32),
            act=torch.zeros(batch, spec.intermediate_size, dtype=torch.int32, device=device),   # tagged bf16
            logits=torch.empty(batch, spec.vocab_size, **f32),
            lm_val=shared((batch, tiles), torch.float32),
            lm_idx=shared((batch, tiles), torch.int32),
            tokens=torch.zeros(batch, **i32),
            pos=torch.zeros(batch, **i32),
            history=torch.full((batch, layout.history_len), -1, **i32),
            counters=shared((layout.num_counters,), torch.int32),
            control=torch.zeros(4, **i32),
            error=torch.zeros(ERROR_WORDS, dtype=torch.int32).pin_memory(),
            sampling=torch.zeros(batch, SAMPLING_SLOT_BYTES, dtype=torch.uint8, device=device),
            lm_lse=torch.zeros(batch, layout.n_lm_tiles, 4, **f32),
            logprobs=torch.zeros(batch, 1 + MAX_TOP_LOGPROBS, **f32),
            top_ids=torch.zeros(batch, MAX_TOP_LOGPROBS, **i32),
            cand_hist=torch.zeros(batch, CAND_HIST_BINS, **i32),
            **cls._moe(spec, batch, f32, i32),
        )

    @staticmethod
    def _moe(spec: ModelSpec, batch: int, f32: dict, i32: dict) -> dict:
        if not spec.is_moe:
            return dict(router_logits=None, moe_slot=None, moe_w=None, moe_act=None, moe_xn=None, router_acc=None,
                        expert_sum=None)
        n, L = spec.moe_slots(batch), spec.num_layers
        i64 = dict(dtype=torch.int64, device=f32["device"])
        return dict(router_logits=torch.zeros(batch, spec.num_experts, **f32), moe_slot=torch.zeros(n, **i32),
                    moe_w=torch.zeros(n, batch, **f32), moe_act=torch.zeros(n, batch, spec.mlp_intermediate, **f32),
                    moe_xn=torch.zeros(batch, spec.hidden_size, **f32),
                    router_acc=torch.zeros(L, batch, spec.num_experts, seam.ROUTER_ACC_STRIDE, **i64),
                    expert_sum=torch.zeros(L + 1, batch, spec.hidden_size, **i64))


def _check_tensor(name: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    if tuple(t.shape) != tuple(shape):
        raise EngineError(f"{name}: shape {tuple(t.shape)} but the engine needs {tuple(shape)}")
    if t.dtype != dtype:
        raise EngineError(f"{name}: dtype {t.dtype} but the engine needs {dtype}")
    if t.device != device:
        raise EngineError(f"{name}: on {t.device} but the engine runs on {device}")
    if not t.is_contiguous():
        raise EngineError(f"{name}: must be contiguous")


# id of an expert down matrix -> (a reference to it, its copy in the other layout) while the matrix
# lives (MegakernelDecoder._expert_down)
_TRANSPOSED: dict[int, tuple[weakref.ref, torch.Tensor]] = {}


class MegakernelDecoder:
    """One compiled megakernel bound to weights, a paged KV cache and its own activation buffers."""

    def __init__(self, schedule: Schedule, cubin: str | Path, layout: KernelLayout, weights: dict[str, torch.Tensor],
                 cache: PagedKVCache, inv_freq: torch.Tensor, cooperative: bool = True, peer_alloc=None):
        """A tensor-parallel kernel (``layout.tensor_parallel`` > 1) binds one rank's shard and cache;
        ``connect`` then tells it its rank and every rank's cross-rank buffers (``peer_alloc``: see
        DecodeBuffers.allocate) before the first step."""
        spec, B = schedule.spec, schedule.batch
        self.spec, self.schedule, self.layout, self.batch = spec, schedule, layout, B
        dev = cache.pool.device
        if dev.type != "cuda":
            raise EngineError("the megakernel needs CUDA tensors (weights and KV cache on the GPU)")
        self.device = dev
        self._check_bindings(weights, cache)
        self.weights, self.cache = weights, cache
        self.inv_freq = inv_freq.to(device=dev, dtype=torch.float32).contiguous()
        self.buf = DecodeBuffers.allocate(spec, B, schedule, layout, dev, peer_alloc)
        self._trace: torch.Tensor | None = None
        self.rank, self._peer_table = 0, None   # tensor parallelism: set by connect
        self._layer_table = self._pack_layer_table(weights, LAYER_FIELDS)
        self._scale_table = self._pack_layer_table(weights, SCALE_FIELDS) if spec.quantized else None
        self._routers, self._experts = self._pack_expert_tables(weights) if spec.is_moe else (None, None)
        # the router through o_proj of each sparse layer (kept alive here) and its [L] pointer table
        self._router_o_mats, self._router_o = (self._pack_router_o(weights) if spec.is_moe and schedule.plan.expert_fused
                                               else ([], None))
        self._params = self._pack_params()
        mkrt = load_runtime()
        with torch.cuda.device(dev):
            self.module = mkrt.Module(str(cubin), KERNEL_NAME, layout.grid, layout.block, layout.smem_bytes,
                                      cooperative, dev.index or 0)

    # ------------------------------------------------------------------ binding
    def _check_bindings(self, weights: dict[str, torch.Tensor], cache: PagedKVCache) -> None:
        spec, dev = self.spec, cache.pool.device
        downs = self._down_names() if spec.is_moe else set()
        for name, (shape, dtype) in kernel_tensors(spec).items():
            if name not in weights:
                raise EngineError(f"weights: missing {name}")
            t = weights[name]
            if name in downs and t.dim() == 2 and not t.is_contiguous() and t.t().is_contiguous():
                t, shape = t.t(), tuple(reversed(shape))   # transposed storage (_expert_down binds either layout)
            _check_tensor(f"weights[{name}]", t, shape, dtype, dev)
        L, NKV, D = spec.num_layers, spec.num_kv_heads, spec.head_dim
        pool = cache.pool
        if pool.dim() != 6 or (pool.shape[0], pool.shape[2], pool.shape[3], pool.shape[4], pool.shape[5]) != (
                L, 2, NKV, self.layout.tokens_per_block, D):
            raise EngineError(f"kv cache: pool shape {tuple(pool.shape)} but the engine needs "
                              f"[{L}, blocks, 2, {NKV}, {self.layout.tokens_per_block}, {D}]")
        _check_tensor("kv cache pool", pool, tuple(pool.shape), torch.bfloat16, dev)
        bt = cache.block_table
        need = -(-self.layout.history_len // self.layout.tokens_per_block)
        if bt.dim() != 2 or bt.shape[0] != self.batch or bt.shape[1] < need:
            raise EngineError(f"block table: shape {tuple(bt.shape)} but the engine needs [{self.batch}, >= {need}]")
        _check_tensor("block table", bt, tuple(bt.shape), torch.int32, dev)

    def _pack_layer_table(self, weights: dict[str, torch.Tensor], table: list[tuple[str, str]]) -> torch.Tensor:
        rows = []
        for i in range(self.spec.num_layers):
            p = f"model.layers.{i}."
            rows.append([weights[p + hf].data_ptr() if (p + hf) in weights else 0 for _, hf in table])
        return torch.tensor(rows, dtype=torch.int64, device=self.device)

    def _down_names(self) -> set[str]:
        return {d for i in range(self.spec.num_layers) if self.spec.is_moe_layer(i) for _, _, d in self.spec.moe_names(i)[1]}

    def _expert_down(self, t: torch.Tensor) -> torch.Tensor:
        """An expert's down matrix [H, I] in the layout the kernel streams: row-major, or under
        TilePlan.expert_fused transposed, [I, H] rows (kinds/emlp.py). Storage already in that layout
        (for fused plans the engine's, share_fused_storage transposed_down) is bound as it is;
        otherwise the decoder keeps a copy in it, a third of the experts' bytes more, shared by the
        decoders bound to the same tensor while it lives."""
        fused = self.schedule.plan.expert_fused
        if fused and t.t().is_contiguous():
            return t.t()
        if not fused and t.is_contiguous():
            return t
        hit = _TRANSPOSED.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        try:
            copy = t.t().contiguous() if fused else t.contiguous()
        except torch.cuda.OutOfMemoryError:
            raise EngineError(f"the {'fused' if fused else 'split'} expert tiles stream each expert's down matrix "
                              f"{'transposed' if fused else 'row-major'}, and a copy of the ones given does not fit on "
                              f"{t.device}; store them so (share_fused_storage(transposed_down={fused}))") from None
        key = id(t)
        _TRANSPOSED[key] = (weakref.ref(t, lambda _: _TRANSPOSED.pop(key, None)), copy)
        return copy

    def _pack_expert_tables(self, weights: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """([L] router pointers, [L, E, 3] expert weight pointers in seam.EXPERT_FIELDS order)."""
        routers, experts = [], []
        for i in range(self.spec.num_layers):
            router, names = self.spec.moe_names(i)
            routers.append(weights[router].data_ptr())
            experts.append([[weights[g].data_ptr(), weights[u].data_ptr(), self._expert_down(weights[d]).data_ptr()]
                            for g, u, d in names])
        dev = self.device
        return (torch.tensor(routers, dtype=torch.int64, device=dev), torch.tensor(experts, dtype=torch.int64, device=dev))

    def _pack_router_o(self, weights: dict[str, torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Each sparse layer's router through the o-projection (kinds/router.py), made from the weights (E rows
        of q_size bf16 a layer), and the [L] table of their pointers."""
        from ..model.moe import router_through_o
        mats = []
        for i in range(self.spec.num_layers):
            p = f"model.layers.{i}."
            router, _ = self.spec.moe_names(i)
            mats.append(router_through_o(weights[router], weights[p + "post_attention_layernorm.weight"],
                                         weights[p + "self_attn.o_proj.weight"]).contiguous())
        return mats, torch.tensor([m.data_ptr() for m in mats], dtype=torch.int64, device=self.device)

    def _pack_params(self) -> bytes:
        w, b = self.weights, self.buf
        lm = w["lm_head.weight"] if "lm_head.weight" in w else w["model.embed_tokens.weight"]
        # tensors, or None where the kernel has none (a null pointer): scale words of bf16 weights, the
        # peers of one GPU, the expert tables and buffers of a dense model, the trace when off
        ptrs = dict(layers=self._layer_table, embed=w["model.embed_tokens.weight"], final_norm=w["model.norm.weight"],
                    lm_head=lm, inv_freq=self.inv_freq, kv_pool=self.cache.pool, block_table=self.cache.block_table,
                    layer_scales=self._scale_table, peers=self._peer_table, routers=self._routers,
                    experts=self._experts, router_o=self._router_o, trace=self._trace)
        ptrs.update((f.name, getattr(b, f.name)) for f in fields(DecodeBuffers))   # every engine-owned buffer
        values = {f: 0 if t is None else t.data_ptr() for f, t in ptrs.items()}
        values.update(rank=self.rank, num_blocks=self.cache.pool.shape[1],
                      block_table_stride=self.cache.block_table.shape[1])
        return seam.pack_params(values)

    # ------------------------------------------------------------------ tensor parallelism
    def peer_pointers(self) -> dict[str, int]:
        """This rank's cross-rank buffers (seam.PEER_FIELDS) as device addresses on its own GPU."""
        return {name: getattr(self.buf, name).data_ptr() for name in seam.PEER_FIELD_NAMES}

    def connect(self, rank: int, peers: list[dict[str, int]]) -> None:
        """Rank ``rank`` of ``len(peers)``: ``peers[r]`` holds rank r's cross-rank buffers as addresses
        this GPU can reach (the same GPU's, a peer-mapped or a symmetric-memory mapping), ``peers[rank]``
        this rank's own."""
        tp = self.layout.tensor_parallel
        if len(peers) != tp or not 0 <= rank < tp:
            raise EngineError(f"the kernel runs {tp} tensor-parallel ranks; got rank {rank} of {len(peers)}")
        if peers[rank] != self.peer_pointers():
            raise EngineError(f"rank {rank}: its own entry of the peer table is not its buffers")
        rows = [[p[name] for name in seam.PEER_FIELD_NAMES] for p in peers]
        self._peer_table = torch.tensor(rows, dtype=torch.int64, device=self.device)
        self.rank = rank
        self._params = self._pack_params()

    # ------------------------------------------------------------------ tracing
    def set_trace(self, on: bool) -> None:
        """Record a per-task timeline in the following steps (each overwrites the last); see
        trtllm_mk/runtime/trace.py. Costs a few timer reads per task, so benchmarks leave it off."""
        if on and self._trace is None:
            n = self.layout.grid * (self.layout.trace_tasks * TRACE_WORDS + TRACE_SM_WORDS)
            self._trace = torch.zeros(n, dtype=torch.int64, device=self.device)
        elif not on:
            self._trace = None
        self._params = self._pack_params()

    def read_trace(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(tasks [grid, trace_tasks, TRACE_WORDS], per-SM [grid, 4]) int64 ns of the last traced step."""
        if self._trace is None:
            raise EngineError("tracing is off: call set_trace(True) before the step")
        self.synchronize()
        g, n = self.layout.grid, self.layout.trace_tasks
        t = self._trace.cpu()
        w = TRACE_WORDS
        return t[: g * n * w].view(g, n, w), t[g * n * w:].view(g, TRACE_SM_WORDS)

    # ------------------------------------------------------------------ stepping
    def set_state(self, tokens: torch.Tensor, pos: torch.Tensor) -> None:
        """This step's input token and its position (= tokens already in the cache) per sequence."""
        self.buf.tokens.copy_(tokens.to(torch.int32))
        self.buf.pos.copy_(pos.to(torch.int32))

    def set_sampling(self, row: int, params) -> None:
        """How batch row ``row`` chooses its tokens from the next step on (a
        ``trtllm_mk.sampling.SamplingParams``; None: greedy without log-probabilities). The kernel
        chooses in place (device/mk_sampling.cuh): the token lands in ``tokens``/``history``, the
        log-probabilities, when asked for, in ``logprobs``/``top_ids``."""
        if self.layout.tensor_parallel > 1 and params is not None and not params.plain_greedy:
            raise EngineError("a tensor-parallel kernel decodes greedily: sampling and log-probabilities need "
                              "every rank's logits")
        raw = seam.pack_sampling_slot() if params is None else seam.pack_sampling_slot(
            params.temperature, params.top_k, params.top_p, params.seed, params.logprobs)
        self.buf.sampling[row].copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))

    def step(self, stream: torch.cuda.Stream | None = None) -> None:
        """Launch one decode step (asynchronous). Reads/advances tokens, pos on the device."""
        if self.layout.tensor_parallel > 1 and self._peer_table is None:
            raise EngineError("a tensor-parallel kernel needs its peers: call connect(rank, peers) first")
        s = stream if stream is not None else torch.cuda.current_stream(self.device)
        self.module.launch(self._params, s.cuda_stream)

    def synchronize(self) -> None:
        """Wait for the steps in flight; turn a kernel fault into an error that names its cause."""
        try:
            torch.cuda.synchronize(self.device)
        except RuntimeError as e:
            raise RuntimeError(f"megakernel failed: {e}; {self.error_report()}") from None
        if int(self.buf.error[0]) != 0:
            raise RuntimeError(f"megakernel reported an error: {self.error_report()}")

    def error_report(self) -> str:
        w = self.buf.error.tolist()
        e = {name: int(w[error_word(name)]) for name, _ in ERROR_FIELDS}
        if e["code"] == 0:
            return "no device-side diagnostic recorded"
        if e["code"] == ERROR_CODES["NONFINITE_LOGITS"]:
            return (f"the logits of batch row {e['layer']} were all NaN or -inf at step {e['task']} (the weights or "
                    "the KV cache hold non-finite values); its token was set to 0")
        if e["code"] != ERROR_CODES["WAIT_TIMEOUT"]:
            return f"unknown device error code {e['code']}"
        ev = "?"
        for name, off in sorted(self.layout.event_offsets.items(), key=lambda kv: kv[1]):
            if e["event_index"] >= off:
                ev = f"{name}[+{e['event_index'] - off}]"
        return (f"SM {e['sm']} timed out waiting on event {ev} (counter {e['event_index']}): target {e['target']}, "
                f"seen {e['seen']}, layer {e['layer']}, task #{e['task']} of that SM")

    @property
    def tokens(self) -> torch.Tensor:
        return self.buf.tokens

    @property
    def logits(self) -> torch.Tensor:
        return self.buf.logits


def build_decoder(schedule: Schedule, weights: dict[str, torch.Tensor], cache: PagedKVCache, target: str,
                  use_bulk_copy: bool, max_seq_len: int | None = None,
                  diagnostics=None) -> MegakernelDecoder:
    """Schedule -> generated source -> cubin (cached) -> a decoder bound to ``weights`` and ``cache``.
    For tests and benchmarks; engines are built once by the builder and opened with HybridEngine.
    ``diagnostics``: the kernel's diagnostic switches (codegen.Diagnostics; None: production)."""
    from ..codegen import Diagnostics, compile_cubin, generate_source
    from ..model.rope import rope_inv_freq
    src, layout = generate_source(schedule, cache.tokens_per_block, max_seq_len or cache.max_seq_len, use_bulk_copy,
                                  diagnostics or Diagnostics())
    cubin, _ = compile_cubin(src, target)
    return MegakernelDecoder(schedule, cubin, layout, weights, cache, rope_inv_freq(schedule.spec))
