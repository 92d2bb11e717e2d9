"""Token sampling: temperature, top-k, top-p and a per-request seed, defined so that the megakernel
can compute the very same function on the device (integer hashing, one fixed candidate rule).

The function, for one sequence, its fp32 logits ``l[0..V)`` and the position ``n`` of the token being
chosen (the number of tokens before it in the sequence, prompt included):

1. ``temperature == 0``: greedy, the first index of the maximum logit (what the ARGMAX task returns).
   A temperature below ``MIN_TEMPERATURE`` (1e-5, vLLM's threshold) is greedy too: dividing fp32 logits
   by it could overflow, and the distribution it would draw from is the argmax's to within rounding.
2. Otherwise ``z = l / temperature`` (fp32). Each vocabulary entry gets Gumbel noise
   ``g[i] = -log(-log(u))`` with ``u = ((h >> 9) + 0.5) * 2**-23`` (exact in fp32, strictly inside
   (0, 1): 23 bits, as fp32 cannot hold 1 - 2**-25) and ``h = gumbel_hash(seed, n, i)`` (below).
   The chosen token is the first index of the maximum of ``z[i] + g[i]`` over the kept set.
   Gumbel-max draws exactly from the softmax of ``z`` restricted to the kept set, and the noise depends only on (seed, n, i): the same seed gives the
   same tokens whatever else is batched, whichever slot serves the request.
3. The kept set is the whole vocabulary when neither top-k nor top-p restricts it. Otherwise it is a
   prefix of the *candidate set*: the ``CANDIDATES`` (256) largest logits, ordered by logit
   descending, ties by smaller index. Top-k keeps the first ``min(top_k, CANDIDATES)``. Top-p then
   keeps candidate ``j`` when the probability mass of the candidates before it is below ``top_p``
   (the one that crosses the threshold is kept), probabilities being the softmax of ``z`` over the
   top-k set when top-k is given, over the whole vocabulary otherwise. This equals HF / vLLM /
   TensorRT-LLM top-k-then-top-p exactly whenever ``top_k <= 256`` and the nucleus fits in the 256
   candidates; when it does not (a nearly flat distribution with ``top_p`` close to 1) the nucleus is
   cut at 256 tokens. The prefix sums run in fp32 in candidate order. The first candidate is always
   kept; a ``top_p`` below ``MIN_TOP_P`` (1e-30, far below any first candidate's probability, which is
   at least 1 / vocabulary) is taken as ``MIN_TOP_P``, so that it keeps the first candidate alone in
   fp32 too, where it would round to 0.

``gumbel_hash`` uses 32-bit unsigned integer operations only (wrapping multiply, xor, shift), so a
CUDA implementation is bit-identical; ``fmix32`` is MurmurHash3's finalizer::

    fmix32(x):  x ^= x >> 16; x *= 0x85EBCA6B; x ^= x >> 13; x *= 0xC2B2AE35; x ^= x >> 16
    row  = fmix32(fmix32(fmix32(seed_lo ^ 0x9E3779B9) ^ seed_hi) ^ n)     # once per sequence and step
    h(i) = fmix32(fmix32(row ^ i) + 0x632BE5AB)

(``seed_lo``/``seed_hi``: the low and high 32 bits of the 64-bit seed.) Only the final fp32
``log`` of step 2 may differ from the device's ``logf`` in the last bit, which changes a choice only
when two perturbed logits tie to within one ulp.

Log-probabilities returned alongside are those of the model, ``log_softmax(l)`` at temperature 1
before any filtering (as OpenAI's API reports them): of the chosen token, and of the ``n`` most
likely tokens on request (``MAX_TOP_LOGPROBS`` at most).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .errors import UserError
from .seam import CANDIDATES, MAX_TOP_LOGPROBS  # shared with the kernel

__all__ = ["CANDIDATES", "MAX_TOP_LOGPROBS", "Choice", "SamplingParams", "sample", "with_logprobs"]

_M32 = 0xFFFFFFFF
MIN_TEMPERATURE = 1e-5   # below it sampling is greedy (module docstring, step 1)
MIN_TOP_P = 1e-30        # smaller top_p values keep the first candidate alone, as this one does (step 3)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0     # 0: greedy
    top_k: int = 0               # 0: no top-k
    top_p: float = 1.0           # 1: no top-p
    seed: int = 0                # 64-bit; the server draws one per request when the client gives none
    logprobs: int | None = None  # None: none; 0: the chosen token's; n: also the n most likely

    def __post_init__(self):
        if not (self.temperature >= 0 and np.isfinite(self.temperature)):
            raise UserError(f"temperature {self.temperature} must be a finite number >= 0")
        if not 0 <= self.top_k <= CANDIDATES:
            raise UserError(f"top_k {self.top_k} must be between 0 (off) and {CANDIDATES}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p {self.top_p} must be in (0, 1]")
        if self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)
        object.__setattr__(self, "top_p", max(float(self.top_p), MIN_TOP_P))
        if not -(1 << 63) <= self.seed < (1 << 64):   # a signed or unsigned 64-bit integer, never wrapped
            raise UserError(f"seed {self.seed} must fit in 64 bits")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise UserError(f"logprobs {self.logprobs} must be between 0 and {MAX_TOP_LOGPROBS}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def plain_greedy(self) -> bool:
        """Greedy without log-probabilities: the step's argmax alone decides (no sampling slot needed)."""
        return self.greedy and self.logprobs is None

    @property
    def filtered(self) -> bool:
        return self.top_k > 0 or self.top_p < 1


@dataclass
class Choice:
    token: int
    logprob: float | None = None                           # of the chosen token (model distribution)
    top_logprobs: list[tuple[int, float]] | None = None    # (token, logprob), most likely first


# ------------------------------------------------------------------------------------------ noise
def fmix32(x: np.ndarray | int) -> np.ndarray:
    """MurmurHash3's 32-bit finalizer on uint32 values (numpy's uint32 arithmetic wraps as CUDA's does)."""
    x = np.asarray(x, dtype=np.uint32)
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint32(16))
        x = x * np.uint32(0x85EBCA6B)
        x = x ^ (x >> np.uint32(13))
        x = x * np.uint32(0xC2B2AE35)
        x = x ^ (x >> np.uint32(16))
    return x


def _row_key(seed: int, n: int) -> np.uint32:
    seed &= (1 << 64) - 1
    lo, hi = np.uint32(seed & _M32), np.uint32(seed >> 32)
    return fmix32(fmix32(fmix32(lo ^ np.uint32(0x9E3779B9)) ^ hi) ^ np.uint32(n & _M32))


def gumbel_hash(seed: int, n: int, index: np.ndarray | int) -> np.ndarray:
    """The 32-bit hash of (seed, position n, vocabulary index) that drives the Gumbel noise."""
    row = _row_key(seed, n)
    with np.errstate(over="ignore"):
        return fmix32(fmix32(row ^ np.asarray(index, dtype=np.uint32)) + np.uint32(0x632BE5AB))


def gumbel_noise(seed: int, n: int, vocab: int) -> torch.Tensor:
    """fp32 Gumbel(0, 1) noise for indices 0..vocab-1 at position n."""
    h = gumbel_hash(seed, n, np.arange(vocab, dtype=np.uint32))
    u = ((h >> np.uint32(9)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0 ** -23)
    return torch.from_numpy(-np.log(-np.log(u)))


# ---------------------------------------------------------------------------------------- choices
def candidates(logits: torch.Tensor) -> torch.Tensor:
    """Indices of the CANDIDATES largest logits, by logit descending, ties by smaller index."""
    idx = torch.arange(logits.numel())
    # A stable sort on -logits keeps equal logits in index order.
    order = torch.sort(-logits, stable=True).indices
    return idx[order[:CANDIDATES]]


def kept_set(z: torch.Tensor, p: SamplingParams) -> torch.Tensor | None:
    """Indices the token is drawn from (None: the whole vocabulary); ``z`` are tempered logits."""
    if not p.filtered:
        return None
    cand = candidates(z)
    if p.top_k > 0:
        cand = cand[:p.top_k]
    if p.top_p < 1:
        norm = torch.logsumexp(z[cand] if p.top_k > 0 else z, 0)
        probs = torch.exp(z[cand] - norm)
        before = torch.cumsum(probs, 0) - probs     # mass of the candidates ahead of each one
        cand = cand[before < p.top_p]
    return cand


def sample(logits: torch.Tensor, p: SamplingParams, n: int) -> Choice:
    """Choose the token at position ``n`` from fp32 ``logits [V]`` (module docstring)."""
    logits = logits.float().reshape(-1)
    if p.greedy:
        token = int(torch.argmax(logits))   # the first index of the maximum
    else:
        z = logits / torch.tensor(p.temperature, dtype=torch.float32)
        g = gumbel_noise(p.seed, n, logits.numel())
        keep = kept_set(z, p)
        if keep is None:
            token = int(torch.argmax(z + g))
        else:
            # The kept set is in candidate order; the first maximum by index, as on the full vocabulary.
            scores = z[keep] + g[keep]
            best = scores.max()
            token = int(keep[scores == best].min())
    return with_logprobs(logits, token, p.logprobs)


def with_logprobs(logits: torch.Tensor, token: int, n_top: int | None) -> Choice:
    if n_top is None:
        return Choice(token)
    lp = torch.log_softmax(logits.float().reshape(-1), 0)
    top = None
    if n_top > 0:
        idx = candidates(logits.float().reshape(-1))[:n_top]
        top = [(int(i), float(lp[i])) for i in idx]
    return Choice(token, float(lp[token]), top)


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution ``sample`` draws from, written the way HF's logits warpers compute it
    (top-k mask, then top-p on the sorted softmax); tests compare draws against it."""
    z = logits.double() / p.temperature
    if p.top_k > 0:
        kth = torch.topk(z, p.top_k).values[-1]
        z = torch.where(z < kth, torch.tensor(float("-inf"), dtype=z.dtype), z)
    if p.top_p < 1:
        sz, si = torch.sort(z, descending=True, stable=True)
        probs = torch.softmax(sz, 0)
        ahead = torch.cumsum(probs, 0) - probs
        drop = si[ahead >= p.top_p]
        z[drop] = float("-inf")
    return torch.softmax(z, 0)
