"""Tile-plan evaluation and coordinate descent over the plan space.

A plan is evaluated by building its step graph, list-scheduling it and simulating SIM_LAYERS layers
(extrapolated to all); evaluations are memoized, so the families the report compares share work.
Coordinate descent: for each field in FIELDS every candidate value (plans.py) is evaluated with the
other fields fixed and the best kept; a sweep that changes nothing ends the descent. Ties on time go
to the plan with less shared memory. ``admit`` restricts the descent to a plan family.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from ..gpus import GpuSpec
from ..graph import build_step_graph
from ..graph.tasks import StepGraph, TilePlan
from ..model.spec import ModelSpec
from ..schedule import SMProgram
from ..smem import plan_smem
from .calibration import Calibration
from .cost import cost_table, default_streaming
from .listsched import list_schedule
from ..kinds import emlp
from .plans import (SLOT_SIZES, attn_tasks_per_group, field_candidates, ksplit_candidates, ring_candidates, valid,
                    with_ksplit)
from .simulate import Simulator, gc_paused

SIM_LAYERS = 4
MAX_SWEEPS = 3
# The ring comes first: its depth decides how much of the chain the loaders stream through and how
# much shared memory the other fields may take; swept last, a descent that runs out of budget never
# tries it and keeps the initial ring, which can be the wrong depth for every shape (benchmarks/NOTES.md).
FIELDS = ("ring", "attn_splits", "attn_rows", "attn_kv_run", "qkv_rows", "o_ksplit", "o_merge", "o_rows", "gateup_rows",
          "expert_fused", "down_ksplit", "down_rows", "lm_rows", "consumer_warps")
LISTSCHED_COST = 6.0    # one list-scheduled template task costs about as much as this many simulated ones

Admit = Callable[[TilePlan, ModelSpec], bool]


@dataclass
class PlanEval:
    plan: TilePlan
    step_us: float          # extrapolated prediction with the list-scheduled assignment
    peak_smem: int
    programs: list[SMProgram]


class Evaluator:
    """Plan -> PlanEval, memoized. ``evals`` counts distinct plans evaluated and ``work`` their
    nominal cost in simulated task instances (a function of the plans only, so budgets expressed in
    work are deterministic)."""

    def __init__(self, spec: ModelSpec, batch: int, gpu: GpuSpec, cal: Calibration, num_sms: int,
                 context_len: int, seed: int, slot_sizes: tuple[int, ...] = SLOT_SIZES):
        self.spec, self.batch, self.gpu, self.cal = spec, batch, gpu, cal
        self.num_sms, self.context_len, self.seed = num_sms, context_len, seed
        self.slot_sizes = slot_sizes          # ring slot sizes the "ring" field walks
        self.cache: dict[TilePlan, PlanEval] = {}
        self.evals = 0
        self.work = 0.0

    def graph(self, plan: TilePlan) -> StepGraph:
        return build_step_graph(self.spec, self.batch, plan, self.context_len)

    @staticmethod
    def work_of(graph: StepGraph) -> float:
        """Nominal work of evaluating a plan with this graph, in simulated task instances."""
        nt, ntail = len(graph.layer), len(graph.tail)
        return min(SIM_LAYERS, graph.num_layers) * nt + ntail + LISTSCHED_COST * (nt + ntail)

    def __call__(self, plan: TilePlan) -> PlanEval:
        if plan not in self.cache:
            with gc_paused():
                g = self.graph(plan)
                self.cache[plan] = self._evaluate(plan, g)
            self.evals += 1
            self.work += self.work_of(g)
        return self.cache[plan]

    def _evaluate(self, plan: TilePlan, g: StepGraph) -> PlanEval:
        costs = cost_table(g, self.gpu, self.cal, default_streaming(g, self.num_sms))
        progs = list_schedule(g, costs, self.num_sms, self.cal, np.random.default_rng(self.seed))
        res = Simulator(g, self.gpu, self.cal, layers=SIM_LAYERS, costs=costs).run(progs)
        return PlanEval(plan, res.step_us, plan_smem(self.spec, self.batch, plan).peak, progs)


def better(a: PlanEval, b: PlanEval | None) -> bool:
    if b is None:
        return True
    if a.step_us < b.step_us * (1 - 1e-9):
        return True
    return a.step_us <= b.step_us * (1 + 1e-9) and a.peak_smem < b.peak_smem


def field_variants(name: str, plan: TilePlan, ev: Evaluator) -> list[TilePlan]:
    spec, batch, gpu, nsm = ev.spec, ev.batch, ev.gpu, ev.num_sms
    if name == "ring":
        rings = ring_candidates(plan, spec, batch, gpu, ev.slot_sizes)
        # packed 4-bit rows and their scale words fill a slot of another size (quant_max_slot_bytes
        # allows larger ones) with other whole rows of DOWN's K-chunks, so the K-split that fits one
        # slot size can lose at the other: for quantized weights the ring moves with each of DOWN's
        # K-splits too (one at a time, the descent cannot cross from one slot size's best K-split to
        # the other's)
        if spec.quantized and not plan.expert_fused:
            ks = ksplit_candidates(spec)[1]
            rings += [with_ksplit(p, "down_ksplit", k, spec, nsm, batch) for p in rings
                      if p.slot_bytes != plan.slot_bytes for k in ks if k != p.down_ksplit]
        return [p for p in rings if valid(p, spec, batch, gpu)]
    if plan.expert_fused and name in ("down_ksplit", "down_rows"):
        return []   # EMLP's tiles are gateup_rows wide in both halves: these shape no task
    if name in ("o_ksplit", "down_ksplit"):
        ks = ksplit_candidates(spec)[0 if name == "o_ksplit" else 1]
        out = [with_ksplit(plan, name, k, spec, nsm, batch) for k in ks]
    elif name == "o_merge":
        # the merge pays with few heads per OPROJ task and costs much with many, so the two fields move
        # together too: one coordinate at a time, the descent cannot leave a plan with neither
        out = [replace(plan, o_merge=m) for m in (False, True)]
        out.append(replace(with_ksplit(plan, "o_ksplit", max(ksplit_candidates(spec)[0]), spec, nsm, batch), o_merge=True))
    elif name == "expert_fused":   # valid() keeps the fused plans of models with experts only
        # each with its own experts' in-flight cap (kinds/emlp.py EXPERT_INFLIGHT; not searched)
        out = [replace(plan, expert_fused=False, expert_inflight=0),
               replace(plan, expert_fused=True, expert_inflight=emlp.EXPERT_INFLIGHT)]
    else:
        out = [replace(plan, **{name: v}) for v in field_candidates(name, plan, spec, nsm, ev.context_len, batch)]
    if name == "attn_splits":
        # fewer splits over more tiles of batch rows (or the reverse) at the same task count: one
        # coordinate at a time, each half of the trade spreads the phase over fewer or more SMs than
        # it has and the descent does not take it
        tasks = attn_tasks_per_group(plan, batch)
        traded = [replace(p, attn_rows=r) for p in out if p.attn_splits != plan.attn_splits
                  for r in field_candidates("attn_rows", plan, spec, nsm, ev.context_len, batch) if r != plan.attn_rows]
        out += [p for p in traded if attn_tasks_per_group(p, batch) == tasks]
    if name == "o_rows":
        # QKV's and OPROJ's tiles, the chain's two GEMV kinds, share the SMs the list scheduler hands
        # them: resizing one moves the other's tasks, so a better pair can lie past two worse single moves
        qkv = [q for q in field_candidates("qkv_rows", plan, spec, nsm, ev.context_len, batch) if q != plan.qkv_rows]
        out += [replace(p, qkv_rows=q) for p in out if p.o_rows != plan.o_rows for q in qkv]
    return [p for p in out if valid(p, spec, batch, gpu)]


def descend(ev: Evaluator, start: TilePlan, work_limit: float, admit: Admit | None = None,
            tick: Callable[[], None] | None = None) -> tuple[PlanEval, int]:
    """Coordinate descent from ``start`` (which ``admit`` must accept) until a sweep changes nothing,
    MAX_SWEEPS sweeps, or ``ev.work`` reaches ``work_limit`` (cached plans are always reused)."""
    best = ev(start)
    sweeps = 0
    for sweeps in range(1, MAX_SWEEPS + 1):
        changed = False
        for name in FIELDS:
            for p in field_variants(name, best.plan, ev):
                if admit is not None and not admit(p, ev.spec):
                    continue
                if p not in ev.cache:
                    if ev.work >= work_limit:
                        continue
                e = ev(p)
                if tick is not None:
                    tick()
                if better(e, best):
                    best, changed = e, True
        if not changed:
            break
    return best, sweeps


TRIM_FIELDS = ("o_ksplit", "down_ksplit", "consumer_warps", "ring")


def trim(ev: Evaluator, start: TilePlan, target_us: float, tolerance: float, work_limit: float,
         admit: Admit | None = None, tick: Callable[[], None] | None = None) -> PlanEval:
    """Walk the fields that trade shared memory (K-split, consumer warps, ring) from ``start`` and keep
    any plan with less peak shared memory whose time stays within ``tolerance`` of ``target_us``."""
    cur = ev(start)
    limit = target_us * (1 + tolerance)
    for _ in range(MAX_SWEEPS):
        changed = False
        for name in TRIM_FIELDS:
            for p in field_variants(name, cur.plan, ev):
                if admit is not None and not admit(p, ev.spec):
                    continue
                if p not in ev.cache:
                    if ev.work >= work_limit:
                        continue
                e = ev(p)
                if tick is not None:
                    tick()
                if e.step_us <= limit and (e.peak_smem, e.step_us) < (cur.peak_smem, cur.step_us):
                    cur, changed = e, True
        if not changed:
            break
    return cur


def least_smem(cands: list[PlanEval], target_us: float, tolerance: float) -> PlanEval | None:
    """The plan with the least shared memory among those within ``tolerance`` of ``target_us``."""
    ok = [e for e in cands if e.step_us <= target_us * (1 + tolerance)]
    return min(ok, key=lambda e: (e.peak_smem, e.step_us)) if ok else None
