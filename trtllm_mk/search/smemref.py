"""What K-splitting buys in shared memory: the chosen plan against plan families without it.

Two reference families (plans.py):
  no_ksplit    no task is split along K (OPROJ / DOWN reduce their whole K range; rows may still be
               streamed through the ring in pieces)
  no_k_tiling  Ada-MK's baseline: no task K-split and every weight row fits one ring slot, so the
               K tile is the whole K range for every GEMV kind
For each family a coordinate descent (sharing the evaluator's memo) finds its fastest plan, and a
trim (planeval.trim) within the family lowers its shared memory at that time; its reference plan is
the one with the least shared memory within the tolerance of that time. Where no plan of a family
fits the GPU's per-block shared memory (no K tiling at 8B widths: one 16-row block of 24 KB DOWN
rows is 384 KB), the family is searched on the same GPU with that limit lifted and with slots of
whole rows (plans.whole_row_slot_sizes), in an evaluator of its own: its reference then says what
the baseline would need, and the report marks it as over the limit. Two
comparisons follow, both at equal predicted time (within the tolerance):
  at the chosen plan's time   the family's least-smem plan that is as fast as the chosen plan, if any
  at the family's best time   the least-smem plan of all evaluated plans (K-split allowed) that is as
                              fast as the family's reference ("iso-time"), after a trim from the chosen
                              plan at that time (trim_at_references)
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from .planeval import Evaluator, PlanEval, descend, least_smem, trim
from .plans import SLOT_SIZES, largest_ring, no_k_tiling, no_ksplit, valid, whole_row_slot_sizes, with_ksplit

FAMILIES = {"no_ksplit": no_ksplit, "no_k_tiling": no_k_tiling}
UNBOUNDED_SMEM = 1 << 30     # per-block shared memory of the lifted-limit evaluation


@dataclass
class Family:
    """A reference family's search result: its fastest plan and the evaluator whose memo holds its
    plans (the search's own, or one without the shared-memory limit when ``over_limit``)."""
    best: PlanEval
    ev: Evaluator
    over_limit: bool = False

    def pool(self, admit) -> list[PlanEval]:
        return [e for e in self.ev.cache.values() if admit(e.plan, self.ev.spec)]


def family_start(ev: Evaluator, plan, admit):
    """``plan`` with K-split 1 (rows rescaled to keep the waves), its ring shrunk until it fits and the
    family admits it; None if no ring does."""
    spec, nsm = ev.spec, ev.num_sms
    p = with_ksplit(with_ksplit(plan, "o_ksplit", 1, spec, nsm, ev.batch), "down_ksplit", 1, spec, nsm, ev.batch)
    if valid(p, spec, ev.batch, ev.gpu) and admit(p, spec):
        return p
    return largest_ring(p, spec, ev.batch, ev.gpu, admit, ev.slot_sizes)


def unbounded_evaluator(ev: Evaluator) -> Evaluator:
    """The search's evaluator on the same GPU without its per-block shared-memory limit, with slots of
    whole rows added (the time model does not read the limit, so predictions stay comparable)."""
    gpu = replace(ev.gpu, smem_per_block_optin=UNBOUNDED_SMEM)
    slots = tuple(sorted(set(SLOT_SIZES) | set(whole_row_slot_sizes(ev.spec))))
    return Evaluator(ev.spec, ev.batch, gpu, ev.cal, ev.num_sms, ev.context_len, ev.seed, slot_sizes=slots)


def search_families(ev: Evaluator, start_plan, work_each: float, tolerance: float,
                    tick: Callable[[], None] | None = None) -> dict[str, Family | None]:
    """Descend and trim in each family from ``start_plan``; returns family -> Family (None when no
    plan of the family exists even without the shared-memory limit). Work done in an unbounded
    evaluator is added to ``ev.work``, so the search's later budgets account for it."""
    out: dict[str, Family | None] = {}
    for name, admit in FAMILIES.items():
        fev, start = ev, family_start(ev, start_plan, admit)
        if start is None:
            fev = unbounded_evaluator(ev)
            start = family_start(fev, start_plan, admit)
            if start is None:
                out[name] = None
                continue
        before = fev.work
        best, _ = descend(fev, start, before + work_each, admit, tick)
        trim(fev, best.plan, best.step_us, tolerance, max(before + work_each, fev.work) + work_each / 2,
             admit, tick)
        if fev is not ev:
            ev.work += fev.work
        out[name] = Family(best, fev, over_limit=fev is not ev)
    return out


def _reference(fam: Family, admit, tolerance: float) -> PlanEval:
    """The family's least-smem plan within the tolerance of its best time (over every plan of the
    family its evaluator has seen: other descents find some too)."""
    pool = fam.pool(admit)
    best = min(pool, key=lambda e: (e.step_us, e.peak_smem))
    return least_smem(pool, best.step_us, tolerance) or best


def trim_at_references(ev: Evaluator, chosen: PlanEval, fastest: dict[str, Family | None], work_each: float,
                       tolerance: float, tick: Callable[[], None] | None = None) -> None:
    """For the iso-time comparison: from the chosen plan (K-split allowed), trim shared memory at each
    family's best time, which is slower than the chosen plan's and so leaves room to shrink the ring
    and the tiles; the plans found join the evaluator's memo, which ``compare`` reads."""
    for name, admit in FAMILIES.items():
        fam = fastest.get(name)
        if fam is None:
            continue
        ref = _reference(fam, admit, tolerance)
        trim(ev, chosen.plan, ref.step_us, tolerance, ev.work + work_each, tick=tick)


def _cut(a: int, b: int) -> float:
    return round(100.0 * (1.0 - a / b), 2)


def compare(ev: Evaluator, chosen: PlanEval, fastest: dict[str, Family | None], tolerance: float) -> dict:
    """The comparison table of the report (see module doc), JSON-ready."""
    every = list(ev.cache.values())
    out: dict = {"tolerance_pct": round(tolerance * 100, 3), "limit": ev.gpu.smem_per_block_optin,
                 "chosen": {"predicted_us": round(chosen.step_us, 3), "peak_smem": chosen.peak_smem,
                            "plan": chosen.plan.to_dict()}}
    for name, admit in FAMILIES.items():
        fam = fastest.get(name)
        if fam is None or not fam.pool(admit):
            out[name] = {"fits": False, "exists": False}
            continue
        ref = _reference(fam, admit, tolerance)
        at_chosen = least_smem(fam.pool(admit), chosen.step_us, tolerance)
        iso = least_smem(every, ref.step_us, tolerance)
        out[name] = {
            "fits": not fam.over_limit, "exists": True,
            "best_us": round(ref.step_us, 3), "peak_smem": ref.peak_smem, "plan": ref.plan.to_dict(),
            "reaches_chosen_time": at_chosen is not None,
            "at_chosen_time": None if at_chosen is None else {
                "predicted_us": round(at_chosen.step_us, 3), "peak_smem": at_chosen.peak_smem,
                "cut_pct": _cut(chosen.peak_smem, at_chosen.peak_smem)},
            # None when no plan that fits reaches the family's time (an unbounded family can be faster)
            "iso_time": None if iso is None else {
                "target_us": round(ref.step_us, 3), "predicted_us": round(iso.step_us, 3),
                "peak_smem": iso.peak_smem, "plan": iso.plan.to_dict(), "cut_pct": _cut(iso.peak_smem, ref.peak_smem)},
        }
    return out
