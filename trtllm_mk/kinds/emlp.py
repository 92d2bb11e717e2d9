"""EMLP: one expert tile's whole MLP (TilePlan.expert_fused). For the expert of its slot (kinds/route.py)
a task computes silu(gate) * up for a row range [r0, r1) of the expert's intermediate width, on x
normed (ln2), keeps that activation in shared memory, then streams the same range of the expert's
down matrix and adds its partial sum of every hidden row, scaled per batch row by the routing weight,
into the layer's expert_sum (fixed point: any order; kinds/router.py: x stays as the tiles stage it).
Its down matrix is stored transposed, [I, H] (MegakernelDecoder binds it so), so the range is rows
[r0, r1), contiguous and streamed like gate/up.

Against EGATEUP + EDOWN it drops a dependent phase per layer: no task waits for another SM's expert
tile (egateup_done), nothing is staged twice, and an SM's loader streams its down columns straight
after its gate/up rows. It adds H values per tile where EDOWN adds a tile's rows. The loader and the
consumers route the rows themselves from the logits the chain summed (kinds/router.py), as soon as
OPROJ is done: no ROUTER phase stands between OPROJ and the experts. An idle slot streams and
computes nothing. bf16 experts only (the megakernel's experts are)."""
from __future__ import annotations

from ..residual import RESIDUAL_BYTES
from . import KindDef

DEF = KindDef("EMLP", streams_weights=True, args=("layer", "r0", "r1", "tile", "stage"), device_file="emlp.cuh",
              device_needs=("GATEUP", "ROUTE"))

# its loader waits for the task's first event (oproj_done) and routes before it streams (mk_gemv.cuh gemv_load)
LOADER_WAITS = True

# GEMV cost and ring hooks (kinds/gemv.py): the gate/up part's geometry; the down part's slots come
# from extra_ring_slots
MATRICES = 2
NORMS_INPUT = True
BF16_WEIGHTS = False

MMA_ROWS = 16   # intermediate rows per down slot: one tensor-core k-step
# TilePlan.expert_inflight of a fused plan: ring slots its loaders keep in flight. Every SM starts its
# tile's stream at once after the routing and streams gate/up and down back to back: the whole ring in
# flight lengthens each stream's queue, a single slot leaves it waiting on every round trip. The search
# sets it with expert_fused and does not vary it (the cost model does not price queueing; the
# measurements are in benchmarks/NOTES.md).
EXPERT_INFLIGHT = 2


CALIBRATION = {
    "emlp_route_us": (0.0, "consumer time an EMLP task's staging spends beyond reading its activation: "
                           "the consumers route the rows from the chain's logits (top-k over the experts' "
                           "accumulators, the softmax) while the SM's loader, which routed faster, already "
                           "streams the expert"),
}


def staging_extra_us(task, graph, cal) -> float:
    """The consumers' routing of the rows (route.cuh route_row) before they stage x."""
    return cal.emlp_route_us


def active(spec, plan) -> bool:
    return spec.is_moe and plan.expert_fused


def k_range(spec, plan) -> int:
    """Columns the gate/up part reduces over (the normed rows): KT of its ring geometry."""
    return spec.hidden_size


def down_cols(hidden: int, slot_bytes: int, consumer_warps: int) -> int:
    """Hidden columns per down slot: the widest multiple of 16 that divides ``hidden``, whose 16 rows fit
    a slot, and that gives each consumer warp at most 8 tensor-core row blocks (its accumulators)."""
    d = hidden - hidden % 16
    while not (hidden % d == 0 and MMA_ROWS * d * 2 <= slot_bytes and d <= 128 * consumer_warps):
        d -= 16
    return d


def scratch_words(batch: int, experts: int, topk: int, consumer_warps: int) -> int:
    """4-byte words of the CTA scratch the consumers' routing keeps for the layer's EMLP tasks: the
    routing warps' union masks, then every row's k experts and weights (route.cuh)."""
    return min(batch, consumer_warps) * -(-experts // 32) + 2 * batch * max(topk, 1)


def check(spec, plan, batch: int) -> str | None:
    """Why ``plan`` cannot fuse the expert MLP at ``batch`` (None: it can)."""
    from ..smem import SCRATCH_BYTES
    if plan.gateup_rows % MMA_ROWS:
        return f"gateup_rows={plan.gateup_rows} must be a multiple of {MMA_ROWS}"
    if spec.mlp_intermediate % MMA_ROWS:
        return f"the expert width {spec.mlp_intermediate} must be a multiple of {MMA_ROWS}"
    if 4 * scratch_words(batch, spec.num_experts, spec.num_experts_per_tok, plan.consumer_warps) > SCRATCH_BYTES:
        return f"batch {batch}: the rows' routing does not fit the {SCRATCH_BYTES}-byte scratch"
    return None


def device_constants(graph) -> dict[str, int]:
    """cfg::EMLP_ROWS (the widest tile: the shared-memory activation's rows) and cfg::EMLP_DKC."""
    p = graph.plan
    return dict(EMLP_ROWS=p.gateup_rows, EMLP_DKC=down_cols(graph.dims.hidden, p.slot_bytes, p.consumer_warps))


def activation_bytes(hidden: int, batch: int, plan, act_pad: int) -> int:
    """The staged normed rows, then the tile's activation ([B][EMLP_ROWS + act_pad] bf16, the routing
    weight of each row in its skew)."""
    return batch * (hidden + act_pad) * 2 + batch * (plan.gateup_rows + act_pad) * 2


def extra_ring_slots(task, plan, dims) -> tuple[int, int]:
    """The down part: per 16 intermediate rows, H / EMLP_DKC slots; one output group per column chunk."""
    chunks = dims.hidden // down_cols(dims.hidden, plan.slot_bytes, plan.consumer_warps)
    return -(-(task.r1 - task.r0) // MMA_ROWS) * chunks, chunks


def execute(ex, t, layer: int) -> None:
    """CPU-executor semantics (trtllm_mk.executor.CpuExecutor ``ex``): see graph.tasks. The task routes
    the rows itself from the chain's logits (route_slots_fixed, as the device's loader and consumers
    do) and stages normed x; the activation is rounded to bf16 as the device keeps it, and each row adds
    its partial of every hidden row only where it chose the slot's expert, into expert_sum (kinds/router.py)."""
    from ..residual import to_fixed
    from .egateup import expert_act
    from .route import route_slots_fixed
    slots, weights = route_slots_fixed(ex, layer)
    e = int(slots[t.slot])
    if e < 0:
        return
    ew = ex.experts[layer][e]
    xn = ex.norm_staged(ex.layers[layer]["ln2"])
    y = ex.stage_round(expert_act(ex, ew, t.r0, t.r1, xn)) @ ew["down"][:, t.r0:t.r1].T
    w = weights[t.slot]
    rows = w != 0
    ex.expert_sum[layer + 1][rows] += to_fixed(y[rows] * w[rows, None])


def lower(c) -> list[dict]:
    """For each slot, row tiles of the expert's intermediate width (TilePlan.gateup_rows); each waits
    only for oproj_done (its loader and consumers route the rows from the chain's logits, kinds/router.py)
    and adds into all of the layer's expert_sum."""
    from ..graph.tasks import Access, EventRef
    B, H = c.B, c.H
    return [dict(r0=a, r1=b, k0=0, k1=H, slot=s, waits=(EventRef("oproj_done", 0, 0),),
                 signals=(EventRef("resid_ready", 1, 0),),
                 reads=(Access("x", 0, H), Access("router_acc", 0, c.E, layer=0)),
                 writes=(Access("expert_sum", 0, H, layer=1, add=True),),
                 weight_bytes=2 * c.linear_bytes(b - a, H) + c.linear_bytes(H, b - a),
                 act_bytes=B * (H * RESIDUAL_BYTES + c.E * 8 + H * RESIDUAL_BYTES), flops=6 * B * (b - a) * H)
            for s in range(c.NSLOT) for a, b in c.tiles(c.I, c.plan.gateup_rows)]
