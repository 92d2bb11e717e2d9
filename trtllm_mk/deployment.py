"""What a deployment needs and resolves to: its GPU memory budget, its decode bandwidth floor, and
``describe``, the readable summary the builder prints before it searches.

The memory budget follows TensorRT-LLM's accounting: weights and activations (the largest live set
of one prefill pass) must fit in the GPU's memory, and ``kv_cache_config.free_gpu_memory_fraction``
is TensorRT-LLM's share of the memory left free after them that the KV cache may take; the paged KV
cache for every sequence at full length must fit in that share. With tensor parallelism the budget
is per GPU: the callers pass the spec of one rank's share (``parallel.rank_spec``: its weight shard,
its KV heads, its prefill activations).

A mixture-of-experts model keeps every expert resident (the memory budget counts them all), but a
decode step reads only the experts its rows select: the bandwidth floor counts the active bytes
(``ModelSpec.decode_weight_bytes``: batch 1 reads k experts per sparse layer; batch b the expected
number of distinct experts, and at worst min(E, b*k)).
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .gpus import GB, KB, GpuSpec
from .model.spec import ModelSpec

if TYPE_CHECKING:  # config imports this module; the summary only reads a finished config
    from .config import DeploymentConfig

FP32_BYTES = 4


@dataclass(frozen=True)
class MemoryBudget:
    weights: int          # bytes, all weights resident
    kv_cache: int         # bytes, max_batch_size sequences of max_seq_len tokens (whole blocks)
    kv_tokens: int        # tokens the KV pool holds (max_batch_size x max_seq_len rounded up to blocks)
    activations: int      # bytes, estimate of one prefill pass of max_num_tokens tokens + logits
    gpu_memory: int       # bytes of the GPU
    available: int        # bytes the KV cache may take: free_gpu_memory_fraction x (GPU memory - weights
                          # - activations), 0 when those do not fit

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations

    @property
    def headroom(self) -> int:
        return self.available - self.kv_cache

    @property
    def weights_fit(self) -> bool:
        return self.weights + self.activations <= self.gpu_memory

    @property
    def fits(self) -> bool:
        return self.weights_fit and self.kv_cache <= self.available


def kv_pool_tokens(max_batch_size: int, max_seq_len: int, tokens_per_block: int) -> int:
    """Tokens in the paged KV pool: each sequence gets whole blocks (as PagedKVCache.allocate does)."""
    blocks_per_seq = -(-max_seq_len // tokens_per_block)
    return max_batch_size * blocks_per_seq * tokens_per_block


def prefill_activation_bytes(spec: ModelSpec, max_num_tokens: int, max_batch_size: int) -> int:
    """Estimate of the peak activation memory of one prefill pass over ``max_num_tokens`` tokens.

    Live at once inside a layer (bf16): residual + normed input (2H), q/k/v, attention output (H),
    gate, up and their product (3I); SDPA runs flash/memory-efficient kernels, so no T x T scores.
    Then the fp32 logits of the last token of every sequence. Decode scratch is negligible.
    A sparse layer holds, per token, the router's logits and the gate, up and product of its k experts.
    """
    mlp = 3 * spec.intermediate_size if len(spec.moe_layers) < spec.num_layers else 0
    if spec.is_moe:
        mlp = max(mlp, 3 * spec.num_experts_per_tok * spec.moe_intermediate_size + spec.num_experts)
    per_token = 3 * spec.hidden_size + spec.q_size + 2 * spec.kv_size + mlp
    return max_num_tokens * per_token * spec.dtype_bytes + max_batch_size * spec.vocab_size * FP32_BYTES


def memory_budget(spec: ModelSpec, gpu: GpuSpec, *, max_batch_size: int, max_seq_len: int, max_num_tokens: int,
                  tokens_per_block: int, free_gpu_memory_fraction: float, kv_dtype_bytes: int = 2,
                  weight_bytes: int | None = None) -> MemoryBudget:
    """``weight_bytes`` replaces the spec's own count (quantized weights)."""
    tokens = kv_pool_tokens(max_batch_size, max_seq_len, tokens_per_block)
    weights = spec.weight_bytes() if weight_bytes is None else weight_bytes
    activations = prefill_activation_bytes(spec, max_num_tokens, max_batch_size)
    return MemoryBudget(
        weights=weights,
        kv_cache=tokens * spec.kv_bytes_per_token(kv_dtype_bytes),
        kv_tokens=tokens,
        activations=activations,
        gpu_memory=gpu.hbm_bytes,
        available=int(max(0, gpu.hbm_bytes - weights - activations) * free_gpu_memory_fraction),
    )


def decode_floor_s(spec: ModelSpec, gpu: GpuSpec, batch: int = 1, worst_case: bool = False) -> float:
    """Lower bound of one decode step of ``batch`` rows: every weight it reads (a sparse layer: the
    selected experts only, expected or ``worst_case``) read once at the GPU's streaming read bandwidth."""
    return spec.decode_weight_bytes(batch, worst_case) / gpu.read_bandwidth


def resolve_prefill_backend(name: str) -> tuple[str, str]:
    """(backend, why) for a configured ``prefill.backend``; ``auto`` picks TensorRT-LLM when installed.

    Presence is checked with find_spec rather than an import: importing tensorrt_llm initialises CUDA
    and takes seconds, which a summary must not cost.
    """
    from .config import PREFILL_BACKENDS
    from .errors import UserError
    if name not in PREFILL_BACKENDS:
        raise UserError(f"prefill backend '{name}' is not one of {', '.join(PREFILL_BACKENDS)}")
    if name == "torch":
        return name, "as configured"
    installed = importlib.util.find_spec("tensorrt_llm") is not None
    if name == "tensorrt_llm":
        return name, "as configured" if installed else "as configured; not installed here, so run and bench fail until it is"
    return ("tensorrt_llm", "auto: tensorrt_llm is installed") if installed else \
        ("torch", "auto: tensorrt_llm is not installed here")


# ------------------------------------------------------------------------------------------- summary

def _gb(n: float) -> str:
    """Bytes in decimal units (as GPU datasheets count), scaled so tiny test models stay readable."""
    for unit, scale in (("GB", GB), ("MB", 10**6), ("KB", 10**3)):
        if abs(n) >= scale / 10:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _count(n: int) -> str:
    for unit, scale in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(n)


def _duration(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-4 else f"{seconds * 1e6:.2f} us"


def _format(sections: list[tuple[str, list[tuple[str, str]]]]) -> str:
    """Titled sections of key/value rows, values aligned in one column across all sections."""
    width = max(len(k) for _, rows in sections for k, _ in rows)
    lines: list[str] = []
    for title, rows in sections:
        lines += [title] + [f"  {k.ljust(width)}  {v}" for k, v in rows] + [""]
    return "\n".join(lines).rstrip() + "\n"


def _quantization(cfg: "DeploymentConfig") -> str:
    q = cfg.quantization
    if cfg.quant_scheme is not None:
        return cfg.quant_scheme.describe()
    return f"{q['quant_algo']} (group_size {q['group_size']}, zero points {'yes' if q['has_zero_point'] else 'no'})"


def _tensor_parallel(cfg: "DeploymentConfig") -> str:
    spec, share, tp = cfg.model_spec, cfg.rank_spec, cfg.tensor_parallel_size
    kv = (f"{share.num_kv_heads} KV head" + ("s" if share.num_kv_heads > 1 else "")
          + (f" (each on {tp // spec.num_kv_heads} GPUs)" if spec.num_kv_heads < tp else ""))
    return (f"{tp} GPUs, each with {share.num_heads} heads, {kv}, intermediate {share.intermediate_size}, "
            f"vocab {share.vocab_size}")


def describe(cfg: "DeploymentConfig") -> str:
    """A readable summary of the resolved deployment: model, GPU, limits, memory, prefill, floor."""
    from .quant.kernel_support import weight_format
    spec, gpu, kv, mk = cfg.model_spec, cfg.gpu_spec, cfg.kv_cache_config, cfg.megakernel
    mem = cfg.memory_budget()
    tp, share = cfg.tensor_parallel_size, cfg.rank_spec
    floor = decode_floor_s(share, gpu)
    decode_bytes = share.decode_weight_bytes()
    if cfg.quant_scheme is not None and not share.quantized:   # the checkpoint's bytes; the kernel's otherwise
        from .quant.scheme import quantized_weight_bytes
        decode_bytes = quantized_weight_bytes(share, cfg.quant_scheme, decode=True)
        floor = decode_bytes / gpu.read_bandwidth
    prefill, why = resolve_prefill_backend(cfg.prefill.backend)
    variant = {"qwen2": "q/k/v bias", "qwen3": "QK-norm", "qwen3_moe": "QK-norm, routed experts",
               "mixtral": "routed experts"}.get(spec.family)
    lm_head = "tied to the embedding" if spec.tie_word_embeddings else "separate LM head"
    if cfg.cuda_graph_config is None:
        cuda_graphs = "disabled (null)"
    else:
        cuda_graphs = str(cfg.cuda_graph_config) if cfg.cuda_graph_config else "TensorRT-LLM default"

    return _format([
        (f"Deployment {cfg.name}" + (f"  ({cfg.source})" if cfg.source else ""), [
            ("engine dir", str(mk.output_dir)),
            ("dtype", cfg.dtype),
            *([("tensor parallel", _tensor_parallel(cfg))] if tp > 1 else []),
        ]),
        (f"Model {spec.name}  ({cfg.model_source})", [
            ("family", spec.family + (f" ({variant})" if variant else "")),
            ("layers", str(spec.num_layers)),
            ("hidden / intermediate", f"{spec.hidden_size} / {spec.intermediate_size}"),
            ("heads / kv heads", f"{spec.num_heads} / {spec.num_kv_heads} (GQA group {spec.group_size})"),
            ("head_dim", str(spec.head_dim)),
            ("vocab", f"{spec.vocab_size} ({lm_head})"),
            *(_experts_rows(spec) if spec.is_moe else []),
            ("parameters", f"{_count(spec.num_params())} ({spec.num_params()})"),
            ("weights", f"{_gb(spec.weight_bytes())} {weight_format(spec)}"),
            *([("quantization", _quantization(cfg))] if cfg.quantization else []),
            ("max_position_embeddings", str(spec.max_position_embeddings)),
        ]),
        (f"GPU {gpu.name}", [
            ("SMs", str(gpu.sm_count)),
            ("smem per block", f"{gpu.smem_per_block_optin // KB} KB opt-in ({gpu.smem_per_sm // KB} KB per SM)"),
            ("memory", f"{gpu.hbm_bytes / GB:.0f} GB"),
            ("bandwidth", f"{gpu.hbm_bandwidth / 1e9:.0f} GB/s datasheet, {gpu.read_bandwidth / 1e9:.0f} GB/s "
                          f"streaming read ({gpu.read_bw_fraction:.0%})"),
            ("nvcc target", f"{gpu.nvcc_arch} (compute capability {'.'.join(map(str, gpu.compute_capability))})"),
            ("weight streaming", "TMA bulk copies" if gpu.has_tma else "cp.async (no TMA)"),
        ]),
        ("Batch and sequence", [
            ("max_batch_size", str(cfg.max_batch_size)),
            ("max_seq_len", str(cfg.max_seq_len)),
            ("max_input_len", str(cfg.max_input_len)),
            ("max_num_tokens", str(cfg.max_num_tokens)),
            ("tokens_per_block", str(kv.tokens_per_block)),
            ("kv cache dtype", kv.dtype),
            ("cuda_graph_config", cuda_graphs),
        ]),
        ("Memory budget" + (f" per GPU (of {tp})" if tp > 1 else ""), [
            ("weights", _gb(mem.weights)),
            ("KV cache", f"{_gb(mem.kv_cache)}  ({mem.kv_tokens} tokens x {spec.kv_bytes_per_token()} B)"),
            ("activations", f"{_gb(mem.activations)}  (estimate: prefill of {cfg.max_num_tokens} tokens + logits)"),
            ("total", _gb(mem.total)),
            ("KV cache may take", f"{_gb(mem.available)}  (free_gpu_memory_fraction {kv.free_gpu_memory_fraction} "
                                  f"of the {_gb(mem.gpu_memory - mem.weights - mem.activations)} left of "
                                  f"{gpu.hbm_bytes / GB:.0f} GB)"),
            ("headroom", _gb(mem.headroom)),
        ]),
        ("Prefill and decode", [
            ("prefill backend", f"{prefill}  ({why})"),
            ("megakernel", f"{mk.mode} schedule, search budget {mk.search_budget_s:g} s, seed {mk.seed}, "
                           f"optimised for context {mk.context_len}; "
                           + ("register spills allowed" if mk.allow_spills else
                              f"no register spills (up to {mk.max_plan_attempts} ranked plans compiled)")),
            ("decode floor", f"{_duration(floor)} per token  ({_gb(decode_bytes)} of weights"
                             f"{' per GPU' if tp > 1 else ''} at {gpu.read_bandwidth / 1e9:.0f} GB/s"
                             f"{'; all-reduces not counted' if tp > 1 else ''}"
                             + (f"; {spec.num_experts_per_tok} of {spec.num_experts} experts per layer)"
                                if spec.is_moe and cfg.quant_scheme is None else ")")),
            *(_moe_floor_rows(spec, gpu, cfg.max_batch_size) if spec.is_moe and cfg.quant_scheme is None else []),
        ]),
    ])


def _experts_rows(spec: ModelSpec) -> list[tuple[str, str]]:
    sparse = len(spec.moe_layers)
    return [
        ("experts", f"{spec.num_experts}, {spec.num_experts_per_tok} per token, intermediate "
                    f"{spec.moe_intermediate_size}; top-k weights {'renormalised' if spec.norm_topk_prob else 'as routed'}"),
        ("sparse layers", f"{sparse} of {spec.num_layers}"
                          + (f" (dense MLP of {spec.intermediate_size} elsewhere)" if sparse < spec.num_layers else "")),
        ("active weights", f"{_gb(spec.decode_weight_bytes())} per token at batch 1 "
                           f"(of {_gb(spec.weight_bytes())} resident)"),
    ]


def _moe_floor_rows(spec: ModelSpec, gpu: GpuSpec, batch: int) -> list[tuple[str, str]]:
    """The floor at the deployment's batch: the expected distinct experts (uniform routing) and the worst case."""
    if batch == 1:
        return []
    rows = []
    for label, worst in (("expected", False), ("worst case", True)):
        n = spec.active_experts(batch, worst)
        rows.append((f"decode floor, batch {batch}, {label}",
                     f"{_duration(decode_floor_s(spec, gpu, batch, worst))} per step  ({n:.1f} distinct experts "
                     f"per layer, {_gb(spec.decode_weight_bytes(batch, worst))})"))
    return rows
