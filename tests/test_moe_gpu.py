"""The megakernel's expert kinds on the GPU (ROUTER, ROUTE, EGATEUP, EDOWN: data-dependent expert
weights streamed after the in-kernel routing), against the reference decoder as for dense models
(tests/test_megakernel_gpu.py ``run_and_compare``: free-running decode, then teacher-forced references
over the kernel's own tokens and KV cache, noise-filled KV padding, 128 steps)."""
from __future__ import annotations

import dataclasses

import pytest

from test_megakernel_gpu import _weights, check, run_and_compare
from trtllm_mk.model.registry import resolve_model
from trtllm_mk.model.spec import spec_from_hf_config
from trtllm_mk.model.tiny import tiny_config

pytestmark = pytest.mark.gpu


def tiny_moe(family):
    spec = spec_from_hf_config(dict(tiny_config(family), max_position_embeddings=4096), name=f"tiny-{family}")
    return dataclasses.replace(spec, mlp_only_layers=())


def moe_weights(spec):
    """``_weights`` (GPT-2's residual scaling of o_proj / down_proj) with Mixtral's w2 scaled too."""
    w = _weights(spec)
    scale = (2 * spec.num_layers) ** -0.5
    for name, t in w.items():
        if name.endswith(".w2.weight"):
            t.mul_(scale)
    return w


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_tiny_moe_models_match_reference(family, batch):
    spec = tiny_moe(family)
    check(run_and_compare(spec, batch, moe_weights(spec), steps=128), 3e-2)


@pytest.mark.parametrize("batch", [1, 4])
def test_qwen3_30b_a3b_widths_match_reference(batch):
    """Real widths (128 experts of 768, 8 per token, hidden 2048), four layers."""
    spec = dataclasses.replace(resolve_model("qwen3-30b-a3b").spec, num_layers=4)
    res = run_and_compare(spec, batch, moe_weights(spec), steps=64, budget_s=10.0)
    assert res.max_p < 5e-2
    assert res.flips <= 0.12 * 64 * batch


def _prebuild() -> None:
    """Compile these tests' kernels into the cubin cache on a machine without a GPU."""
    import os

    from test_megakernel_gpu import MAX_SEQ, TPB
    from trtllm_mk.codegen import compile_cubin, generate_source
    from trtllm_mk.gpus import get_gpu
    from trtllm_mk.search import search
    gpu = get_gpu(os.environ.get("TRTLLM_MK_TEST_GPU", "H100-SXM"))
    cases = [(tiny_moe(f), b, 5.0) for f in ("qwen3_moe", "mixtral") for b in (1, 4)]
    cases += [(dataclasses.replace(resolve_model("qwen3-30b-a3b").spec, num_layers=4), b, 10.0) for b in (1, 4)]
    for spec, batch, budget in cases:
        sch, _ = search(spec, batch, gpu, context_len=256, budget_s=budget, seed=0)
        src, _ = generate_source(sch, TPB, MAX_SEQ, use_bulk_copy=gpu.has_tma)
        path, _ = compile_cubin(src, gpu.nvcc_arch)
        print(spec.name, batch, path, flush=True)


if __name__ == "__main__":
    _prebuild()
