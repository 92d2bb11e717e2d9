"""Which ranked plans are worth compiling after one spilled registers.

Plans whose spilling function compiles to the same code spill alike, so the builder passes over them.
A function of the megakernel is specialized on some plan fields (the constants codegen/source.py
compiles in that its code reads) and, for the functions ``run_program`` calls once per task
(``run_task<KIND>``, ``prefetch_next_step<KIND>``), on the task arguments that every call of it passes
alike: the compiler folds those into the body (``codegen.source.shared_call_arguments``), and whether
ptxas then spills at the register cap can turn on one of them (one GATEUP task per SM makes every call
stage its input, and that constant alone tipped a body over the cap). ``run_program`` is the task list
itself: it is keyed on every compile-time field (long lists spill alike).

A body that spills one register (MARGINAL_SPILL_BYTES) sits at the cap, and there ptxas's
allocation tips with the rest of the kernel too: the task bodies are not inlined, and their registers
are allocated with their caller, the task list. So the same code, with the same shared arguments,
spills in one plan and not in another whose task list differs (another OPROJ tiling, say). Such a
spill passes over only plans with every field equal, which differ in no more than which SM runs which
task and spill alike. A plan passed over wrongly costs one option, a plan compiled needlessly a compile.
"""
from __future__ import annotations

import re
from dataclasses import astuple

from .codegen.ptxas import PtxasReport
from .codegen.source import shared_call_arguments
from .schedule import Schedule

# spill stores (or loads) of a body that sits at the register cap, bytes: one register
MARGINAL_SPILL_BYTES = 4
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


def spill_key(name: str, schedule: Schedule, shared: dict[str, tuple], marginal: bool = False) -> tuple:
    """What the function ``name`` of ``schedule``'s kernel is compiled from, as far as the filter
    tells plans apart. ``shared``: shared_call_arguments(schedule). ``marginal``: the key of a body at
    the register cap, every plan field (see the module's doc)."""
    if marginal:
        return ("plan", astuple(schedule.plan), shared.get(name))
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
            marginal = max(f.spill_stores, f.spill_loads) <= MARGINAL_SPILL_BYTES
            self.keys.setdefault(name, set()).add(spill_key(name, schedule, shared, marginal))

    def expected_to_spill(self, schedule: Schedule) -> bool:
        if not self.keys:
            return False
        shared = shared_call_arguments(schedule)
        return any(spill_key(name, schedule, shared, m) in keys for name, keys in self.keys.items()
                   for m in (False, True))
