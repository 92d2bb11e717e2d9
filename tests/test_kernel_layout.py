"""quant/kernel_layout.py: the megakernel's 4-bit and FP8 weight layouts, checked against the layouts
written out here from their description (code placement per mma fragment, tiles of 16 rows with
row-swizzled 16-byte chunks, scale words per 16-row block), and the weights it computes with against
the checkpoint's own dequantization."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from trtllm_mk.model.spec import ModelSpec
from trtllm_mk.quant.kernel_layout import (BLOCK_ORDER, W4Layout, check_layout, dequantize, kernel_dequantize,
                                           kernel_tensors, kernel_weights, pack, per_channel_group, quantize_model,
                                           unpack_codes, unpack_sz)
from trtllm_mk.quant.rtn import quantize_int
from trtllm_mk.quant.scheme import PER_CHANNEL


def _lin(out: int, k: int, group: int, symmetric: bool, scale_dtype=torch.float16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, k, generator=g) * 0.05
    return quantize_int("model.layers.0.mlp.up_proj", w, 4, group, symmetric, scale_dtype)


def _column_of(t: int, nibble: int) -> int:
    """Column (within a 32-column block) of nibble ``nibble`` of word ``t``, from the mma m16n8k16 A
    fragment: lane (g, t) holds columns 2t, 2t+1 (a0), 2t+8, 2t+9 (a2) of each 16-column k-step;
    nibbles j and j + 4 are the even and odd column of pair j (k-step j // 2, upper half j % 2)."""
    j, odd = nibble % 4, nibble // 4
    return 16 * (j // 2) + 8 * (j % 2) + 2 * t + odd


def test_block_order_is_a_permutation_matching_the_fragment_layout():
    assert sorted(BLOCK_ORDER.tolist()) == list(range(32))
    assert BLOCK_ORDER.tolist() == [_column_of(t, i) for t in range(4) for i in range(8)]


@pytest.mark.parametrize("tile", [128, 256, 512])
@pytest.mark.parametrize("group", [32, 64, 128, PER_CHANNEL])
@pytest.mark.parametrize("symmetric", [True, False])
def test_pack_round_trip_and_byte_layout(group, symmetric, tile):
    out, k = 48, 1024
    lin = _lin(out, k, group, symmetric, seed=group + symmetric)
    lg = per_channel_group(k) if group == PER_CHANNEL else group
    packed, sz = pack(lin, tile=tile)
    lay = W4Layout(out, k, lg, tile)
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == lay.packed_shape
    assert sz.dtype == torch.int32 and tuple(sz.shape) == lay.sz_shape
    codes = lin.codes()
    assert torch.equal(unpack_codes(packed), codes.long())
    # byte layout, written out: the 32 columns of block b of row o are chunk c = b % (tile / 32) of tile
    # b // (tile / 32) of the row's 16-row block, stored at chunk c ^ (o % 8) of its tile row (c ^ (o // 2
    # % 4) in 128-column tiles); word t of the chunk = little-endian bytes 4 t .. 4 t + 3
    per_tile = tile // 32
    for o in (0, 9, 17, out - 1):
        for b in range(k // 32):
            at = 16 * ((b % per_tile) ^ ((o % 16) // 2 % 4 if tile == 128 else o % 8))
            row = packed[o // 16, b // per_tile, o % 16]
            for t in range(4):
                word = int.from_bytes(bytes(row[at + 4 * t:at + 4 * t + 4].tolist()), "little")
                want = sum(int(codes[o, 32 * b + _column_of(t, i)]) << (4 * i) for i in range(8))
                assert word == want, (o, b, t)
    # scale words: sz[blk, grp, r] = bf16 scale (low half) | bf16(128 + zero) (high half) of row 16 blk + r
    zeros = lin.zero_codes()
    for o in (0, 17, out - 1):
        for grp in range(k // lg):
            w = int(sz[o // 16, grp, o % 16]) & 0xFFFFFFFF
            src = 0 if group == PER_CHANNEL else grp
            scale = torch.tensor([w & 0xFFFF], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
            hi = torch.tensor([w >> 16], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
            assert float(scale) == float(lin.scales[o, src].to(torch.bfloat16))
            assert float(hi) == 128 + int(zeros[o, src])
    s, zz = unpack_sz(sz, out)
    assert s.shape == (out, k // lg) and torch.equal(zz, (zeros.float() + 128).repeat_interleave(
        k // lg if group == PER_CHANNEL else 1, dim=1))
    # the kernel's weights: the same from the layout as from the checkpoint's objects
    assert torch.equal(dequantize(packed, sz, lg), kernel_dequantize(lin))


def test_kernel_weights_equal_the_checkpoints_when_its_scales_are_bf16():
    """The kernel computes with (code - zero) x scale exact in fp32 (it scales a group's sums): with bf16
    scales those are the checkpoint's own values, bit for bit, and rounded to bf16 the checkpoint's bf16
    load; fp16 scales move each weight by the scale's one rounding to bf16 and nothing else."""
    lin = _lin(32, 128, 64, symmetric=False, scale_dtype=torch.bfloat16)
    assert kernel_dequantize(lin).dtype == torch.float32
    assert torch.equal(kernel_dequantize(lin), lin.dequantize())
    assert torch.equal(kernel_dequantize(lin, torch.bfloat16), lin.dequantize(torch.bfloat16))
    half = _lin(32, 128, 64, symmetric=False, scale_dtype=torch.float16)
    err = (kernel_dequantize(half) - half.dequantize()).abs()
    assert bool((err <= half.dequantize().abs() * 2 ** -8).all()) and bool((err > 0).any())


def test_per_channel_group():
    assert [per_channel_group(k) for k in (4096, 192, 96)] == [128, 64, 32]
    with pytest.raises(ValueError, match="not a multiple of 32"):
        per_channel_group(100)


@pytest.mark.parametrize("out,k,group,message", [
    (32, 512, 96, "group size 96 is not one the kernel implements"),
    (32, 96, 64, "96 input channels are not a multiple of the group size 64"),
    (32, 384, 128, "384 input channels are not a multiple of the 512-column tile"),
    (32, 896, 128, "896 input channels are not a multiple of the 512-column tile"),
    (24, 512, 128, "24 output channels are not a multiple of 16"),
])
def test_check_layout_errors(out, k, group, message):
    with pytest.raises(ValueError, match=message):
        check_layout(out, k, group)


def test_tile_cols_is_the_widest_dividing_every_k():
    from trtllm_mk.quant.kernel_layout import tile_cols
    assert tile_cols(_tiny_spec()) == 256
    assert tile_cols(dataclasses.replace(_tiny_spec(), hidden_size=1024, intermediate_size=2048, num_heads=32)) == 512
    assert tile_cols(dataclasses.replace(_tiny_spec(), hidden_size=896, num_heads=28)) == 128
    with pytest.raises(ValueError, match="not multiples of 128 columns"):
        tile_cols(dataclasses.replace(_tiny_spec(), hidden_size=96, num_heads=3))


def test_swizzle_spreads_eight_rows_over_eight_bank_groups():
    """The rows one ldmatrix phase reads (8 consecutive rows of a tile, one chunk each) land in 8
    different 16-byte groups of the 128-byte bank line, for every chunk and tile width."""
    from trtllm_mk.quant.kernel_layout import swizzle
    for tile in (128, 256, 512):
        sw, row_bytes = swizzle(tile), tile // 2
        assert all(sorted(sw[r].tolist()) == list(range(tile // 32)) for r in range(16))   # a permutation per row
        for r0 in (0, 8):
            for c in range(tile // 32):
                groups = {((r * row_bytes + 16 * int(sw[r, c])) % 128) // 16 for r in range(r0, r0 + 8)}
                assert len(groups) == 8, (tile, r0, c)


def test_pack_refuses_what_the_layout_cannot_hold():
    lin = _lin(32, 512, 64, True)
    with pytest.raises(ValueError, match="group size 64 cannot be laid out as 128"):
        pack(lin, 128)
    w8 = quantize_int("x", torch.randn(32, 512), 8, 64, True, torch.float16)
    with pytest.raises(ValueError, match="8-bit weights are not the kernel's 4-bit layout"):
        pack(w8)
    act = dataclasses.replace(lin, g_idx=torch.arange(512, dtype=torch.int32).flip(0) // 64)
    with pytest.raises(ValueError, match=r"activation-order groups \(g_idx\)"):
        pack(act)


def _tiny_spec(**kw) -> ModelSpec:
    return ModelSpec(name="t", family="llama", hidden_size=256, intermediate_size=512, num_layers=2, num_heads=8,
                     num_kv_heads=2, head_dim=32, vocab_size=64, rms_norm_eps=1e-5, rope_theta=1e4,
                     max_position_embeddings=256, tie_word_embeddings=False, **kw)


def test_kernel_weights_round_trip():
    """The bind dict dequantizes back to the dense dict; only layer linears are packed; bytes add up."""
    from trtllm_mk.model.random_weights import random_weights
    spec = _tiny_spec(weight_bits=4, weight_group=64)
    bf16 = random_weights(spec, seed=3)
    bind, dense = kernel_weights(spec, quantize_model(spec, bf16, symmetric=False))
    want = kernel_tensors(spec)
    assert set(bind) == set(want)
    for name, (shape, dtype) in want.items():
        assert tuple(bind[name].shape) == shape and bind[name].dtype == dtype, name
    packed = [n for n in want if n + "_sz" in want]
    assert len(packed) == 7 * spec.num_layers
    for name in spec.expected_tensors():
        if name in packed:
            assert torch.equal(dequantize(bind[name], bind[name + "_sz"], 64), dense[name]), name
            assert (dense[name].float() - bf16[name].float()).abs().max() > 0   # really quantized
        else:
            assert bind[name] is dense[name] and torch.equal(dense[name], bf16[name]), name
    assert sum(t.numel() * t.element_size() for t in bind.values()) == spec.weight_bytes()
    with pytest.raises(ValueError, match="is not quantized, but the 4-bit kernel streams"):
        kernel_weights(spec, bf16)


def test_packed_linear_applies_the_kernels_weights_without_a_copy():
    """PackedW4Linear dequantizes exactly as the layout says, and the fused q/k/v / gate/up modules that
    kernel_weights(..., packed_dense=True) gives the prefill read the bound codes' memory."""
    from trtllm_mk.model.decoder_block import Decoder
    from trtllm_mk.model.random_weights import random_weights
    from trtllm_mk.quant.packed_linear import PackedW4Linear
    spec = _tiny_spec(weight_bits=4, weight_group=64)
    q = quantize_model(spec, random_weights(spec, seed=4), symmetric=False)
    bind, dense = kernel_weights(spec, q)
    pbind, packed = kernel_weights(spec, q, packed_dense=True)
    name = "model.layers.1.mlp.down_proj.weight"
    assert isinstance(packed[name], PackedW4Linear) and packed[name].shape == tuple(dense[name].shape)
    assert torch.equal(packed[name].weight(), dense[name])
    x = torch.randn(3, dense[name].shape[1], dtype=torch.bfloat16)
    assert torch.equal(packed[name](x), torch.nn.functional.linear(x, dense[name].to(x.dtype)))   # rounded once
    a = "model.layers.0.self_attn."
    fused = PackedW4Linear.cat([packed[a + n + ".weight"] for n in ("q_proj", "k_proj", "v_proj")])
    assert fused.packed.data_ptr() == pbind[a + "q_proj.weight"].data_ptr()      # rows of the bound tensor
    assert torch.equal(fused.weight(), torch.cat([dense[a + n + ".weight"] for n in ("q_proj", "k_proj", "v_proj")]))
    # a decoder on the packed modules computes what the decoder on the dequantized weights does
    from trtllm_mk.model.rope import rope_cos_sin, rope_inv_freq
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    ref, got = Decoder(spec, dense), Decoder(spec, packed)
    assert torch.equal(got.layers[0].wqkv.packed, fused.packed)
    cos, sin = rope_cos_sin(torch.arange(5)[None], rope_inv_freq(spec), torch.float32)
    group = spec.num_heads // spec.num_kv_heads

    def attn(layer, q_, k_, v_):
        k_, v_ = k_.repeat_interleave(group, 2), v_.repeat_interleave(group, 2)
        return torch.nn.functional.scaled_dot_product_attention(
            q_.transpose(1, 2), k_.transpose(1, 2), v_.transpose(1, 2), is_causal=True).transpose(1, 2)
    assert torch.equal(got(ids, cos, sin, attn), ref(ids, cos, sin, attn))


# ------------------------------------------------------------------------------------------------ FP8

def _fp8(out: int, k: int, per_channel: bool, seed: int = 0):
    from trtllm_mk.quant.rtn import quantize_fp8
    from trtllm_mk.quant.scheme import PER_TENSOR
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, k, generator=g) * 0.05 * (1 + torch.arange(out)[:, None] / 8)
    return quantize_fp8("model.layers.0.mlp.up_proj", w, PER_CHANNEL if per_channel else PER_TENSOR)


def test_block_order8_is_the_fragment_order_of_one_k_step():
    """Byte 4 t + j of a chunk: lane (g, t)'s a0 (columns 2t, 2t+1) then a2 (columns 2t+8, 2t+9)."""
    from trtllm_mk.quant.kernel_layout import BLOCK_ORDER8
    assert sorted(BLOCK_ORDER8.tolist()) == list(range(16))
    assert BLOCK_ORDER8.tolist() == [0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15]


def test_swizzle_of_fp8_tiles_and_the_4bit_default():
    from trtllm_mk.quant.kernel_layout import swizzle
    for tile in (128, 256, 512):
        assert torch.equal(swizzle(tile), swizzle(tile, bits=4))
        sw = swizzle(tile, bits=8)
        assert tuple(sw.shape) == (16, tile // 16)
        for r in range(16):
            assert sw[r].tolist() == [c ^ (r % 8) for c in range(tile // 16)]
            # eight consecutive rows of one chunk: eight different 16-byte groups of the 128-byte line
        for r0 in (0, 8):
            for c in range(tile // 16):
                assert len({((r * tile + 16 * int(sw[r, c])) % 128) // 16 for r in range(r0, r0 + 8)}) == 8


def _bf16_bits(x: float) -> int:
    return int(torch.tensor([x]).to(torch.bfloat16).view(torch.int16).item()) & 0xFFFF


@pytest.mark.parametrize("tile", [128, 256, 512])
@pytest.mark.parametrize("per_channel", [True, False])
def test_fp8_pack_round_trip_and_byte_layout(tile, per_channel):
    from trtllm_mk.quant.kernel_layout import (Fp8Layout, dequantize_fp8, kernel_dequantize_fp8, pack_fp8,
                                               unpack_fp8_codes, unpack_fp8_sz)
    out, k = 48, 1024
    lin = _fp8(out, k, per_channel, seed=tile)
    packed, sz = pack_fp8(lin, tile)
    lay = Fp8Layout(out, k, tile)
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == lay.packed_shape == (out // 16, k // tile, 16, tile)
    assert sz.dtype == torch.int32 and tuple(sz.shape) == lay.sz_shape == (out // 16, k // tile, 16)
    assert lay.nbytes == packed.numel() + 4 * sz.numel()
    codes = lin.weight.view(torch.uint8)
    assert torch.equal(unpack_fp8_codes(packed), codes)
    # byte layout, written out: column x of row o is in tile x // tile of the row's 16-row block, chunk
    # c = (x % tile) // 16 of that tile row, stored at chunk c ^ (o % 8); byte 4 t + j of the chunk holds
    # column (2t, 2t+1, 2t+8, 2t+9)[j] of the chunk's 16
    for o in (0, 9, 17, out - 1):
        row_codes = codes[o].tolist()
        for x in range(k):
            c, col = divmod(x % tile, 16)
            t, j = (col % 8) // 2, (col % 2) + 2 * (col // 8)
            assert int(packed[o // 16, x // tile, o % 16, 16 * (c ^ (o % 8)) + 4 * t + j]) == row_codes[x], (o, x)
    # scale words: low half = bits of bf16(scale) with 120 added to the exponent field, high half 0
    scale = lin.scale.float().expand(out) if not per_channel else lin.scale
    for o in (0, 17, out - 1):
        b = _bf16_bits(float(scale[o]))
        for grp in range(k // tile):
            w = int(sz[o // 16, grp, o % 16]) & 0xFFFFFFFF
            assert w >> 16 == 0 and w == b + (120 << 7)
            assert w == _bf16_bits(float(torch.tensor(float(scale[o])).to(torch.bfloat16)) * 2.0 ** 120)
    assert torch.equal(unpack_fp8_sz(sz, out), scale.to(torch.bfloat16)[:, None].expand(out, k // tile))
    # the kernel's weights from the layout and from the checkpoint's object: bit for bit
    want = kernel_dequantize_fp8(lin)
    assert torch.equal(dequantize_fp8(packed, sz), want)
    assert torch.equal(dequantize(packed, sz, tile, bits=8), want)
    assert torch.equal(kernel_dequantize(lin), want)
    # bf16(code * bf16(scale)), one rounding, written out for a few weights
    s16 = scale.to(torch.bfloat16).float()
    for o, x in ((0, 0), (17, 300), (out - 1, k - 1)):
        v = float(lin.weight[o, x].float()) * float(s16[o])
        assert float(want[o, x]) == float(torch.tensor(v).to(torch.bfloat16))


def test_fp8_dequantize_rounds_the_scale_to_bf16_once():
    """fp32 scales that are not bf16 values are rounded first: the weights differ from the checkpoint's
    own (code * fp32 scale, rounded once) by at most that rounding and their own."""
    from trtllm_mk.quant.kernel_layout import kernel_dequantize_fp8
    lin = _fp8(32, 256, True)
    assert not torch.equal(lin.scale, lin.scale.to(torch.bfloat16).float())     # the case is exercised
    got, exact = kernel_dequantize_fp8(lin).float(), lin.dequantize()
    assert bool(((got - exact).abs() <= exact.abs() * 2 ** -8 * 2 + 1e-30).all())
    bf = dataclasses.replace(lin, scale=lin.scale.to(torch.bfloat16).float())
    assert torch.equal(kernel_dequantize_fp8(bf), bf.dequantize(torch.bfloat16))


@pytest.mark.parametrize("scale,ok", [
    (2.0 ** -126, True), (255.0, True), (2.0 ** -127, False), (256.0, False), (0.0, False), (-1.0, False),
    (float("inf"), False), (float("nan"), False)])
def test_fp8_scale_words_refuse_what_the_exponent_cannot_carry(scale, ok):
    from trtllm_mk.quant.kernel_layout import fp8_scale_words, pack_fp8
    lin = _fp8(16, 128, False)
    bad = dataclasses.replace(lin, scale=torch.tensor(scale))
    if ok:
        w = int(fp8_scale_words("x", torch.tensor([scale]))[0])
        assert w == _bf16_bits(scale) + (120 << 7) < 1 << 15
        pack_fp8(bad, 128)
        return
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.up_proj: FP8 scale \S+ cannot be carried by the "
                                         r"kernel's scale word") as e:
        pack_fp8(bad, 128)
    assert "\n" not in str(e.value)


def test_fp8_pack_refuses_other_shapes_and_integer_weights():
    from trtllm_mk.quant.kernel_layout import pack_fp8
    with pytest.raises(ValueError, match="384 input channels are not a multiple of the 256-column tile"):
        pack_fp8(_fp8(16, 384, True), 256)
    with pytest.raises(ValueError, match="24 output channels are not a multiple of 16"):
        pack_fp8(_fp8(24, 256, True), 256)
    with pytest.raises(ValueError, match="4-bit integer weights are not the kernel's FP8 layout"):
        pack_fp8(_lin(32, 512, 64, True), 512)
    from trtllm_mk.model.random_weights import random_weights
    fp8 = quantize_model(_tiny_spec(weight_bits=8, weight_group=256), random_weights(_tiny_spec(), seed=1))
    with pytest.raises(ValueError, match="FP8 weights are not the kernel's 4-bit integer layout"):
        kernel_weights(_tiny_spec(weight_bits=4, weight_group=64), fp8)


def test_fp8_kernel_weights_round_trip_and_packed_modules():
    """An FP8 spec binds Fp8Layout tensors whose bytes are the spec's; the dense dict is the kernel's
    weights; the packed prefill modules compute the same, fused q/k/v on the bound memory."""
    from trtllm_mk.model.decoder_block import Decoder
    from trtllm_mk.model.random_weights import random_weights
    from trtllm_mk.model.rope import rope_cos_sin, rope_inv_freq
    from trtllm_mk.quant.kernel_layout import dequantize_fp8, kernel_dequantize_fp8
    from trtllm_mk.quant.linear import Fp8Linear
    from trtllm_mk.quant.packed_linear import PackedFp8Linear
    spec = _tiny_spec(weight_bits=8, weight_group=256)
    bf16 = random_weights(spec, seed=7)
    q = quantize_model(spec, bf16)
    lin = q["model.layers.0.mlp.up_proj.weight"]
    assert isinstance(lin, Fp8Linear) and lin.per_channel and lin.scale.dtype == torch.float32
    bind, dense = kernel_weights(spec, q)
    want = kernel_tensors(spec)
    assert set(bind) == set(want)
    for name, (shape, dtype) in want.items():
        assert tuple(bind[name].shape) == shape and bind[name].dtype == dtype, name
    assert want["model.layers.0.mlp.down_proj.weight"] == ((256 // 16, 512 // 256, 16, 256), torch.uint8)
    assert want["model.layers.0.mlp.down_proj.weight_sz"] == ((256 // 16, 512 // 256, 16), torch.int32)
    assert sum(t.numel() * t.element_size() for t in bind.values()) == spec.weight_bytes()
    packed_names = [n for n in want if n + "_sz" in want]
    assert len(packed_names) == 7 * spec.num_layers
    for name in packed_names:
        assert torch.equal(dequantize_fp8(bind[name], bind[name + "_sz"]), dense[name]), name
        assert torch.equal(dense[name], kernel_dequantize_fp8(q[name])), name
        assert (dense[name].float() - bf16[name].float()).abs().max() > 0
    with pytest.raises(ValueError, match="is not quantized, but the 8-bit kernel streams"):
        kernel_weights(spec, bf16)
    with pytest.raises(ValueError, match="FP8 layouts take one scale word per 256-column tile, not per 128"):
        kernel_weights(dataclasses.replace(spec, weight_group=128), q)

    pbind, packed = kernel_weights(spec, q, packed_dense=True)
    name = "model.layers.1.mlp.down_proj.weight"
    assert isinstance(packed[name], PackedFp8Linear) and packed[name].shape == tuple(dense[name].shape)
    assert torch.equal(packed[name].weight(), dense[name])
    x = torch.randn(3, dense[name].shape[1], dtype=torch.bfloat16)
    assert torch.equal(packed[name](x), torch.nn.functional.linear(x, dense[name].to(x.dtype)))   # rounded once
    a = "model.layers.0.self_attn."
    fused = PackedFp8Linear.cat([packed[a + n + ".weight"] for n in ("q_proj", "k_proj", "v_proj")])
    assert fused.packed.data_ptr() == pbind[a + "q_proj.weight"].data_ptr()
    assert torch.equal(fused.weight(), torch.cat([dense[a + n + ".weight"] for n in ("q_proj", "k_proj", "v_proj")]))
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    ref, got = Decoder(spec, dense), Decoder(spec, packed)
    cos, sin = rope_cos_sin(torch.arange(5)[None], rope_inv_freq(spec), torch.float32)
    group = spec.num_heads // spec.num_kv_heads

    def attn(layer, q_, k_, v_):
        k_, v_ = k_.repeat_interleave(group, 2), v_.repeat_interleave(group, 2)
        return torch.nn.functional.scaled_dot_product_attention(
            q_.transpose(1, 2), k_.transpose(1, 2), v_.transpose(1, 2), is_causal=True).transpose(1, 2)
    assert torch.equal(got(ids, cos, sin, attn), ref(ids, cos, sin, attn))


def test_fp8_per_tensor_checkpoints_bind_one_scale_everywhere():
    from trtllm_mk.quant.kernel_layout import pack_fp8
    lin = _fp8(32, 512, per_channel=False)
    _, sz = pack_fp8(lin, 256)
    assert len(set(sz.reshape(-1).tolist())) == 1
