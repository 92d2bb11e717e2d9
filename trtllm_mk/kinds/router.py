"""ROUTER: RMS-norms x (ln2) and multiplies a row range of a sparse layer's router weight [E, H]: the
experts' logits (mixture-of-experts models; ROUTE chooses from them)."""
from __future__ import annotations

from . import KindDef
from .gemv import no_staging_extra

DEF = KindDef("ROUTER", streams_weights=True, args=("layer", "r0", "r1", "stage"), device_file="router.cuh")


def execute(ex, t, layer: int) -> None:
    """CPU-executor semantics (trtllm_mk.executor.CpuExecutor ``ex``): see graph.tasks."""
    lw = ex.layers[layer]
    ex.router_logits[:, t.r0:t.r1] = ex.norm_staged(lw["ln2"]) @ lw["router"][t.r0:t.r1].T

# GEMV cost hooks (kinds/gemv.py)
MATRICES = 1
NORMS_INPUT = True
staging_extra_us = no_staging_extra


def lower(c) -> list[dict]:
    """Row tiles of the E experts (bf16 router weights, as the checkpoint keeps them)."""
    from ..graph.tasks import Access, EventRef
    B, H = c.B, c.H
    return [dict(r0=a, r1=b, k0=0, k1=H, waits=(EventRef("oproj_done", 0, 0),),
                 signals=(EventRef("router_done", 0, 0),),
                 reads=(Access("x", 0, H),), writes=(Access("router_logits", a, b),),
                 weight_bytes=(b - a) * H * 2, act_bytes=B * (H * 4 + (b - a) * 4), flops=2 * B * (b - a) * H)
            for a, b in c.tiles(c.E, c.plan.gateup_rows)]
