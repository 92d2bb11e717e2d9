"""The fixed-point residual: any order of K-split partial sums gives the same bits."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trtllm_mk.residual import FRAC_BITS, from_fixed, to_fixed


def _accumulate(base: torch.Tensor, parts: list[torch.Tensor], order: list[int], fixed: bool) -> torch.Tensor:
    if fixed:
        x = to_fixed(base)
        for i in order:
            x = x + to_fixed(parts[i])
        return from_fixed(x)
    x = base.clone()
    for i in order:
        x = x + parts[i]
    return x


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), chunks=st.integers(2, 8), scale=st.sampled_from([1e-3, 1.0, 50.0]))
def test_every_order_gives_the_same_bits(seed, chunks, scale):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(512, generator=g) * scale
    parts = [torch.randn(512, generator=g) * scale for _ in range(chunks)]
    ref = _accumulate(base, parts, list(range(chunks)), fixed=True)
    perm = torch.randperm(chunks, generator=g).tolist()
    assert torch.equal(_accumulate(base, parts, perm, fixed=True), ref)
    assert torch.equal(_accumulate(base, parts, perm[::-1], fixed=True), ref)


def test_fp32_accumulation_is_order_dependent():
    """Why the residual is fixed point: the same adds in fp32 give other bits in another order."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4096, generator=g)
    parts = [torch.randn(4096, generator=g) for _ in range(8)]
    assert not torch.equal(_accumulate(base, parts, list(range(8)), False),
                           _accumulate(base, parts, list(range(8))[::-1], False))


def test_conversions_round_to_nearest_even_and_keep_fp32_precision():
    half = 2.0 ** -(FRAC_BITS + 1)          # exactly half a unit: ties go to the even neighbour
    v = torch.tensor([half, 3 * half, -half, 1.0, -2.5, 1e-3, 1234.5678], dtype=torch.float32)
    assert to_fixed(v)[:4].tolist() == [0, 2, 0, 2 ** FRAC_BITS]
    back = from_fixed(to_fixed(v))
    assert torch.equal(back[3:5], v[3:5])   # values on the grid come back exactly
    assert ((back - v).abs() <= 2.0 ** -FRAC_BITS).all()
    big = torch.tensor([2.0 ** 30], dtype=torch.float32)
    assert torch.equal(from_fixed(to_fixed(big)), big)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), adds=st.integers(1, 40), first=st.integers(0, 2**10 - 1),
       scale=st.sampled_from([1e-3, 1.0, 3e4]))
def test_counted_words_keep_the_value_and_count_the_adds(seed, adds, first, scale):
    # the device's counted residual (mk_common.cuh): EMBED stores its count over the value, each add
    # puts one count and its value into the word in one 64-bit add; the values, negative ones
    # included, come back exactly and the count is EMBED's plus the adds, modulo the count's bits
    from trtllm_mk.residual import COUNT_BITS, VALUE_BITS, word_counts, word_values
    g = torch.Generator().manual_seed(seed)
    base, parts = torch.randn(256, generator=g) * scale, torch.randn(adds, 256, generator=g) * scale
    q0, qs = to_fixed(base), to_fixed(parts)
    words = (first << VALUE_BITS) + q0          # int64 arithmetic wraps as the device's unsigned words do
    for q in qs:
        words = words + (1 << VALUE_BITS) + q
    assert torch.equal(word_values(words, counted=True), q0 + qs.sum(0))
    assert (word_counts(words) == (first + adds) % 2 ** COUNT_BITS).all()
    assert torch.equal(word_values(q0, counted=False), q0)


def test_a_step_of_counts_fits_the_word():
    from trtllm_mk.residual import COUNT_BITS, counted_states, fits_counts
    # Llama-3.1-8B with 8-way OPROJ and 16-way DOWN splits: 1 + 32 x 24 counts of 1024
    assert counted_states(32, 24) == 769 and fits_counts(32, 24)
    assert not fits_counts(32, 32) and counted_states(31, 33) == 2 ** COUNT_BITS and not fits_counts(31, 33)
