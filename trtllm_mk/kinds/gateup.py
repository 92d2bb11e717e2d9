"""GATEUP: RMS-norms x (ln2) and computes silu(gate) * up for a row range of the MLP."""
from __future__ import annotations

from ..residual import RESIDUAL_BYTES
from . import KindDef
from .gemv import no_staging_extra

# DOWN, the one reader of act, polls the tagged bf16 words themselves: the GATEUP -> DOWN edge of the
# chain takes no release and no counter poll (gateup.cuh epilogue, mk_gemv.cuh stage_tagged_rows)
DEF = KindDef("GATEUP", streams_weights=True, args=("layer", "r0", "r1", "stage"), device_file="gateup.cuh",
              signals_by_data=("gateup_done",), polls=("oproj_done",))


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


def gateup_staged(c) -> bool:
    """Whether GATEUP tiles publish gateup_staged once they have staged x, and DOWN waits for it. DOWN
    adds into x, which every GATEUP tile reads for its norm; a DOWN task polls only the act words of its
    own K-chunk (gateup_done is polled), which tell it nothing of the tiles of the other chunks, so
    under a K-split it also waits for every tile's staging, published long before DOWN needs it. Under
    tensor parallelism it is a cross-rank event. One K-chunk polls every tile's words, which come after
    the tile's staging."""
    return c.tp > 1 or c.plan.down_ksplit > 1


def down_chunks(c) -> tuple[int, int]:
    """(slots of gateup_done, columns of I per slot). Under gateup_staged one slot per DOWN K-chunk, so
    a chunk's DOWN tasks start when the GATEUP tiles of its columns are done; otherwise (and where a
    tile would signal more chunks than a task's event references hold: codegen MAX_REFS, less
    gateup_staged) one slot for all."""
    from ..codegen.source import MAX_REFS
    chunk = c.I // c.plan.down_ksplit
    tiles = c.tiles(c.I, c.plan.gateup_rows)
    if not gateup_staged(c) or max((b - 1) // chunk - a // chunk + 1 for a, b in tiles) > MAX_REFS - 1:
        return 1, c.I
    return c.plan.down_ksplit, chunk


def lower(c) -> list[dict]:
    """Row tiles of I; each row streams its gate and its up row. Under gateup_staged (above) a
    tile signals gateup_staged once it has staged x (DOWN adds into x, which every GATEUP tile reads
    for its norm, so DOWN need not wait for the GEMVs); after its GEMV it signals gateup_done of the
    DOWN K-chunks its rows fall in (down_chunks)."""
    from ..graph.tasks import Access, EventRef
    B, H = c.B, c.H
    staged = (EventRef("gateup_staged", 0, 0),) if gateup_staged(c) else ()
    _, chunk = down_chunks(c)
    return [dict(r0=a, r1=b, k0=0, k1=H, waits=(EventRef("oproj_done", 0, 0),),
                 signals=staged + tuple(EventRef("gateup_done", 0, k) for k in range(a // chunk, (b - 1) // chunk + 1)),
                 staged_signals=len(staged),
                 reads=(Access("x", 0, H, staged=True),), writes=(Access("act", a, b),),
                 weight_bytes=2 * c.linear_bytes(b - a, H), act_bytes=B * (H * RESIDUAL_BYTES + (b - a) * 4), flops=4 * B * (b - a) * H)
            for a, b in c.tiles(c.I, c.plan.gateup_rows)]
