"""COMBINE: merges one KV group's attention split partials into attn_out."""
from __future__ import annotations

from . import KindDef

DEF = KindDef("COMBINE", streams_weights=False, args=("group",))


def execute(ex, t, layer: int) -> None:
    """CPU-executor semantics (trtllm_mk.executor.CpuExecutor ``ex``): see graph.tasks."""
    g, n = t.group, ex.G * ex.d
    ex.attn_out[:, g * n:(g + 1) * n] = ex.merged_attention(g)


def merge_units(splits: int, elements: int, consumer_warps: int) -> int:
    """Split-merges on a consumer thread's path when ``elements`` attention outputs are merged from
    their ``splits`` partials (mk_gemv.cuh merge_splits): each thread merges its elements one after
    another, each from every split's (max, sum, o) loaded together."""
    return splits * -(-elements // (32 * consumer_warps))


def merge_cost(splits: int, elements: int, consumer_warps: int, cal: Calibration) -> float:
    """Consumer time of that merge: ``merge_split_us`` per unit."""
    return merge_units(splits, elements, consumer_warps) * cal.merge_split_us


def duration_us(task, graph, rates, cal) -> float:
    """Consumer time: the fixed merge latency, the merge of every split's partials, L2-resident reads."""
    d, plan = graph.dims, graph.plan
    fixed = cal.combine_fixed_us + merge_cost(d.splits, d.batch * d.group * d.head_dim, plan.consumer_warps, cal)
    return cal.task_overhead_us + fixed + task.act_bytes / rates.l2 + task.flops / rates.attn
