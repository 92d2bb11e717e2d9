"""Prefill on TensorRT-LLM's PyTorch backend, handing its KV cache over to the megakernel.

TensorRT-LLM (>= 1.1, whose LLM API runs the PyTorch backend by default) runs each prompt's context
phase and samples its first token (``SamplingParams(max_tokens=1)``, greedy). Its KV Cache Connector
gives us the whole KV pool (``KvCacheConnectorWorker.register_kv_caches``) and, per scheduled request,
the pool blocks that hold the prompt (``SchedulerOutput`` -> ``build_connector_meta``). At the end of
the forward pass that completes a prompt (``wait_for_save``, on TensorRT-LLM's forward stream, so in
order after the kernels that wrote the K/V) the connector copies those blocks into our
``PagedKVCache``; the megakernel then decodes from it exactly as after the torch prefill.

Why a copy and not the pool itself: TensorRT-LLM's pool is block-major across layers,
``[num_blocks, num_layers, 2, kv_heads * tokens_per_block * head_dim]`` (one block id covers every
layer), while the megakernel addresses ``[layers, num_blocks, 2, kv_heads, tokens_per_block, head_dim]``.
Inside a block both use the same "HND" order, so only the prompt's blocks move, once per request
(the copy costs one read and one write of the prompt's K/V). Decoding in place from TensorRT-LLM's
pool would need a per-layer block stride in mk::Params.

Why this route and not a model class registered for the HF architecture that calls the megakernel
on generation-only steps (``attn_metadata.num_contexts == 0``): decode would then run inside
TensorRT-LLM's scheduler and CUDA graph, whose per-step host work is what the megakernel removes;
the connector keeps TensorRT-LLM to what it is best at here (batched, compute-bound prefill).

Configuration: ``DeploymentConfig.trtllm_llm_kwargs()`` supplies TensorRT-LLM's own keys (ours,
``prefill`` and ``megakernel``, are never passed: TensorRT-LLM rejects unknown keys). On top of them:
``max_seq_len = max_input_len + 1`` and a KV ``max_tokens`` cap (TensorRT-LLM never generates more
than the first token here), no CUDA graphs (it runs no generation step), no chunked prefill,
``skip_tokenizer_init`` (prompts are token ids), tensor parallelism 1, the connector, and the
executor in this process (``TLLM_WORKER_USE_SINGLE_PROCESS=1``: the connector and our cache must
share one address space).

What could not be run here: TensorRT-LLM cannot be installed in this project's development
environment (its PyPI package downloads from NVIDIA's index), so the TensorRT-LLM calls below were
written against its public sources (LLM API, KvCacheConfig, SamplingParams, the KV cache connector
in tensorrt_llm/_torch/pyexecutor) and never executed. The handover copy and the request tracking
are plain torch / Python and are tested on the CPU (tests/test_trt_integration.py).
"""
from __future__ import annotations

import contextlib
import importlib
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import EngineError, UserError
from ..kv_cache import PagedKVCache

NOT_INSTALLED = ("TensorRT-LLM is not installed: pip install '.[tensorrt-llm]' --extra-index-url https://pypi.nvidia.com "
                 "(on a machine with its CUDA), or use prefill.backend: torch")
SCHEDULER_CLASS = "MegakernelHandoverScheduler"
WORKER_CLASS = "MegakernelHandoverWorker"
# Where TensorRT-LLM has kept the connector base classes (moved between releases).
_CONNECTOR_MODULES = ("tensorrt_llm._torch.pyexecutor.kv_cache_connector",
                      "tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector",
                      "tensorrt_llm._torch.pyexecutor.connector")


class TensorRTLLMNotInstalled(UserError):
    """``import tensorrt_llm`` failed: only the torch prefill backend can be used here."""


def _import_trtllm():
    """The ``tensorrt_llm`` module, or TensorRTLLMNotInstalled with one clear line."""
    try:
        import tensorrt_llm  # noqa: PLC0415 - optional dependency
    except ImportError as e:
        raise TensorRTLLMNotInstalled(f"{NOT_INSTALLED} (import tensorrt_llm failed: {e})") from None
    except Exception as e:  # a broken install (wrong CUDA, placeholder package) fails with other errors
        raise TensorRTLLMNotInstalled(f"{NOT_INSTALLED} (import tensorrt_llm failed: {type(e).__name__}: {e})") from None
    return tensorrt_llm


def is_available() -> bool:
    """Whether TensorRT-LLM imports here (``prefill.backend: auto`` picks it then)."""
    try:
        _import_trtllm()
    except TensorRTLLMNotInstalled:
        return False
    return True


# ------------------------------------------------------------------------------- handover (no TRT-LLM)

def blocks_for(num_tokens: int, tokens_per_block: int) -> int:
    return -(-num_tokens // tokens_per_block)


class RequestTracker:
    """Accumulates what the connector scheduler reports per request and says when a prompt is
    complete in the cache: the pass that computes its last context token. Each request is handed
    over once; later (generation) passes are ignored."""

    def __init__(self) -> None:
        self._reqs: dict[int, dict[str, Any]] = {}

    def update(self, request_id: int, new_tokens, new_block_ids, computed_position: int,
               num_scheduled_tokens: int | None) -> tuple[tuple[int, ...], list[int]] | None:
        """Record one RequestData; returns (prompt tokens, pool block ids) when this pass completes the
        prompt's context, else None. ``num_scheduled_tokens`` None (older TensorRT-LLM) means the whole
        remaining context is computed in this pass (chunked prefill is off)."""
        rec = self._reqs.setdefault(request_id, {"tokens": [], "blocks": [], "done": False})
        rec["tokens"].extend(int(t) for t in new_tokens)
        rec["blocks"].extend(int(b) for b in new_block_ids)
        if rec["done"]:
            return None
        end = len(rec["tokens"]) if num_scheduled_tokens is None else computed_position + num_scheduled_tokens
        if end < len(rec["tokens"]):
            return None
        rec["done"] = True
        return tuple(rec["tokens"]), list(rec["blocks"])

    def finish(self, request_id: int) -> None:
        self._reqs.pop(request_id, None)


class KVHandover:
    """Process-wide state shared by the connector objects TensorRT-LLM creates (by class name, so they
    cannot be handed a reference) and by TensorRTLLMPrefill: TensorRT-LLM's pool, and for the prefill
    in progress which prompt goes to which of our batch slots."""

    def __init__(self, num_layers: int, num_kv_heads: int, tokens_per_block: int, head_dim: int):
        self.shape = (num_layers, 2, num_kv_heads, tokens_per_block, head_dim)
        self.tokens_per_block = tokens_per_block
        self.pool: torch.Tensor | None = None   # [num_blocks, L, 2, NKV, TPB, D] view of TensorRT-LLM's pool
        self.cache: PagedKVCache | None = None
        self.wanted: dict[tuple[int, ...], list[int]] = {}
        self.copied: dict[int, list[int]] = {}  # our slot -> TensorRT-LLM blocks it was filled from
        self.lock = threading.Lock()

    def register_pool(self, pool: torch.Tensor) -> None:
        """TensorRT-LLM's KV pool, checked against the engine's model and viewed block-major."""
        L, two, nkv, tpb, d = self.shape
        per_block = L * two * nkv * tpb * d
        if pool.dtype != torch.bfloat16:
            raise EngineError(f"TensorRT-LLM's KV cache is {pool.dtype} but the megakernel reads bfloat16: use a "
                              f"bfloat16 checkpoint and kv_cache_config.dtype: auto")
        if pool.numel() % per_block or (pool.dim() >= 3 and pool.shape[1] != L) or not pool.is_contiguous():
            raise EngineError(f"TensorRT-LLM's KV pool has shape {tuple(pool.shape)}, not [num_blocks, {L} layers, "
                              f"2, {nkv}x{tpb}x{d}] contiguous: this TensorRT-LLM version lays its cache out "
                              f"differently; use prefill.backend: torch")
        with self.lock:
            self.pool = pool.view(-1, *self.shape)

    def begin(self, cache: PagedKVCache, prompts: list[list[int]]) -> list[tuple[int, ...]]:
        """Start a prefill into ``cache``; returns the distinct prompts (identical prompts have
        identical K/V, so each is computed once and copied to every slot that holds it)."""
        with self.lock:
            self.cache = cache
            self.wanted = {}
            for b, p in enumerate(prompts):
                self.wanted.setdefault(tuple(int(t) for t in p), []).append(b)
            self.copied = {}
            return list(self.wanted)

    def abort(self) -> None:
        with self.lock:
            self.cache, self.wanted, self.copied = None, {}, {}

    def end(self) -> dict[int, list[int]]:
        with self.lock:
            missing = [b for slots in self.wanted.values() for b in slots if b not in self.copied]
            copied, self.cache, self.wanted, self.copied = self.copied, None, {}, {}
        if missing:
            raise EngineError(f"TensorRT-LLM finished the prefill but its KV cache connector never handed over the "
                              f"K/V of batch slot(s) {missing}; this TensorRT-LLM version does not drive the "
                              f"connector as expected (use prefill.backend: torch)")
        return copied

    def copy_out(self, orders: list[tuple[tuple[int, ...], list[int]]], stream: torch.cuda.Stream | None) -> None:
        """Copy each completed prompt's blocks from TensorRT-LLM's pool into our cache, on ``stream``
        (TensorRT-LLM's forward stream) so that the copy follows the kernels that wrote them. Requests
        we did not submit (TensorRT-LLM's own warm-up) are skipped."""
        with self.lock:
            if self.cache is None or self.pool is None:
                return
            ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
            with ctx:
                for tokens, blocks in orders:
                    slots = self.wanted.get(tokens)
                    if not slots:
                        continue
                    n = blocks_for(len(tokens), self.tokens_per_block)
                    if len(blocks) < n:
                        raise EngineError(f"TensorRT-LLM reported {len(blocks)} KV blocks for a {len(tokens)}-token "
                                          f"prompt; {n} are needed")
                    src = torch.tensor(blocks[:n], dtype=torch.long, device=self.pool.device)
                    kv = self.pool.index_select(0, src).transpose(0, 1)  # [L, n, 2, NKV, TPB, D]
                    for b in slots:
                        dst = self.cache.block_table[b, :n].to(device=self.cache.pool.device, dtype=torch.long)
                        self.cache.pool[:, dst] = kv.to(self.cache.pool.dtype)
                        self.copied[b] = list(blocks[:n])


_HANDOVER: KVHandover | None = None


def _handover() -> KVHandover:
    if _HANDOVER is None:
        raise EngineError("the trtllm_mk KV cache connector was created outside TensorRTLLMPrefill; construct "
                          "TensorRTLLMPrefill instead of passing the connector to tensorrt_llm.LLM yourself")
    return _HANDOVER


# ------------------------------------------------------------------- connector classes (need TRT-LLM)

def _connector_bases():
    for name in _CONNECTOR_MODULES:
        try:
            mod = importlib.import_module(name)
            return mod.KvCacheConnectorScheduler, mod.KvCacheConnectorWorker
        except (ImportError, AttributeError):
            continue
    raise EngineError("this TensorRT-LLM has no KV cache connector (KvCacheConnectorScheduler/Worker); the "
                      "tensorrt_llm prefill backend needs TensorRT-LLM 1.1 or newer; use prefill.backend: torch")


@dataclass
class HandoverMetadata:
    """What the scheduler side tells the worker side each iteration (picklable, as TensorRT-LLM requires)."""
    orders: list = field(default_factory=list)   # [(prompt tokens, pool block ids)]


def _build_connector_classes() -> dict[str, type]:
    """The connector classes, defined on first use because their bases come from TensorRT-LLM."""
    scheduler_base, worker_base = _connector_bases()

    class MegakernelHandoverScheduler(scheduler_base):
        """Scheduler side: loads nothing from outside, and names the blocks of every prompt whose
        context completes in the coming forward pass."""

        def __init__(self, llm_args):
            super().__init__(llm_args)
            self._tracker = RequestTracker()

        def build_connector_meta(self, scheduler_output):
            meta = HandoverMetadata()
            for req in list(scheduler_output.new_requests) + list(scheduler_output.cached_requests):
                order = self._tracker.update(req.request_id, req.new_tokens, req.new_block_ids, req.computed_position,
                                             getattr(req, "num_scheduled_tokens", None))
                if order is not None:
                    meta.orders.append(order)
            return meta

        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            return 0, False

        def update_state_after_alloc(self, request, block_ids):
            return None

        def request_finished(self, request, cache_block_ids):
            self._tracker.finish(request.request_id)
            return False  # the copy was already enqueued before the blocks can be freed

    class MegakernelHandoverWorker(worker_base):
        """Worker side: receives the pool once, copies completed prompts at the end of each pass."""

        def register_kv_caches(self, kv_cache_tensor):
            _handover().register_pool(kv_cache_tensor)

        def start_load_kv(self, stream):
            return None

        def wait_for_layer_load(self, layer_idx, stream):
            return None

        def save_kv_layer(self, layer_idx, stream):
            return None

        def wait_for_save(self, stream):
            meta = self.get_connector_meta() if hasattr(self, "get_connector_meta") else getattr(self, "_metadata", None)
            if meta is not None and meta.orders:
                _handover().copy_out(meta.orders, stream)

        def get_finished(self, finished_gen_req_ids, started_loading_req_ids):
            return [], []

    return {SCHEDULER_CLASS: MegakernelHandoverScheduler, WORKER_CLASS: MegakernelHandoverWorker}


def __getattr__(name: str):
    # TensorRT-LLM imports this module by name (KvCacheConnectorConfig.connector_module) and looks the
    # classes up with getattr; they are built then, so this module imports without TensorRT-LLM.
    if name in (SCHEDULER_CLASS, WORKER_CLASS):
        _import_trtllm()
        classes = _build_connector_classes()
        globals().update(classes)
        return classes[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ----------------------------------------------------------------------------------------- backend

def _deployment_config(cfg, engine_dir):
    """A DeploymentConfig from a DeploymentConfig, the resolved dict of engine_dir/config.json, or None."""
    if hasattr(cfg, "trtllm_llm_kwargs"):
        return cfg
    from ..config import parse_config  # noqa: PLC0415 - config pulls in the model registry
    where = str(Path(engine_dir) / "config.json") if engine_dir is not None else "<config>"
    if cfg is None:
        import json  # noqa: PLC0415
        try:
            cfg = json.loads(Path(where).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise EngineError(f"{where}: cannot read the engine's config ({e}); rebuild the engine") from None
    return parse_config(cfg, where=where)


def _llm_kwargs(cfg) -> dict[str, Any]:
    """tensorrt_llm.LLM keyword arguments: TensorRT-LLM's own keys from the deployment config, adapted to
    a prefill-only role (see the module docstring)."""
    kw = dict(cfg.trtllm_llm_kwargs())
    leaked = {"prefill", "megakernel"} & set(kw)
    if leaked:  # TensorRT-LLM rejects unknown keys; ours must never reach it
        raise EngineError(f"internal: trtllm_llm_kwargs() passed our own sections {sorted(leaked)}")
    from tensorrt_llm.llmapi import KvCacheConfig  # noqa: PLC0415
    try:
        from tensorrt_llm.llmapi.llm_args import KvCacheConnectorConfig  # noqa: PLC0415
    except ImportError:
        raise EngineError("this TensorRT-LLM has no KvCacheConnectorConfig; the tensorrt_llm prefill backend needs "
                          "TensorRT-LLM 1.1 or newer; use prefill.backend: torch") from None
    B, tpb = cfg.max_batch_size, cfg.kv_cache_config.tokens_per_block
    seq = cfg.max_input_len + 1  # the prompt and the one token TensorRT-LLM samples
    kv = dict(kw.pop("kv_cache_config", {}))
    kv.setdefault("tokens_per_block", tpb)
    kv["max_tokens"] = max(B * blocks_for(seq, tpb), blocks_for(cfg.max_num_tokens, tpb) + B) * tpb
    if "use_kv_cache_manager_v2" in getattr(KvCacheConfig, "model_fields", {}):
        kv["use_kv_cache_manager_v2"] = False  # the V1 manager hands the connector one pool tensor
    kw["kv_cache_config"] = KvCacheConfig(**kv)
    kw["max_seq_len"] = seq
    kw["cuda_graph_config"] = None
    kw["enable_chunked_prefill"] = False
    kw["skip_tokenizer_init"] = True
    kw["tensor_parallel_size"] = 1
    kw["kv_connector_config"] = KvCacheConnectorConfig(connector_module=__name__,
                                                       connector_scheduler_class=SCHEDULER_CLASS,
                                                       connector_worker_class=WORKER_CLASS)
    return kw


class TensorRTLLMPrefill:
    """Prefill backend on TensorRT-LLM: ``prefill(prompts, cache)`` -> (first tokens, handover).

    ``cfg``: the DeploymentConfig (or the engine's resolved config.json as a dict, or None to read it
    from ``engine_dir``); ``weights_dir``: the HF checkpoint directory TensorRT-LLM loads (it keeps its
    own copy of the weights on the GPU, next to the megakernel's). One instance per process.
    """

    name = "tensorrt_llm"

    def __init__(self, cfg=None, engine_dir: str | os.PathLike | None = None,
                 weights_dir: str | os.PathLike | None = None):
        global _HANDOVER
        trtllm = _import_trtllm()
        self.cfg = _deployment_config(cfg, engine_dir)
        if weights_dir is None or str(weights_dir) == "random" or not Path(weights_dir).is_dir():
            raise UserError(f"the tensorrt_llm prefill backend loads an HF checkpoint directory, got {weights_dir!r}; "
                            f"for random weights use prefill.backend: torch")
        if _HANDOVER is not None:
            raise UserError("a TensorRTLLMPrefill already exists in this process (its KV cache connector is "
                            "process-wide); reuse it or call close() first")
        single = os.environ.get("TLLM_WORKER_USE_SINGLE_PROCESS")
        if single not in (None, "1"):
            raise UserError(f"TLLM_WORKER_USE_SINGLE_PROCESS={single}: the tensorrt_llm prefill backend needs "
                            f"TensorRT-LLM's executor in this process (unset it or set it to 1)")
        os.environ["TLLM_WORKER_USE_SINGLE_PROCESS"] = "1"
        spec = self.cfg.model_spec
        self.spec = spec
        self.tokens_per_block = self.cfg.kv_cache_config.tokens_per_block
        _HANDOVER = KVHandover(spec.num_layers, spec.num_kv_heads, self.tokens_per_block, spec.head_dim)
        try:
            self.llm = trtllm.LLM(model=str(weights_dir), **_llm_kwargs(self.cfg))
        except Exception:
            _HANDOVER = None
            raise
        if _HANDOVER.pool is None:
            self.close()
            raise EngineError("TensorRT-LLM started without handing its KV pool to the connector "
                              "(register_kv_caches was never called); use prefill.backend: torch")

    def close(self) -> None:
        global _HANDOVER
        llm = getattr(self, "llm", None)
        if llm is not None and hasattr(llm, "shutdown"):
            llm.shutdown()
        self.llm = None
        _HANDOVER = None

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], cache: PagedKVCache | None = None
                ) -> tuple[torch.Tensor, dict[int, list[int]]]:
        """Run every prompt's context phase on TensorRT-LLM and copy its K/V into ``cache`` (allocated for
        the batch when None, then reachable as ``self.cache``). Returns the greedy first token of each
        prompt (int32 [B] on the GPU) and the handover record: our batch slot -> the TensorRT-LLM pool
        blocks its K/V came from."""
        from tensorrt_llm import SamplingParams  # noqa: PLC0415

        if self.llm is None:
            raise UserError("this TensorRTLLMPrefill was closed")
        if not prompts or len(prompts) > self.cfg.max_batch_size:
            raise UserError(f"{len(prompts)} prompts; the engine takes 1..{self.cfg.max_batch_size}")
        for p in prompts:
            if not p or len(p) > self.cfg.max_input_len:
                raise UserError(f"prompt of {len(p)} tokens; the engine takes 1..{self.cfg.max_input_len}")
        if cache is None:
            cache = PagedKVCache.allocate(self.spec, len(prompts), self.cfg.max_seq_len, self.tokens_per_block,
                                          device="cuda")
        if cache.tokens_per_block != self.tokens_per_block or cache.pool.dtype != torch.bfloat16:
            raise UserError(f"cache: tokens_per_block {cache.tokens_per_block}, dtype {cache.pool.dtype}; TensorRT-LLM "
                            f"prefills bfloat16 blocks of {self.tokens_per_block} tokens")
        self.cache = cache
        handover = _handover()
        distinct = handover.begin(cache, prompts)
        # Greedy, one token: the first token comes from TensorRT-LLM's logits, the rest from the megakernel.
        # Without a tokenizer (skip_tokenizer_init) TensorRT-LLM takes the end id from the request.
        eos = list(getattr(self.spec, "eos_token_ids", None) or [])
        ids = {"end_id": eos[0], "pad_id": eos[0]} if eos else {}
        params = SamplingParams(max_tokens=1, top_k=1, ignore_eos=True, **ids)
        try:
            outputs = self.llm.generate([list(p) for p in distinct], params, use_tqdm=False)
            torch.cuda.synchronize()  # the copies ran on TensorRT-LLM's stream; decode runs on ours
        except BaseException:
            handover.abort()
            raise
        first = {p: int(out.outputs[0].token_ids[0]) for p, out in zip(distinct, outputs)}
        copied = handover.end()
        tokens = torch.tensor([first[tuple(int(t) for t in p)] for p in prompts], dtype=torch.int32,
                              device=cache.pool.device)
        return tokens, copied
