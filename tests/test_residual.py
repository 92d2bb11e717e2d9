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
