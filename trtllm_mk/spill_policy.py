"""Which ranked plans are worth compiling after one spilled registers.

Plans that differ only in fields the spilling code is not specialized on compile to the same
register allocation there, so their kernels spill too. Each function of the megakernel is specialized
on some plan fields (the constants codegen/source.py compiles in; task sizes reach the kernel as task
arguments and cost no registers); a plan is passed over when, for some plan already found spilling,
it agrees with it on every field of one of that plan's spilling functions.
"""
from __future__ import annotations

import re

from .codegen.ptxas import PtxasReport
from .graph.tasks import TilePlan

# the fields every function's code depends on: the ring's shape and the consumer warps
RING = ("consumer_warps", "slot_bytes", "stages", "inflight_slots", "inflight_chain")
ALL_FIELDS = RING + ("attn_splits", "o_ksplit", "down_ksplit", "o_merge")
KIND_FIELDS = {
    "EMBED": ("consumer_warps",),
    "QKV": RING, "GATEUP": RING, "LMHEAD": RING,
    "OPROJ": RING + ("o_ksplit", "o_merge", "attn_splits"),
    "DOWN": RING + ("down_ksplit",),
    "ATTN": ("attn_splits", "slot_bytes", "consumer_warps"),
    "COMBINE": ("attn_splits", "consumer_warps"),
    "ARGMAX": ("consumer_warps",),
}
_KIND_FUNCTION = re.compile(r"^(?:run_task|prefetch_next_step)<([A-Z]+)>$")


def function_fields(name: str) -> tuple[str, ...]:
    """The plan fields the function ``name`` (kernel_function_name's form) is specialized on; the
    step's loop and anything unknown depend on all of them."""
    m = _KIND_FUNCTION.match(name)
    return KIND_FIELDS.get(m.group(1), ALL_FIELDS) if m else ALL_FIELDS


class SpilledPlans:
    """The plans found spilling, and which later plans would spill the same way."""

    def __init__(self, rename=None):
        self.rename = rename or (lambda n: n)
        self.seen: list[tuple[TilePlan, tuple[tuple[str, ...], ...]]] = []

    def add(self, plan: TilePlan, report: PtxasReport) -> None:
        self.seen.append((plan, tuple(function_fields(self.rename(f.readable)) for f in report.spilling)))

    def expected_to_spill(self, plan: TilePlan) -> bool:
        return any(all(getattr(plan, f) == getattr(p, f) for f in fields)
                   for p, groups in self.seen for fields in groups)
