"""The task-kind registry: one module per kind (this package's ``<kind>.py``), in the order that fixes
each kind's number. ``Kind`` (re-exported by ``trtllm_mk.graph``) is built from the registry, so a new
kind is one new module here plus its line in ``_MODULES``; the generated kernel's ``enum Kind`` and
the task dispatch follow from ``Kind``.

Each kind module defines ``DEF``, a ``KindDef``: its name, whether its weight tiles stream through the
shared-memory ring (the GEMV kinds), the ``TaskArgs`` fields its device body reads, and its device
file (``<kind>.cuh`` beside the module). A kind whose cost model needs constants that are not
datasheet facts declares them in ``CALIBRATION``, ``{name: (default, why)}``: search.calibration's
``Calibration`` carries them beside the machine's constants and the calibration files set them.
Optional hooks a module may define: ``active(spec, plan)`` (whether a step under the plan has the
kind's tasks), ``device_constants(graph)`` (``cfg`` constants its device file reads, emitted into the
kernel), ``extra_ring_slots(task, plan, dims)`` (ring slots and output groups a task streams beyond
its GEMV geometry's, for the cost model), ``off_ring(plan)`` (a ring kind whose tasks read their
weights themselves under the plan: the cost model prices them by the kind's ``duration_us``).
A kind whose outputs carry their own readiness (``KindDef.signals_by_data``: tagged words that its
consumers, ``KindDef.polls``, load until the tags are theirs) makes that event polled: the device keeps
no counter for it, the CPU executor and the race checker keep the edge."""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from importlib import import_module
from pathlib import Path

from ..seam import TASK_ARGS

HERE = Path(__file__).resolve().parent

# The task-argument fields a device body may read: mk::TaskArgs (seam.TASK_ARGS) less its event
# reference lists (the arrays w / s) and their lengths (nw / ns), which the task dispatch consumes.
_EVENT_LISTS = {a.name for a in TASK_ARGS if a.count}
TASK_ARG_FIELDS = tuple(a.name for a in TASK_ARGS
                        if a.name not in _EVENT_LISTS and a.name.removeprefix("n") not in _EVENT_LISTS)


@dataclass(frozen=True)
class KindDef:
    name: str                      # the enum name, e.g. "QKV"
    streams_weights: bool          # weight tiles go through the shared-memory ring (GEMV tasks)
    args: tuple[str, ...]          # the TaskArgs fields the device body reads
    device_file: str               # "<kind>.cuh" beside this package: the device body
    # kinds whose device files define functions this body calls (inlined with it even when the step
    # has no task of theirs)
    device_needs: tuple[str, ...] = ()
    # Polled events (graph.tasks Event.polled): those this kind signals by storing its outputs as tagged
    # words (mk::st_tagged), and those it waits for by polling such words (mk::TagPoll) instead of a
    # counter. The residual's events (graph.builder RESIDUAL_EVENTS) are polled only where the step's
    # residual is counted (graph.builder counted_residual); the kinds listing them here count their
    # adds or poll the counts then
    signals_by_data: tuple[str, ...] = ()
    polls: tuple[str, ...] = ()

    def __post_init__(self):
        unknown = [a for a in self.args if a not in TASK_ARG_FIELDS]
        if unknown:
            raise ValueError(f"kind {self.name}: unknown task-argument fields {unknown}")


# Registry order is the kind's number (part of the schedule file format and the kernel's ABI).
_MODULES = ("embed", "qkv", "attn", "combine", "oproj", "gateup", "down", "lmhead", "argmax",
            "router", "route", "egateup", "edown", "emlp")
KIND_MODULES = tuple(import_module(f".{m}", __name__) for m in _MODULES)
KIND_DEFS: tuple[KindDef, ...] = tuple(m.DEF for m in KIND_MODULES)


class _KindBase(IntEnum):
    @property
    def definition(self) -> KindDef:
        return KIND_DEFS[self.value]

    @property
    def module(self):
        """The kind's module: lowering, costs and CPU-executor semantics (``execute``)."""
        return KIND_MODULES[self.value]

    @property
    def streams_weights(self) -> bool:
        """Kinds whose weight tiles go through the shared-memory ring (GEMV tasks)."""
        return KIND_DEFS[self.value].streams_weights

    @property
    def args(self) -> tuple[str, ...]:
        return KIND_DEFS[self.value].args

    def active(self, spec, plan) -> bool:
        """Whether the kind has tasks in a step under ``plan`` (its module's ``active``; default yes):
        a step lists alternatives, such as the split and the fused expert kinds, and the plan picks one."""
        test = getattr(KIND_MODULES[self.value], "active", None)
        return True if test is None else bool(test(spec, plan))


Kind = _KindBase("Kind", [(d.name, i) for i, d in enumerate(KIND_DEFS)], module=__name__)


def device_files(names=None) -> list[Path]:
    """The device files of the kinds ``names`` (default: every kind) and of the kinds they need, in
    registry order, for codegen to inline after the shared headers."""
    need = set(d.name for d in KIND_DEFS) if names is None else set(names)
    while True:
        more = {n for d in KIND_DEFS if d.name in need for n in d.device_needs} - need
        if not more:
            break
        need |= more
    return [HERE / d.device_file for d in KIND_DEFS if d.name in need]


def calibration_constants() -> dict[str, tuple[float, str, str]]:
    """``{name: (default, why, kind name)}`` of every kind's ``CALIBRATION``, in registry order."""
    out: dict[str, tuple[float, str, str]] = {}
    for d, m in zip(KIND_DEFS, KIND_MODULES):
        for name, (default, why) in getattr(m, "CALIBRATION", {}).items():
            if name in out:
                raise ValueError(f"kind {d.name}: calibration constant {name} is also kind {out[name][2]}'s")
            out[name] = (default, why, d.name)
    return out


__all__ = ["KIND_DEFS", "KIND_MODULES", "Kind", "KindDef", "TASK_ARG_FIELDS", "calibration_constants",
           "device_files"]
