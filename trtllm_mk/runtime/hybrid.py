"""HybridEngine: prefill on a conventional backend, every decode step on the megakernel.

    engine = HybridEngine("engines/h100_bs1")   # the engine's own checkpoint; or weights=DIR / "random"
    result = engine.generate([[1, 2, 3]], max_new_tokens=64)
    result.tokens, result.ttft_ms, result.tpot_ms
    for event in engine.stream("Hello", max_tokens=32, temperature=0.7, seed=1):   # text needs a tokenizer
        print(event.text, end="")

Each batch row of the engine is a *slot*. A request takes a free slot and is prefilled alone into
that slot's KV blocks (``start``) while the other slots keep their state; every decode step then
advances all busy slots at once (``decode``). Free slots still run through the kernel (its schedule is
specialised for the batch size) but start each round at position 0, so they neither grow nor touch
another slot's blocks; their outputs are ignored. The scheduler in ``trtllm_mk.serve.scheduler``
drives these two calls for ``generate``, ``stream`` and the HTTP server.

Every decode step chooses its tokens in place: each slot's ``SamplingParams`` go to the decoder once
(``set_sampling``) and the kernel's last task samples (``trtllm_mk.sampling`` defines the function;
``device/mk_sampling.cuh`` computes it), so tokens and positions stay on the device and several steps
run per host round trip. Only a slot asking for log-probabilities makes a round one step long (they
are read back after each step). ``simulate=True`` runs the decode steps on the CPU task-graph
executor instead (machines without a GPU; same schedule, same semantics, far slower).

A quantized engine (``ModelSpec.weight_bits`` 4: W4A16; 8: FP8 e4m3) loads its checkpoint's packed
layers (``quant.load_quantized``; ``--weights random`` quantizes random weights) and the megakernel binds them
in its own layout (``quant.kernel_layout``); prefill and the CPU executor compute with the same weights
dequantized to bf16 exactly as the kernel dequantizes them, so every token comes from one model.

A tensor-parallel engine (``tensor_parallel_size`` N) runs one rank per process under
``torchrun --nproc-per-node N``: each process binds its rank's shard of the weights and its KV heads,
prefills with its shard over torch.distributed (``parallel.distributed.RankPrefill``) and steps its
rank's kernel, whose cross-rank buffers live in torch's symmetric memory (``parallel.gpu_ranks``).
Every rank makes the same calls in the same order (the requests are the same on every rank), and
every rank's kernel chooses the same tokens; rank 0 reports. It decodes greedily. ``simulate=True``
runs every rank in this one process (the emulated prefill, ``parallel.cpu_executor``).
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from ..engine import EngineDir
from ..errors import EngineError, UserError, is_int, short_repr
from ..gpus import detect_gpu, get_gpu
from ..kv_cache import PagedKVCache
from ..model.decoder_block import share_fused_storage
from ..model.rope import rope_inv_freq
from ..sampling import Choice, SamplingParams, sample
from ..seam import SCALE_SUFFIX

# Decode steps launched per host round trip when no busy slot asks for log-probabilities (GPU only): a
# new request waits at most this many steps for its slot, a finished one decodes at most this many
# extra steps.
STEPS_PER_ROUND = 8


@dataclass
class _Round:
    """Decode steps launched from one host state of the slots (tokens, positions, sampling)."""
    k: int
    tok: list[int]
    pos: list[int]
    params: list
    events: list

    def matches(self, k: int, tok: list[int], pos: list[int], params: list) -> bool:
        return self.k == k and self.tok == tok and self.pos == pos and self.params == params


@dataclass
class GenerationResult:
    tokens: list[list[int]]              # generated tokens per prompt (EOS included when hit)
    ttft_ms: float                       # until every prompt has its first token (prefills + first tokens)
    tpot_ms: list[float] = field(default_factory=list)  # per decode step (CUDA events or wall clock)
    prefill_backend: str = "torch"
    decode: str = "megakernel"
    request_ttft_ms: list[float] = field(default_factory=list)     # per prompt, from submission
    request_latency_ms: list[float] = field(default_factory=list)  # per prompt, submission to last token
    finish_reasons: list[str] = field(default_factory=list)

    @property
    def tpot_median_ms(self) -> float:
        return sorted(self.tpot_ms)[len(self.tpot_ms) // 2] if self.tpot_ms else float("nan")


def resolve_weights(engine: EngineDir, weights: str | Path | dict | None) -> str | Path | dict:
    """What to decode with: the checkpoint the engine was built from (None, checked unchanged), a
    checkpoint directory (checked to describe the engine's model), ``"random"`` by name, or tensors."""
    from ..model.consistency import check_matches, check_unchanged
    spec = engine.model_spec
    if isinstance(weights, dict) or str(weights) == "random":
        return weights
    if weights is None:
        if engine.checkpoint is None:
            raise UserError(f"engine {engine.path} was built from the architecture '{spec.name}' without a checkpoint: "
                            "pass --weights CKPT_DIR, or --weights random for random weights")
        check_unchanged(engine.checkpoint)
        weights = engine.checkpoint["path"]
    check_matches(spec, weights)
    return weights


def _load_weights(spec, weights: str | Path | dict, device: str, seed: int) -> dict:
    """The weights prefill and the CPU executor compute with (every tensor by its HF name, bf16 valued)."""
    return _load_engine_weights(spec, weights, device, seed)[0]


def _load_engine_weights(spec, weights: str | Path | dict, device: str, seed: int) -> tuple[dict, dict]:
    """(dense, bound): what prefill and the CPU executor compute with, and what the megakernel binds.
    A bf16 engine binds the dense dict itself. A quantized engine (``spec.quantized``: 4-bit or FP8)
    binds each layer linear in the kernel layout (``quant.kernel_layout.kernel_tensors``), and the
    dense dict holds the very weights the kernel computes with from it (4-bit: exact in fp32; FP8: bf16),
    so prefill and decode run one model; on the GPU as ``PackedW4Linear`` / ``PackedFp8Linear`` modules
    over the bound tensors, which dequantize one layer at a time to the prefill's dtype (no dense copy of
    the layer weights beside the packed ones)."""
    if not spec.quantized:
        w = _load_bf16(spec, weights, device, seed)
        return w, w
    from ..quant.kernel_layout import kernel_weights, quantize_model
    if isinstance(weights, dict):
        if any(k.endswith(SCALE_SUFFIX) for k in weights):
            return _dense_from_bound(spec, weights, packed=device != "cpu"), weights
        loaded = weights
    elif str(weights) == "random":
        from ..model.random_weights import random_weights
        loaded = quantize_model(spec, random_weights(spec, device=device, seed=seed))
    else:
        loaded = _load_quantized(spec, weights, device)
    try:
        bound, dense = kernel_weights(spec, loaded, packed_dense=device != "cpu")
    except ValueError as e:
        where = "weights" if isinstance(weights, dict) else str(weights)
        raise UserError(f"{where}: cannot be laid out for this engine's {_format(spec)} kernel: {e}") from None
    return dense, bound


def _format(spec) -> str:
    from ..quant.kernel_support import weight_format
    return weight_format(spec)


def _load_quantized(spec, path: str | Path, device: str) -> dict:
    """A quantized checkpoint's layers as the loader reads them (IntLinear / Fp8Linear and plain tensors)."""
    from ..quant import load_quantized, read_scheme
    from ..quant.kernel_support import unsupported_reason
    scheme = read_scheme(path)
    if scheme is None:
        raise UserError(f"{path}: holds unquantized weights, but this engine streams {_format(spec)} weights; "
                        "pass the quantized checkpoint it was built from, or build an engine from this one")
    reason = unsupported_reason(scheme)
    if reason:
        raise UserError(f"{path}: {reason}")
    return load_quantized(path, spec, scheme, device=device)


def _dense_from_bound(spec, bound: dict, packed: bool = False) -> dict:
    """The kernel's weights of a dict already in the kernel layout (codes under the weight's name, scale
    words under ``name + SCALE_SUFFIX``); ``packed``: as ``PackedW4Linear`` / ``PackedFp8Linear`` modules
    over them."""
    from ..quant.kernel_layout import dequantize
    from ..quant.packed_linear import packed_linear
    make = packed_linear if packed else dequantize
    return {name: make(bound[name], bound[name + SCALE_SUFFIX], spec.weight_group, bits=spec.weight_bits)
            if name + SCALE_SUFFIX in bound else bound[name] for name in spec.expected_tensors()}


def _load_bf16(spec, weights: str | Path | dict, device: str, seed: int) -> dict:
    if isinstance(weights, dict):
        return weights
    if str(weights) == "random":
        from ..model.random_weights import random_weights
        return random_weights(spec, device=device, seed=seed)
    from ..model.checkpoint import check_checkpoint, load_checkpoint
    from ..quant import read_scheme
    scheme = read_scheme(weights)
    if scheme is not None and device != "cpu":   # never a silent dequantize-to-bf16 run on the GPU
        raise UserError(f"{weights}: holds {scheme.describe()} weights, but this engine was built for bf16 weights; "
                        "build an engine from this checkpoint, or decode it dequantized on the CPU executor "
                        "with --simulate")
    stored = sorted(check_checkpoint(weights, spec) - {"BF16"}) if scheme is None else []
    if stored:
        # The megakernel streams bf16 weights (and the CPU executor rounds to bf16 as it does).
        print(f"note: {weights} stores weights in {' and '.join(stored)}; they are cast to bfloat16 at load",
              file=sys.stderr)
    return load_checkpoint(weights, spec, device=device, dtype=torch.bfloat16)


class HybridEngine:
    def __init__(self, engine_dir: str | Path, weights: str | Path | dict | None = None, simulate: bool = False,
                 seed: int = 0, prefill_backend: str | None = None):
        self._closed = False
        if not isinstance(engine_dir, (str, Path)):
            raise UserError(f"engine_dir must be a path, got {short_repr(engine_dir)}")
        if weights is not None and not isinstance(weights, (str, Path, dict)):
            raise UserError(f"weights must be a checkpoint directory, 'random' or a dict of tensors, got {short_repr(weights)}")
        if not is_int(seed):
            raise UserError(f"seed must be an integer, got {seed!r}")
        self.engine = EngineDir.open(engine_dir)
        cfg = self.engine.config
        self.schedule = self.engine.schedule
        # the model; the schedule's spec is one rank's share of it under tensor parallelism
        self.spec, self.batch = self.engine.model_spec, self.schedule.batch
        self.tp, self.rank = self.schedule.spec.tensor_parallel, 0
        self.max_seq_len, self.max_input_len = int(cfg["max_seq_len"]), int(cfg["max_input_len"])
        self.tokens_per_block = int(cfg["kv_cache_config"]["tokens_per_block"])
        self.simulate = simulate
        if simulate:
            self.device = "cpu"
        else:
            if self.tp > 1:   # before the GPU checks: the launch picks this rank's GPU
                import torch.distributed as dist

                from ..parallel.distributed import join_ranks
                self._owns_group = not dist.is_initialized()   # close() leaves only a group it joined
                self.rank, self._group = join_ranks(self.tp, f"engine {self.engine.path}")
            if not torch.cuda.is_available():
                raise EngineError("no CUDA GPU here: run with --simulate (HybridEngine(..., simulate=True)) to decode "
                                  "on the CPU task-graph executor")
            built_for = get_gpu(cfg["gpu"])
            here = detect_gpu()
            if here.name != built_for.name:
                raise EngineError(f"engine {self.engine.path} was built for {built_for.name} but this GPU is "
                                  f"{here.name}{f' (rank {self.rank})' if self.tp > 1 else ''}; build a config "
                                  f"with gpu: {here.name} (or gpu: auto) instead")
            self.device = "cuda"
        weights = resolve_weights(self.engine, weights)
        # where the weights came from: a checkpoint directory (its tokenizer, if any), "random" or "tensors"
        self.weights_source = "tensors" if isinstance(weights, dict) else str(weights)
        self.weights_dir = None if self.weights_source in ("tensors", "random") else Path(weights)
        if self.tp > 1:
            self._open_ranks(weights, seed)
        else:
            self._open_one_gpu(weights, seed, cfg, prefill_backend)
        # Host copy of each slot's state: the token it feeds next and that token's position.
        self._tok = [0] * self.batch
        self._pos = [0] * self.batch
        self._params: list[SamplingParams | None] = [None] * self.batch   # as the decoder has them
        self._ahead: _Round | None = None   # steps launched for the next decode call (GPU)
        self.step_ms: list[float] = []      # time of every decode step run so far (while recorded)
        self.record_steps = True            # a long-running server turns this off: the list only grows
        self._scheduler = None
        self._tokenizer = None
        self._eos: set[int] | None = None

    def _open_one_gpu(self, weights, seed: int, cfg: dict, prefill_backend: str | None) -> None:
        simulate = self.simulate
        dense, bound = _load_engine_weights(self.spec, weights, self.device, seed)
        tensor = lambda v: isinstance(v, torch.Tensor)   # noqa: E731 (quantized engines: modules for layer linears)
        if simulate:  # the CPU executor computes in fp32 from bf16-valued weights
            dense = {k: v.float() if tensor(v) and v.dtype == torch.bfloat16 else v for k, v in dense.items()}
        else:
            dense = {k: v.to(torch.bfloat16) if tensor(v) and v.dtype in (torch.float16, torch.float32) else v
                     for k, v in dense.items()}
        # The torch prefill's fused q/k/v and gate/up matrices are then the very memory the decoder
        # reads by name: one copy of the weights on the GPU, as the memory budget assumes (also the
        # experts' down matrices, stored transposed when the kernel's expert tiles stream them so).
        self.weights = share_fused_storage(self.spec, dense, transposed_down=self.schedule.plan.expert_fused)
        # What the megakernel binds: the same tensors, but a quantized engine's packed layer linears and
        # their scale words (which its torch prefill's packed modules read too).
        self.decode_weights = self.weights if not self.spec.quantized else {
            k: v if v.dtype in (torch.uint8, torch.int32) else self.weights[k] for k, v in bound.items()}
        kv_dtype = torch.float32 if simulate else torch.bfloat16
        self.cache = PagedKVCache.allocate(self.spec, self.batch, self.max_seq_len, self.tokens_per_block,
                                           dtype=kv_dtype, device=self.device)
        from ..backends import make_prefill, resolve_backend
        self.prefill_name = resolve_backend(prefill_backend or cfg.get("prefill", {}).get("backend", "torch"))
        if self.prefill_name == "tensorrt_llm" and (simulate or not isinstance(weights, (str, Path))
                                                   or str(weights) == "random"):
            self.prefill_name = "torch"   # TensorRT-LLM needs a GPU and a checkpoint directory
        self.prefill = make_prefill(self.prefill_name, self.spec, self.weights, engine_dir=self.engine.path,
                                    weights_dir=None if isinstance(weights, dict) else weights)
        if simulate:
            from ..executor import CpuExecutor
            self.decoder = CpuExecutor(self.spec, self.weights, self.schedule, self.cache)
        else:
            from .megakernel import MegakernelDecoder
            self.decoder = MegakernelDecoder(self.schedule, self.engine.cubin, self.engine.layout, self.decode_weights,
                                             self.cache, rope_inv_freq(self.spec))
        self.caches = [self.cache]

    def _open_ranks(self, weights, seed: int) -> None:
        """A tensor-parallel engine: this process's rank (every rank when simulating)."""
        from ..parallel import shard_weights
        share, tp = self.schedule.spec, self.tp
        if self.spec.quantized:
            raise EngineError(f"engine {self.engine.path}: a tensor-parallel engine streams bf16 weights only")
        self.prefill_name = "torch (tensor parallel)"
        self.prefill = None
        if self.simulate:   # every rank here, on the CPU executor, from the whole model's weights
            from ..parallel.cpu_executor import TensorParallelCpuExecutor
            from ..parallel.emulate import TensorParallelDecoder
            full = {k: v.float() for k, v in _load_bf16(self.spec, weights, "cpu", seed).items()}
            self.caches = [PagedKVCache.allocate(share, self.batch, self.max_seq_len, self.tokens_per_block,
                                                 dtype=torch.float32) for _ in range(tp)]
            self._emulation = TensorParallelDecoder(self.spec, full, tp)
            self.decoder = TensorParallelCpuExecutor(self.spec, full, tp, self.schedule, self.caches)
            self.weights = self.decode_weights = full
        else:
            from ..parallel.distributed import RankPrefill
            from ..parallel.gpu_ranks import connect_over_process_group, symmetric_allocator
            from .megakernel import MegakernelDecoder
            if str(weights) == "random":   # the same seed on every rank: the shards of one model
                from ..model.random_weights import random_weights
                shard = random_weights(share, device=self.device, seed=seed)
            else:   # a checkpoint is read whole on the host, and this rank keeps its shard
                full = weights if isinstance(weights, dict) else _load_bf16(self.spec, weights, "cpu", seed)
                shard = {k: v.to(self.device, torch.bfloat16) for k, v in
                         shard_weights(self.spec, full, tp, self.rank).items()}
            self.caches = [PagedKVCache.allocate(share, self.batch, self.max_seq_len, self.tokens_per_block,
                                                 dtype=torch.bfloat16, device=self.device)]
            self._rank_prefill = RankPrefill(self.spec, shard, tp, self.rank, self._group)
            self.decoder = MegakernelDecoder(self.schedule, self.engine.cubin, self.engine.layout, shard,
                                             self.caches[0], rope_inv_freq(share), peer_alloc=symmetric_allocator(self._group))
            connect_over_process_group(self.decoder, self._group)
            self.weights = self.decode_weights = shard
        self.cache = self.caches[0]

    # ------------------------------------------------------------------ checks
    def check_request(self, prompt: list[int], max_new_tokens: int) -> None:
        if self._closed:
            raise UserError("the engine is closed; open a new HybridEngine")
        if not is_int(max_new_tokens):
            raise UserError(f"max_new_tokens must be an integer, got {max_new_tokens!r}")
        if max_new_tokens < 1:
            raise UserError("max_new_tokens must be >= 1")
        if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__len__") or not all(map(is_int, prompt)):
            raise UserError(f"a prompt here is a list of token ids (ints), got {short_repr(prompt)}; text goes "
                            "through stream(), which tokenizes it")
        if not prompt:
            raise UserError("empty prompt")
        if len(prompt) > self.max_input_len:
            raise UserError(f"prompt of {len(prompt)} tokens is longer than max_input_len={self.max_input_len}")
        if len(prompt) + max_new_tokens > self.max_seq_len:
            raise UserError(f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) exceeds "
                            f"max_seq_len={self.max_seq_len}")
        if min(prompt) < 0 or max(prompt) >= self.spec.vocab_size:
            raise UserError(f"token ids must be in [0, {self.spec.vocab_size})")

    # ------------------------------------------------------------------ slots
    def check_sampling(self, params: SamplingParams | None) -> None:
        """A tensor-parallel engine decodes greedily (its ranks' kernels choose from their own logits)."""
        if self.tp > 1 and params is not None and not params.plain_greedy:
            raise UserError(f"engine {self.engine.path} is tensor-parallel ({self.tp} GPUs) and decodes greedily: "
                            "sampling and log-probabilities are not available")

    def start(self, slot: int, prompt: list[int], params: SamplingParams) -> Choice:
        """Prefill ``prompt`` alone into ``slot``'s KV blocks; the first generated token."""
        from ..backends.torch_prefill import TorchPrefill
        self.check_sampling(params)
        rows = [PagedKVCache(c.pool, c.block_table[slot:slot + 1], c.tokens_per_block) for c in self.caches]
        row = rows[0]
        impl = getattr(self.prefill, "impl", None)
        n = len(prompt)
        if self.tp > 1:   # every rank's prefill (simulated here, or this rank's share of a collective one)
            logits = (self._emulation.prefill([prompt], rows) if self.simulate
                      else self._rank_prefill.prefill([prompt], row))[0].cpu()
            choice = sample(logits, params, n)
        elif isinstance(impl, TorchPrefill):
            logits = impl.prefill([prompt], row)[0].float().cpu()
            choice = sample(logits, params, n)
        else:   # TensorRT-LLM hands over its own greedy first token, without logits
            choice = Choice(int(self.prefill.first_tokens([prompt], row)[0]))
        self._tok[slot], self._pos[slot] = choice.token, n
        self._set_sampling(slot, params)
        return choice

    def release(self, slot: int) -> None:
        """A free slot restarts at position 0 each round (it never reaches the end of its blocks)."""
        self._tok[slot], self._pos[slot] = 0, 0
        self._set_sampling(slot, None)

    def _set_sampling(self, slot: int, params: SamplingParams | None) -> None:
        if params is not None and params.plain_greedy:
            params = None
        if self._params[slot] != params:
            self.decoder.set_sampling(slot, params)
            self._params[slot] = params

    def decode(self, busy: dict[int, SamplingParams], max_steps: int = STEPS_PER_ROUND
               ) -> dict[int, list[Choice]]:
        """Decode steps for every slot at once; the tokens chosen for the ``busy`` slots (one list per
        slot, as many entries as steps ran: 1, or up to ``min(max_steps, STEPS_PER_ROUND)`` on
        the GPU when every busy slot is greedy without log-probabilities). ``max_steps`` must not
        exceed any busy slot's remaining token budget."""
        for b in range(self.batch):
            if b not in busy:
                self.release(b)
        if self.simulate:
            return self._decode_cpu(busy)
        return self._decode_gpu(busy, max_steps)

    def _choices(self, b: int, tokens: list[int], params: SamplingParams, logprobs, top_ids) -> list[Choice]:
        """The Choices of slot ``b`` for the steps just run (log-probabilities: one step only)."""
        if params.logprobs is None:
            return [Choice(t) for t in tokens]
        top = [(int(top_ids[b, j]), float(logprobs[b, 1 + j])) for j in range(params.logprobs)] if params.logprobs else None
        return [Choice(tokens[0], float(logprobs[b, 0]), top)]

    def _decode_cpu(self, busy: dict[int, SamplingParams]) -> dict[int, list[Choice]]:
        t = time.perf_counter()
        _, tokens = self.decoder.step(torch.tensor(self._tok), torch.tensor(self._pos))
        if self.record_steps:
            self.step_ms.append((time.perf_counter() - t) * 1e3)
        out = {}
        for b, p in busy.items():
            out[b] = self._choices(b, [int(tokens[b])], p, self.decoder.logprobs, self.decoder.top_ids)
            self._tok[b], self._pos[b] = out[b][-1].token, self._pos[b] + 1
        return out

    def _launch(self, k: int) -> _Round:
        """k decode steps from the host's slot state, launched and not waited for."""
        dec = self.decoder
        dec.set_state(torch.tensor(self._tok), torch.tensor(self._pos))
        events = []
        for _ in range(k):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            dec.step()
            e1.record()
            events.append((e0, e1))
        return _Round(k, list(self._tok), list(self._pos), list(self._params), events)

    def _decode_gpu(self, busy: dict[int, SamplingParams], max_steps: int) -> dict[int, list[Choice]]:
        dec = self.decoder
        with_lp = any(p.logprobs is not None for p in busy.values())
        k = 1 if with_lp or not busy else max(1, min(max_steps, STEPS_PER_ROUND))
        # the round launched ahead by the last call counts when it started from exactly this state
        ahead, self._ahead = self._ahead, None
        if ahead is None or not ahead.matches(k, self._tok, self._pos, self._params):
            ahead = self._launch(k)
        dec.synchronize()
        # The kernel writes step s's token of row b at history[b, pos[b] + 1 + s].
        pos = torch.tensor(self._pos, device=self.device, dtype=torch.long)
        cols = (pos[:, None] + 1 + torch.arange(k, device=self.device)).clamp(max=dec.buf.history.shape[1] - 1)
        hist = torch.gather(dec.buf.history, 1, cols).cpu()
        logprobs, top_ids = (dec.buf.logprobs.cpu(), dec.buf.top_ids.cpu()) if with_lp else (None, None)
        if self.record_steps:
            self.step_ms.extend(a.elapsed_time(b) for a, b in ahead.events)
        out = {}
        for b, p in busy.items():
            out[b] = self._choices(b, [int(hist[b, s]) for s in range(k)], p, logprobs, top_ids)
            self._tok[b], self._pos[b] = out[b][-1].token, self._pos[b] + len(out[b])
        # Launch the next round now, so the GPU decodes while the host hands these tokens out. Kept if
        # the next call finds the same slots in the same state (no request ended, joined or changed);
        # otherwise its steps are recomputed (same tokens: sampling depends on seed and position only)
        # and what they wrote to the KV cache lies at positions the recomputation overwrites.
        nxt = min(STEPS_PER_ROUND, max_steps - k)
        if busy and not with_lp and nxt >= 1 and max(self._pos[b] for b in busy) + nxt < self.max_seq_len:
            self._ahead = self._launch(nxt)
        return out

    # ------------------------------------------------------------------ requests
    @property
    def scheduler(self):
        """The request scheduler over this engine's slots (created on first use)."""
        if self._scheduler is None:
            from ..serve.scheduler import Scheduler
            self._scheduler = Scheduler(self)
        return self._scheduler

    @property
    def tokenizer(self):
        """The checkpoint's tokenizer, or None (random weights, or a directory without one)."""
        if self._tokenizer is None and self.weights_dir is not None:
            from ..serve.text import has_tokenizer, load_tokenizer
            if has_tokenizer(self.weights_dir):
                self._tokenizer = load_tokenizer(self.weights_dir)
        return self._tokenizer

    def eos_ids(self) -> set[int]:
        """End-of-sequence ids (generation_config.json, else config.json, else the tokenizer's)."""
        if self._eos is None:
            from ..serve.text import eos_token_ids
            self._eos = eos_token_ids(self.weights_dir, self.spec.eos_token_ids, self.tokenizer)
        return self._eos

    def generate(self, prompts: list[list[int]], max_new_tokens: int, eos_ids: tuple[int, ...] | None = None,
                 sampling: SamplingParams | None = None) -> GenerationResult:
        """Up to max_batch_size prompts of different lengths, each in its own slot (greedy by default).
        ``eos_ids=()`` decodes exactly ``max_new_tokens`` tokens per prompt."""
        from ..serve.scheduler import Request
        if not prompts:
            raise UserError("no prompt given")
        if isinstance(prompts, (str, bytes)) or not all(isinstance(p, (list, tuple)) for p in prompts):
            raise UserError(f"generate takes a list of prompts, each a list of token ids, got {short_repr(prompts)}")
        if len(prompts) > self.batch:
            raise UserError(f"{len(prompts)} prompts but the engine was built for max_batch_size={self.batch}")
        for p in prompts:
            self.check_request(p, max_new_tokens)
        eos = self.eos_ids() if eos_ids is None else set(eos_ids)
        reqs = [Request(list(p), sampling or SamplingParams(), max_new_tokens, eos_ids=eos) for p in prompts]
        first_step = len(self.step_ms)
        t0 = time.perf_counter()
        self.scheduler.run(reqs)
        done = [r.result() for r in reqs]
        ttft = max(r.t_first for r in reqs) - t0
        return GenerationResult(
            [d.tokens for d in done], ttft * 1e3, self.step_ms[first_step:], self.prefill_name,
            "cpu-executor" if self.simulate else "megakernel",
            request_ttft_ms=[(r.t_first - r.t_submit) * 1e3 for r in reqs],
            request_latency_ms=[(r.t_done - r.t_submit) * 1e3 for r in reqs],
            finish_reasons=[d.finish_reason for d in done])

    def stream(self, prompt: str | list[int], max_tokens: int = 16, *, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int | None = None, stop: list[str] | None = None,
               stop_token_ids: list[int] | None = None, logprobs: int | None = None, ignore_eos: bool = False
               ) -> Iterator:
        """Yield ``serve.scheduler.Event``s (tokens, their text, log-probs) as they are decoded; the last
        one carries ``finish_reason``. A text prompt needs the checkpoint's tokenizer. Stopping the
        iteration early frees the slot."""
        from ..serve.scheduler import make_request
        req = make_request(self, prompt, max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                           seed=seed, stop=stop, stop_token_ids=stop_token_ids, logprobs=logprobs,
                           ignore_eos=ignore_eos)
        sched = self.scheduler
        sched.start()
        sched.submit(req)
        try:
            yield from req.events()
        finally:
            sched.cancel(req)

    def close(self) -> None:
        self._closed = True
        if self._scheduler is not None:
            self._scheduler.close()
        if self.tp > 1 and not self.simulate and self._owns_group:   # this rank leaves the group it joined
            import torch.distributed as dist
            if dist.is_initialized():
                self.decoder.synchronize()
                dist.destroy_process_group()
