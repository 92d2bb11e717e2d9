"""Rotary position embedding tables, computed once on the host.

The megakernel, the CPU executor and the reference all read the same ``inv_freq`` vector, so the
"llama3" frequency scaling lives in exactly one place (here), never in CUDA; the host-side rotation
(the reference decoder's, the CPU executor's) lives here too.
"""
from __future__ import annotations

import math

import torch

from .spec import ModelSpec


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """fp32 [head_dim // 2] inverse frequencies, with HF's llama3 scaling when configured."""
    d = spec.head_dim
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    rs = spec.rope_scaling
    if rs and rs.get("rope_type", rs.get("type")) == "llama3":
        factor = float(rs["factor"])
        lo, hi = float(rs.get("low_freq_factor", 1.0)), float(rs.get("high_freq_factor", 4.0))
        old = float(rs["original_max_position_embeddings"])
        lo_wavelen, hi_wavelen = old / lo, old / hi
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > lo_wavelen, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= hi_wavelen) & (wavelen <= lo_wavelen)
        inv = torch.where(is_mid, mid, scaled)
    return inv.to(torch.float32)


def rope_cos_sin(pos: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[..., T, 1, head_dim]`` for positions ``pos [..., T]``: angles in fp32, then cast to
    ``dtype`` (the activation dtype for HF's rounding, fp32 for fp32 RoPE)."""
    ang = pos.float()[..., None] * inv_freq
    ang = torch.cat([ang, ang], -1)[..., None, :]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (HF convention) on ``x [..., T, heads, head_dim]`` with tables from
    ``rope_cos_sin``, computed in cos's dtype, returned in x's."""
    xc = x.to(cos.dtype)
    h = x.shape[-1] // 2
    return (xc * cos + torch.cat([-xc[..., h:], xc[..., :h]], -1) * sin).to(x.dtype)


def apply_rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """fp32 RoPE of ``x [..., T, heads, d]`` (fp32) at positions ``pos [..., T]``."""
    return apply_rotary(x, *rope_cos_sin(pos, inv_freq, torch.float32))
