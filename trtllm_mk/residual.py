"""The residual stream's number format: fixed point in an int64, shared by the kernel and the executor.

OPROJ and DOWN tasks split along K add their partial sums into the residual in whatever order their
SMs finish. Floating-point addition is not associative, so in fp32 the order shows in the low bits,
and through later bf16 roundings in the tokens: the same inputs would decode differently from run to
run. Integer addition is exact, so in fixed point every order gives the same bits. FRAC_BITS = 32
leaves 31 integer bits (|x| < 2^31, far beyond any hidden state) and a resolution of 2^-32, below
fp32's own step for every |x| above 2^-9.

Counted words. On one GPU a dense step's x can also carry its own readiness: each add puts one unit
into the word's top COUNT_BITS bits together with its value (one 64-bit add), EMBED stores the step's
first count, and a norm kind stages x once every word holds the count its layer expects (the events
resid_ready and oproj_done are then polled: graph.builder counted_residual). The value keeps the low
64 - COUNT_BITS bits, so a counted residual holds |x| < 2^(63 - COUNT_BITS - FRAC_BITS) = 2^21; a
larger value spills into the count, and the staging that waits for it reports a timed-out wait
instead of reading a wrong value. The counts of one step are ``states`` consecutive numbers (EMBED's
store and every add after it), and a step starts ``states`` past the previous one, so a word left
from the previous step never holds a count this step waits for.
"""
from __future__ import annotations

import torch

FRAC_BITS = 32
RESIDUAL_BYTES = 8   # bytes of one element in device memory: what a staging of x reads per element
COUNT_BITS = 10      # a counted residual word's count (module docstring)
VALUE_BITS = 64 - COUNT_BITS


def to_fixed(v: torch.Tensor) -> torch.Tensor:
    """fp32 values -> int64 residual units, rounded to nearest even (the device's __float2ll_rn of
    v * 2^FRAC_BITS, which is exact in fp32 before the rounding)."""
    return torch.round(v.to(torch.float64) * 2.0 ** FRAC_BITS).to(torch.int64)


def from_fixed(q: torch.Tensor) -> torch.Tensor:
    """int64 residual units -> fp32 (the device's __ll2float_rn(q) * 2^-FRAC_BITS)."""
    return q.to(torch.float32) * 2.0 ** -FRAC_BITS


def counted_states(layers: int, adds_per_layer: int) -> int:
    """The counts one step of a counted residual takes: EMBED's store, then every add of every layer."""
    return 1 + layers * adds_per_layer


def fits_counts(layers: int, adds_per_layer: int) -> bool:
    """Whether a step's counts are all distinct from each other and from the previous step's last."""
    return counted_states(layers, adds_per_layer) < 2 ** COUNT_BITS


def word_values(words: torch.Tensor, counted: bool) -> torch.Tensor:
    """Residual words as in device memory -> int64 residual units: a counted word's count (its top
    COUNT_BITS bits) dropped, the value's sign extended (the device's resid_value)."""
    if not counted:
        return words
    return (words << COUNT_BITS) >> COUNT_BITS


def word_counts(words: torch.Tensor) -> torch.Tensor:
    """The counts of counted residual words (the device's resid_count_of)."""
    return ((words + 2 ** (VALUE_BITS - 1)) >> VALUE_BITS) & (2 ** COUNT_BITS - 1)
