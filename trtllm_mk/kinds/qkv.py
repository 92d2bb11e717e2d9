"""QKV: RMS-norms x (ln1) and multiplies the grouped q/k/v weight rows (plus bias for Qwen2)."""
from __future__ import annotations

from . import KindDef
from .gemv import no_staging_extra

DEF = KindDef("QKV", streams_weights=True, args=("layer", "r0", "r1", "stage"))


def execute(ex, t, layer: int) -> None:
    """CPU-executor semantics (trtllm_mk.executor.CpuExecutor ``ex``): see graph.tasks."""
    lw = ex.layers[layer]
    out = ex.norm_staged(lw["ln1"]) @ lw["qkv"][t.r0:t.r1].T
    if lw["qkv_bias"] is not None:
        out = out + lw["qkv_bias"][t.r0:t.r1]
    ex.qkv[:, t.r0:t.r1] = out

# GEMV cost hooks (kinds/gemv.py)
MATRICES = 1
NORMS_INPUT = True
staging_extra_us = no_staging_extra
