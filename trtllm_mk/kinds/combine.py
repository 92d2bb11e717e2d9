"""COMBINE: merges one KV group's attention split partials into attn_out."""
from __future__ import annotations

from . import KindDef

DEF = KindDef("COMBINE", streams_weights=False, args=("group",), device_file="combine.cuh")

# Cost-model constants (search.calibration: defaults, set per GPU by the calibration files).
CALIBRATION = {
    "combine_fixed_us": (2.0, "consumer time of a task beyond its bandwidth terms: the dependent reads of "
                              "the partials and the block barriers"),
    "merge_split_us": (0.1, "consumer time per split of a merge of split partials (here, and in OPROJ's "
                            "staging under TilePlan.o_merge): each split adds an o load per vector of elements "
                            "(combine.cuh merge_heads), a (max, sum) load and an exp per head, issued "
                            "together, so their count, not their bytes, sets it"),
}


def execute(ex, t, layer: int) -> None:
    """CPU-executor semantics (trtllm_mk.executor.CpuExecutor ``ex``): see graph.tasks."""
    g, n = t.group, ex.G * ex.d
    ex.attn_out[:, g * n:(g + 1) * n] = ex.merged_attention(g)


def merge_rounds(splits: int, elements: int, consumer_warps: int) -> int:
    """Load rounds of a consumer thread when ``elements`` attention outputs are merged from their
    ``splits`` partials (combine.cuh merge_heads): a thread loads the partials of up to
    ``32 // splits`` elements together, and its next elements' loads follow the merge of these."""
    per_thread = -(-elements // (32 * consumer_warps))
    return -(-per_thread // max(1, 32 // splits))


def merge_units(splits: int, elements: int, consumer_warps: int) -> int:
    """Split-loads on a consumer thread's path in that merge: ``splits`` per round."""
    return splits * merge_rounds(splits, elements, consumer_warps)


def merge_scratch_bytes(batch: int, heads: int, splits: int) -> int:
    """Shared scratch of a merge over ``heads`` heads (combine.cuh merge_heads): per batch row and
    head the ``splits`` exp factors and their weighted sum, fp32."""
    return batch * heads * (splits + 1) * 4


def merge_cost(splits: int, elements: int, consumer_warps: int, cal: Calibration) -> float:
    """Consumer time of that merge: ``merge_split_us`` per unit, and a dependent L2 round trip
    (``l2_latency_us``) for every round after the first, whose loads wait for the merge before them
    (the first round's is the staging pass of OPROJ, or in COMBINE's fixed latency)."""
    rounds = merge_rounds(splits, elements, consumer_warps)
    return rounds * splits * cal.merge_split_us + (rounds - 1) * cal.l2_latency_us


def duration_us(task, graph, rates, cal) -> float:
    """Consumer time: the fixed merge latency, the merge of every split's partials, L2-resident reads."""
    d, plan = graph.dims, graph.plan
    fixed = cal.combine_fixed_us + merge_cost(d.splits, d.batch * d.group * d.head_dim, plan.consumer_warps, cal)
    return cal.task_overhead_us + fixed + task.act_bytes / rates.l2 + task.flops / rates.attn


def lower(c) -> list[dict]:
    """One task per KV group; none under TilePlan.o_merge (OPROJ merges the partials itself)."""
    from ..graph.tasks import Access, EventRef
    if c.plan.o_merge:
        return []
    B, G, S, d = c.B, c.G, c.S, c.d
    return [dict(group=g, waits=(EventRef("attn_done", 0, g),),
                 signals=(EventRef("combine_done", 0, g // c.groups_per_chunk),),
                 reads=c.partials(g, g + 1), writes=(Access("attn_out", g * G * d, (g + 1) * G * d),),
                 act_bytes=B * (S * G * (d + 2) * 4 + G * d * 4), flops=3 * B * S * G * d)
            for g in range(c.nkv)]
