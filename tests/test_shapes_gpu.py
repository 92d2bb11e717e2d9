"""Model shapes and batch sizes no shipped config has, on the GPU against the reference decoder.

Users bring their own checkpoints: KV groups of 1 (multi-head attention), 3, 5 and 7 query heads,
head widths of 64, 96 and 256, hidden sizes that are multiples of 64 but not of 128 or 256, widths
with large odd factors (rows that stream in uneven pieces), a
single KV head, biased QKV projections, tied embeddings, large vocabularies, and batches of 1-8.
Each shape here runs two layers at its real widths through the searched schedule, teacher-forced as
in tests/test_megakernel_gpu.py (``run_and_compare``): typical steps agree with the kernel-numerics
reference to fp32 summation order, and token flips happen only in steps with a bf16 rounding event.
Prebuild the kernels on a CPU machine: ``TRTLLM_MK_CACHE=.cubin_cache python tests/test_shapes_gpu.py``.
"""
from __future__ import annotations

import dataclasses

import pytest

from trtllm_mk.model.spec import spec_from_hf_config

from test_megakernel_gpu import _decoder, _weights, check, run_and_compare

pytestmark = pytest.mark.gpu

LLAMA, QWEN2, QWEN3, MISTRAL = (["LlamaForCausalLM"], ["Qwen2ForCausalLM"], ["Qwen3ForCausalLM"],
                                ["MistralForCausalLM"])
# name: (HF config fields, batch); real widths of the models named, two layers
SHAPES = {
    # Qwen2.5-0.5B: hidden 896 (14 x 64), 7 q heads a KV group of width 64, QKV bias, tied 152k vocabulary
    "qwen2.5-0.5b": (dict(architectures=QWEN2, hidden_size=896, intermediate_size=4864, num_attention_heads=14,
                          num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6), 3),
    # Qwen2.5-7B: 7 q heads a group of width 128; at batch 4 its hidden 3584 leaves the RMSNorm staging a
    # ragged last vector per thread (smem.norm_staging_passes)
    "qwen2.5-7b": (dict(architectures=QWEN2, hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                        num_key_value_heads=4, vocab_size=152064, rope_theta=1e6), 4),
    # Qwen3-4B widths: hidden 2560 and intermediate 9728 (2^9 x 19) stream in uneven pieces whose last
    # is narrower (smem.slot_geometry) on every GEMV kind; tied 152k vocabulary, batch 5
    "qwen3-4b": (dict(architectures=QWEN3, hidden_size=2560, intermediate_size=9728, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                      rope_theta=1e6), 5),
    # multi-head attention (Llama-2 style): one q head a KV head
    "mha-2048": (dict(architectures=LLAMA, hidden_size=2048, intermediate_size=5504, num_attention_heads=16,
                      num_key_value_heads=16, vocab_size=32000, rope_theta=10000.0), 2),
    # Phi-3-mini widths: heads of 96, multi-head, batch 8
    "mha-hd96": (dict(architectures=LLAMA, hidden_size=3072, intermediate_size=8192, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32064, rope_theta=10000.0), 8),
    # 3 q heads a group (Mistral block), batch 1
    "mistral-g3": (dict(architectures=MISTRAL, hidden_size=3072, intermediate_size=8192, num_attention_heads=24,
                        num_key_value_heads=8, head_dim=128, vocab_size=32768, rope_theta=1e6), 1),
    # QK-norm with 5 q heads a group of width 64 (q width 2560 from hidden 1024), batch 6
    "qwen3-g5": (dict(architectures=QWEN3, hidden_size=1024, intermediate_size=3072, num_attention_heads=40,
                      num_key_value_heads=8, head_dim=64, vocab_size=4096, rope_theta=1e6, tie_word_embeddings=True), 6),
    # heads of 256 (Gemma-style widths in a Llama block)
    "llama-hd256": (dict(architectures=LLAMA, hidden_size=2048, intermediate_size=4096, num_attention_heads=8,
                         num_key_value_heads=4, head_dim=256, vocab_size=8192, rope_theta=10000.0), 4),
    # one KV head, hidden 320 (5 x 64), batch 7
    "tiny-one-kv-head": (dict(architectures=LLAMA, hidden_size=320, intermediate_size=576, num_attention_heads=5,
                              num_key_value_heads=1, head_dim=64, vocab_size=1000, rope_theta=10000.0), 7),
}
BUDGET_S = 5.0
# (shape, path): 4-bit weights in groups of 128 (hidden 896 and 3072: 7 and 24 groups a row; Qwen3-4B's
# 512-column tiles, 19 to an intermediate row, stream in uneven pieces), FP8 weights on the same shape,
# and the cp.async weight ring of GPUs without bulk copies (L20, A100), compiled for this GPU
PATHS = [("qwen2.5-0.5b", "w4a16"), ("mha-hd96", "w4a16"), ("qwen3-4b", "w4a16"), ("qwen3-4b", "fp8"),
         ("qwen2.5-7b", "cp.async")]


def shape_spec(name):
    cfg, _ = SHAPES[name]
    return spec_from_hf_config(dict(max_position_embeddings=4096, num_hidden_layers=2, **cfg), name)


@pytest.mark.parametrize("name", list(SHAPES))
def test_unshipped_shape_matches_reference(name):
    spec, batch = shape_spec(name), SHAPES[name][1]
    res = run_and_compare(spec, batch, _weights(spec), steps=64, budget_s=BUDGET_S)
    # two layers at real widths: as test_real_widths_one_layer_agree_exactly
    check(res, 1e-2, exact=5e-3)


@pytest.mark.parametrize("name,path", PATHS)
def test_unshipped_shape_on_other_weight_paths(name, path):
    spec, batch = shape_spec(name), SHAPES[name][1]
    w = _weights(spec)
    if path == "w4a16":
        from test_quant_gpu import quantized
        qspec, bind, dense = quantized(spec, w, 128, False)
        del w
        check(run_and_compare(qspec, batch, dense, steps=64, budget_s=BUDGET_S, bind=bind), 3e-2, exact=5e-3)
    elif path == "fp8":
        from test_fp8_gpu import quantized
        qspec, bind, dense = quantized(spec, w)
        del w
        check(run_and_compare(qspec, batch, dense, steps=64, budget_s=BUDGET_S, bind=bind), 3e-2, exact=5e-3)
    else:
        dec = _decoder(spec, batch, w, budget_s=BUDGET_S, use_bulk_copy=False)
        check(run_and_compare(spec, batch, w, steps=64, decoder=dec), 1e-2, exact=5e-3)


def _prebuild() -> None:
    """Compile every kernel these tests use into the cubin cache (no GPU needed)."""
    import os

    from trtllm_mk.codegen import compile_cubin, generate_source
    from trtllm_mk.gpus import get_gpu
    from trtllm_mk.search import search

    from test_megakernel_gpu import MAX_SEQ, TPB
    gpu = get_gpu(os.environ.get("TRTLLM_MK_TEST_GPU", "H100-SXM"))
    cases = [(name, shape_spec(name), gpu.has_tma) for name in SHAPES]
    for name, path in PATHS:
        spec = shape_spec(name)
        if path == "w4a16":
            cases.append((name, dataclasses.replace(spec, weight_bits=4, weight_group=128), gpu.has_tma))
        elif path == "fp8":
            from test_fp8_gpu import fp8
            cases.append((name, fp8(spec), gpu.has_tma))
        else:
            cases.append((name, spec, False))
    for name, spec, bulk in cases:
        sch, _ = search(spec, SHAPES[name][1], gpu, context_len=256, budget_s=BUDGET_S, seed=0)
        path, _ = compile_cubin(generate_source(sch, TPB, MAX_SEQ, use_bulk_copy=bulk)[0], gpu.nvcc_arch)
        print(name, spec.weight_bits, "bulk" if bulk else "cp.async", path, flush=True)


if __name__ == "__main__":
    _prebuild()
