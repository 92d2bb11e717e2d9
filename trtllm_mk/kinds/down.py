"""DOWN: the MLP down projection, a K-split GEMV that adds into x."""
from __future__ import annotations

from . import KindDef
from .gemv import no_staging_extra

# DOWN polls act's tagged words (gateup_done is polled: kinds/gateup.py)
DEF = KindDef("DOWN", streams_weights=True, args=("layer", "r0", "r1", "k0", "k1", "stage"), device_file="down.cuh",
              polls=("gateup_done",), signals_by_data=("resid_ready",))


def execute(ex, t, layer: int) -> None:
    """CPU-executor semantics (trtllm_mk.executor.CpuExecutor ``ex``): see graph.tasks."""
    from ..residual import to_fixed
    w = ex.layers[layer]["down"][t.r0:t.r1, t.k0:t.k1]
    ex.x[:, t.r0:t.r1] += to_fixed(ex.stage_round(ex.act[:, t.k0:t.k1]) @ w.T)

# GEMV cost and ring hooks (kinds/gemv.py)
MATRICES = 1
NORMS_INPUT = False
staging_extra_us = no_staging_extra
BF16_WEIGHTS = False   # the spec's weight format (quantized when the layers are)


def k_range(spec, plan) -> int:
    """Columns a task reduces over (one K-chunk of the MLP activation): KT of the
    ring geometry (smem.geometries)."""
    return spec.mlp_intermediate // plan.down_ksplit


def device_constants(graph) -> dict[str, int]:
    """cfg::GATEUP_DONE_SLOTS: the slots of gateup_done (kinds/gateup.py down_chunks), whose counter
    index a DOWN task's poll reports when it times out."""
    return dict(GATEUP_DONE_SLOTS=graph.events["gateup_done"].slots)


def lower(c) -> list[dict]:
    """Row tiles of H, each K-split into ``down_ksplit`` chunks of I, adding into x. A chunk waits on
    gateup_done of its own columns and, where that does not imply it, on gateup_staged (every GATEUP
    tile has staged x, which DOWN adds into) (kinds/gateup.py down_chunks)."""
    from ..graph.tasks import Access, EventRef
    from .gateup import down_chunks, gateup_staged
    plan, B = c.plan, c.B
    d_chunk = c.I // plan.down_ksplit
    _, act_chunk = down_chunks(c)
    out = []
    for a, b in c.tiles(c.H, plan.down_rows):
        for k in range(plan.down_ksplit):
            k0, k1 = k * d_chunk, (k + 1) * d_chunk
            # K-split (or other ranks') partials accumulate atomically (fixed point: any order)
            split = plan.down_ksplit > 1 or c.tp > 1
            out.append(dict(r0=a, r1=b, k0=k0, k1=k1,
                            waits=((EventRef("gateup_staged", 0, 0),) if gateup_staged(c) else ())
                            + (EventRef("gateup_done", 0, k0 // act_chunk),),
                            signals=(EventRef("resid_ready", 1, 0),),
                            reads=(Access("act", k0, k1),) + (() if split else (Access("x", a, b),)),
                            writes=(Access("x", a, b, add=split),),
                            weight_bytes=c.linear_bytes(b - a, k1 - k0), act_bytes=B * ((k1 - k0) * 4 + (b - a) * 8),
                            flops=2 * B * (b - a) * (k1 - k0)))
    return out
