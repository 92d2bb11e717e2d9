"""GATEUP: RMS-norms x (ln2) and computes silu(gate) * up for a row range of the MLP."""
from __future__ import annotations

from . import KindDef
from .gemv import no_staging_extra

DEF = KindDef("GATEUP", streams_weights=True, args=("layer", "r0", "r1", "stage"), device_file="gateup.cuh")


def execute(ex, t, layer: int) -> None:
    """CPU-executor semantics (trtllm_mk.executor.CpuExecutor ``ex``): see graph.tasks."""
    import torch
    lw = ex.layers[layer]
    xn = ex.norm_staged(lw["ln2"])
    gate, up = xn @ lw["gate"][t.r0:t.r1].T, xn @ lw["up"][t.r0:t.r1].T
    ex.act[:, t.r0:t.r1] = torch.nn.functional.silu(gate) * up

# GEMV cost and ring hooks (kinds/gemv.py)
MATRICES = 2
NORMS_INPUT = True
staging_extra_us = no_staging_extra
BF16_WEIGHTS = False   # the spec's weight format (quantized when the layers are)


def k_range(spec, plan) -> int:
    """Columns a task reduces over (x, normed): KT of the
    ring geometry (smem.geometries)."""
    return spec.hidden_size


def lower(c) -> list[dict]:
    """Row tiles of I; each row streams its gate and its up row."""
    from ..graph.tasks import Access, EventRef
    B, H = c.B, c.H
    return [dict(r0=a, r1=b, k0=0, k1=H, waits=(EventRef("oproj_done", 0, 0),),
                 signals=(EventRef("gateup_done", 0, 0),),
                 reads=(Access("x", 0, H),), writes=(Access("act", a, b),),
                 weight_bytes=2 * c.linear_bytes(b - a, H), act_bytes=B * (H * 4 + (b - a) * 4), flops=4 * B * (b - a) * H)
            for a, b in c.tiles(c.I, c.plan.gateup_rows)]
