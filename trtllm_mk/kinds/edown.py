"""EDOWN: DOWN for the expert of one slot: a K chunk of the slot's activation times that expert's down
rows, scaled per batch row by the slot's routing weight and added into x (fixed point: any order), in
the rows that chose the expert. An idle slot (beyond the step's distinct experts) streams and adds
nothing."""
from __future__ import annotations

from . import KindDef
from .gemv import no_staging_extra
from .route import active  # noqa: F401  (the split expert kinds run together)

DEF = KindDef("EDOWN", streams_weights=True, args=("layer", "r0", "r1", "k0", "k1", "tile", "stage"),
              device_file="edown.cuh", device_needs=("ROUTE",))


def execute(ex, t, layer: int) -> None:
    """CPU-executor semantics (trtllm_mk.executor.CpuExecutor ``ex``): see graph.tasks."""
    from ..residual import to_fixed
    # the task waits for route_done: ROUTE's slots are the ones its loader routes to on the GPU; an
    # idle slot computes nothing, and a row that did not choose the slot's expert adds nothing
    e = int(ex.moe_slot[t.slot])
    if e < 0:
        return
    w = ex.experts[layer][e]["down"][t.r0:t.r1, t.k0:t.k1]
    y = ex.stage_round(ex.moe_act[t.slot, :, t.k0:t.k1]) @ w.T
    rows = ex.moe_w[t.slot] != 0
    ex.x[rows, t.r0:t.r1] += to_fixed(y[rows] * ex.moe_w[t.slot][rows, None])

# its staged input is the slot's own activation: a task of another slot stages again
INPUT_PER_SLOT = True

# its loader waits for the task's first event (router_done) and routes before it streams (mk_gemv.cuh gemv_load)
LOADER_WAITS = True

# GEMV cost and ring hooks (kinds/gemv.py)
MATRICES = 1
NORMS_INPUT = False
staging_extra_us = no_staging_extra
BF16_WEIGHTS = False   # the spec's weight format (quantized when the layers are)


def k_range(spec, plan) -> int:
    """Columns a task reduces over (one K-chunk of the slot's activation): KT of the
    ring geometry (smem.geometries)."""
    return spec.mlp_intermediate // plan.down_ksplit


def lower(c) -> list[dict]:
    """For each slot, row tiles of H, each K-split into ``down_ksplit`` chunks of the expert's width.
    They wait on their slot's egateup_done (no EGATEUP task reads x, which they add into) and on
    route_done (the slot's routing weights), and first on router_done, which is all their loader
    waits for (it routes the rows itself)."""
    from ..graph.tasks import Access, EventRef
    plan, B = c.plan, c.B
    d_chunk = c.I // plan.down_ksplit
    return [dict(r0=a, r1=b, k0=k * d_chunk, k1=(k + 1) * d_chunk, slot=s,
                 # router_done first: the loader waits only for it (edown.cuh) before streaming the expert
                 waits=(EventRef("router_done", 0, 0), EventRef("egateup_done", 0, s), EventRef("route_done", 0, 0)),
                 signals=(EventRef("resid_ready", 1, 0),),
                 reads=(Access(f"moe_act{s}", k * d_chunk, (k + 1) * d_chunk), Access("moe_slots", s, s + 1),
                        Access("router_logits", 0, c.E)),
                 writes=(Access("x", a, b, add=True),),
                 weight_bytes=c.linear_bytes(b - a, d_chunk), act_bytes=B * (d_chunk * 4 + (b - a) * 8),
                 flops=2 * B * (b - a) * d_chunk)
            for s in range(c.NSLOT) for a, b in c.tiles(c.H, plan.down_rows) for k in range(plan.down_ksplit)]
