"""OPROJ: the output projection, a K-split GEMV that adds into x (optionally merging the splits itself)."""
from __future__ import annotations

from . import KindDef
from .combine import merge_cost

DEF = KindDef("OPROJ", streams_weights=True, args=("layer", "r0", "r1", "k0", "k1", "stage"))


def execute(ex, t, layer: int) -> None:
    """CPU-executor semantics (trtllm_mk.executor.CpuExecutor ``ex``): see graph.tasks."""
    import torch
    w = ex.layers[layer]["o"][t.r0:t.r1, t.k0:t.k1]
    if ex.graph.plan.o_merge:            # the chunk's heads, merged from the partials here
        n = ex.G * ex.d
        src = torch.cat([ex.merged_attention(g) for g in range(t.k0 // n, t.k1 // n)], dim=1)
    else:
        src = ex.attn_out[:, t.k0:t.k1]
    ex.x[:, t.r0:t.r1] += ex.stage_round(src) @ w.T

# GEMV cost hooks (kinds/gemv.py)
MATRICES = 1
NORMS_INPUT = False


def staging_extra_us(task, graph, cal) -> float:
    """Under TilePlan.o_merge the staging merges the partials of every split of the task's heads."""
    if not graph.plan.o_merge:
        return 0.0
    d = graph.dims
    return merge_cost(d.splits, d.batch * (task.k1 - task.k0), graph.plan.consumer_warps, cal)
