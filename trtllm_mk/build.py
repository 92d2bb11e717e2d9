"""The engine builder: deployment config -> search -> validated schedule -> CUDA source -> cubin ->
engine directory (see engine.py for its layout).

Nothing is decided at run time: the schedule searched here is compiled into the kernel. A schedule
that fails validation is never written; the directory is assembled beside its destination and
moved into place only when complete, so an interrupted build never leaves a half engine behind, and it
replaces only an engine (engine_target.py).

Nor is a kernel that spills registers shipped unless the user allows it: the search's ranked plans
are compiled best first (megakernel.max_plan_attempts of them at most, passing over plans expected
to spill as one already compiled did: spill_policy.py), and the first whose kernel ptxas reports
without spill stores or loads in any function is taken, each plan skipped named with its spills.
When every plan tried spills, the build fails naming the spills of the best one, or, with
megakernel.allow_spills, ships it with a warning. The report and kernel.json record the kernel's
registers and spills per function, and the plans skipped.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from .codegen import find_nvcc, kernel_smem_bytes
from .config import DeploymentConfig, MegakernelConfig
from .engine import (TP_MODEL_KEY, KernelBuild, checkpoint_record, compile_kernel, kernel_function_name,
                     write_checkpoint_record, write_kernel, write_manifest)
from .engine_target import EngineTarget
from .graph.tasks import StepGraph
from .model.spec import ModelSpec
from .quant.kernel_support import UnsupportedQuantization, quantized_spec
from .errors import ConfigError, EngineError
from .report import write_report
from .schedule import Schedule
from .search import SearchStats, search_candidates
from .smem import plan_smem
from .spill_policy import SpilledPlans
from .verify import ValidationReport, check


class SpillError(EngineError):
    """Every plan the build compiled spills registers, and the config does not allow spills."""


def check_buildable(cfg: DeploymentConfig) -> None:
    """Refuse what the megakernel cannot compute yet, before any work: quantized weights it does not
    stream (8-bit, FP8, activation order, groups its layout cannot take) are never dequantized into a
    bf16 engine behind the user's back, nor is a mixture-of-experts model built dense; a
    tensor-parallel engine takes bf16 weights."""
    where = cfg.source or cfg.name
    if cfg.tensor_parallel_size > 1 and cfg.model_spec.quantized:
        raise ConfigError(f"{where}: tensor_parallel_size {cfg.tensor_parallel_size} with quantized weights: the "
                          "tensor-parallel engine streams bf16 weights only; use tensor_parallel_size: 1 or a bf16 "
                          "checkpoint")
    from .model.moe import check_buildable_moe
    check_buildable_moe(cfg.model_spec, where)
    scheme = cfg.quant_scheme
    if scheme is not None and cfg.model_spec.is_moe:   # before the layout's own reasons: this one is the cause
        raise ConfigError(f"{where}: quantization: cannot be built into an engine: a mixture-of-experts model with "
                          f"{scheme.describe()} weights; the megakernel streams bf16 experts (the reference decoder "
                          "and the CPU executor read these checkpoints dequantized)")
    if scheme is not None and not cfg.model_spec.quantized:
        try:
            quantized_spec(cfg.model_spec, scheme)
            why = f"{scheme.describe()}: the model spec was not formed for these weights"   # a bug, never a user's
        except UnsupportedQuantization as e:
            why = str(e)
        raise ConfigError(f"{where}: quantization: cannot be built into an engine: {why} (the reference decoder and "
                          "the CPU executor read these checkpoints dequantized)")


def check_weights(cfg: DeploymentConfig, log=print) -> dict | None:
    """The checkpoint's tensors checked against the model (names, shapes, dtypes; a quantized checkpoint's
    packed layers read one at a time), then its fingerprint for the engine's record; None when the model
    was named by architecture only."""
    if cfg.checkpoint_dir is None:
        return None
    if cfg.quant_scheme is not None:
        log(f"checking the quantized layers of {cfg.checkpoint_dir} ...")
    from .model.checkpoint import check_checkpoint
    check_checkpoint(cfg.checkpoint_dir, cfg.model_spec)
    return checkpoint_record(cfg.checkpoint_dir)


def _candidate(schedule: Schedule, gpu) -> tuple:
    """A searched schedule's graph and validation; a plan the kernel's shared memory cannot hold is
    a bug of the search's shared-memory model, never skipped silently."""
    graph = schedule.graph()
    report = check(schedule, graph)        # raises ScheduleError naming the first offending task
    smem_need = kernel_smem_bytes(graph)
    if smem_need > gpu.smem_per_block_optin:  # the search's smem model must agree with the kernel's layout
        raise EngineError(f"searched plan needs {smem_need} B of shared memory per block, "
                          f"{gpu.name} allows {gpu.smem_per_block_optin} B (smem model out of sync with kernel)")
    return graph, report


def _plan_line(rank: int, schedule: Schedule) -> str:
    return f"plan {rank + 1} (predicted {schedule.predicted_step_us / 1000:.3f} ms/step)"


@dataclass
class ChosenPlan:
    """The plan a build ships: its rank among the search's plans (0: the search's first choice), its
    schedule, graph and validation, its compiled kernel, and the plans skipped before it."""
    rank: int
    schedule: Schedule
    stats: SearchStats
    graph: StepGraph
    validation: ValidationReport
    kernel: KernelBuild
    skipped: list[dict] = field(default_factory=list)


def first_without_spills(candidates, gpu, tokens_per_block: int, max_seq_len: int,
                         spilled: SpilledPlans | None = None, on_skip=None) -> tuple[ChosenPlan, bool]:
    """Compile the ranked ``candidates`` ((schedule, stats) pairs, best first) until one's kernel does
    not spill: (that plan, False); when every candidate spills, (the best of them, True). Each spilling
    plan is recorded in the returned plan's ``skipped``, learnt by ``spilled`` (the search then passes
    over the plans expected to spill alike) and reported to ``on_skip(rank, schedule, kernel)``."""
    skipped: list[dict] = []
    first = None
    for rank, (schedule, stats) in enumerate(candidates):
        graph, validation = _candidate(schedule, gpu)
        kernel = compile_kernel(schedule, tokens_per_block, max_seq_len, gpu.nvcc_arch, use_bulk_copy=gpu.has_tma)
        plan = ChosenPlan(rank, schedule, stats, graph, validation, kernel, skipped)
        if not kernel.spills:
            return plan, False
        ptx = kernel.ptxas
        if spilled is not None:
            spilled.add(schedule, ptx)
        skipped.append({"rank": rank + 1, "plan": schedule.plan.to_dict(),
                        "predicted_step_us": round(schedule.predicted_step_us, 2),
                        "spill_stores": ptx.spill_stores, "spill_loads": ptx.spill_loads,
                        "spills": kernel.describe_spills()})
        first = first or plan
        if on_skip is not None:
            on_skip(rank, schedule, kernel)
    first.skipped = [s for s in skipped if s["rank"] != first.rank + 1]
    return first, True


def compile_without_spills(cfg: DeploymentConfig, candidates, show_progress: bool = True,
                           log=print, spilled: SpilledPlans | None = None) -> ChosenPlan:
    """The build's choice among the ranked ``candidates`` (``first_without_spills``): the first plan
    whose kernel does not spill. When every candidate spills: SpillError, or with
    megakernel.allow_spills the best candidate."""
    gpu, mk = cfg.gpu_spec, cfg.megakernel
    bar = None

    def on_skip(rank, schedule, kernel):
        nonlocal bar
        more = rank + 1 < mk.max_plan_attempts
        if bar is not None:
            bar.clear()                   # the line goes above the bar, not into it
        log(f"{_plan_line(rank, schedule)} skipped: its kernel spills registers ({kernel.describe_spills()})"
            + ("; compiling the next ranked plan" if more else ""))
        if bar is not None:
            bar.update(1)
            bar.refresh()
        elif more:
            bar = tqdm(total=mk.max_plan_attempts, initial=rank + 1, desc="compiling ranked plans",
                       unit="plan", disable=not show_progress, leave=False)

    try:
        chosen, spills = first_without_spills(candidates, gpu, cfg.kv_cache_config.tokens_per_block, cfg.max_seq_len,
                                              spilled, on_skip)
    finally:
        if bar is not None:
            bar.close()
    if not spills:
        return chosen
    kernel = chosen.kernel
    what = (f"every one of the {len(chosen.skipped) + 1} ranked plans compiled spills registers; the best, "
            f"{_plan_line(chosen.rank, chosen.schedule)}, spills {kernel.ptxas.spill_stores} B of stores and "
            f"{kernel.ptxas.spill_loads} B of loads ({kernel.describe_spills()})")
    if not mk.allow_spills:
        raise SpillError(f"{cfg.source or cfg.name}: {what}; raise megakernel.max_plan_attempts "
                         f"(now {mk.max_plan_attempts}) to compile more plans, or set megakernel.allow_spills: "
                         "true to ship it")
    log(f"WARNING: {what}; shipping it because megakernel.allow_spills is set (the kernel is slower "
        "than the cost model predicts)")
    return chosen


def shipped_schedule(spec: ModelSpec, batch: int, gpu, context_len: int, budget_s: float, tokens_per_block: int,
                     max_seq_len: int, max_plans: int = MegakernelConfig.max_plan_attempts, seed: int = 0) -> Schedule:
    """The schedule a build with these arguments ships (``allow_spills`` set: it never fails): the
    search's best plan whose kernel does not spill, the plans expected to spill alike passed over. For
    benchmarks and experiments, which must measure what a build ships."""
    spilled = SpilledPlans(kernel_function_name)
    candidates = search_candidates(spec, batch, gpu, context_len=context_len, budget_s=budget_s, seed=seed,
                                   show_progress=False, max_plans=max_plans, skip=spilled.expected_to_spill)
    chosen, _ = first_without_spills(candidates, gpu, tokens_per_block, max_seq_len, spilled)
    return chosen.schedule


def build_engine(cfg: DeploymentConfig, output_dir: str | Path | None = None, show_progress: bool = True,
                 log=print) -> tuple[Path, dict]:
    """Build the engine of ``cfg``; returns (engine directory, report dict)."""
    # a tensor-parallel engine's schedule and kernel are one rank's (every rank runs them on its shard)
    spec, gpu, mk = cfg.rank_spec, cfg.gpu_spec, cfg.megakernel
    out = Path(output_dir or mk.output_dir)
    check_buildable(cfg)
    find_nvcc()                                # before the search: a missing compiler is no late surprise
    record = check_weights(cfg, log)           # likewise a checkpoint whose tensors do not fit the model
    with EngineTarget(out) as target:          # and a folder the build may not write or replace
        if show_progress:
            log(f"searching the decode schedule (budget {mk.search_budget_s:g} s, seed {mk.seed}) ...")
        t0 = time.perf_counter()
        spilled = SpilledPlans(kernel_function_name)
        candidates = search_candidates(spec, cfg.max_batch_size, gpu, context_len=mk.context_len,
                                       budget_s=mk.search_budget_s, seed=mk.seed, show_progress=show_progress,
                                       max_plans=mk.max_plan_attempts, skip=spilled.expected_to_spill)
        best = next(candidates)
        t_search = time.perf_counter() - t0

        def ranked():
            yield best
            yield from candidates

        t1 = time.perf_counter()
        if show_progress:
            log(f"compiling the megakernel for {gpu.nvcc_arch} (nvcc; a minute or more for real models) ...")
        chosen = compile_without_spills(cfg, ranked(), show_progress, log, spilled)
        t_compile = time.perf_counter() - t1
        schedule, kernel, graph = chosen.schedule, chosen.kernel, chosen.graph
        if cfg.tensor_parallel_size > 1:
            schedule.meta[TP_MODEL_KEY] = cfg.model_spec.to_dict()
        tmp = target.tmp
        (tmp / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1, sort_keys=True) + "\n")
        schedule.save(tmp / "schedule.json")
        write_kernel(tmp, schedule, kernel)
        resources = kernel.resources
        kernel_rep = {"target": gpu.nvcc_arch, **{k: resources[k] for k in ("registers", "spill_stores",
                                                                           "spill_loads", "stack_frame")},
                      "spills": kernel.describe_spills() or None, "functions": resources["functions"],
                      "plan_rank": chosen.rank + 1, "plans_skipped": chosen.skipped,
                      "allow_spills": mk.allow_spills}
        rep = write_report(tmp, schedule, chosen.stats, plan_smem(spec, cfg.max_batch_size, schedule.plan), graph, gpu,
                           kernel=kernel_rep)
        rep["build"] = {"search_s": round(t_search, 2), "compile_s": round(t_compile, 2),
                        "validation": chosen.validation.summary()}
        (tmp / "report.json").write_text(json.dumps(rep, indent=1, sort_keys=True) + "\n")
        write_checkpoint_record(tmp, record)
        write_manifest(tmp)
        out = target.commit()
    return out, rep
