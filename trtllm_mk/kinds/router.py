"""ROUTER: a sparse layer's router logits, rows [r0, r1) of its router weight [E, H] (mixture-of-experts
models). Two placements, as the plan's expert kinds need:

Beside the split expert kinds (ROUTE, EGATEUP, EDOWN) it RMS-norms x (ln2) after OPROJ and multiplies:
the logits, for ROUTE. Each task also publishes its share of the columns of the normed rows (moe_xn) as
the experts' input: EGATEUP stages them instead of x, so that EDOWN, which adds into x, waits only for
the EGATEUP tiles of its own slot.

Under TilePlan.expert_fused the logits are summed along the attention chain instead, so that no phase
stands between OPROJ and the experts' streams. The router is linear in ln2 * x, and x after OPROJ is x
at the layer's start plus W_o o (o the attention output); the norm's 1 / rms scales every logit of a
row alike, so the routing needs it only for the weights. So ROUTER tasks run at the layer's start,
beside QKV, and store the rows' logits of ln2 * x (not normed, fp32 on the CUDA cores: router.cuh
router_in_chain) in fixed point (router_acc), and OPROJ adds the logits of ln2 * W_o o as E more rows of
its GEMV: the router through the o-projection, router diag(ln2) W_o (model/moe.py router_through_o,
bf16, ``through_o``), whose rows' K-chunk partials add into router_acc as the o-projection's rows add
into x. The reference decoder sums the same (DecoderBlock.chain_logits). EMLP ranks the experts by
router_acc and scales by the 1 / rms of x it stages (kinds/route.py ``route_fixed``). Fixed point
makes the sum the same in every order. EMLP's tiles, which stage x, then add their outputs into
expert_sum (row l + 1 for layer l) rather than x; layer l + 1's QKV (and the LM head after the last
layer) stages x + expert_sum[l + 1], ROUTER reads the same, and layer l + 1's first K-chunk OPROJ tasks
add their rows of it into x and zero the same rows of expert_sum[l + 2], which their own layer's
experts then add into.
Row 0 is never written: zero."""
from __future__ import annotations

from ..residual import RESIDUAL_BYTES
from . import KindDef
from .gemv import no_staging_extra

DEF = KindDef("ROUTER", streams_weights=True, args=("layer", "r0", "r1", "stage"), device_file="router.cuh")


def in_chain(spec, plan) -> bool:
    """Whether the router's logits are summed along the attention chain (module docstring)."""
    return spec.is_moe and plan.expert_fused


def off_ring(plan) -> bool:
    """Under TilePlan.expert_fused a task reads its rows of the router itself (router.cuh router_in_chain)."""
    return plan.expert_fused


def duration_us(task, graph, rates, cal) -> float:
    """Consumer time of a task in the chain: its weights' round trip from memory (the loader brings
    them into L2 as the task starts), x from L2, the CUDA-core math and one reduction."""
    return (cal.task_overhead_us + cal.mem_latency_us + cal.l2_latency_us + task.act_bytes / rates.l2
            + task.flops / rates.attn)


def execute(ex, t, layer: int) -> None:
    """CPU-executor semantics (trtllm_mk.executor.CpuExecutor ``ex``): see graph.tasks."""
    from ..residual import from_fixed, to_fixed
    lw = ex.layers[layer]
    if ex.graph.plan.expert_fused:   # ln2 * (x + expert_sum[layer]) in fp32, not normed
        xs = from_fixed(ex.x + ex.expert_sum[layer]) * lw["ln2"]
        ex.router_acc[layer][:, t.r0:t.r1] = to_fixed(xs @ lw["router"][t.r0:t.r1].T)
        return
    xn = ex.norm_staged(lw["ln2"])
    ex.router_logits[:, t.r0:t.r1] = xn @ lw["router"][t.r0:t.r1].T
    c0, c1 = normed_share(t.r0, t.r1, ex.spec.num_experts, ex.spec.hidden_size)
    ex.moe_xn[:, c0:c1] = xn[:, c0:c1]

# The router's rows are few (E x H) and its phase stands between OPROJ and the experts, which cannot
# stream before it: spread over about this many SMs, each streams a ring slot or two instead of a
# large share of the matrix.
ROUTER_TASKS = 16

# GEMV cost and ring hooks (kinds/gemv.py)
MATRICES = 1
NORMS_INPUT = True
staging_extra_us = no_staging_extra
BF16_WEIGHTS = True   # bf16 as the checkpoint keeps them, also when the layers' weights are quantized


def k_range(spec, plan) -> int:
    """Columns a task reduces over (x, normed): KT of the
    ring geometry (smem.geometries)."""
    return spec.hidden_size


def lower(c) -> list[dict]:
    """Row tiles of the E experts (bf16 router weights, as the checkpoint keeps them)."""
    from ..graph.tasks import Access, EventRef
    B, H = c.B, c.H
    if c.plan.expert_fused:   # at the layer's start; OPROJ adds into x and router_acc after router_done
        return [dict(r0=a, r1=b, k0=0, k1=H, waits=(EventRef("resid_ready", 0, 0),),
                     signals=(EventRef("router_done", 0, 0),),
                     reads=(Access("x", 0, H), Access("expert_sum", 0, H, layer=0)),
                     writes=(Access("router_acc", a, b, layer=0),),
                     weight_bytes=(b - a) * H * 2, act_bytes=B * (staged_residual_bytes(c, 0) + (b - a) * 8), flops=2 * B * (b - a) * H)
                for a, b in c.tiles(c.E, router_rows(c.E))]
    return [dict(r0=a, r1=b, k0=0, k1=H, waits=(EventRef("oproj_done", 0, 0),),
                 signals=(EventRef("router_done", 0, 0),),
                 reads=(Access("x", 0, H),),
                 writes=(Access("router_logits", a, b), Access("moe_xn", *normed_share(a, b, c.E, H))),
                 weight_bytes=(b - a) * H * 2, act_bytes=B * (H * RESIDUAL_BYTES + (b - a) * 4), flops=2 * B * (b - a) * H)
            for a, b in c.tiles(c.E, router_rows(c.E))]


def device_constants(graph) -> dict[str, int]:
    """cfg::ROUTER_ROWS: the most rows a ROUTER task has (router.cuh router_in_chain)."""
    return dict(ROUTER_ROWS=router_rows(graph.dims.experts))


def normed_share(r0: int, r1: int, experts: int, hidden: int) -> tuple[int, int]:
    """The columns of the normed rows that the ROUTER task of rows [r0, r1) publishes: the tiles
    partition the E rows, so these partition the H columns (router.cuh computes the same)."""
    return r0 * hidden // experts, r1 * hidden // experts


def router_rows(experts: int) -> int:
    """Rows per ROUTER task: ROUTER_TASKS tiles of whole 8-row ring stages."""
    return max(8, -(-experts // (8 * ROUTER_TASKS)) * 8)


# ---------------------------------------------------------------- the chain's share (TilePlan.expert_fused)
def pending(ex, layer: int):
    """The experts' outputs kept beside x that a task staging x at ``layer``'s start (or the LM head, at
    num_layers) adds to it; None without them."""
    return ex.expert_sum[layer] if ex.graph.plan.expert_fused else None


def pending_reads(c, layer: int, staged: bool = False) -> tuple:
    """The Access of that read (``layer`` relative for LAYER tasks)."""
    from ..graph.tasks import Access
    return (Access("expert_sum", 0, c.H, layer=layer, staged=staged),) if in_chain(c.spec, c.plan) else ()


def staged_residual_bytes(c, layer: int) -> int:
    """Bytes a batch row of a kind that norms the residual stages: x, and under the chain the experts'
    sum beside it (``pending_reads``), each an 8-byte fixed-point element (residual.py)."""
    return c.H * RESIDUAL_BYTES * (1 + len(pending_reads(c, layer)))


def through_o(ex, layer: int):
    """The executor's router through the o-projection of ``layer`` [E, q_size] (fp32 values of the bf16
    matrix the kernel streams), made on first use."""
    lw = ex.layers[layer]
    if "router_o" not in lw:
        from ..model.moe import router_through_o
        lw["router_o"] = router_through_o(lw["router"], lw["ln2"], lw["o"]).float()
    return lw["router_o"]


def oproj_parts(a: int, b: int, hidden: int) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """What OPROJ's rows [a, b) cover: rows of x (below H), and rows of the router through o, counted from
    H (its experts); None for a part the tile does not reach."""
    return ((a, min(b, hidden)) if a < hidden else None), ((max(a, hidden) - hidden, b - hidden) if b > hidden else None)


def oproj_fold(ex, t, layer: int) -> None:
    """A first K-chunk OPROJ task's share of the chain (module docstring): its rows of x get the experts'
    outputs kept beside x, and the same rows of this layer's expert_sum are zeroed."""
    rows, _ = oproj_parts(t.r0, t.r1, ex.spec.hidden_size)
    if t.k0 == 0 and rows:
        ex.x[:, slice(*rows)] += ex.expert_sum[layer][:, slice(*rows)]
        ex.expert_sum[layer + 1][:, slice(*rows)] = 0


def oproj_accesses(c, a: int, b: int, first_chunk: bool) -> tuple[tuple, tuple, tuple]:
    """(waits, reads, writes) that the chain adds to an OPROJ task of rows [a, b) (rows from H on: the
    router through o, into router_acc). Every task waits for ROUTER, which reads x and expert_sum as
    they were at the layer's start and stores the accumulators."""
    from ..graph.tasks import Access, EventRef
    if not in_chain(c.spec, c.plan):
        return (), (), ()
    rows, experts = oproj_parts(a, b, c.H)
    fold = first_chunk and rows is not None
    reads = (Access("expert_sum", *rows, layer=0),) if fold else ()
    writes = ((Access("router_acc", *experts, layer=0, add=True),) if experts else ()) + (
        (Access("expert_sum", *rows, layer=1),) if fold else ())
    return (EventRef("router_done", 0, 0),), reads, writes


def oproj_rows(spec, plan) -> int:
    """OPROJ's output rows: H, and under the chain E more, the router through o."""
    return spec.hidden_size + (spec.num_experts if in_chain(spec, plan) else 0)
