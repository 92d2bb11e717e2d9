"""CPU emulation of tensor-parallel decoding: ``tp`` ranks in one process, in lock step.

Each rank is the shared decoder (``model.decoder_block.Decoder``) built over its shard
(``shard.shard_weights``): the model ``layout.rank_spec`` describes, with its own paged KV cache
holding only its KV heads. Where the ranks communicate, this module does it explicitly:

* the embedding: each rank looks up the tokens of its vocabulary range (zeros elsewhere) and the
  rows are all-reduced; exactly one rank contributes each token, so the sum is exact;
* after o_proj and after down_proj of every layer: each rank's output is a partial sum over its
  heads or intermediate range, and the all-reduce (``all_reduce``) adds the ranks' partials before
  the residual add; every rank then holds the same residual;
* the next token: a cross-rank argmax over the vocabulary shards (``cross_rank_argmax``).

Reduction order. Floating-point addition is not associative, so the sum of the partials must be
taken in one fixed order for the result to be reproducible: ``all_reduce(..., "ordered")`` adds in
fp32 from rank 0 to rank tp-1, ``((p0 + p1) + p2) + ...``, and a device all-reduce that adds fp32
partials must use that same order on every rank (one-shot: each rank reads all partials and sums
them in rank order; two-shot: each rank reduces its slice in rank order, then the slices are
gathered) to give these bits. The megakernel's residual is fixed point (``trtllm_mk/residual.py``):
``all_reduce(..., "fixed")`` converts each partial to fixed point and adds integers, which gives the
same bits in any order, so a device all-reduce of fixed-point partials needs no agreed order.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F

from ..kinds.argmax import NonFiniteLogits
from ..kv_cache import PagedKVCache
from ..model.decoder_block import Decoder, check_weights, rms_norm
from ..model.rope import rope_cos_sin, rope_inv_freq
from ..model.spec import ModelSpec
from ..reference import paged_attention, prompt_inputs
from ..residual import from_fixed, to_fixed
from .layout import rank_layout, rank_spec
from .shard import shard_all

REDUCTIONS = ("ordered", "fixed")


def all_reduce(partials: Sequence[torch.Tensor], mode: str = "ordered") -> torch.Tensor:
    """The sum of the ranks' ``partials`` (rank 0 first), in their dtype.

    ``ordered``: accumulated in fp32 in rank order, then rounded once to the partials' dtype.
    ``fixed``: each partial rounded to the residual's fixed point, summed as integers (any order gives
    the same bits), converted back. One partial is returned unchanged in either mode."""
    if mode not in REDUCTIONS:
        raise ValueError(f"all_reduce mode {mode!r}; choose one of {', '.join(REDUCTIONS)}")
    if len(partials) == 1:
        return partials[0]
    dtype = partials[0].dtype
    if mode == "fixed":
        total = to_fixed(partials[0].float())
        for p in partials[1:]:
            total = total + to_fixed(p.float())
        return from_fixed(total).to(dtype)
    acc = partials[0].float()
    for p in partials[1:]:
        acc = acc + p.float()
    return acc.to(dtype)


def cross_rank_argmax(shard_logits: Sequence[torch.Tensor]) -> torch.Tensor:
    """Greedy next tokens ``[B]`` (global vocabulary ids) from each rank's logits ``[B, V/tp]``, rank 0
    holding the lowest ids. Each rank offers its maximum and the lowest local index holding it (NaN is
    never a candidate); the ranks' offers are compared in rank order and a later rank wins only with a
    strictly greater value, so ties go to the lowest global index, as a single-GPU argmax gives."""
    best_val = best_idx = None
    offset = 0
    for logits in shard_logits:
        vals = logits.float()
        vals = torch.where(vals.isnan(), float("-inf"), vals)
        v, i = vals.max(-1)                     # the first maximum along the row
        i = i + offset
        if best_val is None:
            best_val, best_idx = v, i
        else:
            take = v > best_val
            best_val, best_idx = torch.where(take, v, best_val), torch.where(take, i, best_idx)
        offset += logits.shape[-1]
    bad = (best_val == float("-inf")).nonzero().flatten().tolist()
    if bad:
        raise NonFiniteLogits(f"the logits of batch row {bad[0]} are all NaN or -inf on every rank")
    return best_idx


def embed_rows(ids: torch.Tensor, lay, decoder: Decoder) -> torch.Tensor:
    """Vocab-parallel embedding, one rank's part: its rows for the tokens in its range, zero elsewhere."""
    local = ids - lay.vocab[0]
    inside = (local >= 0) & (local < lay.vocab[1] - lay.vocab[0])
    e = F.embedding(local.clamp(0, lay.vocab[1] - lay.vocab[0] - 1), decoder.tok_embeddings)
    return torch.where(inside[..., None], e, torch.zeros((), dtype=e.dtype))


def rank_forward(spec: ModelSpec, decoders: Sequence[Decoder], layouts, ids: torch.Tensor, pos: torch.Tensor,
                 rows: torch.Tensor, caches: Sequence[PagedKVCache], inv_freq: torch.Tensor, dtype: torch.dtype,
                 stage, reduce) -> list[torch.Tensor]:
    """The forward pass of the ranks this process computes (``decoders``, with their ``layouts`` and
    ``caches``): tokens ``ids [N, T]`` at ``pos [N, T]`` of cache rows ``rows [N]``; each rank's fp32
    logits ``[N, V/tp]`` of each row's last token. ``reduce(parts, exact=False)`` sums these ranks'
    partial results with every other rank's (the emulation: all ranks are here; under
    torch.distributed: one rank here, the others in their processes)."""
    cos, sin = rope_cos_sin(pos, inv_freq, dtype)
    attention = [paged_attention(c, rows, pos, spec.sliding_window) for c in caches]
    x = reduce([embed_rows(ids, lay, m) for lay, m in zip(layouts, decoders)], exact=True)
    for i in range(spec.num_layers):
        blocks = [m.layers[i] for m in decoders]
        x = x + reduce([b.attention_delta(x, cos, sin, a, stage) for b, a in zip(blocks, attention)])
        x = x + reduce([b.mlp_delta(x, stage) for b in blocks])
    out = []
    for m in decoders:                     # the final norm is replicated: every rank's h is the same
        h = rms_norm(x[:, -1], m.norm, spec.rms_norm_eps)
        if stage is not None:
            h = stage(h)
        out.append(F.linear(h, m.output).float())
    return out


class TensorParallelDecoder:
    """Greedy prefill/decode of ``spec`` over ``tp`` emulated ranks; the interface of
    ``reference.ReferenceDecoder`` (logits are the ranks' shards concatenated, fp32), with one
    ``PagedKVCache`` per rank (``allocate_caches``)."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], tp: int,
                 compute_dtype: torch.dtype | None = None, gemv_input_dtype: torch.dtype | None = None,
                 reduction: str = "ordered"):
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction {reduction!r}; choose one of {', '.join(REDUCTIONS)}")
        check_weights(spec, weights)
        self.spec, self.tp, self.reduction = spec, tp, reduction
        self.rank_spec = rank_spec(spec, tp)
        self.layouts = [rank_layout(spec, tp, r) for r in range(tp)]
        # each rank's decoder checks its shard against the rank's spec: the tensors its engine binds
        self.ranks = [Decoder(self.rank_spec, shard, compute_dtype) for shard in shard_all(spec, weights, tp)]
        self.dtype = self.ranks[0].dtype
        self.device = self.ranks[0].tok_embeddings.device
        self.inv_freq = rope_inv_freq(spec).to(self.device)
        self.gemv_input_dtype = gemv_input_dtype

    def allocate_caches(self, batch: int, max_seq_len: int, dtype: torch.dtype | None = None,
                        **kwargs) -> list[PagedKVCache]:
        """One paged KV cache per rank, each holding that rank's KV heads (same block table: same seed)."""
        return [PagedKVCache.allocate(self.rank_spec, batch, max_seq_len, dtype=dtype or self.dtype,
                                      device=self.device, **kwargs) for _ in range(self.tp)]

    def _stage(self, x: torch.Tensor) -> torch.Tensor:
        g = self.gemv_input_dtype
        return x if g == x.dtype else x.to(g).to(x.dtype)

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor,
                 caches: Sequence[PagedKVCache]) -> list[torch.Tensor]:
        """Tokens ``ids [N, T]`` at ``pos [N, T]`` of cache rows ``rows [N]``: every rank's fp32 logits
        ``[N, V/tp]`` of each row's last token."""
        if len(caches) != self.tp:
            raise ValueError(f"{len(caches)} KV caches for {self.tp} ranks")

        def reduce(parts, exact=False):   # exact: one non-zero contribution per element
            return all_reduce(parts, "ordered" if exact else self.reduction)
        stage = None if self.gemv_input_dtype is None else self._stage
        return rank_forward(self.spec, self.ranks, self.layouts, ids, pos, rows, caches, self.inv_freq, self.dtype,
                            stage, reduce)

    # -- public API ------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill_shards(self, prompts: Sequence[Sequence[int]], caches: Sequence[PagedKVCache]) -> list[torch.Tensor]:
        """Prompt b into cache row b of every rank; each rank's logits ``[B, V/tp]`` of the last tokens."""
        per_prompt = [self._forward(ids, pos, rows, caches) for ids, pos, rows in prompt_inputs(prompts, self.device)]
        return [torch.cat([p[r] for p in per_prompt]) for r in range(self.tp)]

    @torch.inference_mode()
    def decode_shards(self, tokens: torch.Tensor, pos: torch.Tensor,
                      caches: Sequence[PagedKVCache]) -> list[torch.Tensor]:
        """One step for a batch (token b at position pos[b] of cache row b); each rank's logits."""
        tokens = torch.as_tensor(tokens, device=self.device).long().reshape(-1)
        pos = torch.as_tensor(pos, device=self.device).long().reshape(-1)
        rows = torch.arange(tokens.shape[0], device=self.device)
        return self._forward(tokens[:, None], pos[:, None], rows, caches)

    def prefill(self, prompts: Sequence[Sequence[int]], caches: Sequence[PagedKVCache]) -> torch.Tensor:
        """fp32 logits ``[B, V]``: the ranks' shards side by side."""
        return torch.cat(self.prefill_shards(prompts, caches), -1)

    def decode(self, tokens: torch.Tensor, pos: torch.Tensor, caches: Sequence[PagedKVCache]) -> torch.Tensor:
        return torch.cat(self.decode_shards(tokens, pos, caches), -1)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 caches: Sequence[PagedKVCache] | None = None, eos_ids: Iterable[int] = ()) -> list[list[int]]:
        """Greedy generation with the cross-rank argmax; the new tokens of each prompt, cut after the
        first in ``eos_ids`` (as ``ReferenceDecoder.generate``)."""
        longest = max(len(p) for p in prompts) + max_new_tokens
        if caches is None:
            caches = self.allocate_caches(len(prompts), longest)
        stop = set(eos_ids)
        pos = torch.tensor([len(p) for p in prompts], device=self.device)
        done = torch.zeros(len(prompts), dtype=torch.bool)
        steps = []
        shards = self.prefill_shards(prompts, caches)
        for t in range(max_new_tokens):
            tok = cross_rank_argmax(shards)
            steps.append(tok)
            done |= torch.tensor([int(k) in stop for k in tok.tolist()])
            if stop and bool(done.all()):
                break
            if t + 1 < max_new_tokens:
                shards = self.decode_shards(tok, pos + t, caches)
        out = []
        for seq in torch.stack(steps, 1).tolist():
            cut = next((j + 1 for j, tk in enumerate(seq) if tk in stop), len(seq))
            out.append(seq[:cut])
        return out
