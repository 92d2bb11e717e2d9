"""The megakernel's layout of 4-bit weights (W4A16), and the arithmetic its GEMV kinds dequantize with.

A decoder layer's linear weight ``[out, in]`` travels as two tensors:

``packed``  uint8 ``[out, in / 2]``: row-major like the bf16 weight, K contiguous, every 32 columns in
            16 bytes. Inside a 32-column block the codes are not in column order but in the order the
            tensor-core mma (m16n8k16) wants its A fragments: 32-bit word ``t`` holds what lane
            ``(g, t)`` of a warp needs for the two 16-column k-steps of the block, so a lane reads one
            word per row and block and unpacks it with shifts and masks (``BLOCK_ORDER``).
``sz``      int32 ``[ceil(out / 16), in / group, 16]``: per 16-row block (the mma's M), per group of
            ``group`` input columns, per row of the block, one word: the bf16 scale in the low half,
            the bf16 value ``128 + zero`` in the high half. A ring slot copies one 16-row block's
            groups as one contiguous piece, and the 16 rows of a group sit in 16 consecutive words,
            so the lanes' loads meet no bank conflict.

The kernel forms a weight as ``bf16(scale_bf16 * ((128 + code) - (128 + zero)))``: the code enters a bf16
mantissa under the exponent of 128 (exact), the difference of two integers below 256 is exact, and the
product is rounded once. ``dequantize`` computes the same values on any device, so the reference decoder
and the CPU executor run exactly the kernel's weights. Scales are rounded to bf16 once at packing (as
TensorRT-LLM's and vLLM's W4A16 kernels do for bf16 models); ``scale_rounding_error`` reports what that costs.

Per-channel checkpoints (one scale per output row) are laid out with ``per_channel_group`` columns per
group, the row's scale repeated, so that every GEMV kind reads one layout.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..seam import SCALE_SUFFIX
from .linear import IntLinear

BITS = 4
ROWS_PER_BLOCK = 16       # the mma's M: scale words are grouped per 16 output rows
COLS_PER_BLOCK = 32       # columns whose codes fill the four words of one row's 16 bytes
CODE_BIAS = 128           # bf16 128.0 has a 7-bit mantissa of zeros: 128 + code is exact for codes < 128
SUPPORTED_GROUPS = (32, 64, 128, 256, 512, 1024)


def _block_order() -> torch.Tensor:
    """int64 ``[32]``: the column (0..31 within a 32-column block) whose code sits at nibble ``i`` of
    word ``t``, flattened as ``t * 8 + i``. Nibble ``i`` of a word sits at bits ``4 i``. A lane unpacks
    the pairs (nibble j, nibble j + 4) for j = 0..3 into one bf16x2 each: j = 0, 1 are the A fragment
    registers a0 (columns 2t, 2t+1) and a2 (columns 2t+8, 2t+9) of the first k-step, j = 2, 3 those of
    the second (16 columns further)."""
    order = torch.empty(32, dtype=torch.int64)
    for t in range(4):
        for j in range(4):
            ks, upper = divmod(j, 2)
            col = 16 * ks + 8 * upper + 2 * t
            order[t * 8 + j] = col          # low half of the bf16x2: the even column
            order[t * 8 + j + 4] = col + 1  # high half: the odd column
    return order


BLOCK_ORDER = _block_order()


@dataclass(frozen=True)
class W4Layout:
    """Shapes of one matrix in the kernel layout."""
    out_features: int
    in_features: int
    group: int

    @property
    def packed_shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features // 2)

    @property
    def sz_shape(self) -> tuple[int, int, int]:
        return (-(-self.out_features // ROWS_PER_BLOCK), self.in_features // self.group, ROWS_PER_BLOCK)

    @property
    def nbytes(self) -> int:
        """Bytes a decode step reads for this matrix (codes and scale words)."""
        p, s = self.packed_shape, self.sz_shape
        return p[0] * p[1] + 4 * s[0] * s[1] * s[2]


def per_channel_group(in_features: int) -> int:
    """Columns per group for a per-channel matrix: the largest supported group up to 128 that divides
    ``in_features`` (128 keeps the repeated scales at 1/16 of the codes' bytes)."""
    for g in (128, 64, 32):
        if in_features % g == 0:
            return g
    raise ValueError(f"{in_features} input channels are not a multiple of 32")


def check_layout(out_features: int, in_features: int, group: int) -> None:
    """ValueError (a sentence) when the kernel cannot lay out this matrix."""
    if group not in SUPPORTED_GROUPS:
        raise ValueError(f"group size {group} is not one the kernel implements ({', '.join(map(str, SUPPORTED_GROUPS))})")
    if in_features % group or in_features % COLS_PER_BLOCK:
        raise ValueError(f"{in_features} input channels are not a multiple of the group size {group}")
    if out_features % ROWS_PER_BLOCK:
        raise ValueError(f"{out_features} output channels are not a multiple of {ROWS_PER_BLOCK}")


def kernel_group(lin: IntLinear) -> int:
    """The kernel layout's group size for ``lin``: its own, or ``per_channel_group`` when it has one
    group per output row."""
    return per_channel_group(lin.in_features) if lin.groups == 1 and lin.group_size == lin.in_features \
        else lin.group_size


def pack(lin: IntLinear, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8, sz int32) of a 4-bit ``lin`` in the kernel layout. ``group``: the layout's group
    size (default ``kernel_group(lin)``); it must be the matrix's own or, for a per-channel matrix, divide
    its input channels. Activation-order checkpoints (g_idx) are refused: the kernel streams groups in
    column order."""
    if lin.bits != BITS:
        raise ValueError(f"{lin.name}: {lin.bits}-bit weights are not the kernel's 4-bit layout")
    if lin.g_idx is not None:
        raise ValueError(f"{lin.name}: activation-order groups (g_idx) cannot be laid out for the kernel")
    group = group or kernel_group(lin)
    per_row = lin.groups == 1
    if not per_row and group != lin.group_size:
        raise ValueError(f"{lin.name}: group size {lin.group_size} cannot be laid out as {group}")
    check_layout(lin.out_features, lin.in_features, group)
    out, k = lin.out_features, lin.in_features
    codes = lin.codes().to(torch.int64)                                   # [out, k]
    blocks = codes.view(out, k // COLS_PER_BLOCK, COLS_PER_BLOCK)[..., BLOCK_ORDER.to(codes.device)]
    nib = blocks.view(out, k // COLS_PER_BLOCK, 4, 8)                      # [.., word t, nibble i]
    words = (nib << (4 * torch.arange(8, device=codes.device))).sum(-1)   # < 2**32
    packed = words.to(torch.int64).view(-1, 1).bitwise_and(0xFFFFFFFF)
    packed = torch.stack([(packed >> (8 * b)) & 0xFF for b in range(4)], -1).to(torch.uint8).view(out, k // 2)

    reps = k // group if per_row else 1
    scale = lin.scales.to(torch.bfloat16).repeat_interleave(reps, dim=1)          # [out, k / group]
    zero = (lin.zero_codes().to(torch.int64) + CODE_BIAS).repeat_interleave(reps, dim=1)
    zz = zero.to(torch.bfloat16)                                                   # exact: < 256
    lo = scale.view(torch.int16).to(torch.int64) & 0xFFFF
    hi = zz.view(torch.int16).to(torch.int64) & 0xFFFF
    word = lo | (hi << 16)
    word = torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)   # [out, groups]
    nblk = -(-out // ROWS_PER_BLOCK)
    padded = torch.zeros(nblk * ROWS_PER_BLOCK, word.shape[1], dtype=torch.int32, device=word.device)
    padded[:out] = word
    sz = padded.view(nblk, ROWS_PER_BLOCK, -1).transpose(1, 2).contiguous()       # [blk, group, row]
    return packed.contiguous(), sz


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """int64 codes ``[out, in]`` in column order from the kernel's packed bytes."""
    out, half = packed.shape
    b = packed.to(torch.int64).view(out, half // 16, 4, 4)                 # [.., word t, byte]
    words = (b << (8 * torch.arange(4, device=packed.device))).sum(-1)     # [.., t]
    nib = (words.unsqueeze(-1) >> (4 * torch.arange(8, device=packed.device))) & 0xF   # [.., t, i]
    flat = nib.reshape(out, half // 16, 32)
    codes = torch.empty_like(flat)
    codes[..., BLOCK_ORDER.to(packed.device)] = flat
    return codes.reshape(out, 2 * half)


def unpack_sz(sz: torch.Tensor, out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale bf16 ``[out, groups]``, zero + 128 as float ``[out, groups]``) from the scale words."""
    w = sz.transpose(1, 2).reshape(-1, sz.shape[1])[:out_features].to(torch.int64) & 0xFFFFFFFF
    scale = (w & 0xFFFF).to(torch.int16).view(torch.bfloat16)
    zz = ((w >> 16) & 0xFFFF).to(torch.int16).view(torch.bfloat16)
    return scale, zz.float()


def dequantize(packed: torch.Tensor, sz: torch.Tensor, group: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The weights the kernel computes with, ``[out, in]``: ``bf16(scale * ((128 + code) - (128 + zero)))``
    (exact in fp32 before the one rounding to bf16)."""
    out = packed.shape[0]
    codes = unpack_codes(packed).float() + CODE_BIAS
    scale, zz = unpack_sz(sz, out)
    g = torch.arange(codes.shape[1], device=packed.device) // group
    return ((codes - zz[:, g]) * scale.float()[:, g]).to(torch.bfloat16).to(dtype)


def kernel_dequantize(lin: IntLinear, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``lin`` as the kernel computes with it (scales rounded to bf16, then one rounding per weight)."""
    g = lin.group_of_input()
    diff = (lin.codes() - lin.zero_codes()[:, g]).float()
    return (diff * lin.scales.to(torch.bfloat16).float()[:, g]).to(torch.bfloat16).to(dtype)


def scale_rounding_error(lin: IntLinear) -> float:
    """Largest relative change of a scale when rounded to bf16 (0 for bf16 checkpoints)."""
    s = lin.scales.float()
    return float(((s.to(torch.bfloat16).float() - s).abs() / s.abs().clamp(min=1e-30)).max())


# ---------------------------------------------------------------- whole models
def is_layer_linear(name: str, shape: tuple[int, ...]) -> bool:
    """Whether ``name`` is a decoder layer's linear weight the kernel streams quantized (not a router)."""
    return len(shape) == 2 and name.startswith("model.layers.") and not name.endswith("mlp.gate.weight")


def kernel_tensors(spec) -> dict[str, tuple[tuple[int, ...], "torch.dtype"]]:
    """What a megakernel of ``spec`` binds, by name: (shape, dtype). bf16 specs bind the HF tensors;
    quantized ones bind each layer linear as ``name`` (packed codes) and ``name + "_sz"`` (scale words)."""
    out = {}
    for name, shape in spec.expected_tensors().items():
        if spec.quantized and is_layer_linear(name, shape):
            lay = W4Layout(shape[0], shape[1], spec.weight_group)
            out[name] = (lay.packed_shape, torch.uint8)
            out[name + SCALE_SUFFIX] = (lay.sz_shape, torch.int32)
        else:
            out[name] = (shape, torch.bfloat16)
    return out


def kernel_weights(spec, weights: dict) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(what the megakernel binds, what the reference / prefill computes with) from a checkpoint's
    weights (``quant.loader.load_quantized``: IntLinear for quantized layers, tensors for the rest).
    The second dict holds every weight as the kernel computes with it (``kernel_dequantize``), in
    bf16; a quantized LM head is dequantized for both (the kernel streams it in bf16)."""
    bind, dense = {}, {}
    for name, shape in spec.expected_tensors().items():
        v = weights[name]
        if isinstance(v, IntLinear):
            dense[name] = kernel_dequantize(v)
            if spec.quantized and is_layer_linear(name, shape):
                p, sz = pack(v, spec.weight_group)
                bind[name], bind[name + SCALE_SUFFIX] = p, sz
            else:
                bind[name] = dense[name]
        else:
            if spec.quantized and is_layer_linear(name, shape):
                raise ValueError(f"{name} is not quantized, but the {spec.weight_bits}-bit kernel streams every "
                                 "decoder layer's linear weights quantized")
            bind[name] = dense[name] = v
    return bind, dense


def quantize_model(spec, weights: dict[str, torch.Tensor], symmetric: bool = True) -> dict:
    """A bf16 model's weights with every layer linear round-to-nearest quantized to 4 bits in
    ``spec.weight_group`` groups (benchmarks and tests: real quantized bytes without a checkpoint)."""
    from .rtn import quantize_int
    out = {}
    for name, shape in spec.expected_tensors().items():
        t = weights[name]
        if is_layer_linear(name, shape):
            out[name] = quantize_int(name[:-len(".weight")], t, BITS, spec.weight_group, symmetric, torch.bfloat16)
        else:
            out[name] = t
    return out
