"""Rotary position embedding tables, computed once on the host.

The megakernel, the CPU executor and the reference all read the same ``inv_freq`` vector, so the
"llama3" frequency scaling lives in exactly one place (here), never in CUDA.
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


def apply_rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (HF convention). x: [..., T, heads, d] fp32; pos: [..., T] int."""
    ang = pos.to(torch.float32)[..., None] * inv_freq  # [..., T, d/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[..., None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[..., None, :]
    h = x.shape[-1] // 2
    rot = torch.cat([-x[..., h:], x[..., :h]], -1)
    return x * cos + rot * sin
