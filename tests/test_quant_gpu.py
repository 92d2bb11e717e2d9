"""Megakernel correctness with 4-bit weights (W4A16) on the GPU, against the reference decoder.

Random bf16 weights (GPT-2 residual scaling) are round-to-nearest quantized to 4 bits in several
schemes: symmetric and asymmetric (zero points) codes, groups of 128 and 32 input columns, and one
scale per output row (laid out as ``per_channel_group`` columns, the row's scale repeated). The kernel
binds the packed codes and scale words (``kernel_layout.kernel_weights``); the references run the
exact fp32 weights it computes with ((code - zero) x scale: the kernel scales each group's sums), so the
comparison is the one of tests/test_megakernel_gpu.py
(``run_and_compare``: free-running kernel, teacher-forced references over its tokens and KV history,
noise-filled KV padding) with the same tolerances.

The one-step layout test gives every (row, group) its own magnitude and, for asymmetric codes, its own
offset, so that reading a nibble, a scale or a zero point from the wrong place moves the logits by
O(1): the kernel's logits must match the reference of the right layout and be far from the references
of each wrong one. The int4 benchmark baseline (torch's tinygemm kernel) is checked against the same
dequantized weights.
"""
from __future__ import annotations

import dataclasses
import gc
import sys
from pathlib import Path

import pytest
import torch

from trtllm_mk.kv_cache import PagedKVCache
from trtllm_mk.quant.kernel_layout import (BLOCK_ORDER, COLS_PER_BLOCK, dequantize, is_layer_linear, kernel_weights,
                                           pack_codes, per_channel_group, quantize_model, swizzle, unpack_codes)
from trtllm_mk.quant.rtn import quantize_int
from trtllm_mk.quant.scheme import PER_CHANNEL
from trtllm_mk.reference import ReferenceDecoder
from trtllm_mk.seam import SCALE_SUFFIX

from test_megakernel_gpu import MAX_SEQ, TINY, TPB, _decoder, _prompts, _spec, _weights, check, run_and_compare

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[1]

# scheme -> (group size or PER_CHANNEL, symmetric)
SCHEMES = {"sym-g128": (128, True), "asym-g128": (128, False), "sym-g32": (32, True),
           "asym-per-channel": (PER_CHANNEL, False)}
REAL = {"llama-3.2-1b": None, "llama-3.1-8b": 4, "qwen3-8b": 4}   # name -> layers (None: full depth)


def _layer_linears(spec):
    return [(n, s) for n, s in spec.expected_tensors().items() if is_layer_linear(n, s)]


def quantized(spec, weights, group, symmetric):
    """(quantized spec, what the kernel binds, the bf16 weights it computes with) of bf16 ``weights``
    RTN-quantized in groups of ``group`` columns (PER_CHANNEL: one scale per output row)."""
    if group == PER_CHANNEL:
        layout = min(per_channel_group(s[1]) for _, s in _layer_linears(spec))
        qspec = dataclasses.replace(spec, weight_bits=4, weight_group=layout)
        q = dict(weights)
        for name, shape in _layer_linears(spec):
            q[name] = quantize_int(name[:-len(".weight")], weights[name], 4, PER_CHANNEL, symmetric, torch.bfloat16)
            assert q[name].groups == 1   # the repeated-scale layout is what this scheme exercises
    else:
        qspec = dataclasses.replace(spec, weight_bits=4, weight_group=group)
        q = quantize_model(qspec, weights, symmetric=symmetric)
    bind, dense = kernel_weights(qspec, q)
    return qspec, bind, dense


def _free():
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("name", list(TINY))
def test_tiny_models_quantized_match_reference(name, scheme, batch):
    spec = _spec(name)
    qspec, bind, dense = quantized(spec, _weights(spec), *SCHEMES[scheme])
    check(run_and_compare(qspec, batch, dense, steps=128, bind=bind), 3e-2)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("name", list(REAL))
def test_real_shapes_quantized_match_reference(name, batch):
    """Real widths (row pieces, K-split over whole groups, several warps per row); llama-3.2-1b at full
    depth, the 8B shapes at 4 layers. As in the bf16 full-depth test, rounding events are amplified by
    the later random layers, so the check is bf16 tolerance against the fp32 reference, the exact argmax
    of the kernel's own logits, and a bounded share of near-tie flips; a wrong layout flips most tokens
    and misses the tolerance by orders of magnitude."""
    spec = _spec(name)
    if REAL[name] is not None:
        spec = dataclasses.replace(spec, num_layers=REAL[name])
    free = torch.cuda.mem_get_info()[0]
    need = spec.weight_bytes() * 4 + (4 << 30)   # bf16 weights, then their exact fp32 copy (the reference's)
    if free < need:
        pytest.skip(f"{name}: needs {need / 1e9:.0f} GB of GPU memory, {free / 1e9:.0f} GB free")
    w = _weights(spec)
    qspec, bind, dense = quantized(spec, w, 128, True)
    del w
    _free()
    res = run_and_compare(qspec, batch, dense, steps=128, budget_s=10.0, bind=bind)
    del bind, dense
    _free()
    assert res.max_p < 5e-2
    assert res.flips <= 0.12 * 128 * batch


WIDE_SLOT = (49152, 4)   # (slot_bytes, stages): a 4-bit slot of two 16-row blocks over 2048 columns


def _wide_slot_schedule(spec, gpu):
    """The searched plan of ``spec`` at batch 1 with 48 KB ring slots: QKV and GATEUP slots of 2048 and
    4096 columns (at 32 KB they take half), the geometry the H200 calibration admits for 4-bit weights."""
    from trtllm_mk.search import schedule_plan, search
    sch, _ = search(spec, 1, gpu, context_len=256, budget_s=10.0, seed=0)
    return schedule_plan(spec, 1, gpu, dataclasses.replace(sch.plan, slot_bytes=WIDE_SLOT[0], stages=WIDE_SLOT[1]), 256)


def test_wide_quantized_slots_match_reference():
    """8B widths, two layers, 48 KB slots: the same check as the real shapes' on the slot geometry the
    searched plans use when the calibration admits wide slots for 4-bit weights."""
    from test_megakernel_gpu import _gpu
    spec = dataclasses.replace(_spec("llama-3.1-8b"), num_layers=2)
    w = _weights(spec)
    qspec, bind, dense = quantized(spec, w, 128, True)
    del w
    _free()
    sch = _wide_slot_schedule(qspec, _gpu())
    assert sch.plan.slot_bytes == WIDE_SLOT[0]
    res = run_and_compare(qspec, 1, dense, steps=128, schedule=sch, bind=bind)
    del bind, dense
    _free()
    assert res.max_p < 5e-2
    assert res.flips <= 0.12 * 128


# ---------------------------------------------------------------- the layout, one step
LAYOUT_GROUP = 32


def _contrasted(spec, weights, symmetric, seed=5):
    """``weights`` with every (row, group of LAYOUT_GROUP columns) of the layer linears scaled by its own
    factor in [1/4, 4] and, for asymmetric codes, shifted by its own offset: scales and zero points then
    differ widely between neighbours, so any mix-up of them is an O(1) change of the weights."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    out = dict(weights)
    for name, (rows, cols) in _layer_linears(spec):
        g = cols // LAYOUT_GROUP
        f = torch.exp2(torch.rand(rows, g, 1, device="cuda", generator=gen) * 4 - 2)
        w = weights[name].float().view(rows, g, LAYOUT_GROUP) * f
        if not symmetric:
            std = w.std(-1, keepdim=True)
            w = w + (torch.rand(rows, g, 1, device="cuda", generator=gen) * 2 - 1) * 2 * std
        out[name] = w.view(rows, cols).to(torch.bfloat16)
    return out


def _swap_nibbles(p, sz):
    return ((p >> 4) | (p << 4)).to(torch.uint8), sz


def _column_order(p, sz):
    """Codes stored in plain column order, not the mma fragment order (BLOCK_ORDER)."""
    codes = unpack_codes(p)
    out, k = codes.shape
    stored = codes.view(out, k // COLS_PER_BLOCK, COLS_PER_BLOCK)[..., BLOCK_ORDER.to(p.device)].reshape(out, k)
    return pack_codes(stored, 2 * p.shape[-1]), sz


def _unswizzled(p, sz):
    """Tile rows stored without the chunk swizzle (chunk c of every row at c)."""
    nblk, ntile, rows, half = p.shape
    sw = swizzle(2 * half).to(p.device)
    chunks = p.view(nblk, ntile, rows, half // 16, 16)
    return chunks[:, :, torch.arange(rows, device=p.device).view(-1, 1), sw].reshape(p.shape).contiguous(), sz


def _next_group_scale(p, sz):
    return p, sz.roll(1, dims=1)


def _next_row_scale(p, sz):
    return p, sz.roll(1, dims=2)


def _zero_ignored(p, sz):
    """Every zero point read as the symmetric midpoint (the high half of each word replaced by 136.0)."""
    mid = torch.tensor([136.0], dtype=torch.bfloat16).view(torch.int16).item() & 0xFFFF
    w = (sz.to(torch.int64) & 0xFFFF) | (mid << 16)
    return p, torch.where(w >= 1 << 31, w - (1 << 32), w).to(torch.int32)


WRONG = {"nibbles swapped": _swap_nibbles, "column order": _column_order, "unswizzled": _unswizzled,
         "next group's scale": _next_group_scale, "next row's scale": _next_row_scale}


def _dense_of(qspec, bind, dense, transform):
    """``dense`` with each layer linear dequantized from ``transform(packed, sz)``."""
    out = dict(dense)
    for name, _ in _layer_linears(qspec):
        p, sz = transform(bind[name], bind[name + SCALE_SUFFIX])
        out[name] = dequantize(p, sz, qspec.weight_group)
    return out


def _rel(a, b):
    return ((a - b).norm(dim=-1) / b.norm(dim=-1)).max().item()


@pytest.mark.parametrize("symmetric", [True, False])
def test_gemv_layout_one_step(symmetric):
    spec = _spec("tiny-llama")
    qspec, bind, dense = quantized(spec, _contrasted(spec, _weights(spec), symmetric), LAYOUT_GROUP, symmetric)
    # the wrong layouts really are other weights (else the test below could not tell them apart)
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
        """One reference step from the KV state the kernel's step started from."""
        r = ReferenceDecoder(qspec, weights, compute_dtype=torch.float32, gemv_input_dtype=torch.bfloat16)
        return r.decode(first.cuda(), pos, PagedKVCache(before.clone(), table.clone(), tpb))

    good = _rel(got, reference(dense))
    wrong = dict(WRONG, **({} if symmetric else {"zero point ignored": _zero_ignored}))
    bad = {what: _rel(got, reference(_dense_of(qspec, bind, dense, f))) for what, f in wrong.items()}
    print(f"layout, symmetric={symmetric}: rel err {good:.1e} vs the kernel layout; "
          + ", ".join(f"{k} {v:.2f}" for k, v in bad.items()))
    assert good < 1e-2
    for what, err in bad.items():
        assert err > 0.1, f"a kernel reading {what} would pass this test"
    del dec, cache
    _free()


# ---------------------------------------------------------------- the int4 benchmark baseline
@pytest.mark.parametrize("name,layers", [("tiny-llama", None), ("tiny-qwen2", None), ("llama-3.1-8b", 2)])
def test_int4_baseline_matches_dequantized_weights(name, layers):
    """tinygemm's packing (two codes a byte on CUDA) and scale/offset conversion: the int4 baseline's
    decode logits agree with the bf16 static-cache decoder on the dequantized weights to bf16 accuracy."""
    sys.path.insert(0, str(REPO))
    from benchmarks.baselines import StaticCacheDecoder, random_prompt
    from benchmarks.int4_baseline import to_tinygemm
    from benchmarks.w4a16_weights import w4a16_spec, w4a16_weights

    spec = _spec(name)
    if layers is not None:
        spec = dataclasses.replace(spec, num_layers=layers)
    qspec = w4a16_spec(spec, 128)
    w = w4a16_weights(qspec, "cuda")
    dense_dec = StaticCacheDecoder(qspec, w, 2, 64)
    int4_dec = StaticCacheDecoder(qspec, w, 2, 64)
    to_tinygemm(qspec, int4_dec, w.linears)
    prompt = random_prompt(qspec, 2, 33, torch.device("cuda"))
    with torch.no_grad():
        errs = [_rel(int4_dec.prefill(prompt[:, :32]).float(), dense_dec.prefill(prompt[:, :32]).float())]
        pos = torch.full((2,), 32, device="cuda")
        errs.append(_rel(int4_dec.decode_step(prompt[:, 32], pos).float(),
                         dense_dec.decode_step(prompt[:, 32], pos).float()))
    print(f"int4 baseline {name}: rel err vs dequantized bf16 prefill {errs[0]:.1e}, decode {errs[1]:.1e}")
    assert max(errs) < 3e-2
    del dense_dec, int4_dec, w
    _free()


def _prebuild() -> None:
    """Compile every kernel these tests use into the cubin cache (no GPU needed); see
    tests/test_megakernel_gpu.py's _prebuild."""
    import os

    from trtllm_mk.codegen import compile_cubin, generate_source
    from trtllm_mk.gpus import get_gpu
    from trtllm_mk.search import search
    gpu = get_gpu(os.environ.get("TRTLLM_MK_TEST_GPU", "H100-SXM"))

    def qspec(spec, group):
        return dataclasses.replace(spec, weight_bits=4, weight_group=group)

    cases = {}
    for n in TINY:
        spec = _spec(n)
        for g, _ in SCHEMES.values():
            group = min(per_channel_group(s[1]) for _, s in _layer_linears(spec)) if g == PER_CHANNEL else g
            for b in (1, 4):
                cases[(n, group, b)] = (qspec(spec, group), b, 5.0)
    cases[("tiny-llama", LAYOUT_GROUP, 2)] = (qspec(_spec("tiny-llama"), LAYOUT_GROUP), 2, 5.0)
    for n, layers in REAL.items():
        spec = _spec(n) if layers is None else dataclasses.replace(_spec(n), num_layers=layers)
        for b in (1, 4):
            cases[(n, 128, b)] = (qspec(spec, 128), b, 10.0)
    scheds = [search(spec, batch, gpu, context_len=256, budget_s=budget, seed=0)[0]
              for spec, batch, budget in cases.values()]
    scheds.append(_wide_slot_schedule(qspec(dataclasses.replace(_spec("llama-3.1-8b"), num_layers=2), 128), gpu))
    for sch in scheds:
        spec, batch = sch.spec, sch.batch
        src, _ = generate_source(sch, TPB, MAX_SEQ, use_bulk_copy=gpu.has_tma)
        path, _ = compile_cubin(src, gpu.nvcc_arch)
        print(spec.name, spec.num_layers, spec.weight_group, batch, path, flush=True)


if __name__ == "__main__":
    _prebuild()
