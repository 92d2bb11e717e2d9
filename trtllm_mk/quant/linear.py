"""The packed weights of one quantized linear layer, in one canonical layout whatever the checkpoint's
format, so that the CPU paths and the device code read a single layout (biases and every unquantized
tensor stay plain tensors under their HF names).

``IntLinear`` (GPTQ, AWQ, compressed-tensors pack-quantized) and ``Fp8Linear`` (FP8 e4m3) hold the
weight row-major as the bf16 engine does (``[out_features, in_features]``, K contiguous); each format
module converts its own layout into this one at load and back at write (exact integer operations).

Integer weights dequantize as ``W[o, k] = scales[o, g(k)] * (code[o, k] - zero[o, g(k)])`` with
``g(k) = g_idx[k]`` when the checkpoint orders its groups by activation (GPTQ ``desc_act``) and
``k // group_size`` otherwise. With fp16 or bf16 scales the product is exact in fp32 (a code
difference of at most 9 bits times an 11-bit significand), so ``dequantize()`` gives the format's value
before any rounding (with fp32 scales, the value the format's own fp32 arithmetic gives), and
``dequantize(torch.bfloat16)`` rounds it once, as a kernel that dequantizes in fp32 registers and
feeds bf16 tensor cores does.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .packing import unpack_last


@dataclass(frozen=True)
class IntLinear:
    """4- or 8-bit integer weights of one linear layer (``name`` is its HF prefix, without ``.weight``)."""
    name: str
    out_features: int
    in_features: int
    bits: int                        # 4 or 8
    group_size: int                  # input channels per group; in_features when one group per output row
    qweight: torch.Tensor            # int32 [out, in * bits / 32]: unsigned codes packed along K (packing.py)
    scales: torch.Tensor             # [out, groups], the checkpoint's dtype (fp16 for GPTQ/AWQ, bf16/fp32 else)
    zeros: torch.Tensor | None       # int32 [out, groups] unsigned zero codes; None: 2**(bits-1) (symmetric)
    g_idx: torch.Tensor | None = None  # int32 [in]: group of each input channel; None: k // group_size

    @property
    def groups(self) -> int:
        return self.scales.shape[1]

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    def codes(self) -> torch.Tensor:
        """Unsigned codes, int32 ``[out, in]``."""
        return unpack_last(self.qweight, self.bits, self.in_features)

    def group_of_input(self) -> torch.Tensor:
        """int64 ``[in]``: the group that scales input channel ``k``."""
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.in_features, device=self.qweight.device) // self.group_size

    def zero_codes(self) -> torch.Tensor:
        """int32 ``[out, groups]``: the zero point of every group, the implied midpoint when symmetric."""
        if self.zeros is not None:
            return self.zeros
        return torch.full((self.out_features, self.groups), 1 << (self.bits - 1), dtype=torch.int32,
                          device=self.qweight.device)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[out, in]`` weights: exact in fp32, rounded once to ``dtype``."""
        g = self.group_of_input()
        diff = (self.codes() - self.zero_codes()[:, g]).float()
        return (diff * self.scales.float()[:, g]).to(dtype)

    def act_order_permutation(self) -> torch.Tensor | None:
        """For a checkpoint with ``g_idx``: the input order (int64 ``[in]``, stable) that makes every group
        contiguous, so a kernel can stream ``W[:, perm]`` group by group against ``x[perm]``; None when
        the groups are contiguous already."""
        if self.g_idx is None:
            return None
        return torch.sort(self.g_idx.long(), stable=True).indices

    def packed_bytes(self) -> int:
        """Bytes a decode step streams for this layer: packed codes, scales and zeros."""
        n = self.qweight.numel() * 4 + self.scales.numel() * self.scales.element_size()
        if self.zeros is not None:
            n += self.out_features * self.groups * self.bits // 8
        return n


@dataclass(frozen=True)
class Fp8Linear:
    """FP8 e4m3 weights of one linear layer with a per-output-channel or a per-tensor scale."""
    name: str
    out_features: int
    in_features: int
    weight: torch.Tensor             # float8_e4m3fn [out, in]
    scale: torch.Tensor              # float32 [out] (per channel) or [] (per tensor): W = weight * scale
    input_scale: torch.Tensor | None = None  # float32 []: a static activation scale, when the checkpoint has one

    bits = 8

    @property
    def per_channel(self) -> bool:
        return self.scale.dim() == 1

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        s = self.scale.float()
        return (self.weight.float() * (s[:, None] if self.per_channel else s)).to(dtype)

    def packed_bytes(self) -> int:
        return self.weight.numel() + self.scale.numel() * 4


QuantizedLinear = IntLinear | Fp8Linear
