"""The naive baseline: default tiles without K-split, round-robin placement, a barrier between phases.

It stands for the straightforward megakernel (one operator after another, each operator's tiles dealt
to SMs 0, 1, 2, ... in order, a grid barrier after each operator). Its predicted time comes from the
same simulator with ``barrier=True``; the searched schedule must beat it.
"""
from __future__ import annotations

from dataclasses import replace

from ..gpus import GpuSpec
from ..graph.tasks import StepGraph, TilePlan
from ..model.spec import ModelSpec
from ..schedule import Schedule, SMProgram
from ..smem import fits
from .plans import smallest_fitting_ksplit


def naive_plan(spec: ModelSpec, batch: int, gpu: GpuSpec) -> TilePlan:
    """TilePlan defaults with no K-split; ring stages reduced, then slot size halved, until the plan
    fits. Where even the smallest ring leaves no room for a whole-K activation (large batch on a
    99 KB GPU), the smallest K-split that fits is used: a baseline must at least run."""
    o, d = smallest_fitting_ksplit(spec, batch, gpu)
    plan = replace(TilePlan(), o_ksplit=o, down_ksplit=d)
    while not fits(gpu, spec, batch, plan):
        if plan.stages > 2:
            plan = replace(plan, stages=plan.stages - 1)
        else:
            plan = replace(plan, slot_bytes=plan.slot_bytes // 2)
    return plan


def naive_programs(graph: StepGraph, num_sms: int) -> list[SMProgram]:
    """Each phase's tasks dealt round-robin from SM 0, in template order (which is topological)."""
    progs = [SMProgram() for _ in range(num_sms)]

    def deal(tasks, attr: str) -> None:
        first_of_kind: dict = {}
        for i, t in enumerate(tasks):
            k = first_of_kind.setdefault(t.kind, i)
            getattr(progs[(i - k) % num_sms], attr).append(i)

    deal(graph.head, "head")
    deal(graph.layer, "layer")
    deal(graph.tail, "tail")
    return progs


def naive_schedule(spec: ModelSpec, graph: StepGraph, gpu: GpuSpec, num_sms: int | None = None) -> Schedule:
    """The naive schedule of ``graph`` (build the graph with ``naive_plan`` for the baseline proper)."""
    n = num_sms or gpu.sm_count
    return Schedule(spec=spec, batch=graph.batch, plan=graph.plan, num_sms=n, gpu=gpu.name,
                    programs=naive_programs(graph, n), context_len=graph.dims.context_len,
                    meta={"kind": "naive", "barrier": True})
