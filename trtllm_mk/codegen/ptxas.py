"""ptxas's resource report (``-Xptxas -v``) as typed values: registers, stack frame and spills per
function.

ptxas reports every kernel entry ("Compiling entry function 'NAME' for 'sm_XX'", then its stack frame
and spills, then "Used N registers, ...") and every function it kept as a call (the megakernel's
``run_program``, ``run_task<KIND>``, ``prefetch_next_step<KIND>``, ...: stack frame and spills only;
a called function runs in its entry's registers). Lines that are not ptxas's (nvcc's warnings on the
same stream) are ignored.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass

_ENTRY = re.compile(r"ptxas info\s*: Compiling entry function '([^']+)' for '([^']+)'")
_PROPS = re.compile(r"ptxas info\s*: Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"ptxas info\s*: Used (\d+) registers")


@dataclass(frozen=True)
class FunctionResources:
    """One function of ptxas's report. ``registers`` is set for kernel entries only."""
    name: str                    # as ptxas names it (mangled)
    stack_frame: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    registers: int | None = None
    entry: bool = False

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0

    @property
    def readable(self) -> str:
        return demangle(self.name)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["readable"] = self.readable
        return d


@dataclass(frozen=True)
class PtxasReport:
    """Every function ptxas reported, in its order; ``arch`` is the target of the (last) entry."""
    functions: tuple[FunctionResources, ...] = ()
    arch: str = ""

    @property
    def entries(self) -> tuple[FunctionResources, ...]:
        return tuple(f for f in self.functions if f.entry)

    @property
    def registers(self) -> int | None:
        """The most registers any entry uses (the megakernel has one entry)."""
        regs = [f.registers for f in self.entries if f.registers is not None]
        return max(regs) if regs else None

    @property
    def spill_stores(self) -> int:
        return sum(f.spill_stores for f in self.functions)

    @property
    def spill_loads(self) -> int:
        return sum(f.spill_loads for f in self.functions)

    @property
    def spilling(self) -> tuple[FunctionResources, ...]:
        return tuple(f for f in self.functions if f.spills)

    def function(self, readable: str) -> FunctionResources | None:
        """The function whose readable name is ``readable`` (e.g. "run_program", "run_task<3>")."""
        return next((f for f in self.functions if f.readable == readable), None)

    def describe_spills(self, rename=None) -> str:
        """One line: each spilling function with its spill stores / loads, e.g. "run_program 2400 B
        stores / 4520 B loads". ``rename`` maps a readable name to the one to print."""
        rename = rename or (lambda n: n)
        return ", ".join(f"{rename(f.readable)} {f.spill_stores} B stores / {f.spill_loads} B loads"
                         for f in self.spilling)

    def to_dict(self, rename=None) -> dict:
        """What kernel.json and report.json record."""
        rename = rename or (lambda n: n)
        return {"arch": self.arch, "registers": self.registers, "spill_stores": self.spill_stores,
                "spill_loads": self.spill_loads,
                "stack_frame": max((f.stack_frame for f in self.entries), default=0),
                "functions": {rename(f.readable): {"stack_frame": f.stack_frame, "spill_stores": f.spill_stores,
                                                   "spill_loads": f.spill_loads, "registers": f.registers,
                                                   "entry": f.entry, "symbol": f.name}
                              for f in self.functions}}


def parse_ptxas(text: str) -> PtxasReport:
    """Parse ptxas's verbose output (nvcc's stderr with ``-Xptxas -v``)."""
    funcs: dict[str, dict] = {}
    entries: set[str] = set()
    arch, current_entry, pending = "", None, None
    for line in text.splitlines():
        m = _ENTRY.search(line)
        if m:
            current_entry, arch = m.group(1), m.group(2)
            entries.add(current_entry)
            funcs.setdefault(current_entry, {})
            continue
        m = _PROPS.search(line)
        if m:
            pending = m.group(1)
            funcs.setdefault(pending, {})
            continue
        m = _FRAME.search(line)
        if m and pending is not None:
            funcs[pending].update(stack_frame=int(m.group(1)), spill_stores=int(m.group(2)),
                                  spill_loads=int(m.group(3)))
            pending = None
            continue
        m = _USED.search(line)
        if m and current_entry is not None:
            funcs[current_entry]["registers"] = int(m.group(1))
    out = tuple(FunctionResources(name=n, entry=n in entries, **v) for n, v in funcs.items())
    return PtxasReport(functions=out, arch=arch)


_LENGTH = re.compile(r"(\d+)")


def demangle(name: str) -> str:
    """A readable name for the Itanium-mangled names ptxas prints, enough for the megakernel's
    functions: the unqualified name and its integer template arguments (``_ZN2mk8run_taskILi3EEE...``
    -> ``run_task<3>``, ``_Z11run_programN2mk3CtxE`` -> ``run_program``); anything else unchanged."""
    if not name.startswith("_Z"):
        return name
    s = name[2:]
    nested = s.startswith("N")
    if nested:
        s = s[1:]
    last, i = None, 0
    while i < len(s) and s[i].isdigit():
        m = _LENGTH.match(s, i)
        n = int(m.group(1))
        start = m.end()
        last = s[start:start + n]
        i = start + n
        if not nested:
            break
    if last is None:
        return name
    args = []
    if s[i:i + 1] == "I":
        i += 1
        while s[i:i + 2] == "Li":
            m = re.match(r"Li(n?\d+)E", s[i:])
            if not m:
                break
            args.append(m.group(1).replace("n", "-"))
            i += m.end()
    return f"{last}<{', '.join(args)}>" if args else last
