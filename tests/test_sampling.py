"""Sampling (trtllm_mk/sampling.py): the hash is the documented integer function, the same seed gives
the same draws, and many draws follow the reference softmax with temperature, top-k and top-p
(a chi-square goodness-of-fit test at a fixed significance level; the draws are deterministic, so
the test cannot flake)."""
import numpy as np
import pytest
import torch

from trtllm_mk.errors import UserError
from trtllm_mk.sampling import (CANDIDATES, SamplingParams, fmix32, gumbel_hash, gumbel_noise, reference_probs,
                                sample)

M = 0xFFFFFFFF


def fmix32_py(x: int) -> int:
    """MurmurHash3 fmix32 in plain Python integers (the specification the device code follows)."""
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & M
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & M
    x ^= x >> 16
    return x


def gumbel_hash_py(seed: int, n: int, i: int) -> int:
    lo, hi = seed & M, (seed >> 32) & M
    row = fmix32_py(fmix32_py(fmix32_py(lo ^ 0x9E3779B9) ^ hi) ^ n)
    return fmix32_py((fmix32_py(row ^ i) + 0x632BE5AB) & M)


def test_fmix32_known_values():
    # MurmurHash3's finalizer maps 0 to 0 and is a bijection; two published-style spot values.
    assert int(fmix32(0)) == 0
    for x in (1, 0xDEADBEEF, 123456789, M):
        assert int(fmix32(x)) == fmix32_py(x)


@pytest.mark.parametrize("seed,n", [(0, 0), (1, 7), (2**40 + 5, 1023), (2**64 - 1, 2**31)])
def test_vectorised_hash_matches_the_integer_specification(seed, n):
    idx = np.array([0, 1, 2, 511, 65535, 151935], dtype=np.uint32)
    got = gumbel_hash(seed, n, idx)
    assert [int(h) for h in got] == [gumbel_hash_py(seed, n, int(i)) for i in idx]


def test_noise_is_gumbel_distributed():
    g = gumbel_noise(3, 0, 200_000).double()
    # Gumbel(0, 1): mean = Euler-Mascheroni constant, variance = pi^2 / 6.
    assert abs(g.mean().item() - 0.5772) < 0.01
    assert abs(g.var().item() - np.pi ** 2 / 6) < 0.03
    assert torch.isfinite(g).all()


def test_temperature_zero_is_the_first_argmax():
    logits = torch.tensor([0.5, 2.0, -1.0, 2.0, 1.9])
    for seed in range(5):
        assert sample(logits, SamplingParams(temperature=0.0, seed=seed), n=seed).token == 1


def test_same_seed_same_tokens_other_seed_other_tokens():
    logits = torch.randn(512, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.0, seed=1234)
    a = [sample(logits, p, n).token for n in range(64)]
    b = [sample(logits, p, n).token for n in range(64)]
    c = [sample(logits, SamplingParams(temperature=1.0, seed=1235), n).token for n in range(64)]
    assert a == b
    assert a != c


def _chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    from scipy.stats import chisquare
    n = counts.sum()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "drew a token outside the kept set"
    expected = probs[keep] * n
    # Pool the rare tail so that every cell expects at least 5 draws (the chi-square approximation).
    order = np.argsort(expected)
    e, o = expected[order], counts[keep][order]
    small = np.cumsum(e) < 5
    if small.any():
        cut = int(small.sum()) + 1
        e = np.concatenate([[e[:cut].sum()], e[cut:]])
        o = np.concatenate([[o[:cut].sum()], o[cut:]])
    return chisquare(o, e).pvalue


LOGITS = torch.tensor([2.0, 1.5, 1.1, 0.7, 0.2, -0.3, -0.9, -1.6, 0.45, 1.3, -2.5, 0.05])


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=1.7),
    SamplingParams(temperature=1.0, top_k=4),
    SamplingParams(temperature=0.8, top_p=0.7),
    SamplingParams(temperature=1.3, top_k=6, top_p=0.85),
], ids=["T1", "T0.6", "T1.7", "k4", "p0.7", "k6p0.85"])
def test_draws_follow_the_reference_softmax(params):
    pytest.importorskip("scipy")
    draws = 20_000
    counts = np.zeros(LOGITS.numel(), dtype=np.int64)
    p = SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=99)
    for n in range(draws):
        counts[sample(LOGITS, p, n).token] += 1
    probs = reference_probs(LOGITS, params).numpy()
    assert _chi_square_p(counts, probs) > 1e-3
    # And the test can fail: the same draws are far from the untempered / unfiltered distribution.
    other = reference_probs(LOGITS, SamplingParams(temperature=params.temperature * 1.5 + 0.5))
    assert counts[other.numpy() == 0].sum() > 0 or _chi_square_p(counts, other.numpy()) < 1e-6


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0, -1.0])
    seen = {sample(logits, SamplingParams(temperature=5.0, top_k=2, seed=1), n).token for n in range(300)}
    assert seen == {1, 3}
    # softmax([3, 2, 1, 0, -1]) = .636 .234 .086 .032 .012: top_p 0.8 keeps 3 (crosses), 2 (0.87 > 0.8 after)
    seen = {sample(logits, SamplingParams(temperature=1.0, top_p=0.8, seed=2), n).token for n in range(300)}
    assert seen == {1, 3}
    seen = {sample(logits, SamplingParams(temperature=1.0, top_p=0.5, seed=2), n).token for n in range(50)}
    assert seen == {1}


@pytest.mark.parametrize("top_p", [1e-300, 1e-46, 1e-38, 1e-6])
def test_a_vanishing_top_p_keeps_the_first_candidate(top_p):
    # 1e-46 and below round to 0 in fp32; the kept set still holds the first candidate
    logits = torch.tensor([0.0, 3.0, 1.0, 3.0, -1.0])
    got = {sample(logits, SamplingParams(temperature=1.0, top_p=top_p, seed=3), n).token for n in range(40)}
    assert got == {1}


@pytest.mark.parametrize("temperature", [1e-46, 1e-40, 1e-20, 9e-6])
def test_a_temperature_below_the_threshold_is_greedy(temperature):
    # l / T overflows fp32 for such T (1e-40: every large logit would be inf, and the noise would pick among them)
    logits = torch.tensor([0.5, 2.0, -1.0, 1.99, 1.9]) * 100
    p = SamplingParams(temperature=temperature, top_k=3, seed=7)
    assert p.greedy and p.temperature == 0.0
    assert {sample(logits, p, n).token for n in range(20)} == {1}
    assert not SamplingParams(temperature=1e-5).greedy


def test_nucleus_larger_than_the_candidate_set_is_cut_there():
    flat = torch.zeros(4 * CANDIDATES)
    got = {sample(flat, SamplingParams(temperature=1.0, top_p=0.99, seed=5), n).token for n in range(2000)}
    assert max(got) < CANDIDATES   # ties by smaller index: the candidates are the first 256


def test_logprobs_are_the_model_log_softmax():
    logits = torch.tensor([1.0, 3.0, 2.0, 0.5, 2.9, -1.0, 2.95])
    c = sample(logits, SamplingParams(temperature=0.7, seed=4, logprobs=3), n=10)
    lp = torch.log_softmax(logits, 0)
    assert c.logprob == pytest.approx(float(lp[c.token]))
    assert [t for t, _ in c.top_logprobs] == [1, 6, 4]
    assert [v for _, v in c.top_logprobs] == pytest.approx([float(lp[i]) for i in (1, 6, 4)])
    assert sample(logits, SamplingParams(), 0).logprob is None
    assert sample(logits, SamplingParams(logprobs=0), 0).top_logprobs is None


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_k=CANDIDATES + 1), dict(top_p=0),
                                 dict(top_p=1.5), dict(logprobs=6), dict(temperature=float("nan"))])
def test_invalid_parameters_are_user_errors(bad):
    with pytest.raises(UserError):
        SamplingParams(**bad)
