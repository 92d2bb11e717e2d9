"""Which ranked plans are worth compiling after one spilled registers.

Plans whose spilling function compiles to the same code spill alike, so the builder passes over them.
A function of the megakernel is specialized on some plan fields (the constants codegen/source.py
compiles in that its code reads) and, for the functions ``run_program`` calls once per task
(``run_task<KIND>``, ``prefetch_next_step<KIND>``), on the task arguments that every call of it passes
alike: the compiler folds those into the body (``codegen.source.shared_call_arguments``), and whether
ptxas then spills at the register cap can turn on one of them (one GATEUP task per SM makes every call
stage its input, and that constant alone tipped a body over the cap). A plan is passed over when, for
some plan already found spilling, it agrees with it on one spilling function's fields and shared
arguments. The key leaves out constants a function reads only through the shared-memory layout, which
can still tip a body that sits at the cap; the filter accepts that (a plan passed over wrongly costs
one option, a plan compiled needlessly a compile). ``run_program`` is the task list itself: it is
keyed on every compile-time field (long lists spill alike).
"""
from __future__ import annotations

import re

from .codegen.ptxas import PtxasReport
from .codegen.source import shared_call_arguments
from .schedule import Schedule

# the fields every function's code depends on: the ring's shape and the consumer warps
RING = ("consumer_warps", "slot_bytes", "stages", "inflight_slots", "inflight_chain")
ALL_FIELDS = RING + ("attn_splits", "attn_kv_run", "o_ksplit", "down_ksplit", "o_merge")
KIND_FIELDS = {
    "EMBED": ("consumer_warps",),
    "QKV": RING, "GATEUP": RING, "LMHEAD": RING,
    "OPROJ": RING + ("o_ksplit", "o_merge", "attn_splits"),
    "DOWN": RING + ("down_ksplit",),
    "ATTN": ("attn_splits", "attn_kv_run", "slot_bytes", "consumer_warps"),
    "COMBINE": ("attn_splits", "consumer_warps"),
    "ARGMAX": ("consumer_warps",),
}
_KIND_FUNCTION = re.compile(r"^(?:run_task|prefetch_next_step)<([A-Z]+)>$")


def function_fields(name: str) -> tuple[str, ...]:
    """The plan fields the function ``name`` (kernel_function_name's form) is specialized on; the
    step's loop and anything unknown depend on all of them."""
    m = _KIND_FUNCTION.match(name)
    return KIND_FIELDS.get(m.group(1), ALL_FIELDS) if m else ALL_FIELDS


def spill_key(name: str, schedule: Schedule, shared: dict[str, tuple]) -> tuple:
    """What the function ``name`` of ``schedule``'s kernel is compiled from, as far as the filter
    tells plans apart. ``shared``: shared_call_arguments(schedule)."""
    fields = tuple(getattr(schedule.plan, f) for f in function_fields(name))
    return (fields, shared.get(name)) if _KIND_FUNCTION.match(name) else fields


class SpilledPlans:
    """The spilling functions' keys, and which later plans would spill the same way. One instance per
    deployment: the keys leave out what a deployment fixes (model, batch, GPU, context)."""

    def __init__(self, rename=None):
        self.rename = rename or (lambda n: n)
        self.keys: dict[str, set] = {}

    def add(self, schedule: Schedule, report: PtxasReport) -> None:
        shared = shared_call_arguments(schedule)
        for f in report.spilling:
            name = self.rename(f.readable)
            self.keys.setdefault(name, set()).add(spill_key(name, schedule, shared))

    def expected_to_spill(self, schedule: Schedule) -> bool:
        if not self.keys:
            return False
        shared = shared_call_arguments(schedule)
        return any(spill_key(name, schedule, shared) in keys for name, keys in self.keys.items())
