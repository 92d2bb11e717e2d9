"""Linear layers that keep their weight in the megakernel's 4-bit or FP8 layout and dequantize it per call.

The torch prefill of a quantized engine computes with exactly the weights the megakernel decodes with
(``kernel_layout.dequantize``, ``dequantize_fp8``). Holding them dequantized would keep a bf16 copy of
every layer linear beside the packed one (about 15 GB for an 8B model); these modules hold only the
packed codes and scale words the megakernel binds (the same tensors) and dequantize one matrix at a
time, when the prefill reaches its layer. A layer's q/k/v (and gate/up) concatenate block by block
(``cat``), since the layouts store 16-row blocks one after another (without a copy when the parts are
adjacent rows of one tensor, as ``kernel_weights(..., packed_dense=True)`` lays them out).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .kernel_layout import (BITS, BLOCK_ORDER, BLOCK_ORDER8, COLS_PER_BLOCK, CODE_BIAS, FP8_BITS, FP8_COLS_PER_CHUNK,
                            FP8_SCALE_SHIFT, swizzle)


class PackedW4Linear(nn.Module):
    """``y = x @ W.T`` for ``W`` in the kernel layout (``packed`` uint8 tiles, ``sz`` int32 scale words)."""

    def __init__(self, packed: torch.Tensor, sz: torch.Tensor, group: int):
        super().__init__()
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("sz", sz, persistent=False)
        self.group = group
        nblk, ntile, rows, half = packed.shape
        self.out_features, self.in_features = nblk * rows, ntile * 2 * half
        tile = 2 * half
        # gather indices from the stored nibble sequence of a tile row to column order
        nch = tile // COLS_PER_BLOCK
        chunk_at = swizzle(tile)                                             # [16, nch]: stored chunk of column chunk c
        inv_block = torch.argsort(BLOCK_ORDER)                               # column -> position in a 32-block
        col = torch.arange(tile)
        pos = chunk_at[:, col // COLS_PER_BLOCK] * COLS_PER_BLOCK + inv_block[col % COLS_PER_BLOCK]   # [16, tile]
        self.register_buffer("_gather", pos.to(packed.device), persistent=False)

    @property
    def shape(self) -> tuple[int, int]:
        """The weight's shape, ``[out, in]`` (as a weight tensor's, for shape checks)."""
        return (self.out_features, self.in_features)

    @classmethod
    def cat(cls, parts: list["PackedW4Linear"]) -> "PackedW4Linear":
        """The rows of ``parts`` in order, as one layer (one copy of their packed tensors)."""
        if len({p.group for p in parts}) != 1 or len({p.in_features for p in parts}) != 1:
            raise ValueError("4-bit linears concatenate only with the same group and input size")
        from ..model.decoder_block import concat_rows
        return cls(concat_rows([p.packed for p in parts]), torch.cat([p.sz for p in parts]), parts[0].group)

    def weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``W [out, in]`` as the kernel computes with it: ``scale * ((128 + code) - (128 + zero))``, exact in
        fp32, rounded once to ``dtype``."""
        nblk, ntile, rows, half = self.packed.shape
        # nibble sequence of each tile row: byte b holds positions 2b (low nibble) and 2b + 1 (high)
        p = self.packed
        nib = torch.stack([p & 0xF, p >> 4], -1).view(nblk, ntile, rows, 2 * half)
        codes = torch.gather(nib, 3, self._gather.view(1, 1, rows, -1).expand(nblk, ntile, rows, -1))
        codes = codes.permute(0, 2, 1, 3).reshape(self.out_features, self.in_features)
        w = self.sz.transpose(1, 2).reshape(self.out_features, -1)         # [out, groups]
        scale = (w << 16).view(torch.float32)                               # bf16 scale, exact in fp32
        zz = (w >> 16 << 16).view(torch.float32)                            # 128 + zero
        g = torch.arange(self.in_features, device=p.device) // self.group
        return ((codes.float() + CODE_BIAS - zz[:, g]) * scale[:, g]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight(x.dtype))


class PackedFp8Linear(nn.Module):
    """``y = x @ W.T`` for FP8 ``W`` in the kernel layout (``packed`` uint8 e4m3 tiles ``[out/16, in/T, 16, T]``,
    ``sz`` int32 scale words ``[out/16, in/T, 16]``)."""

    def __init__(self, packed: torch.Tensor, sz: torch.Tensor):
        super().__init__()
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("sz", sz, persistent=False)
        nblk, ntile, rows, tile = packed.shape
        self.group = tile
        self.out_features, self.in_features = nblk * rows, ntile * tile
        # gather indices from a stored tile row's bytes to column order
        ck = FP8_COLS_PER_CHUNK
        chunk_at = swizzle(tile, FP8_BITS)                                   # [16, tile / 16]
        inv_block = torch.argsort(BLOCK_ORDER8)                              # column -> byte in its chunk
        col = torch.arange(tile)
        pos = chunk_at[:, col // ck] * ck + inv_block[col % ck]             # [16, tile]
        self.register_buffer("_gather", pos.to(packed.device), persistent=False)

    @property
    def shape(self) -> tuple[int, int]:
        """The weight's shape, ``[out, in]`` (as a weight tensor's, for shape checks)."""
        return (self.out_features, self.in_features)

    @classmethod
    def cat(cls, parts: list["PackedFp8Linear"]) -> "PackedFp8Linear":
        """The rows of ``parts`` in order, as one layer (one copy of their packed tensors)."""
        if len({p.in_features for p in parts}) != 1 or len({p.group for p in parts}) != 1:
            raise ValueError("FP8 linears concatenate only with the same input size and tile")
        from ..model.decoder_block import concat_rows
        return cls(concat_rows([p.packed for p in parts]), torch.cat([p.sz for p in parts]))

    def weight(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """``W [out, in]`` as the kernel computes with it: ``bf16(float(code) * float(bf16(scale)))``."""
        nblk, ntile, rows, tile = self.packed.shape
        p = self.packed
        codes = torch.gather(p, 3, self._gather.view(1, 1, rows, -1).expand(nblk, ntile, rows, -1))
        codes = codes.permute(0, 2, 1, 3).reshape(self.out_features, self.in_features)
        w = self.sz.transpose(1, 2).reshape(self.out_features, -1)         # [out, tiles]
        # bf16(scale) * 2**120 as fp32 bits, then the power of two taken off (exact: the scale is normal)
        scale = ((w & 0xFFFF) << 16).view(torch.float32) * 2.0 ** -FP8_SCALE_SHIFT
        g = torch.arange(self.in_features, device=p.device) // tile
        return (codes.view(torch.float8_e4m3fn).float() * scale[:, g]).to(torch.bfloat16).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight(x.dtype))


def packed_linear(packed: torch.Tensor, sz: torch.Tensor, group: int, bits: int = BITS) -> nn.Module:
    """The module over one matrix in the kernel layout of ``bits`` (4 or 8, FP8)."""
    if bits == FP8_BITS:
        return PackedFp8Linear(packed, sz)
    return PackedW4Linear(packed, sz, group)


__all__ = ["PackedFp8Linear", "PackedW4Linear", "packed_linear"]
