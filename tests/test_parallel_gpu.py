"""Tensor-parallel megakernels on one GPU: ``tp`` rank kernels at once on disjoint shares of the SMs,
adding into each other's residual, signalling each other's events and exchanging LM-head maxima
(trtllm_mk/parallel/gpu_ranks.py). The same protocol runs between GPUs (scripts/tp_check.py under
torchrun); here it is checked for correctness, not speed.

Free-running tensor-parallel decode, then the emulated tensor-parallel decoder (parallel/emulate.py,
fp32 with the kernel's bf16 GEMV inputs) teacher-forced over the kernels' own tokens and KV caches,
as tests/test_megakernel_gpu.py does for one rank."""
from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

from trtllm_mk.codegen import compile_cubin, generate_source
from trtllm_mk.kv_cache import PagedKVCache
from trtllm_mk.model.rope import rope_inv_freq
from trtllm_mk.parallel import rank_spec, shard_all
from trtllm_mk.parallel.emulate import TensorParallelDecoder, cross_rank_argmax
from trtllm_mk.search.cached import cached_search

from test_megakernel_gpu import MAX_SEQ, TPB, _prompts, _spec, _weights

pytestmark = pytest.mark.gpu


def tp_schedule(spec, tp, batch, gpu, budget_s=5.0):
    """The schedule of one rank of ``spec`` over ``tp`` ranks sharing one GPU's SMs."""
    return cached_search(rank_spec(spec, tp), batch, gpu, 256, budget_s, num_sms=gpu.sm_count // tp)


def run_tp_and_compare(spec, tp, batch, steps, budget_s=5.0):
    """(relative logit errors per step, token flips) of ``tp`` rank kernels on this GPU against the
    emulated tensor-parallel decoder in the kernels' numerics."""
    from trtllm_mk.gpus import detect_gpu
    from trtllm_mk.parallel.gpu_ranks import RanksOnOneGpu
    from trtllm_mk.runtime.megakernel import MegakernelDecoder
    gpu = detect_gpu()
    sch = tp_schedule(spec, tp, batch, gpu, budget_s)
    src, layout = generate_source(sch, TPB, MAX_SEQ, use_bulk_copy=gpu.has_tma)
    cubin, _ = compile_cubin(src, gpu.nvcc_arch)
    weights = _weights(spec)
    emu = TensorParallelDecoder(spec, weights, tp, compute_dtype=torch.float32, gemv_input_dtype=torch.bfloat16)
    share = rank_spec(spec, tp)
    caches = [PagedKVCache.allocate(share, batch, MAX_SEQ, TPB, device="cuda", fill=1e4, seed=3) for _ in range(tp)]
    prompts = _prompts(spec, batch, torch.Generator().manual_seed(1))
    first = cross_rank_argmax(emu.prefill_shards(prompts, caches))
    pos = torch.tensor([len(p) for p in prompts], device="cuda")
    ranks = RanksOnOneGpu([MegakernelDecoder(sch, cubin, layout, shard, cache, rope_inv_freq(share), cooperative=False)
                           for shard, cache in zip(shard_all(spec, weights, tp), caches)])
    ranks.set_state(first, pos)
    tokens, logits = [first.cpu()], []
    for _ in range(steps):
        ranks.step()
        logits.append(ranks.logits.clone())
        toks = [t.cpu().long() for t in ranks.tokens]
        assert all(torch.equal(toks[0], t) for t in toks[1:]), f"the ranks chose different tokens: {toks}"
        tokens.append(toks[0])
    ranks.synchronize()
    ref_caches = [PagedKVCache(c.pool.clone(), c.block_table.clone(), c.tokens_per_block) for c in caches]
    errs, flips = [], 0
    for t in range(steps):
        for rc, c in zip(ref_caches, caches):
            rc.pool.copy_(c.pool)
        got = logits[t]
        assert torch.equal(got.argmax(-1).cpu(), tokens[t + 1]), f"step {t}: the token is not the argmax of the logits"
        want = emu.decode(tokens[t].cuda(), pos + t, ref_caches)
        errs.append(((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item())
        flips += int((want.argmax(-1).cpu() != tokens[t + 1]).sum())
    for d in ranks.decoders:
        assert torch.equal(d.buf.pos.cpu(), (pos + steps).int().cpu())
    errs.sort()
    print(f"{spec.name} tp{tp} b{batch}: {steps} steps; rel err median {errs[steps // 2]:.1e} max {errs[-1]:.1e}; "
          f"{flips} of {steps * batch} tokens differ")
    del ranks, emu, caches, ref_caches, weights
    gc.collect()
    torch.cuda.empty_cache()
    return errs, flips


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("batch", [1, 4])
def test_tiny_llama_ranks_on_one_gpu_match_the_emulation(tp, batch):
    errs, flips = run_tp_and_compare(_spec("tiny-llama"), tp, batch, steps=64)
    assert errs[len(errs) // 2] < 5e-3 and errs[-1] < 3e-2
    assert flips <= 0.05 * 64 * batch


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen2"])
def test_tiny_families_two_ranks_on_one_gpu(name):
    errs, flips = run_tp_and_compare(_spec(name), 2, 2, steps=64)
    assert errs[len(errs) // 2] < 5e-3 and errs[-1] < 3e-2
    assert flips <= 0.05 * 64 * 2


@pytest.mark.parametrize("batch", [1, 4])
def test_llama_1b_widths_two_ranks_on_one_gpu(batch):
    """Real widths (2048 hidden, 128k vocabulary split in two), four layers."""
    spec = dataclasses.replace(_spec("llama-3.2-1b"), num_layers=4)
    errs, flips = run_tp_and_compare(spec, 2, batch, steps=32, budget_s=10.0)
    assert errs[len(errs) // 2] < 1e-2 and errs[-1] < 5e-2
    assert flips <= 0.1 * 32 * batch


def _prebuild() -> None:
    """Compile these tests' kernels into the cubin cache on a machine without a GPU."""
    import os

    from trtllm_mk.gpus import get_gpu
    gpu = get_gpu(os.environ.get("TRTLLM_MK_TEST_GPU", "H100-SXM"))
    cases = [(_spec("tiny-llama"), tp, b, 5.0) for tp in (2, 4) for b in (1, 4)]
    cases += [(_spec(n), 2, 2, 5.0) for n in ("tiny-qwen3", "tiny-qwen2")]
    cases += [(dataclasses.replace(_spec("llama-3.2-1b"), num_layers=4), 2, b, 10.0) for b in (1, 4)]
    for spec, tp, batch, budget in cases:
        src, _ = generate_source(tp_schedule(spec, tp, batch, gpu, budget), TPB, MAX_SEQ, use_bulk_copy=gpu.has_tma)
        path, _ = compile_cubin(src, gpu.nvcc_arch)
        print(spec.name, f"tp{tp}", batch, path, flush=True)


if __name__ == "__main__":
    _prebuild()
