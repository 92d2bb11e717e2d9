"""QKV: RMS-norms x (ln1) and multiplies the grouped q/k/v weight rows (plus bias for Qwen2)."""
from __future__ import annotations

from . import KindDef
from .gemv import no_staging_extra

# ATTN, the one reader of qkv, polls the tagged words themselves: the QKV -> ATTN edge of the chain
# takes no release and no counter poll (qkv.cuh epilogue, attn.cuh QkvRow)
DEF = KindDef("QKV", streams_weights=True, args=("layer", "r0", "r1", "stage"), device_file="qkv.cuh",
              signals_by_data=("qkv_done",), polls=("resid_ready",))


def execute(ex, t, layer: int) -> None:
    """CPU-executor semantics (trtllm_mk.executor.CpuExecutor ``ex``): see graph.tasks."""
    lw = ex.layers[layer]
    from .router import pending
    out = ex.norm_staged(lw["ln1"], pending(ex, layer)) @ lw["qkv"][t.r0:t.r1].T
    if lw["qkv_bias"] is not None:
        out = out + lw["qkv_bias"][t.r0:t.r1]
    ex.qkv[:, t.r0:t.r1] = out

# GEMV cost and ring hooks (kinds/gemv.py)
MATRICES = 1
NORMS_INPUT = True
staging_extra_us = no_staging_extra
BF16_WEIGHTS = False   # the spec's weight format (quantized when the layers are)


def k_range(spec, plan) -> int:
    """Columns a task reduces over (x, normed): KT of the
    ring geometry (smem.geometries)."""
    return spec.hidden_size


def lower(c) -> list[dict]:
    """Row tiles of the grouped QKV rows; q/k-norm and RoPE happen in ATTN."""
    from ..graph.tasks import Access, EventRef
    from .router import pending_reads, staged_residual_bytes
    out = []
    for a, b in c.tiles(c.QKVR, c.plan.qkv_rows):
        groups = range(a // c.GR, (b - 1) // c.GR + 1)
        # With a K-split OPROJ, a chunk may add into x as soon as its own heads are combined, while
        # QKV tiles of other groups still read x for their norm: qkv_all orders every OPROJ after
        # every QKV tile's staging of x (without K-split the single combine_done slot already implies
        # it). Under tensor parallelism every OPROJ adds into every rank's x, so every OPROJ waits for
        # it. It is a staged signal, published once the tile has staged x, so its release (under
        # tensor parallelism a cross-rank one) stays off the chain.
        all_sig = (EventRef("qkv_all", 0, 0),) if c.plan.o_ksplit > 1 or c.tp > 1 else ()
        done = tuple(EventRef("qkv_done", 0, g) for g in groups)
        out.append(dict(r0=a, r1=b, k0=0, k1=c.H, waits=(EventRef("resid_ready", 0, 0),),
                        signals=all_sig + done, staged_signals=len(all_sig),
                        reads=(Access("x", 0, c.H, staged=True),) + pending_reads(c, 0, staged=True), writes=(Access("qkv", a, b),),
                        weight_bytes=c.linear_bytes(b - a, c.H), act_bytes=c.B * (staged_residual_bytes(c, 0) + (b - a) * 4),
                        flops=2 * c.B * (b - a) * c.H))
    return out
