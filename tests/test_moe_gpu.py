"""The megakernel's expert kinds on the GPU (ROUTER, ROUTE, EGATEUP, EDOWN, and EMLP under
TilePlan.expert_fused: data-dependent expert weights streamed after the in-kernel routing), against the
reference decoder as for dense models (tests/test_megakernel_gpu.py ``run_and_compare``: free-running
decode, then teacher-forced references over the kernel's own tokens and KV cache, noise-filled KV
padding, 128 steps). Every case runs the searched plan with the split expert kinds and the same plan
with fused expert tiles."""
from __future__ import annotations

import dataclasses
import os

import pytest

from test_megakernel_gpu import EXACT, _decoder, _weights, run_and_compare
from trtllm_mk.model.registry import resolve_model
from trtllm_mk.model.spec import spec_from_hf_config
from trtllm_mk.model.tiny import tiny_config

pytestmark = pytest.mark.gpu

# decode steps of the tiny tests (compute-sanitizer runs them with fewer: scripts/gpu_check.sh moe)
STEPS = int(os.environ.get("MK_MOE_TEST_STEPS", 128))
# MK_MOE_ALL_LANES_RELEASE=1: the tiny tests run the kernel whose every lane releases its ring reads, the
# variant compute-sanitizer's racecheck can follow (EMPTY_ARRIVALS in mk_kernel.cuh; gpu_check.sh moe)
ALL_LANES_RELEASE = os.environ.get("MK_MOE_ALL_LANES_RELEASE") == "1"


def diagnostics():
    from trtllm_mk.codegen import Diagnostics
    return Diagnostics(all_lanes_release=1) if ALL_LANES_RELEASE else None


def check_moe(res, max_err):
    """test_megakernel_gpu.check, with one allowance against the plain fp32 reference: its router input
    is fp32 where the kernel's is bf16, so two nearly tied experts can trade places there and move that
    step's logits by several percent. The kernel-numerics reference routes on the kernel's numerics:
    against it every step stays within max_err and typical steps agree to fp32 order."""
    assert res.median_k < EXACT, "typical steps must agree with the kernel-numerics reference to fp32 order"
    assert res.unexplained == 0, "tokens differ in a step whose rounding agrees with the reference"
    assert res.max_k < max_err
    assert res.max_p < 4 * max_err


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


def moe_schedule(spec, batch, budget_s, fused, gpu=None):
    """The searched schedule, or its plan with fused expert tiles (EMLP: tiles of whole 16-row k-steps)."""
    from test_megakernel_gpu import _gpu
    from trtllm_mk.search import schedule_plan, search
    gpu = gpu or _gpu()
    sch, _ = search(spec, batch, gpu, context_len=256, budget_s=budget_s, seed=0)
    if fused == sch.plan.expert_fused:
        return sch
    rows = -(-sch.plan.gateup_rows // 16) * 16 if fused else sch.plan.gateup_rows
    return schedule_plan(spec, batch, gpu, dataclasses.replace(sch.plan, expert_fused=fused, gateup_rows=rows),
                         context_len=256)


@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused"])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_tiny_moe_models_match_reference(family, batch, fused):
    spec = tiny_moe(family)
    w = moe_weights(spec)
    sch = moe_schedule(spec, batch, 5.0, fused)
    check_moe(run_and_compare(spec, batch, w, steps=STEPS,
                              decoder=_decoder(spec, batch, w, schedule=sch, diagnostics=diagnostics())), 3e-2)


@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused"])
@pytest.mark.parametrize("batch", [1, 4])
def test_tiny_moe_on_the_cp_async_ring(batch, fused):
    """The weight ring of sm_80 / sm_89 (16-byte cp.async copies), compiled for this GPU: the expert
    kinds' loaders on the path an A100 or L20 runs."""
    spec = tiny_moe("qwen3_moe")
    w = moe_weights(spec)
    sch = moe_schedule(spec, batch, 5.0, fused)
    check_moe(run_and_compare(spec, batch, w, steps=32, decoder=_decoder(spec, batch, w, schedule=sch, use_bulk_copy=False)),
              3e-2)


@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused"])
def test_tiny_moe_binds_the_engines_transposed_down_storage(fused):
    """The experts' down matrices stored transposed, as a fused engine stores them: the fused kernel
    streams that storage as it is, the split kernel from the decoder's row-major copy."""
    from trtllm_mk.model.decoder_block import share_fused_storage
    spec = tiny_moe("qwen3_moe")
    w = moe_weights(spec)
    bound = share_fused_storage(spec, w, transposed_down=True)
    sch = moe_schedule(spec, 4, 5.0, fused)
    check_moe(run_and_compare(spec, 4, w, steps=32, decoder=_decoder(spec, 4, bound, schedule=sch)), 3e-2)


@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused"])
@pytest.mark.parametrize("batch", [1, 4])
def test_qwen3_30b_a3b_widths_match_reference(batch, fused):
    """Real widths (128 experts of 768, 8 per token, hidden 2048), four layers."""
    spec = dataclasses.replace(resolve_model("qwen3-30b-a3b").spec, num_layers=4)
    res = run_and_compare(spec, batch, moe_weights(spec), steps=64, schedule=moe_schedule(spec, batch, 10.0, fused))
    assert res.max_p < 5e-2
    assert res.flips <= 0.12 * 64 * batch


def _prebuild() -> None:
    """Compile these tests' kernels into the cubin cache on a machine without a GPU."""
    import os

    from test_megakernel_gpu import MAX_SEQ, TPB
    from trtllm_mk.codegen import Diagnostics, compile_cubin, generate_source
    from trtllm_mk.gpus import get_gpu
    gpu = get_gpu(os.environ.get("TRTLLM_MK_TEST_GPU", "H100-SXM"))
    # the tiny kernels also as racecheck runs them (MK_MOE_ALL_LANES_RELEASE)
    both = (Diagnostics(), Diagnostics(all_lanes_release=1))
    cases = [(tiny_moe(f), b, 5.0, both) for f in ("qwen3_moe", "mixtral") for b in (1, 4)]
    cases += [(dataclasses.replace(resolve_model("qwen3-30b-a3b").spec, num_layers=4), b, 10.0, both[:1])
              for b in (1, 4)]
    for spec, batch, budget, diags in cases:
        for fused in (False, True):
            sch = moe_schedule(spec, batch, budget, fused, gpu)
            # the tiny Qwen3-MoE also on the cp.async ring (test_tiny_moe_on_the_cp_async_ring)
            rings = (gpu.has_tma, False) if spec.name == "tiny-qwen3_moe" and gpu.has_tma else (gpu.has_tma,)
            for bulk in rings:
                for diag in diags if bulk == gpu.has_tma else diags[:1]:
                    src, _ = generate_source(sch, TPB, MAX_SEQ, use_bulk_copy=bulk, diagnostics=diag)
                    path, _ = compile_cubin(src, gpu.nvcc_arch)
                    print(spec.name, batch, "fused" if fused else "split", "bulk" if bulk else "cp.async", path,
                          flush=True)


if __name__ == "__main__":
    _prebuild()
