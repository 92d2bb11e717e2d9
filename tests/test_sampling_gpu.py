"""Sampling inside the megakernel (device/mk_sampling.cuh) against trtllm_mk.sampling on the kernel's own
logits: each step's token, for greedy, tempered, top-k, top-p and top-k + top-p rows side by side in
one batch, and the log-probabilities; then a goodness-of-fit test of many seeded draws from one fixed
state against the reference distribution (HF's warpers on the same logits).

Exactness: the device's ``logf`` may differ from numpy's in the last bit, and a top-p row's
normalizer is summed in another order, so a token may differ only where two perturbed logits tie
within an ulp or the nucleus boundary lies within rounding; the test allows at most 1% such steps
on the top-p rows and none elsewhere.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from trtllm_mk.kv_cache import PagedKVCache
from trtllm_mk.sampling import SamplingParams, reference_probs, sample

pytestmark = pytest.mark.gpu

SPEC_CFG = dict(architectures=["LlamaForCausalLM"], hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                num_attention_heads=8, num_key_value_heads=2, head_dim=32, vocab_size=1000, rope_theta=10000.0,
                max_position_embeddings=4096)


def _decoder(batch, radix_only=0, shape=None):
    from trtllm_mk.gpus import detect_gpu
    from trtllm_mk.model.random_weights import random_weights
    from trtllm_mk.model.spec import spec_from_hf_config
    from trtllm_mk.codegen import Diagnostics
    from trtllm_mk.runtime.megakernel import build_decoder
    from trtllm_mk.search import search
    if shape is None:
        spec = spec_from_hf_config(SPEC_CFG, "tiny-sampling")
    else:   # a real shape's widths and vocabulary, one layer
        from trtllm_mk.model.registry import resolve_model
        spec = dataclasses.replace(resolve_model(shape).spec, num_layers=1)
    gpu = detect_gpu()
    w = random_weights(spec, device="cuda", seed=0)
    for name, t in w.items():   # logits spread over a few units, as a trained model's are
        if name in ("lm_head.weight", "model.embed_tokens.weight" if spec.tie_word_embeddings else ""):
            t.mul_(8.0 if shape is None else 3.0)
    schedule, _ = search(spec, batch, gpu, context_len=256, budget_s=3.0, seed=0)
    cache = PagedKVCache.allocate(spec, batch, 1024, 32, device="cuda", fill=0.5, seed=3)
    return spec, build_decoder(schedule, w, cache, gpu.nvcc_arch, gpu.has_tma,
                               diagnostics=Diagnostics(radix_only=radix_only))


ROWS = [SamplingParams(),                                                  # greedy
        SamplingParams(temperature=0.8, seed=11, logprobs=3),              # tempered, log-probabilities
        SamplingParams(temperature=1.0, top_k=20, seed=12),                # top-k
        SamplingParams(temperature=1.2, top_p=0.9, seed=2**40 + 13, logprobs=0),   # top-p, 64-bit seed
        SamplingParams(temperature=0.7, top_k=50, top_p=0.8, seed=14),     # both
        SamplingParams(logprobs=5)]                                        # greedy with top log-probabilities


@pytest.mark.parametrize("shape,radix_only", [(None, 0), (None, 1), ("llama-3.2-1b", 0), ("qwen3-8b", 1)])
def test_kernel_samples_as_the_reference_defines(shape, radix_only):
    """Both candidate searches (from the LM-head tiles' bin counts; radix passes over the logits), on a
    tiny vocabulary and on real ones (128k, 152k)."""
    batch = len(ROWS)
    spec, dec = _decoder(batch, radix_only, shape)
    for b, p in enumerate(ROWS):
        dec.set_sampling(b, p)
    tok = torch.randint(0, spec.vocab_size, (batch,))
    pos = torch.tensor([40 + 7 * b for b in range(batch)])
    dec.set_state(tok, pos)
    steps, near, total_p = (48 if shape is None else 16), 0, 0
    for t in range(steps):
        dec.step()
        dec.synchronize()
        logits = dec.logits.float().cpu()
        got = dec.tokens.cpu().tolist()
        lp, top = dec.buf.logprobs.cpu(), dec.buf.top_ids.cpu()
        for b, p in enumerate(ROWS):
            want = sample(logits[b], p, int(pos[b]) + t + 1)
            if p.top_p < 1:
                total_p += 1
                near += want.token != got[b]
            else:
                assert got[b] == want.token, f"step {t} row {b} ({p}): kernel {got[b]}, reference {want.token}"
            if p.logprobs is not None:
                ref = torch.log_softmax(logits[b], 0)
                assert abs(float(lp[b, 0]) - float(ref[got[b]])) < 2e-4
                for j, (i, v) in enumerate(want.top_logprobs or []):
                    assert int(top[b, j]) == i and abs(float(lp[b, 1 + j]) - v) < 2e-4
    assert near <= total_p // 100, f"{near} of {total_p} top-p tokens differ from the reference"


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.3), SamplingParams(temperature=1.0, top_k=8),
                                    SamplingParams(temperature=0.9, top_p=0.7)])
def test_draws_fit_the_reference_distribution(params):
    """2,000 draws, each from the same state with its own seed: Pearson's chi-square against the
    reference probabilities (bins with an expected count below 5 pooled)."""
    from scipy.stats import chisquare
    spec, dec = _decoder(1)
    tok, pos = torch.tensor([17]), torch.tensor([60])
    draws = 2000
    counts = torch.zeros(spec.vocab_size, dtype=torch.long)
    logits = None
    for i in range(draws):
        dec.set_sampling(0, SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                           seed=1000 + i))
        dec.set_state(tok, pos)   # the same position each draw: same KV writes, same logits
        dec.step()
        dec.synchronize()
        counts[int(dec.tokens[0])] += 1
        if logits is None:
            logits = dec.logits[0].float().cpu()
        else:
            assert torch.equal(dec.logits[0].float().cpu(), logits), "the state must repeat exactly"
    probs = reference_probs(logits, params)
    assert counts[probs == 0].sum() == 0, "a token outside the kept set was drawn"
    expected = probs * draws
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big].sum().double().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    if exp[-1] < 5:   # pool the remainder into the smallest kept bin
        obs, exp = obs[:-1], exp[:-1]
        obs[-1] += counts[~big].sum()
        exp[-1] += expected[~big].sum()
    stat, pval = chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item())
    print(f"{params}: {int(big.sum())} bins, chi2 {stat:.1f}, p {pval:.3f}")
    assert pval > 1e-3
