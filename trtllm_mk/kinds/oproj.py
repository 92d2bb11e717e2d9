"""OPROJ: the output projection, a K-split GEMV that adds into x (optionally merging the splits itself)."""
from __future__ import annotations

from . import KindDef
from .combine import merge_cost

DEF = KindDef("OPROJ", streams_weights=True, args=("layer", "r0", "r1", "k0", "k1", "stage"), device_file="oproj.cuh",
              device_needs=("COMBINE",))


def execute(ex, t, layer: int) -> None:
    """CPU-executor semantics (trtllm_mk.executor.CpuExecutor ``ex``): see graph.tasks."""
    import torch

    from ..residual import to_fixed
    w = ex.layers[layer]["o"][t.r0:t.r1, t.k0:t.k1]
    if ex.graph.plan.o_merge:            # the chunk's heads, merged from the partials here
        n = ex.G * ex.d
        src = torch.cat([ex.merged_attention(g) for g in range(t.k0 // n, t.k1 // n)], dim=1)
    else:
        src = ex.attn_out[:, t.k0:t.k1]
    y = ex.stage_round(src) @ w.T
    ex.x[:, t.r0:t.r1] += to_fixed(y)
    if ex.graph.plan.expert_fused:   # the router's share of the chain (kinds/router.py)
        from .router import oproj_partial
        oproj_partial(ex, t, layer, y)

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
    """Row tiles of H, each K-split by head groups (``o_ksplit`` chunks), adding into x."""
    from ..graph.tasks import Access, EventRef
    from .router import oproj_accesses
    plan, B, S, d = c.plan, c.B, c.S, c.d
    o_chunk = c.QD // plan.o_ksplit
    out = []
    for a, b in c.tiles(c.H, plan.o_rows):
        for k in range(plan.o_ksplit):
            k0, k1 = k * o_chunk, (k + 1) * o_chunk
            split = plan.o_ksplit > 1 or c.tp > 1   # adds with other K-chunks' or other ranks' partials
            if plan.o_merge:   # the chunk's heads merged from the split partials while staging
                ready = EventRef("attn_done", 0, k)
                source = c.partials(k * c.groups_per_chunk, (k + 1) * c.groups_per_chunk)
                staged = S * (k1 - k0) // d * (d + 2) * 4
            else:
                ready, source, staged = EventRef("combine_done", 0, k), (Access("attn_out", k0, k1),), (k1 - k0) * 4
            # qkv_all first: it is long satisfied when the task starts waiting, so its round trip
            # overlaps the wait for the chunk's heads instead of following it on the chain
            chain_waits, chain_reads, chain_writes = oproj_accesses(c, a, b, k == 0)
            out.append(dict(r0=a, r1=b, k0=k0, k1=k1,
                            waits=((EventRef("qkv_all", 0, 0),) if split else ()) + chain_waits + (ready,),
                            signals=(EventRef("oproj_done", 0, 0),),
                            reads=source + (() if split else (Access("x", a, b),)) + chain_reads,
                            writes=(Access("x", a, b, add=split or bool(chain_writes)),) + chain_writes,
                            weight_bytes=c.linear_bytes(b - a, k1 - k0), act_bytes=B * (staged + (b - a) * 8),
                            flops=2 * B * (b - a) * (k1 - k0)))
    return out


def stash_at(staged: int) -> int:
    """Under TilePlan.expert_fused a task keeps its partial sums after its staged input (``staged`` bytes,
    smem.oproj_staged_bytes), 16-byte aligned, for the router's share of the chain (kinds/router.py)."""
    return staged + -staged % 16


def stash_bytes(batch: int, plan) -> int:
    """The stash: [o_rows][B] fp32."""
    return plan.o_rows * batch * 4


def device_constants(graph) -> dict[str, int]:
    """cfg::O_ROWS (the widest OPROJ tile: the stash's rows) and cfg::OPROJ_STASH_AT (its offset in act[])."""
    from ..smem import oproj_staged_bytes
    d = graph.dims
    return dict(O_ROWS=graph.plan.o_rows,
                OPROJ_STASH_AT=stash_at(oproj_staged_bytes(d.q_dim, d.head_dim, d.batch, graph.plan)))
