"""The trtllm_mk megakernel as a benchmark system (``--plugin benchmarks.megakernel_system``).

For each (model, batch, context) the schedule is searched for exactly that deployment and its plan
chosen as the engine builder chooses it (the best one whose kernel does not spill registers),
compiled, bound to the benchmark's weights and a paged KV cache holding ``context`` tokens, and one
decode step is a replay of a CUDA graph holding one kernel launch (the same launch-overhead treatment
torch.compile's reduce-overhead mode gets).

    python benchmarks/megakernel_system.py --prebuild --models llama-3.2-1b --batch 1 4 --context 512
compiles every kernel a benchmark run will need into the cubin cache without a GPU, and keeps each
searched schedule beside the cubins (``schedules/``), keyed by the search's inputs and the source of
the package, so a GPU run skips the search too; any change to trtllm_mk/ or the calibration misses.
``--weights w4a16 [--group 128]`` prebuilds the kernels of ``decode_latency --weights w4a16``.

With 4-bit weights (``benchmarks.w4a16_weights.W4A16Weights``) the kernel binds their packed form.

A second system, ``trtllm_mk megakernel cp.async``, runs the same schedule with the weight ring of the
GPUs without bulk copies (sm_80 / sm_89: the loader warp's 16-byte ``cp.async``), compiled for this GPU:
on an H100 / H200 it measures that path beside the bulk-copy one (``--prebuild --cp-async`` compiles it).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.baselines import SystemRun, register_system  # noqa: E402
from trtllm_mk.config import MegakernelConfig  # noqa: E402
from trtllm_mk.gpus import GpuSpec, detect_gpu, get_gpu  # noqa: E402
from trtllm_mk.kv_cache import PagedKVCache  # noqa: E402
from trtllm_mk.build import shipped_schedule  # noqa: E402
from trtllm_mk.search.cached import cached_schedule, schedule_key  # noqa: E402

NAME = "trtllm_mk megakernel"
CP_ASYNC_NAME = "trtllm_mk megakernel cp.async"
SEARCH_BUDGET_S = MegakernelConfig.search_budget_s   # the configs' default: the benchmark measures the plan a build ships
TOKENS_PER_BLOCK = 32
HEADROOM = 1024   # decode steps the cache has room for beyond the context




def schedule_for(spec, batch: int, context_len: int, gpu: GpuSpec):
    """The schedule a build of this deployment ships (the search's best plan whose kernel does not
    spill registers: trtllm_mk.build.shipped_schedule), from the schedule cache when a prebuild left it."""
    key = schedule_key(spec, batch, gpu, context_len, SEARCH_BUDGET_S) + "-shipped"
    return cached_schedule(key, lambda: shipped_schedule(spec, batch, gpu, context_len, SEARCH_BUDGET_S,
                                                         TOKENS_PER_BLOCK, context_len + HEADROOM))


def _run(spec, weights, batch, context_len, device, bulk_copy: bool | None) -> SystemRun:
    """``bulk_copy``: None, the GPU's own weight ring; False, the cp.async ring."""
    from trtllm_mk.runtime.megakernel import build_decoder
    gpu = detect_gpu()
    sched = schedule_for(spec, batch, context_len, gpu)
    max_seq = context_len + HEADROOM
    cache = PagedKVCache.allocate(spec, batch, max_seq, TOKENS_PER_BLOCK, device=device, fill=1.0)
    bind = getattr(weights, "kernel", weights)   # W4A16Weights: packed codes and scale words
    bulk = gpu.has_tma if bulk_copy is None else bulk_copy
    dec = build_decoder(sched, bind, cache, gpu.nvcc_arch, bulk, max_seq_len=max_seq)
    dec.set_state(torch.randint(0, spec.vocab_size, (batch,)), torch.full((batch,), context_len))
    for _ in range(3):
        dec.step()
    dec.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            dec.step()
        step, mode = graph.replay, "cuda graph replay"
    except RuntimeError:  # capture refused (e.g. an old driver): time plain launches
        step, mode = dec.step, "direct launch"
    dec.set_state(torch.randint(0, spec.vocab_size, (batch,)), torch.full((batch,), context_len))

    def close():
        dec.synchronize()

    info = {"mode": mode, "plan": sched.plan.to_dict(), "smem_bytes": dec.layout.smem_bytes,
            "weight_ring": "bulk copies" if bulk else "cp.async"}
    if bulk == gpu.has_tma:   # the cost model prices the GPU's own ring, not the cp.async one on an sm_90
        info["predicted_ms"] = round(sched.predicted_step_us / 1e3, 4)
    return SystemRun(step=step, close=close, info=info)


def megakernel_system(spec, weights, batch, context_len, device) -> SystemRun:
    return _run(spec, weights, batch, context_len, device, None)


def cp_async_system(spec, weights, batch, context_len, device) -> SystemRun:
    return _run(spec, weights, batch, context_len, device, False)


register_system(NAME, megakernel_system)
register_system(CP_ASYNC_NAME, cp_async_system)


def prebuild(models, batches, contexts, gpu_name: str, group: int | None = None, weights: str = "bf16",
             cp_async: bool = False) -> None:
    """``weights`` "w4a16": the kernels of 4-bit weights in groups of ``group`` columns; "fp8": of FP8 ones.
    ``cp_async``: also the cp.async-ring kernels (CP_ASYNC_NAME)."""
    from trtllm_mk.codegen import compile_cubin, generate_source
    from trtllm_mk.model.registry import resolve_model
    gpu = get_gpu(gpu_name)
    for m in models:
        spec = resolve_model(m).spec
        if weights == "w4a16":
            from benchmarks.w4a16_weights import w4a16_spec
            spec = w4a16_spec(spec, group)
        elif weights == "fp8":
            from benchmarks.w4a16_weights import fp8_spec
            spec = fp8_spec(spec)
        for b in batches:
            for c in contexts:
                sched = schedule_for(spec, b, c, gpu)
                for bulk in [gpu.has_tma] + ([False] if cp_async and gpu.has_tma else []):
                    src, _ = generate_source(sched, TOKENS_PER_BLOCK, c + HEADROOM, use_bulk_copy=bulk)
                    path, _ = compile_cubin(src, gpu.nvcc_arch)
                    print(f"{m} b{b} ctx{c}{'' if bulk == gpu.has_tma else ' cp.async'}: predicted "
                          f"{sched.predicted_step_us / 1e3:.3f} ms -> {path.name}", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prebuild", action="store_true", required=True)
    ap.add_argument("--models", nargs="+", default=["llama-3.2-1b", "llama-3.1-8b", "qwen3-8b"])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--context", nargs="+", type=int, default=[128, 512, 2048, 8192])
    ap.add_argument("--gpu", default="H100-SXM")
    ap.add_argument("--weights", choices=("bf16", "w4a16", "fp8"), default="bf16")
    ap.add_argument("--group", type=int, default=128, help="--weights w4a16: input columns per scale")
    ap.add_argument("--cp-async", action="store_true", help="also the kernels of the cp.async weight ring")
    a = ap.parse_args()
    prebuild(a.models, a.batch, a.context, a.gpu, a.group, a.weights, a.cp_async)
