"""Megakernel correctness with FP8 (e4m3) weights on the GPU, against the reference decoder.

Random bf16 weights (GPT-2 residual scaling) are quantized to e4m3 with one fp32 scale per output row
(``kernel_layout.quantize_model`` of an FP8 spec); the kernel binds the FP8 layout (``kernel_weights``:
byte tiles and scale words) and the references run the exact bf16 weights it computes with
(``kernel_dequantize_fp8``), compared as in tests/test_megakernel_gpu.py (``run_and_compare``).

The one-step layout test gives every output row its own magnitude, so that reading a byte or a scale
word from the wrong place (or the scale without its exponent shift) moves the logits by O(1): the
kernel's logits must match the reference of the right layout and be far from each wrong one's.
"""
from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

from trtllm_mk.kv_cache import PagedKVCache
from trtllm_mk.quant.kernel_layout import (BLOCK_ORDER8, FP8_COLS_PER_CHUNK, dequantize_fp8,
                                           is_layer_linear, kernel_weights, pack_fp8_codes, quantize_model, swizzle,
                                           tile_cols, unpack_fp8_codes)
from trtllm_mk.reference import ReferenceDecoder
from trtllm_mk.seam import SCALE_SUFFIX

from test_megakernel_gpu import MAX_SEQ, TINY, TPB, _decoder, _prompts, _spec, _weights, check, run_and_compare

pytestmark = pytest.mark.gpu


def _layer_linears(spec):
    return [(n, s) for n, s in spec.expected_tensors().items() if is_layer_linear(n, s)]


def fp8(spec):
    """``spec`` with FP8 decoder-layer linears (one scale word per row and tile)."""
    return dataclasses.replace(spec, weight_bits=8, weight_group=tile_cols(spec))


def quantized(spec, weights):
    """(FP8 spec, what the kernel binds, the bf16 weights it computes with)."""
    qspec = fp8(spec)
    bind, dense = kernel_weights(qspec, quantize_model(qspec, weights))
    return qspec, bind, dense


def _free():
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("name", list(TINY))
def test_tiny_models_fp8_match_reference(name, batch):
    spec = _spec(name)
    qspec, bind, dense = quantized(spec, _weights(spec))
    assert bind["model.layers.0.mlp.up_proj.weight"].dtype == torch.uint8
    check(run_and_compare(qspec, batch, dense, steps=128, bind=bind), 3e-2)


@pytest.mark.parametrize("batch", [1, 4])
def test_llama_1b_fp8_matches_reference(batch):
    """Real widths (1024-wide tiles, row pieces, K-split) at full depth: bf16 tolerance against the fp32
    reference and a bounded share of near-tie flips (as test_quant_gpu's real-shape test)."""
    spec = _spec("llama-3.2-1b")
    qspec, bind, dense = quantized(spec, _weights(spec))
    _free()
    res = run_and_compare(qspec, batch, dense, steps=128, budget_s=10.0, bind=bind)
    del bind, dense
    _free()
    assert res.max_p < 5e-2
    assert res.flips <= 0.12 * 128 * batch


# ---------------------------------------------------------------- the layout, one step
def _contrasted(spec, weights, seed=5):
    """``weights`` with every row of the layer linears scaled by its own factor in [1/4, 4]: the rows'
    scales then differ widely, so reading a neighbour's is an O(1) change of the weights."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    out = dict(weights)
    for name, (rows, _) in _layer_linears(spec):
        f = torch.exp2(torch.rand(rows, 1, device="cuda", generator=gen) * 4 - 2)
        out[name] = (weights[name].float() * f).to(torch.bfloat16)
    return out


def _column_order(p, sz):
    """Bytes stored in plain column order, not the mma fragment order (BLOCK_ORDER8)."""
    codes = unpack_fp8_codes(p)
    out, k = codes.shape
    stored = codes.view(out, k // FP8_COLS_PER_CHUNK, FP8_COLS_PER_CHUNK)[..., BLOCK_ORDER8.to(p.device)]
    return pack_fp8_codes(stored.reshape(out, k), p.shape[-1]), sz


def _unswizzled(p, sz):
    """Tile rows stored without the chunk swizzle (chunk c of every row at c)."""
    nblk, ntile, rows, tile = p.shape
    sw = swizzle(tile, bits=8).to(p.device)
    chunks = p.view(nblk, ntile, rows, tile // 16, 16)
    return chunks[:, :, torch.arange(rows, device=p.device).view(-1, 1), sw].reshape(p.shape).contiguous(), sz


def _next_row_scale(p, sz):
    return p, sz.roll(1, dims=2)


def _exponent_off(p, sz):
    """The scale word read with an exponent shift 4 short of FP8_SCALE_SHIFT (weights 16 times smaller)."""
    return p, sz - (4 << 7)


WRONG = {"column order": _column_order, "unswizzled": _unswizzled, "next row's scale": _next_row_scale,
         "exponent shift": _exponent_off}


def _dense_of(qspec, bind, dense, transform):
    out = dict(dense)
    for name, _ in _layer_linears(qspec):
        out[name] = dequantize_fp8(*transform(bind[name], bind[name + SCALE_SUFFIX]))
    return out


def _rel(a, b):
    return ((a - b).norm(dim=-1) / b.norm(dim=-1)).max().item()


def test_fp8_gemv_layout_one_step():
    spec = _spec("tiny-llama")
    qspec, bind, dense = quantized(spec, _contrasted(spec, _weights(spec)))
    assert torch.equal(_dense_of(qspec, bind, dense, lambda p, sz: (p, sz))["model.layers.0.mlp.up_proj.weight"],
                       dense["model.layers.0.mlp.up_proj.weight"])
    batch = 2
    dec, cache = _decoder(qspec, batch, bind)
    prompts = _prompts(qspec, batch, torch.Generator().manual_seed(1))
    ref = ReferenceDecoder(qspec, dense, compute_dtype=torch.float32, gemv_input_dtype=torch.bfloat16)
    first = ref.prefill(prompts, cache).argmax(-1)
    pos = torch.tensor([len(p) for p in prompts], device="cuda")
    before = cache.pool.clone()
    dec.set_state(first, pos)
    dec.step()
    got = dec.logits.clone()
    dec.synchronize()
    table, tpb = cache.block_table.clone(), cache.tokens_per_block

    def reference(weights):
        r = ReferenceDecoder(qspec, weights, compute_dtype=torch.float32, gemv_input_dtype=torch.bfloat16)
        return r.decode(first.cuda(), pos, PagedKVCache(before.clone(), table.clone(), tpb))

    good = _rel(got, reference(dense))
    bad = {what: _rel(got, reference(_dense_of(qspec, bind, dense, f))) for what, f in WRONG.items()}
    print(f"fp8 layout: rel err {good:.1e} vs the kernel layout; " + ", ".join(f"{k} {v:.2f}" for k, v in bad.items()))
    assert good < 1e-2
    for what, err in bad.items():
        assert err > 0.1, f"a kernel reading {what} would pass this test"
    del dec, cache
    _free()


def _prebuild() -> None:
    """Compile every kernel these tests use into the cubin cache (no GPU needed):
    ``TRTLLM_MK_CACHE=.cubin_cache python tests/test_fp8_gpu.py``."""
    import os

    from trtllm_mk.codegen import compile_cubin, generate_source
    from trtllm_mk.gpus import get_gpu
    from trtllm_mk.search import search
    gpu = get_gpu(os.environ.get("TRTLLM_MK_TEST_GPU", "H100-SXM"))
    cases = [(fp8(_spec(n)), b, 5.0) for n in TINY for b in (1, 2, 4)]
    cases += [(fp8(_spec("llama-3.2-1b")), b, 10.0) for b in (1, 4)]
    for spec, batch, budget in cases:
        sch, _ = search(spec, batch, gpu, context_len=256, budget_s=budget, seed=0)
        src, _ = generate_source(sch, TPB, MAX_SEQ, use_bulk_copy=gpu.has_tma)
        path, _ = compile_cubin(src, gpu.nvcc_arch)
        print(spec.name, spec.num_layers, spec.weight_bits, batch, path, flush=True)


if __name__ == "__main__":
    _prebuild()
