"""LMHEAD: final RMS norm and one LM-head tile of logits, with the tile's max and first argmax."""
from __future__ import annotations

from . import KindDef
from .argmax import NO_TOKEN
from .gemv import no_staging_extra

DEF = KindDef("LMHEAD", streams_weights=True, args=("r0", "r1", "tile", "stage"), device_file="lmhead.cuh",
              polls=("resid_ready",))


def execute(ex, t, layer: int) -> None:
    """CPU-executor semantics (trtllm_mk.executor.CpuExecutor ``ex``): see graph.tasks."""
    import torch
    from .router import pending
    out = ex.norm_staged(ex.final_norm, pending(ex, ex.spec.num_layers)) @ ex.lm_head[t.r0:t.r1].T
    ex.logits[:, t.r0:t.r1] = out
    # as on the device: NaN never wins, and a tile with no logit above -inf has no candidate
    val, idx = torch.nan_to_num(out, nan=-torch.inf, posinf=torch.inf).max(-1)   # first index of the max
    # under tensor parallelism: this rank's columns of every rank's lm_val / lm_idx, global token ids
    col = ex.lm_tile_base + t.index
    ex.lm_val[:, col] = val
    ex.lm_idx[:, col] = torch.where(val > -torch.inf, idx.to(torch.int32) + t.r0 + ex.vocab_base, NO_TOKEN)

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
    """TAIL tasks: row tiles of V after the last layer's residual; each also writes its tile's max."""
    from ..graph.tasks import Access, EventRef
    from .router import pending_reads, staged_residual_bytes
    B, H = c.B, c.H
    return [dict(r0=a, r1=b, k0=0, k1=H, waits=(EventRef("resid_ready", c.L, 0),),
                 signals=(EventRef("lm_done", 0, 0),),
                 reads=(Access("x", 0, H),) + pending_reads(c, c.L), writes=(Access("logits", a, b), Access("lm_part", i, i + 1)),
                 weight_bytes=(b - a) * H * c.wb, act_bytes=B * (staged_residual_bytes(c, c.L) + (b - a) * 4),
                 flops=2 * B * (b - a) * H)
            for i, (a, b) in enumerate(c.lm_tiles)]
