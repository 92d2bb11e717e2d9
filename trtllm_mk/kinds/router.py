"""ROUTER: RMS-norms x (ln2) and multiplies a row range of a sparse layer's router weight [E, H]: the
experts' logits (mixture-of-experts models; ROUTE chooses from them). Each task also publishes its
share of the columns of the normed rows (moe_xn) as the experts' input: EGATEUP stages them instead
of x, so that EDOWN, which adds into x, waits only for the EGATEUP tiles of its own slot."""
from __future__ import annotations

from . import KindDef
from .gemv import no_staging_extra

DEF = KindDef("ROUTER", streams_weights=True, args=("layer", "r0", "r1", "stage"), device_file="router.cuh")


def execute(ex, t, layer: int) -> None:
    """CPU-executor semantics (trtllm_mk.executor.CpuExecutor ``ex``): see graph.tasks."""
    lw = ex.layers[layer]
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
    return [dict(r0=a, r1=b, k0=0, k1=H, waits=(EventRef("oproj_done", 0, 0),),
                 signals=(EventRef("router_done", 0, 0),),
                 reads=(Access("x", 0, H),),
                 writes=(Access("router_logits", a, b), Access("moe_xn", *normed_share(a, b, c.E, H))),
                 weight_bytes=(b - a) * H * 2, act_bytes=B * (H * 4 + (b - a) * 4), flops=2 * B * (b - a) * H)
            for a, b in c.tiles(c.E, router_rows(c.E))]


def normed_share(r0: int, r1: int, experts: int, hidden: int) -> tuple[int, int]:
    """The columns of the normed rows that the ROUTER task of rows [r0, r1) publishes: the tiles
    partition the E rows, so these partition the H columns (router.cuh computes the same)."""
    return r0 * hidden // experts, r1 * hidden // experts


def router_rows(experts: int) -> int:
    """Rows per ROUTER task: ROUTER_TASKS tiles of whole 8-row ring stages."""
    return max(8, -(-experts // (8 * ROUTER_TASKS)) * 8)
