"""OPROJ: the output projection, a K-split GEMV that adds into x (optionally merging the splits itself)."""
from __future__ import annotations

from . import KindDef
from .combine import merge_cost

DEF = KindDef("OPROJ", streams_weights=True, args=("layer", "r0", "r1", "k0", "k1", "stage"), device_file="oproj.cuh",
              device_needs=("COMBINE",), signals_by_data=("oproj_done",))


def execute(ex, t, layer: int) -> None:
    """CPU-executor semantics (trtllm_mk.executor.CpuExecutor ``ex``): see graph.tasks."""
    import torch

    from ..residual import to_fixed
    from .router import oproj_fold, oproj_parts, through_o
    if ex.graph.plan.o_merge:            # the chunk's heads, merged from the partials here
        n = ex.G * ex.d
        src = torch.cat([ex.merged_attention(g) for g in range(t.k0 // n, t.k1 // n)], dim=1)
    else:
        src = ex.attn_out[:, t.k0:t.k1]
    src = ex.stage_round(src)
    rows, experts = oproj_parts(t.r0, t.r1, ex.spec.hidden_size)
    if rows:
        ex.x[:, slice(*rows)] += to_fixed(src @ ex.layers[layer]["o"][slice(*rows), t.k0:t.k1].T)
    if experts:   # the router through o (kinds/router.py)
        m = through_o(ex, layer)[slice(*experts), t.k0:t.k1]
        ex.router_acc[layer][:, slice(*experts)] += to_fixed(src @ m.T)
    if ex.graph.plan.expert_fused:
        oproj_fold(ex, t, layer)

# GEMV cost and ring hooks (kinds/gemv.py)
MATRICES = 1
NORMS_INPUT = False


def staging_extra_us(task, graph, cal) -> float:
    """Under TilePlan.o_merge the staging merges the partials of every split of the task's heads."""
    if not graph.plan.o_merge:
        return 0.0
    d = graph.dims
    return merge_cost(d.splits, d.batch * (task.k1 - task.k0), graph.plan.consumer_warps, cal)


BF16_WEIGHTS = False   # the spec's weight format (quantized when the layers are)


def k_range(spec, plan) -> int:
    """Columns a task reduces over (one K-chunk of the attention output): KT of the
    ring geometry (smem.geometries)."""
    return spec.q_size // plan.o_ksplit


def lower(c) -> list[dict]:
    """Row tiles of H (and under the chain the router's E rows after them: kinds/router.py), each K-split
    by head groups (``o_ksplit`` chunks), adding into x (router_acc)."""
    from ..graph.tasks import Access, EventRef
    from .router import oproj_accesses, oproj_parts, oproj_rows
    plan, B, S, d = c.plan, c.B, c.S, c.d
    o_chunk = c.QD // plan.o_ksplit
    out = []
    for a, b in c.tiles(oproj_rows(c.spec, plan), plan.o_rows):
        for k in range(plan.o_ksplit):
            k0, k1 = k * o_chunk, (k + 1) * o_chunk
            split = plan.o_ksplit > 1 or c.tp > 1   # adds with other K-chunks' or other ranks' partials
            if plan.o_merge:   # the chunk's heads merged from the split partials while staging
                ready = EventRef("attn_done", 0, k)
                source = c.partials(k * c.groups_per_chunk, (k + 1) * c.groups_per_chunk)
                staged = S * (k1 - k0) // d * (d + 2) * 4
            else:
                ready, source, staged = EventRef("combine_done", 0, k), (Access("attn_out", k0, k1),), (k1 - k0) * 4
            chain_waits, chain_reads, chain_writes = oproj_accesses(c, a, b, k == 0)
            rows, experts = oproj_parts(a, b, c.H)
            x_reads = (Access("x", *rows),) if rows and not split else ()
            x_writes = (Access("x", *rows, add=split or bool(chain_writes)),) if rows else ()
            # qkv_all first: it is long satisfied when the task starts waiting, so its round trip
            # overlaps the wait for the chunk's heads instead of following it on the chain
            out.append(dict(r0=a, r1=b, k0=k0, k1=k1,
                            waits=((EventRef("qkv_all", 0, 0),) if split else ()) + chain_waits + (ready,),
                            signals=(EventRef("oproj_done", 0, 0),),
                            reads=source + x_reads + chain_reads, writes=x_writes + chain_writes,
                            # the o-projection's rows in the layers' format, the router through o's in bf16
                            weight_bytes=(c.linear_bytes(rows[1] - rows[0], k1 - k0) if rows else 0)
                            + ((experts[1] - experts[0]) * (k1 - k0) * 2 if experts else 0),
                            act_bytes=B * (staged + (b - a) * 8),
                            flops=2 * B * (b - a) * (k1 - k0)))
    return out


def device_constants(graph) -> dict[str, int]:
    """cfg::O_ROWS: the widest OPROJ tile (the rows a first K-chunk task folds, kinds/router.py)."""
    return dict(O_ROWS=graph.plan.o_rows)
