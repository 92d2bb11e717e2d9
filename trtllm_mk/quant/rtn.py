"""Round-to-nearest quantization of one weight matrix into the canonical packed form (linear.py), for
``python -m trtllm_mk quantize``. Calibration-free: every group's range is its own min and max.

Integer grids follow GPTQ's quantizer, which compressed-tensors' min-max observer matches: the range
always contains 0; symmetric groups use ``scale = 2 * amax / (2**bits - 1)`` around the midpoint code,
asymmetric ones ``scale = (max - min) / (2**bits - 1)`` with the zero code ``round(-min / scale)``.
Codes are computed with the scale as stored (rounded to the format's scale dtype), so every weight
dequantizes to within half a stored scale of its value, up to the scale's own rounding at the ends of
the range.
"""
from __future__ import annotations

import torch

from .linear import Fp8Linear, IntLinear
from .packing import pack_last
from .scheme import PER_CHANNEL, PER_TENSOR

FP8_MAX = 448.0        # largest finite float8_e4m3fn


def _stored(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``scale`` rounded to ``dtype``, with zeros (all-zero groups) and underflows made the smallest
    normal of ``dtype``, so a division by it is finite."""
    tiny = torch.finfo(dtype).tiny
    return scale.clamp(min=tiny).to(dtype)


def quantize_int(name: str, weight: torch.Tensor, bits: int, group_size: int, symmetric: bool,
                 scale_dtype: torch.dtype, min_zero: int = 0) -> IntLinear:
    """``weight [out, in]`` as ``bits``-bit codes, one scale (and zero code) per ``group_size`` inputs
    (PER_CHANNEL: per output row). ``min_zero`` is the smallest zero code the format can store (GPTQ's
    own layout stores ``zero - 1``, so 1 there)."""
    out, k = weight.shape
    gs = k if group_size == PER_CHANNEL else group_size
    if gs <= 0 or k % gs:
        raise ValueError(f"group size {group_size} does not divide {k} input channels")
    maxq = (1 << bits) - 1
    w = weight.float().reshape(out, k // gs, gs)
    lo = w.amin(-1).clamp(max=0.0)
    hi = w.amax(-1).clamp(min=0.0)
    if symmetric:
        scale = _stored(2 * torch.maximum(-lo, hi) / maxq, scale_dtype)
        zero = torch.full_like(scale, 1 << (bits - 1), dtype=torch.int32)
    else:
        scale = (hi - lo) / maxq
        zero = torch.round(-lo / scale.clamp(min=torch.finfo(torch.float32).tiny))
        # A zero code below what the format stores moves the grid up by one step; the scale then
        # grows so that the largest weight still has a code.
        low = zero < min_zero
        scale = torch.where(low, hi / (maxq - min_zero), scale)
        zero = torch.where(low, torch.full_like(zero, min_zero), zero).to(torch.int32)
        scale = _stored(scale, scale_dtype)
    s = scale.float()[..., None]
    codes = torch.clamp(torch.round(w / s) + zero[..., None], 0, maxq).to(torch.int32).reshape(out, k)
    return IntLinear(name=name, out_features=out, in_features=k, bits=bits, group_size=gs,
                     qweight=pack_last(codes, bits), scales=scale,
                     zeros=None if symmetric else zero)


def quantize_fp8(name: str, weight: torch.Tensor, group_size: int, scale_dtype: torch.dtype = torch.float32
                 ) -> Fp8Linear:
    """``weight [out, in]`` as FP8 e4m3 with one scale per output row (PER_CHANNEL) or per matrix (PER_TENSOR),
    the largest magnitude mapping to 448."""
    out, k = weight.shape
    w = weight.float()
    if group_size == PER_TENSOR:
        amax = w.abs().amax()
    elif group_size == PER_CHANNEL:
        amax = w.abs().amax(-1)
    else:
        raise ValueError(f"FP8 weights take per-channel or per-tensor scales, not group size {group_size}")
    scale = _stored(amax / FP8_MAX, scale_dtype).float()
    s = scale[:, None] if scale.dim() else scale
    q = torch.clamp(w / s, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return Fp8Linear(name=name, out_features=out, in_features=k, weight=q, scale=scale)
