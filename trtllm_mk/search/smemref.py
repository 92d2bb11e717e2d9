"""What K-splitting buys in shared memory: the chosen plan against plan families without it.

Two reference families (plans.py):
  no_ksplit    no task is split along K (OPROJ / DOWN reduce their whole K range; rows may still be
               streamed through the ring in pieces)
  no_k_tiling  Ada-MK's baseline: no task K-split and every weight row fits one ring slot, so the
               K tile is the whole K range for every GEMV kind
For each family a coordinate descent (sharing the evaluator's memo) finds its fastest plan, and a
trim (planeval.trim) within the family lowers its shared memory at that time; its reference plan is
the one with the least shared memory within the tolerance of that time. Two
comparisons follow, both at equal predicted time (within the tolerance):
  at the chosen plan's time   the family's least-smem plan that is as fast as the chosen plan, if any
  at the family's best time   the least-smem plan of all evaluated plans (K-split allowed) that is as
                              fast as the family's reference ("iso-time"), after a trim from the chosen
                              plan at that time (trim_at_references)
"""
from __future__ import annotations

from typing import Callable

from .planeval import Evaluator, PlanEval, descend, least_smem, trim
from .plans import largest_ring, no_k_tiling, no_ksplit, valid, with_ksplit

FAMILIES = {"no_ksplit": no_ksplit, "no_k_tiling": no_k_tiling}


def family_start(ev: Evaluator, plan, admit):
    """``plan`` with K-split 1 (rows rescaled to keep the waves), its ring shrunk until it fits and the
    family admits it; None if no ring does."""
    spec, nsm = ev.spec, ev.num_sms
    p = with_ksplit(with_ksplit(plan, "o_ksplit", 1, spec, nsm), "down_ksplit", 1, spec, nsm)
    if valid(p, spec, ev.batch, ev.gpu) and admit(p, spec):
        return p
    return largest_ring(p, spec, ev.batch, ev.gpu, admit)


def search_families(ev: Evaluator, start_plan, work_each: float, tolerance: float,
                    tick: Callable[[], None] | None = None) -> dict:
    """Descend and trim in each family from ``start_plan``; returns family -> its fastest PlanEval
    (or None when no plan of the family fits)."""
    out: dict[str, PlanEval | None] = {}
    for name, admit in FAMILIES.items():
        start = family_start(ev, start_plan, admit)
        if start is None:
            out[name] = None
            continue
        limit = ev.work + work_each
        best, _ = descend(ev, start, limit, admit, tick)
        trim(ev, best.plan, best.step_us, tolerance, max(limit, ev.work) + work_each / 2, admit, tick)
        out[name] = best
    return out


def trim_at_references(ev: Evaluator, chosen: PlanEval, fastest: dict[str, PlanEval | None], work_each: float,
                       tolerance: float, tick: Callable[[], None] | None = None) -> None:
    """For the iso-time comparison: from the chosen plan (K-split allowed), trim shared memory at each
    family's best time, which is slower than the chosen plan's and so leaves room to shrink the ring
    and the tiles; the plans found join the evaluator's memo, which ``compare`` reads."""
    for name, admit in FAMILIES.items():
        pool = [e for e in ev.cache.values() if admit(e.plan, ev.spec)]
        if fastest.get(name) is None or not pool:
            continue
        best = min(pool, key=lambda e: (e.step_us, e.peak_smem))
        ref = least_smem(pool, best.step_us, tolerance) or best
        trim(ev, chosen.plan, ref.step_us, tolerance, ev.work + work_each, tick=tick)


def _cut(a: int, b: int) -> float:
    return round(100.0 * (1.0 - a / b), 2)


def compare(ev: Evaluator, chosen: PlanEval, fastest: dict[str, PlanEval | None], tolerance: float) -> dict:
    """The comparison table of the report (see module doc), JSON-ready."""
    every = list(ev.cache.values())
    out: dict = {"tolerance_pct": round(tolerance * 100, 3),
                 "chosen": {"predicted_us": round(chosen.step_us, 3), "peak_smem": chosen.peak_smem,
                            "plan": chosen.plan.to_dict()}}
    for name, admit in FAMILIES.items():
        pool = [e for e in every if admit(e.plan, ev.spec)]
        if fastest.get(name) is None or not pool:
            out[name] = {"fits": False}
            continue
        # the family's best is over every evaluated plan it admits (other descents find some too)
        best = min(pool, key=lambda e: (e.step_us, e.peak_smem))
        ref = least_smem(pool, best.step_us, tolerance) or best
        at_chosen = least_smem(pool, chosen.step_us, tolerance)
        iso = least_smem(every, ref.step_us, tolerance) or ref
        out[name] = {
            "fits": True,
            "best_us": round(ref.step_us, 3), "peak_smem": ref.peak_smem, "plan": ref.plan.to_dict(),
            "reaches_chosen_time": at_chosen is not None,
            "at_chosen_time": None if at_chosen is None else {
                "predicted_us": round(at_chosen.step_us, 3), "peak_smem": at_chosen.peak_smem,
                "cut_pct": _cut(chosen.peak_smem, at_chosen.peak_smem)},
            "iso_time": {"target_us": round(ref.step_us, 3), "predicted_us": round(iso.step_us, 3),
                         "peak_smem": iso.peak_smem, "plan": iso.plan.to_dict(),
                         "cut_pct": _cut(iso.peak_smem, ref.peak_smem)},
        }
    return out
