"""Bit packing shared by the integer formats: unsigned ``bits``-wide codes, packed little end first
along the last dimension of an int32 tensor (code ``k`` of a row sits in word ``k * bits // 32`` at bit
``(k * bits) % 32``). GPTQ, AWQ and compressed-tensors all pack 4- and 8-bit codes this way; they
differ only in which dimension they pack along and, for AWQ, in the order of the codes inside a word.
"""
from __future__ import annotations

import torch

SUPPORTED_BITS = (4, 8)


def per_word(bits: int) -> int:
    return 32 // bits


def pack_last(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 ``[..., K * bits / 32]`` from unsigned codes ``[..., K]`` (K a multiple of 32 / bits)."""
    n = per_word(bits)
    if codes.shape[-1] % n:
        raise ValueError(f"cannot pack {codes.shape[-1]} codes of {bits} bits into whole int32 words")
    c = codes.to(torch.int64)
    if c.numel() and (int(c.min()) < 0 or int(c.max()) >= 1 << bits):
        raise ValueError(f"codes outside [0, {(1 << bits) - 1}] cannot be packed in {bits} bits")
    c = c.reshape(*c.shape[:-1], -1, n)
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=codes.device)
    words = (c << shifts).sum(-1)                         # < 2**32: the fields do not overlap
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)   # two's complement int32
    return words.to(torch.int32)


def unpack_last(words: torch.Tensor, bits: int, count: int | None = None) -> torch.Tensor:
    """Unsigned codes ``[..., K]`` (int32) of int32 words ``[..., W]``; ``count`` trims K (default W * 32 / bits)."""
    if words.dtype != torch.int32:
        raise ValueError(f"packed weights must be int32, got {words.dtype}")
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    codes = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)   # arithmetic shift; the mask drops the sign
    codes = codes.reshape(*words.shape[:-1], -1)
    return codes if count is None else codes[..., :count]
