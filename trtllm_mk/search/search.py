"""The offline schedule search: tile plan, task -> SM assignment and per-SM order for one deployment.

Stages (every decision is a function of the inputs and the seed; see "Budget" for time):
  1. naive      the baseline (naive.py), simulated exactly with phase barriers.
  2. plans      coordinate descent over the TilePlan fields from the better of plans.initial_plan
                and the naive plan (planeval.py), a second one from plans.wide_ring_plan (the better
                of the two goes on),
                then the same descent restricted to the plan families without K-splitting that the
                report compares against (smemref.py); all share one memo of evaluated plans.
  3. smem trim  from the fastest plan, K-split, consumer warps and ring are walked again keeping
                plans within SMEM_TOLERANCE of the best time that need less shared memory; of all
                evaluated plans within the tolerance, the one with the least peak shared memory is
                chosen (K-split frees shared memory at equal time: Ada-MK's trade).
  4. improve    local search over the chosen plan's assignment (improve.py).
  5. final      exact simulation of all layers gives Schedule.predicted_step_us.

Budget: decisions never read the clock. ``budget_s`` becomes a work budget with a nominal speed
(NOMINAL_SIM_RATE simulated task instances per second, about 60% of what one development core
reaches, so a busy machine still finishes in time). Each plan evaluation costs its graph's size in
instances (planeval.Evaluator.work_of), each improvement step one simulation; the stages get fixed
shares of the work budget. So one seed always gives byte-identical schedules, and the wall time is
reported, not used. Small problems converge before their budget is spent.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Iterator

import numpy as np
from tqdm import tqdm

from ..gpus import GpuSpec
from ..graph import TilePlan, build_step_graph
from ..model.spec import ModelSpec
from ..schedule import Schedule
from .calibration import Calibration, load_calibration
from .improve import improve
from .naive import naive_plan, naive_programs
from .planeval import SIM_LAYERS, Evaluator, better, descend, least_smem, trim
from .plans import SLOT_SIZES, initial_plan, wide_ring_plan, with_weight_inflight
from .simulate import SimResult, Simulator
from .smemref import compare, search_families, trim_at_references

SMEM_TOLERANCE = 0.0025          # plans within 0.25% of the best predicted time count as "equal"
NOMINAL_SIM_RATE = 120_000       # simulated task instances per second (nominal, see module doc)
# shares of the work budget; the rest covers the exact simulations of the naive and final schedules
PLAN_SHARE, WIDE_SHARE, FAMILY_SHARE, TRIM_SHARE, IMPROVE_SHARE = 0.5, 0.25, 0.2, 0.05, 0.15

Progress = Callable[[str, int, int], None]


@dataclass
class SearchStats:
    predicted_us: float = 0.0
    naive_us: float = 0.0
    naive_plan: dict = field(default_factory=dict)
    improvement_pct: float = 0.0
    list_schedule_us: float = 0.0      # chosen plan before local improvement (extrapolated)
    improved_us: float = 0.0           # after local improvement (extrapolated)
    floor_us: float = 0.0              # weight bytes / read bandwidth + launch
    plan_evals: int = 0
    work_budget: int = 0               # simulated task instances budget_s allows (see module doc)
    work_spent: int = 0
    sweeps: int = 0
    improve_steps: int = 0
    improve_accepted: int = 0
    sim_layers: int = SIM_LAYERS
    seed: int = 0
    budget_s: float = 0.0
    search_time_s: float = 0.0         # wall clock, reported only
    calibration: str = "defaults"
    smem_chosen: int = 0
    ksplit: dict = field(default_factory=dict)    # smemref.compare: chosen vs plans without K-split

    def to_dict(self) -> dict:
        return asdict(self)

    def meta(self) -> dict:
        """What goes into Schedule.meta: everything but the wall clock (meta is part of the
        schedule's bytes, which must not depend on how fast the machine was)."""
        d = self.to_dict()
        d.pop("search_time_s")
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in d.items()}


def search(spec: ModelSpec, batch: int, gpu: GpuSpec, context_len: int = 512, budget_s: float = 60.0,
           seed: int = 0, progress: Progress | None = None, calibration: Calibration | None = None,
           num_sms: int | None = None, show_progress: bool = False) -> tuple[Schedule, SearchStats]:
    """Search the decode-step schedule of ``spec`` at ``batch`` on ``gpu`` (see module doc).

    ``progress(stage, done, total)`` is called after every plan evaluation and improvement step;
    ``show_progress`` draws a tqdm bar on stderr."""
    return next(search_candidates(spec, batch, gpu, context_len, budget_s, seed, progress, calibration, num_sms,
                                  show_progress))


def search_candidates(spec: ModelSpec, batch: int, gpu: GpuSpec, context_len: int = 512, budget_s: float = 60.0,
                      seed: int = 0, progress: Progress | None = None, calibration: Calibration | None = None,
                      num_sms: int | None = None, show_progress: bool = False,
                      max_plans: int | None = None,
                      skip: Callable[[Schedule], bool] | None = None) -> Iterator[tuple[Schedule, SearchStats]]:
    """The schedules of the search's ranked plans, best first (at most ``max_plans``): the first is
    ``search``'s; each later one is the next plan of the ranking (every plan the plan stages evaluated,
    by predicted time, then shared memory) with a local improvement of its own, computed only when
    asked for. A later plan whose schedule ``skip(schedule)`` rejects, asked once its task lists are
    final (they shape its kernel's code: spill_policy.py), is passed over. The builder walks them
    until one compiles without register spills."""
    t_start = time.perf_counter()
    cal = (calibration or load_calibration(gpu)).resolved(gpu)
    nsm = num_sms or gpu.sm_count
    where = cal.source
    if spec.tensor_parallel > 1:   # the cross-rank events are priced with the link's constants
        where += f"; link: {cal.link_source or 'assumed, not measured (parallel/allreduce_cost.py UNMEASURED)'}"
    stats = SearchStats(seed=seed, budget_s=budget_s, calibration=where)

    # 1. naive baseline (exact)
    nplan = naive_plan(spec, batch, gpu)
    ngraph = build_step_graph(spec, batch, nplan, context_len)
    stats.naive_us = Simulator(ngraph, gpu, cal, barrier=True).run(naive_programs(ngraph, nsm)).step_us
    stats.naive_plan = nplan.to_dict()
    stats.floor_us = spec.decode_weight_bytes() / cal.read_bandwidth * 1e6 + cal.launch_us

    # work budgets (simulated task instances) from budget_s and a nominal speed, never the clock
    slots = cal.slot_sizes(SLOT_SIZES, quantized=spec.quantized)
    try:   # the smallest slot the calibration allows may leave no ring that fits (large batch, small GPU)
        init = initial_plan(spec, batch, gpu, nsm, context_len, slots)
    except ValueError:
        slots = cal.slot_sizes(SLOT_SIZES, with_min=False, quantized=spec.quantized)
        init = initial_plan(spec, batch, gpu, nsm, context_len, slots)
    ev = Evaluator(spec, batch, gpu, cal, nsm, context_len, seed, slot_sizes=slots)
    work = budget_s * NOMINAL_SIM_RATE
    # each of the two reference families: a descent (w_family), a trim (w_family / 2) and, after the
    # plan is chosen, a trim of the chosen plan at the family's time (w_family / 2)
    w_plans, w_family = work * PLAN_SHARE, work * FAMILY_SHARE / 4
    w_trim, w_improve, w_wide = work * TRIM_SHARE, work * IMPROVE_SHARE, work * WIDE_SHARE
    stats.work_budget = round(work * (PLAN_SHARE + WIDE_SHARE + FAMILY_SHARE + TRIM_SHARE + IMPROVE_SHARE))
    bar = tqdm(total=stats.work_budget, desc=f"search {spec.name} b{batch} {gpu.name}", unit="inst",
               unit_scale=True, disable=not show_progress, leave=False)
    shown = [0.0]

    def report(stage: str, done: float) -> None:
        bar.update(max(0, int(done) - int(shown[0])))
        shown[0] = done
        if progress is not None:
            progress(stage, int(done), stats.work_budget)

    # 2. plan search, then the families without K-split from the best plan found. The descent starts
    # from the better of the heuristic initial plan and the naive plan (list-scheduled, no barriers),
    # so the searched schedule never starts behind the baseline it must beat (unless the naive plan's
    # slots are ones the calibration rules out).
    starts = [init] + (
        [with_weight_inflight(spec, nplan)] if nplan.slot_bytes in slots else [])
    start = min((ev(p) for p in starts), key=lambda e: e.step_us).plan
    best, stats.sweeps = descend(ev, start, w_plans, tick=lambda: report("plans", ev.work))
    # a second descent from the wide-ring start, on a budget share of its own; the better one goes on
    wide = wide_ring_plan(spec, batch, gpu, nsm, context_len, slots)
    if wide is not None:
        other, _ = descend(ev, wide, ev.work + w_wide, tick=lambda: report("plans", ev.work))
        best = other if better(other, best) else best
    fastest = search_families(ev, best.plan, w_family, SMEM_TOLERANCE,
                              tick=lambda: report("references", ev.work))

    # 3. least shared memory at (nearly) the best time over everything evaluated
    top = min(ev.cache.values(), key=lambda e: (e.step_us, e.peak_smem))
    trim(ev, top.plan, top.step_us, SMEM_TOLERANCE, ev.work + w_trim, tick=lambda: report("trim", ev.work))
    chosen = least_smem(list(ev.cache.values()), top.step_us, SMEM_TOLERANCE)
    trim_at_references(ev, chosen, fastest, w_family / 2, SMEM_TOLERANCE, tick=lambda: report("references", ev.work))
    # the iso-time trims may have found a plan as fast with less shared memory: it is the chosen one
    chosen = least_smem(list(ev.cache.values()), top.step_us, SMEM_TOLERANCE)
    stats.plan_evals = ev.evals
    stats.smem_chosen = chosen.peak_smem
    stats.ksplit = compare(ev, chosen, fastest, SMEM_TOLERANCE)
    ranked = [chosen] + sorted((e for e in ev.cache.values() if e.plan != chosen.plan),
                               key=lambda e: (e.step_us, e.peak_smem))
    base_work = ev.work

    rank = 0
    for pe in ranked:
        if max_plans is not None and rank >= max_plans:
            return
        st = stats if rank == 0 else replace(stats, smem_chosen=pe.peak_smem)
        tick = (lambda i, n: report("improve", base_work + i * step_work)) if rank == 0 else None
        # 4. local improvement of the plan's assignment
        graph = ev.graph(pe.plan)
        sim = Simulator(graph, gpu, cal, layers=SIM_LAYERS)
        st.list_schedule_us = pe.step_us
        step_work = 1.3 * sim.n                   # one simulation plus the bookkeeping of a move
        steps = int(w_improve / step_work)
        programs, _, istats = improve(graph, sim, pe.programs, nsm, steps, np.random.default_rng(seed),
                                      progress=tick)
        st.improve_steps, st.improve_accepted, st.improved_us = istats.steps, istats.accepted, istats.end_us
        st.work_spent = round(base_work + steps * step_work)
        if rank == 0:
            bar.close()

        # 5. exact prediction
        final = Simulator(graph, gpu, cal).run(programs)
        st.predicted_us = final.step_us
        st.improvement_pct = 100.0 * (st.naive_us - final.step_us) / st.naive_us
        st.search_time_s = time.perf_counter() - t_start
        sched = Schedule(spec=spec, batch=batch, plan=pe.plan, num_sms=nsm, gpu=gpu.name, programs=programs,
                         context_len=context_len, predicted_step_us=final.step_us,
                         meta={"search": st.meta()})
        if rank > 0 and skip is not None and skip(sched):
            continue
        yield sched, st
        rank += 1


def search_deployment(cfg, budget_s: float | None = None, progress: Progress | None = None,
                      show_progress: bool = False) -> tuple[Schedule, SearchStats]:
    """``search`` for a resolved DeploymentConfig: its model (one rank's share under tensor
    parallelism), GPU, max_batch_size and megakernel section (context_len, search_budget_s unless
    ``budget_s`` is given, seed)."""
    mk = cfg.megakernel
    return search(cfg.rank_spec, cfg.max_batch_size, cfg.gpu_spec, context_len=mk.context_len,
                  budget_s=mk.search_budget_s if budget_s is None else budget_s, seed=mk.seed,
                  progress=progress, show_progress=show_progress)


def predict(schedule: Schedule, gpu: GpuSpec, calibration: Calibration | None = None, barrier: bool = False,
            record: bool = False) -> SimResult:
    """Exact simulation of a schedule (all layers)."""
    cal = (calibration or load_calibration(gpu)).resolved(gpu)
    return Simulator(schedule.graph(), gpu, cal, barrier=barrier).run(schedule.programs, record=record)


def schedule_plan(spec: ModelSpec, batch: int, gpu: GpuSpec, plan: TilePlan, context_len: int = 512,
                  seed: int = 0, calibration: Calibration | None = None) -> Schedule:
    """A list-scheduled schedule of a given tile plan (no plan search, no improvement): to measure
    or test a plan the search did not pick. ``calibration``: the constants to schedule and predict
    under (default: the GPU's calibration file)."""
    cal = (calibration or load_calibration(gpu)).resolved(gpu)
    pe = Evaluator(spec, batch, gpu, cal, gpu.sm_count, context_len, seed)(plan)
    s = Schedule(spec=spec, batch=batch, plan=plan, num_sms=gpu.sm_count, gpu=gpu.name, programs=pe.programs,
                 context_len=context_len, meta={"kind": "list-scheduled plan"})
    s.predicted_step_us = predict(s, gpu, cal).step_us
    return s
