"""The megakernel's layouts of quantized weights (4-bit integers, W4A16; FP8 e4m3), and the arithmetic
its GEMV kinds dequantize with.

A decoder layer's 4-bit linear weight ``[out, in]`` travels as two tensors:

``packed``  uint8 ``[out / 16, in / T, 16, T / 2]``: tiles of 16 rows (the mma's M) by ``T`` columns
            (``tile_cols``), each tile contiguous, so that a ring slot fills with one bulk copy per tile
            instead of one per row (the copy engine's cost is per copy, and 4-bit rows are short).
            Within a tile row, every 32 columns take 16 bytes whose codes are not in column order but
            in the order the tensor-core mma (m16n8k16) wants its A fragments: 32-bit word ``t`` holds
            what lane ``(g, t)`` of a warp needs for the two 16-column k-steps of those columns, so a
            lane reads one word per row and 32 columns and unpacks it with shifts and masks
            (``BLOCK_ORDER``). The 16-byte chunks of tile row ``r`` are swizzled (``swizzle``: chunk
            ``c`` stored at ``c ^ (r % 8)``, or ``c ^ ((r // 2) % 4)`` in 128-column tiles, whose rows
            are half a 128-byte line), so the eight rows a warp reads at once fall in eight different
            bank groups of shared memory without padding rows apart.
``sz``      int32 ``[out / 16, in / group, 16]``: per 16-row block, per group of ``group`` input
            columns, per row of the block, one word: the bf16 scale in the low half, the bf16 value
            ``128 + zero`` in the high half. A slot copies one block's groups as one contiguous piece,
            and the 16 rows of a group sit in 16 consecutive words (conflict-free loads).

The kernel computes with the weight ``scale_bf16 * ((128 + code) - (128 + zero))``, exact in fp32: the code
enters a bf16 mantissa under the exponent of 128 (exact), the difference of two integers below 256 is exact
(an integer of magnitude below 16, which the mma multiplies with the activation), and the scale multiplies a
scale group's fp32 sums, so the product of a 4-bit integer and a bf16 scale (12 significant bits) is never
rounded. ``dequantize`` computes the same fp32 values on any device, so the reference decoder and the CPU
executor run exactly the kernel's weights (up to fp32 summation order). Scales are rounded to bf16 once at
packing (as TensorRT-LLM's and vLLM's W4A16 kernels do for bf16 models); ``scale_rounding_error`` reports
what that costs.

Per-channel checkpoints (one scale per output row) are laid out with ``per_channel_group`` columns per
group, the row's scale repeated, so that every GEMV kind reads one layout.

FP8 e4m3 weights (``ModelSpec.weight_bits`` 8, ``weight_group`` = ``T``) travel the same way, one byte
per weight:

``packed``  uint8 ``[out / 16, in / T, 16, T]``: the raw e4m3 bits in tiles of 16 rows by ``T`` columns.
            Tile row ``r``'s 16-byte chunk ``c`` (columns ``16 c .. 16 c + 15`` of the tile, one mma
            k-step) is stored at chunk ``c ^ (r % 8)`` (``swizzle(T, bits=8)``; an 8-bit tile row is at
            least a 128-byte line). Within a chunk, byte ``4 t + j`` holds column ``(2t, 2t+1, 2t+8,
            2t+9)[j]`` (``BLOCK_ORDER8``): lane ``(g, t)`` reads its A fragment of the k-step as one word.
``sz``      int32 ``[out / 16, in / T, 16]``: the low half holds the bf16 bits of ``bf16(scale) * 2**120``
            (``FP8_SCALE_SHIFT`` added to the exponent field), the high half is 0. The row's scale
            repeats over its groups; a per-tensor scale repeats everywhere.

An e4m3 code's bits placed in a bf16's sign, exponent and mantissa fields (exponent bias 7 against 127,
subnormals included) are the code times ``2**-120``, exactly; the scale word carries the ``2**120`` back,
so the kernel forms ``bf16(float(code) * float(bf16(scale)))``, one rounding (``dequantize_fp8``,
``kernel_dequantize_fp8``). The checkpoint's fp32 scale is rounded to bf16 once, at packing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.spec import is_layer_linear
from ..seam import SCALE_SUFFIX
from .linear import Fp8Linear, IntLinear

BITS = 4
ROWS_PER_BLOCK = 16       # the mma's M: scale words are grouped per 16 output rows
COLS_PER_BLOCK = 32       # columns whose codes fill the four words of one row's 16 bytes
CODE_BIAS = 128           # bf16 128.0 has a 7-bit mantissa of zeros: 128 + code is exact for codes < 128
SUPPORTED_GROUPS = (32, 64, 128, 256, 512, 1024)
TILE_COLS = (512, 256, 128)   # tile widths, widest first
CHUNK = 16                # bytes per swizzled chunk (32 columns of 4-bit codes, 16 of FP8)
FP8_BITS = 8
FP8_COLS_PER_CHUNK = 16   # one mma k-step of e4m3 bytes
FP8_SCALE_SHIFT = 120     # bf16's exponent bias minus e4m3's: what the scale word's exponent carries


def tile_cols(spec) -> int:
    """Columns per tile of ``spec``'s quantized layouts (4-bit and FP8): the widest of TILE_COLS dividing
    the K dimension of every decoder-layer linear (hidden size, q heads x head dim, intermediate size)."""
    ks = (spec.hidden_size, spec.q_size, spec.intermediate_size)
    for t in TILE_COLS:
        if all(k % t == 0 for k in ks):
            return t
    raise ValueError(f"{spec.name}: hidden {spec.hidden_size}, q {spec.q_size} and intermediate "
                     f"{spec.intermediate_size} sizes are not multiples of {TILE_COLS[-1]} columns, "
                     "which the quantized weight layouts need")


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


def _block_order8() -> torch.Tensor:
    """int64 ``[16]``: the column (0..15 within a 16-column chunk) whose e4m3 byte sits at byte ``4 t + j``
    of the chunk: word ``t`` is lane ``(g, t)``'s A fragment of one k-step, bytes 0, 1 the register a0
    (columns 2t, 2t+1) and bytes 2, 3 the register a2 (columns 2t+8, 2t+9)."""
    return torch.tensor([c for t in range(4) for c in (2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9)], dtype=torch.int64)


BLOCK_ORDER8 = _block_order8()


@dataclass(frozen=True)
class W4Layout:
    """Shapes of one matrix in the kernel layout."""
    out_features: int
    in_features: int
    group: int
    tile: int = TILE_COLS[0]

    @property
    def packed_shape(self) -> tuple[int, int, int, int]:
        return (self.out_features // ROWS_PER_BLOCK, self.in_features // self.tile, ROWS_PER_BLOCK, self.tile // 2)

    @property
    def sz_shape(self) -> tuple[int, int, int]:
        return (-(-self.out_features // ROWS_PER_BLOCK), self.in_features // self.group, ROWS_PER_BLOCK)

    @property
    def nbytes(self) -> int:
        """Bytes a decode step reads for this matrix (codes and scale words)."""
        return self.out_features * self.in_features // 2 + 4 * self.sz_shape[0] * self.sz_shape[1] * ROWS_PER_BLOCK


@dataclass(frozen=True)
class Fp8Layout:
    """Shapes of one FP8 matrix in the kernel layout (one scale word per row and ``tile`` columns)."""
    out_features: int
    in_features: int
    tile: int = TILE_COLS[0]

    @property
    def group(self) -> int:
        return self.tile

    @property
    def packed_shape(self) -> tuple[int, int, int, int]:
        return (self.out_features // ROWS_PER_BLOCK, self.in_features // self.tile, ROWS_PER_BLOCK, self.tile)

    @property
    def sz_shape(self) -> tuple[int, int, int]:
        return (self.out_features // ROWS_PER_BLOCK, self.in_features // self.tile, ROWS_PER_BLOCK)

    @property
    def nbytes(self) -> int:
        """Bytes a decode step reads for this matrix (codes and scale words)."""
        return self.out_features * self.in_features + 4 * self.out_features * (self.in_features // self.tile)


def layout_of(spec, shape: tuple[int, int]) -> W4Layout | Fp8Layout:
    """The shapes of a decoder-layer linear ``[out, in]`` in ``spec``'s quantized layout."""
    if spec.weight_bits == FP8_BITS:
        return Fp8Layout(shape[0], shape[1], tile_cols(spec))
    return W4Layout(shape[0], shape[1], spec.weight_group, tile_cols(spec))


def per_channel_group(in_features: int) -> int:
    """Columns per group for a per-channel matrix: the largest supported group up to 128 that divides
    ``in_features`` (128 keeps the repeated scales at 1/16 of the codes' bytes)."""
    for g in (128, 64, 32):
        if in_features % g == 0:
            return g
    raise ValueError(f"{in_features} input channels are not a multiple of 32")


def check_layout(out_features: int, in_features: int, group: int, tile: int = TILE_COLS[0]) -> None:
    """ValueError (a sentence) when the kernel cannot lay out this matrix."""
    if group not in SUPPORTED_GROUPS:
        raise ValueError(f"group size {group} is not one the kernel implements ({', '.join(map(str, SUPPORTED_GROUPS))})")
    if in_features % group:
        raise ValueError(f"{in_features} input channels are not a multiple of the group size {group}")
    if tile not in TILE_COLS or in_features % tile:
        raise ValueError(f"{in_features} input channels are not a multiple of the {tile}-column tile")
    if out_features % ROWS_PER_BLOCK:
        raise ValueError(f"{out_features} output channels are not a multiple of {ROWS_PER_BLOCK}")


def kernel_group(lin: IntLinear) -> int:
    """The kernel layout's group size for ``lin``: its own, or ``per_channel_group`` when it has one
    group per output row."""
    return per_channel_group(lin.in_features) if lin.groups == 1 and lin.group_size == lin.in_features \
        else lin.group_size


def swizzle(tile: int, bits: int = BITS) -> torch.Tensor:
    """int64 ``[16, tile * bits / 128]``: where 16-byte chunk ``c`` of tile row ``r`` is stored, for a tile
    of ``tile`` columns of ``bits``-bit codes. Eight consecutive rows (what one ldmatrix phase reads)
    must hit eight different 16-byte bank groups of a 128-byte line: ``c ^ (r % 8)`` when a tile row
    fills a line or more, ``c ^ ((r // 2) % 4)`` when two rows share one (4-bit 128-column tiles)."""
    row_bytes = tile * bits // 8
    chunks = row_bytes // CHUNK
    r = torch.arange(ROWS_PER_BLOCK).view(-1, 1)
    c = torch.arange(chunks).view(1, -1)
    shift = 1 if row_bytes < 128 else 0
    return c ^ ((r >> shift) % min(8, chunks))


def check_pack(lin: IntLinear, group: int | None = None, tile: int = TILE_COLS[0]) -> int:
    """The layout group ``pack`` lays ``lin`` out with, or ValueError (a sentence) when it cannot."""
    if not isinstance(lin, IntLinear):
        raise ValueError(f"{lin.name}: FP8 weights are not the kernel's {BITS}-bit integer layout")
    if lin.bits != BITS:
        raise ValueError(f"{lin.name}: {lin.bits}-bit weights are not the kernel's 4-bit layout")
    if lin.g_idx is not None:
        raise ValueError(f"{lin.name}: activation-order groups (g_idx) cannot be laid out for the kernel (it "
                         "streams groups in column order); requantize with desc_act false")
    group = group or kernel_group(lin)
    if lin.groups != 1 and group != lin.group_size:
        raise ValueError(f"{lin.name}: group size {lin.group_size} cannot be laid out as {group}")
    check_layout(lin.out_features, lin.in_features, group, tile)
    return group


def pack(lin: IntLinear, group: int | None = None, tile: int = TILE_COLS[0]) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8, sz int32) of a 4-bit ``lin`` in the kernel layout. ``group``: the layout's group
    size (default ``kernel_group(lin)``); it must be the matrix's own or, for a per-channel matrix, divide
    its input channels. ``tile``: columns per tile (``tile_cols`` of the model). Activation-order
    checkpoints (g_idx) are refused: the kernel streams groups in column order."""
    group = check_pack(lin, group, tile)
    per_row = lin.groups == 1
    packed = pack_codes(lin.codes(), tile)
    out, k = lin.out_features, lin.in_features
    nblk = out // ROWS_PER_BLOCK

    reps = k // group if per_row else 1
    scale = lin.scales.to(torch.bfloat16).repeat_interleave(reps, dim=1)          # [out, k / group]
    zero = (lin.zero_codes().to(torch.int64) + CODE_BIAS).repeat_interleave(reps, dim=1)
    zz = zero.to(torch.bfloat16)                                                   # exact: < 256
    lo = scale.view(torch.int16).to(torch.int64) & 0xFFFF
    hi = zz.view(torch.int16).to(torch.int64) & 0xFFFF
    word = lo | (hi << 16)
    word = torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)   # [out, groups]
    sz = word.view(nblk, ROWS_PER_BLOCK, -1).transpose(1, 2).contiguous()         # [blk, group, row]
    return packed, sz


def pack_codes(codes: torch.Tensor, tile: int) -> torch.Tensor:
    """uint8 tiles ``[out / 16, in / tile, 16, tile / 2]`` of unsigned 4-bit ``codes [out, in]``."""
    out, k = codes.shape
    dev = codes.device
    blocks = codes.to(torch.int64).view(out, k // COLS_PER_BLOCK, COLS_PER_BLOCK)[..., BLOCK_ORDER.to(dev)]
    nib = blocks.view(out, k // COLS_PER_BLOCK, 4, 8)                      # [.., word t, nibble i]
    words = (nib << (4 * torch.arange(8, device=dev))).sum(-1)            # < 2**32
    rowmajor = torch.stack([(words >> (8 * b)) & 0xFF for b in range(4)], -1).to(torch.uint8)  # [out, k/32, 4, 4]
    nblk, ntile, nch = out // ROWS_PER_BLOCK, k // tile, tile // COLS_PER_BLOCK
    t = rowmajor.reshape(nblk, ROWS_PER_BLOCK, ntile, nch, CHUNK).permute(0, 2, 1, 3, 4)   # [blk, tile, r, c, 16]
    packed = torch.empty_like(t)
    packed[:, :, torch.arange(ROWS_PER_BLOCK).view(-1, 1), swizzle(tile)] = t
    return packed.reshape(nblk, ntile, ROWS_PER_BLOCK, tile // 2).contiguous()


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """int64 codes ``[out, in]`` in column order from the kernel's packed tiles."""
    nblk, ntile, rows, half = packed.shape
    nch = half // CHUNK
    sw = packed.view(nblk, ntile, rows, nch, CHUNK)
    t = sw[:, :, torch.arange(rows).view(-1, 1), swizzle(2 * half)]                         # [blk, tile, r, c, 16]
    b = t.permute(0, 2, 1, 3, 4).reshape(nblk * rows, ntile * nch, 4, 4).to(torch.int64)    # [out, k/32, word, byte]
    words = (b << (8 * torch.arange(4, device=packed.device))).sum(-1)                      # [out, k/32, t]
    nib = (words.unsqueeze(-1) >> (4 * torch.arange(8, device=packed.device))) & 0xF        # [.., t, i]
    flat = nib.reshape(nblk * rows, ntile * nch, 32)
    codes = torch.empty_like(flat)
    codes[..., BLOCK_ORDER.to(packed.device)] = flat
    return codes.reshape(nblk * rows, ntile * nch * 32)


def unpack_sz(sz: torch.Tensor, out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale bf16 ``[out, groups]``, zero + 128 as float ``[out, groups]``) from the scale words."""
    w = sz.transpose(1, 2).reshape(-1, sz.shape[1])[:out_features].to(torch.int64) & 0xFFFFFFFF
    scale = (w & 0xFFFF).to(torch.int16).view(torch.bfloat16)
    zz = ((w >> 16) & 0xFFFF).to(torch.int16).view(torch.bfloat16)
    return scale, zz.float()


def dequantize(packed: torch.Tensor, sz: torch.Tensor, group: int, dtype: torch.dtype | None = None,
               bits: int = BITS) -> torch.Tensor:
    """The weights the kernel computes with, ``[out, in]``: ``scale * ((128 + code) - (128 + zero))``, exact
    in fp32; ``bits`` 8: ``dequantize_fp8``, in bf16 (``group`` is the tile). ``dtype`` rounds them once
    (None: the kernel's own, fp32 / bf16)."""
    if bits == FP8_BITS:
        if group != packed.shape[-1]:
            raise ValueError(f"FP8 layouts have one scale word per {packed.shape[-1]}-column tile, "
                             f"not per {group} columns")
        return dequantize_fp8(packed, sz, dtype or torch.bfloat16)
    codes = unpack_codes(packed).float() + CODE_BIAS
    out = codes.shape[0]
    scale, zz = unpack_sz(sz, out)
    g = torch.arange(codes.shape[1], device=packed.device) // group
    return ((codes - zz[:, g]) * scale.float()[:, g]).to(dtype or torch.float32)


def kernel_dequantize(lin: IntLinear | Fp8Linear, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``lin`` as the kernel computes with it: integer weights with their scales rounded to bf16, each
    weight exact in fp32 (``dtype`` rounds them once); FP8 layers through ``kernel_dequantize_fp8``, in
    bf16 (the kernel rounds each FP8 weight once). ``dtype`` None: the kernel's own (fp32 / bf16)."""
    if isinstance(lin, Fp8Linear):
        return kernel_dequantize_fp8(lin, dtype or torch.bfloat16)
    g = lin.group_of_input()
    diff = (lin.codes() - lin.zero_codes()[:, g]).float()
    return (diff * lin.scales.to(torch.bfloat16).float()[:, g]).to(dtype or torch.float32)


def scale_rounding_error(lin: IntLinear) -> float:
    """Largest relative change of a scale when rounded to bf16 (0 for bf16 checkpoints)."""
    s = lin.scales.float()
    return float(((s.to(torch.bfloat16).float() - s).abs() / s.abs().clamp(min=1e-30)).max())


# ---------------------------------------------------------------- FP8 (e4m3)
def fp8_scale_words(name: str, scale: torch.Tensor) -> torch.Tensor:
    """int32 scale words (``scale``'s shape) of fp32 FP8 scales: the bits of ``bf16(scale) * 2**120`` in
    the low half, 0 in the high half. ValueError when a scale has no such bf16: the kernel needs every
    bf16-rounded scale positive, finite and normal, below ``2**8`` (``2**128`` overflows bf16)."""
    s = scale.float()
    b = s.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    exp = b >> 7                                    # sign 0 for positive scales
    bad = ~torch.isfinite(s) | (s <= 0) | (exp == 0) | (exp + FP8_SCALE_SHIFT > 254)
    if bool(bad.any()):
        v = float(s.reshape(-1)[bad.reshape(-1)][0])
        raise ValueError(f"{name}: FP8 scale {v:g} cannot be carried by the kernel's scale word (bf16 scales from "
                         "2**-126 up to below 2**8 can)")
    return b + (FP8_SCALE_SHIFT << 7)               # below 2**15: the high half stays 0


def check_layout_fp8(out_features: int, in_features: int, tile: int = TILE_COLS[0]) -> None:
    """ValueError (a sentence) when the kernel cannot lay out this FP8 matrix."""
    if tile not in TILE_COLS or in_features % tile:
        raise ValueError(f"{in_features} input channels are not a multiple of the {tile}-column tile")
    if out_features % ROWS_PER_BLOCK:
        raise ValueError(f"{out_features} output channels are not a multiple of {ROWS_PER_BLOCK}")


def check_pack_fp8(lin: Fp8Linear, tile: int = TILE_COLS[0]) -> torch.Tensor:
    """``lin``'s scale words, one per output row, or ValueError (a sentence) when the kernel cannot lay
    it out."""
    if not isinstance(lin, Fp8Linear):
        raise ValueError(f"{lin.name}: {lin.bits}-bit integer weights are not the kernel's FP8 layout")
    check_layout_fp8(lin.out_features, lin.in_features, tile)
    out = lin.out_features
    scale = lin.scale.float().reshape(-1).expand(out) if not lin.per_channel else lin.scale.float()
    return fp8_scale_words(lin.name, scale)


def pack_fp8(lin: Fp8Linear, tile: int = TILE_COLS[0]) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 ``[out / 16, in / tile, 16, tile]``, sz int32 ``[out / 16, in / tile, 16]``) of an
    FP8 ``lin`` in the kernel layout; per-channel and per-tensor scales alike become one word per row
    and tile (the scale rounded to bf16 once)."""
    word = check_pack_fp8(lin, tile)                                             # [out]
    out, k = lin.out_features, lin.in_features
    packed = pack_fp8_codes(lin.weight.view(torch.uint8), tile)
    sz = word.view(out // ROWS_PER_BLOCK, 1, ROWS_PER_BLOCK).expand(-1, k // tile, -1)
    return packed, sz.contiguous()


def pack_fp8_codes(codes: torch.Tensor, tile: int) -> torch.Tensor:
    """uint8 tiles ``[out / 16, in / tile, 16, tile]`` of e4m3 bytes ``codes`` (uint8 ``[out, in]``)."""
    out, k = codes.shape
    ck = FP8_COLS_PER_CHUNK
    chunks = codes.reshape(out, k // ck, ck)[..., BLOCK_ORDER8.to(codes.device)]     # [out, k/16, 16]
    nblk, ntile, nch = out // ROWS_PER_BLOCK, k // tile, tile // ck
    t = chunks.reshape(nblk, ROWS_PER_BLOCK, ntile, nch, CHUNK).permute(0, 2, 1, 3, 4)   # [blk, tile, r, c, 16]
    packed = torch.empty_like(t)
    packed[:, :, torch.arange(ROWS_PER_BLOCK).view(-1, 1), swizzle(tile, FP8_BITS)] = t
    return packed.reshape(nblk, ntile, ROWS_PER_BLOCK, tile).contiguous()


def unpack_fp8_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 e4m3 bytes ``[out, in]`` in column order from the kernel's FP8 tiles."""
    nblk, ntile, rows, tile = packed.shape
    nch = tile // FP8_COLS_PER_CHUNK
    sw = packed.view(nblk, ntile, rows, nch, CHUNK)
    t = sw[:, :, torch.arange(rows).view(-1, 1), swizzle(tile, FP8_BITS)]               # [blk, tile, r, c, 16]
    b = t.permute(0, 2, 1, 3, 4).reshape(nblk * rows, ntile * nch, CHUNK)
    codes = torch.empty_like(b)
    codes[..., BLOCK_ORDER8.to(packed.device)] = b
    return codes.reshape(nblk * rows, ntile * tile)


def unpack_fp8_sz(sz: torch.Tensor, out_features: int) -> torch.Tensor:
    """bf16 scales ``[out, groups]`` from FP8 scale words (the exponent's ``2**120`` taken back off)."""
    w = sz.transpose(1, 2).reshape(-1, sz.shape[1])[:out_features].to(torch.int64) & 0xFFFF
    return (w - (FP8_SCALE_SHIFT << 7)).to(torch.int16).view(torch.bfloat16)


def dequantize_fp8(packed: torch.Tensor, sz: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The FP8 weights the kernel computes with, ``[out, in]``: ``bf16(float(code) * float(bf16(scale)))``,
    from the layout (e4m3 NaN codes give NaN, as the format defines them)."""
    codes = unpack_fp8_codes(packed).view(torch.float8_e4m3fn).float()
    scale = unpack_fp8_sz(sz, codes.shape[0]).float()
    g = torch.arange(codes.shape[1], device=packed.device) // packed.shape[-1]
    return (codes * scale[:, g]).to(torch.bfloat16).to(dtype)


def kernel_dequantize_fp8(lin: Fp8Linear, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``lin`` as the kernel computes with it: its fp32 scale rounded to bf16 once, then
    ``bf16(float(code) * float(bf16(scale)))`` per weight (``dequantize_fp8`` of its layout, bit for bit)."""
    s = lin.scale.to(torch.bfloat16).float()
    return (lin.weight.float() * (s[:, None] if lin.per_channel else s)).to(torch.bfloat16).to(dtype)


# ---------------------------------------------------------------- whole models
def kernel_tensors(spec) -> dict[str, tuple[tuple[int, ...], "torch.dtype"]]:
    """What a megakernel of ``spec`` binds, by name: (shape, dtype). bf16 specs bind the HF tensors;
    quantized ones bind each layer linear as ``name`` (packed codes) and ``name + "_sz"`` (scale words),
    4-bit (``W4Layout``) or FP8 (``Fp8Layout``) by ``spec.weight_bits``."""
    out = {}
    for name, shape in spec.expected_tensors().items():
        if spec.quantized and is_layer_linear(name, shape):
            lay = layout_of(spec, shape)
            out[name] = (lay.packed_shape, torch.uint8)
            out[name + SCALE_SUFFIX] = (lay.sz_shape, torch.int32)
        else:
            out[name] = (shape, torch.bfloat16)
    return out


def layer_reason(spec, name: str, v) -> str | None:
    """Why the megakernel of quantized ``spec`` cannot stream decoder-layer linear ``name`` as the
    checkpoint holds it (``v``: IntLinear / Fp8Linear, or a plain tensor for a layer left dense), or
    None: the checks ``kernel_weights`` makes, without packing (the builder's read of the checkpoint)."""
    if not isinstance(v, (IntLinear, Fp8Linear)):
        return (f"{name} is not quantized, but the {spec.weight_bits}-bit kernel streams every decoder layer's "
                "linear weights quantized")
    tile = tile_cols(spec)
    try:
        if spec.weight_bits == FP8_BITS:
            check_pack_fp8(v, tile)
        else:
            check_pack(v, spec.weight_group, tile)
    except ValueError as e:
        return str(e)
    return None


def pack_for(spec, lin: IntLinear | Fp8Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed, sz) of a decoder-layer linear in ``spec``'s layout: 4-bit integers (``pack``) or FP8
    (``pack_fp8``); ValueError when ``lin`` is the other kind."""
    tile = tile_cols(spec)
    if spec.weight_bits == FP8_BITS:
        if spec.weight_group != tile:
            raise ValueError(f"FP8 layouts take one scale word per {tile}-column tile, "
                             f"not per {spec.weight_group} columns")
        return pack_fp8(lin, tile)
    if isinstance(lin, Fp8Linear):
        raise ValueError(f"{lin.name}: FP8 weights are not the kernel's {spec.weight_bits}-bit integer layout")
    return pack(lin, spec.weight_group, tile)


def kernel_weights(spec, weights: dict, packed_dense: bool = False,
                   dense_dtype: torch.dtype | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """(what the megakernel binds, what the reference / prefill computes with) from a checkpoint's
    weights (``quant.loader.load_quantized``: IntLinear or Fp8Linear for quantized layers, tensors for
    the rest). The second dict holds every weight as the kernel computes with it (``kernel_dequantize``):
    4-bit layer linears in fp32 (exact), FP8 ones and the rest in bf16; a quantized LM head is dequantized
    to bf16 for both (the kernel streams it in bf16).
    ``packed_dense``: the second dict holds each packed layer linear as a ``PackedW4Linear`` (4-bit) or
    ``PackedFp8Linear`` (FP8) over the bound tensors instead (no bf16 copy; it dequantizes when applied).
    ``dense_dtype``: the quantized layer linears of the second dict rounded once to it (a bf16 baseline's
    weights, without an fp32 copy of every layer)."""
    from .packed_linear import packed_linear
    bind, dense = {}, {}
    for name, shape in spec.expected_tensors().items():
        v = weights[name]
        if isinstance(v, (IntLinear, Fp8Linear)):
            if spec.quantized and is_layer_linear(name, shape):
                p, sz = pack_for(spec, v)
                bind[name], bind[name + SCALE_SUFFIX] = p, sz
                dense[name] = None if packed_dense else kernel_dequantize(v, dense_dtype)
            else:
                bind[name] = dense[name] = kernel_dequantize(v, torch.bfloat16)   # streamed in bf16
        else:
            if spec.quantized and is_layer_linear(name, shape):
                raise ValueError(f"{name} is not quantized, but the {spec.weight_bits}-bit kernel streams every "
                                 "decoder layer's linear weights quantized")
            bind[name] = dense[name] = v
    if packed_dense:
        # q/k/v and gate/up codes as rows of one tensor each, so the prefill's fused layers read the
        # megakernel's very memory (the modules' ``cat`` joins adjacent rows without a copy)
        from ..model.decoder_block import share_fused_storage
        bind = share_fused_storage(spec, bind)
        for name in dense:
            if dense[name] is None:
                dense[name] = packed_linear(bind[name], bind[name + SCALE_SUFFIX], spec.weight_group, spec.weight_bits)
    return bind, dense


def quantize_model(spec, weights: dict[str, torch.Tensor], symmetric: bool = True) -> dict:
    """A bf16 model's weights with every layer linear round-to-nearest quantized as ``spec`` streams
    them: 4 bits in ``spec.weight_group`` groups (``symmetric`` or with zero points), or FP8 e4m3 with
    fp32 per-channel scales when ``spec.weight_bits`` is 8 (benchmarks and tests: real quantized bytes
    without a checkpoint)."""
    from .rtn import quantize_fp8, quantize_int
    from .scheme import PER_CHANNEL
    out = {}
    for name, shape in spec.expected_tensors().items():
        t = weights[name]
        if is_layer_linear(name, shape):
            prefix = name[:-len(".weight")]
            out[name] = quantize_fp8(prefix, t, PER_CHANNEL, torch.float32) if spec.weight_bits == FP8_BITS else \
                quantize_int(prefix, t, BITS, spec.weight_group, symmetric, torch.bfloat16)
        else:
            out[name] = t
    return out
