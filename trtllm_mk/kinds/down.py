"""DOWN: the MLP down projection, a K-split GEMV that adds into x."""
from __future__ import annotations

from . import KindDef
from .gemv import no_staging_extra

DEF = KindDef("DOWN", streams_weights=True, args=("layer", "r0", "r1", "k0", "k1", "stage"))


def execute(ex, t, layer: int) -> None:
    """CPU-executor semantics (trtllm_mk.executor.CpuExecutor ``ex``): see graph.tasks."""
    w = ex.layers[layer]["down"][t.r0:t.r1, t.k0:t.k1]
    ex.x[:, t.r0:t.r1] += ex.stage_round(ex.act[:, t.k0:t.k1]) @ w.T

# GEMV cost hooks (kinds/gemv.py)
MATRICES = 1
NORMS_INPUT = False
staging_extra_us = no_staging_extra
