"""The engine builder: deployment config -> search -> validated schedule -> CUDA source -> cubin ->
engine directory (see engine.py for its layout).

Nothing is decided at run time: the schedule searched here is compiled into the kernel. A schedule
that fails validation is never written; the directory is assembled beside its destination and
moved into place only when complete, so an interrupted build never leaves a half engine behind, and it
replaces only an engine (engine_target.py).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from .codegen import find_nvcc, kernel_smem_bytes
from .config import DeploymentConfig
from .engine import write_checkpoint_record, write_kernel, write_manifest
from .engine_target import EngineTarget
from .errors import ConfigError, EngineError
from .report import write_report
from .search import search
from .smem import plan_smem
from .verify import check


def check_buildable(cfg: DeploymentConfig) -> None:
    """Refuse what the megakernel cannot compute yet, before any work: quantized weights are never
    dequantized into a bf16 engine behind the user's back, a tensor-parallel deployment is never
    built as one GPU's engine, nor is a mixture-of-experts model built dense."""
    if cfg.tensor_parallel_size > 1:
        where = cfg.source or cfg.name
        raise ConfigError(f"{where}: tensor_parallel_size: {cfg.tensor_parallel_size} GPUs cannot be built into an "
                          "engine yet: the multi-GPU megakernel (all-reduce tasks) is not implemented "
                          "(trtllm_mk.parallel shards the weights and emulates the ranks on the CPU); "
                          "use tensor_parallel_size: 1")
    from .model.moe import check_buildable_moe
    check_buildable_moe(cfg.model_spec, cfg.source or cfg.name)
    q = cfg.quantization
    if q is not None:
        where = cfg.source or cfg.name
        raise ConfigError(f"{where}: quantization: {q['quant_algo']} weights cannot be built into an engine yet: the "
                          "megakernel's quantized GEMV kinds are not implemented (the reference decoder and the CPU "
                          "executor read these checkpoints dequantized)")


def build_engine(cfg: DeploymentConfig, output_dir: str | Path | None = None, show_progress: bool = True,
                 log=print) -> tuple[Path, dict]:
    """Build the engine of ``cfg``; returns (engine directory, report dict)."""
    spec, gpu, mk = cfg.model_spec, cfg.gpu_spec, cfg.megakernel
    out = Path(output_dir or mk.output_dir)
    check_buildable(cfg)
    find_nvcc()                                # before the search: a missing compiler is no late surprise
    with EngineTarget(out) as target:          # likewise a folder the build may not write or replace
        t0 = time.perf_counter()
        schedule, stats = search(spec, cfg.max_batch_size, gpu, context_len=mk.context_len,
                                 budget_s=mk.search_budget_s, seed=mk.seed, show_progress=show_progress)
        t_search = time.perf_counter() - t0
        graph = schedule.graph()
        report = check(schedule, graph)        # raises ScheduleError naming the first offending task
        smem_need = kernel_smem_bytes(graph)
        if smem_need > gpu.smem_per_block_optin:  # the search's smem model must agree with the kernel's layout
            raise EngineError(f"searched plan needs {smem_need} B of shared memory per block, "
                              f"{gpu.name} allows {gpu.smem_per_block_optin} B (smem model out of sync with kernel)")
        tmp = target.tmp
        (tmp / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1, sort_keys=True) + "\n")
        schedule.save(tmp / "schedule.json")
        t1 = time.perf_counter()
        write_kernel(tmp, schedule, cfg.kv_cache_config.tokens_per_block, cfg.max_seq_len, gpu.nvcc_arch,
                     use_bulk_copy=gpu.has_tma)
        t_compile = time.perf_counter() - t1
        rep = write_report(tmp, schedule, stats, plan_smem(spec, cfg.max_batch_size, schedule.plan), graph, gpu)
        rep["build"] = {"search_s": round(t_search, 2), "compile_s": round(t_compile, 2),
                        "validation": report.summary()}
        (tmp / "report.json").write_text(json.dumps(rep, indent=1, sort_keys=True) + "\n")
        write_checkpoint_record(tmp, cfg.checkpoint_dir)
        write_manifest(tmp)
        out = target.commit()
    return out, rep
