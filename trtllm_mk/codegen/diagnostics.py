"""The megakernel's diagnostic switches: the one place a kernel build departs from production.

A ``Diagnostics`` value goes into ``generate_source``; codegen emits it as ``namespace diag`` ahead of
the device headers, which read ``diag::NAME`` (``if constexpr``), so a production build
(``Diagnostics()``) compiles exactly the code it runs. Command-line tools take the switches as
``name=value`` items (``scripts/mk_trace.py --diag attn_mark=2``, ``scripts/mk_ab.py
NAME:+prefetch_next=0``).

    attn_mark          where an ATTN task's trace mark ("staging" in runtime/trace.py) is taken, for
                       batch row 0: 0 inputs ready, 1 q/k/v loaded, 2 RoPE done, 3 token loop done
    gemv_mark          where a GEMV's "computed" trace mark is taken: 0 after its last slot's mma,
                       N > 0 after the consumers released the task's N-th ring slot
    prefetch_next      1: at the end of a step each SM prefetches the head of its next step into L2;
                       0 turns it off
    all_lanes_release  1: every consumer lane releases ring slots, so compute-sanitizer racecheck sees
                       the ordering (slower; sanitizer runs only)
    spin_timeout_ns    an event wait unsatisfied after this long records which event and traps
    radix_only         1: ARGMAX's candidate search ignores the LM-head tiles' bin counts and runs
                       its radix passes over the logits (the path of a nearly flat distribution)
    polled_events      1: a polled event (graph.tasks Event.polled) has no counter on the device, its
                       waiters poll the tagged data only; 0 keeps its counter too (release and wait:
                       the same data, the protocol of the other events)
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from ..errors import UserError


@dataclass(frozen=True)
class Diagnostics:
    attn_mark: int = 0
    gemv_mark: int = 0
    prefetch_next: int = 1
    all_lanes_release: int = 0
    spin_timeout_ns: int = 2_000_000_000
    radix_only: int = 0
    polled_events: int = 1

    def __post_init__(self):
        if self.attn_mark not in (0, 1, 2, 3):
            raise UserError(f"attn_mark {self.attn_mark}: must be 0, 1, 2 or 3")
        if self.gemv_mark < 0:
            raise UserError(f"gemv_mark {self.gemv_mark}: must be >= 0")
        for name in ("prefetch_next", "all_lanes_release", "radix_only", "polled_events"):
            if getattr(self, name) not in (0, 1):
                raise UserError(f"{name} {getattr(self, name)}: must be 0 or 1")
        if self.spin_timeout_ns <= 0:
            raise UserError(f"spin_timeout_ns {self.spin_timeout_ns}: must be > 0")

    @classmethod
    def parse(cls, items) -> Diagnostics:
        """From ``name=value`` strings (integers)."""
        known = {f.name for f in fields(cls)}
        values = {}
        for item in items:
            name, eq, value = item.partition("=")
            if name not in known or not eq:
                raise UserError(f"diagnostic switch {item!r}: expected NAME=INT with NAME one of {sorted(known)}")
            try:
                values[name] = int(value)
            except ValueError:
                raise UserError(f"diagnostic switch {item!r}: the value must be an integer") from None
        return cls(**values)

    @property
    def is_production(self) -> bool:
        return self == Diagnostics()

    def changed(self) -> dict[str, int]:
        """The switches that differ from production."""
        base = Diagnostics()
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != getattr(base, f.name)}

    def emit_cuda(self) -> str:
        lines = ["namespace diag {  // trtllm_mk/codegen/diagnostics.py"]
        for f in fields(self):
            ctype = "unsigned long long" if f.name == "spin_timeout_ns" else "int"
            suffix = "ull" if ctype.startswith("unsigned") else ""
            lines.append(f"constexpr {ctype} {f.name.upper()} = {getattr(self, f.name)}{suffix};")
        lines.append("}  // namespace diag")
        return "\n".join(lines) + "\n"
