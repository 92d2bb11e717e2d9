"""The residual stream's number format: fixed point in an int64, shared by the kernel and the executor.

OPROJ and DOWN tasks split along K add their partial sums into the residual in whatever order their
SMs finish. Floating-point addition is not associative, so in fp32 the order shows in the low bits,
and through later bf16 roundings in the tokens: the same inputs would decode differently from run to
run. Integer addition is exact, so in fixed point every order gives the same bits. FRAC_BITS = 32
leaves 31 integer bits (|x| < 2^31, far beyond any hidden state) and a resolution of 2^-32, below
fp32's own step for every |x| above 2^-9.
"""
from __future__ import annotations

import torch

FRAC_BITS = 32
RESIDUAL_BYTES = 8   # bytes of one element in device memory: what a staging of x reads per element


def to_fixed(v: torch.Tensor) -> torch.Tensor:
    """fp32 values -> int64 residual units, rounded to nearest even (the device's __float2ll_rn of
    v * 2^FRAC_BITS, which is exact in fp32 before the rounding)."""
    return torch.round(v.to(torch.float64) * 2.0 ** FRAC_BITS).to(torch.int64)


def from_fixed(q: torch.Tensor) -> torch.Tensor:
    """int64 residual units -> fp32 (the device's __ll2float_rn(q) * 2^-FRAC_BITS)."""
    return q.to(torch.float32) * 2.0 ** -FRAC_BITS
