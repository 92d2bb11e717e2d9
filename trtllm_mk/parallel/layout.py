"""Which part of the model each tensor-parallel rank holds, and the ModelSpec of that part.

Megatron-style tensor parallelism over ``tp`` ranks, with TensorRT-LLM's choices:

* attention: query heads are split evenly, rank r holding heads ``[r*nh/tp, (r+1)*nh/tp)``; KV
  heads likewise when there are at least ``tp`` of them. With fewer KV heads than ranks each KV head
  is *replicated* on ``tp / nkv`` consecutive ranks (TensorRT-LLM's rule: rank r holds KV head
  ``r // (tp / nkv)``), which keeps every rank's query heads inside one GQA group; ``tp`` must then
  be a multiple of ``nkv``. Each rank's KV cache holds only its own KV heads.
* MLP: gate and up rows (column-parallel) and down_proj's columns (row-parallel) split into equal
  ranges of the intermediate dimension; o_proj's columns follow the rank's query heads.
* vocabulary: the LM head's rows, and the embedding's (TensorRT-LLM's ``use_parallel_embedding``
  with ``embedding_sharding_dim=0``), split into equal ranges of the vocabulary. A tied model stays
  tied: its one vocabulary shard is both. The vocabulary is not padded: it must divide by ``tp``.
  Splitting the embedding costs one more exchange per step (``batch x hidden`` values, exact: one
  rank holds each token's row); replicating it instead (TensorRT-LLM's default) would avoid that at
  ``vocab x hidden`` bf16 values more per GPU, and a rank would no longer be a model of its own.
* norms (input, post-attention, final, Qwen3's q/k norms) and RoPE are replicated.

So a rank computes exactly a smaller model of the same family, ``rank_spec(spec, tp)``: every shard
has the shape that spec's ``expected_tensors()`` names, which is what the rank's engine binds.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import ModelError
from ..model.spec import ModelSpec

TP_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True)
class RankLayout:
    """The ranges of heads, KV heads, intermediate units and vocabulary that rank ``rank`` of ``tp`` holds
    (half-open, in the full model's numbering)."""
    tp: int
    rank: int
    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    kv_replicas: int = 1   # ranks holding each KV head (more than 1: fewer KV heads than ranks)


def check_tensor_parallel(spec: ModelSpec, tp: int) -> None:
    """A ModelError naming the first dimension of ``spec`` that ``tp`` ranks cannot split."""
    if tp not in TP_SIZES:
        raise ModelError(f"tensor_parallel_size {tp!r} is not one of {', '.join(map(str, TP_SIZES))}")
    nh, nkv = spec.num_heads, spec.num_kv_heads
    if nh % tp:
        raise ModelError(f"{spec.name}: num_attention_heads={nh} does not divide by tensor_parallel_size {tp}")
    if nkv >= tp and nkv % tp:
        raise ModelError(f"{spec.name}: num_key_value_heads={nkv} does not divide by tensor_parallel_size {tp}")
    if nkv < tp and tp % nkv:
        raise ModelError(f"{spec.name}: num_key_value_heads={nkv} is fewer than tensor_parallel_size {tp} and does "
                         f"not divide it, so the KV heads cannot be replicated evenly (use a size that is a "
                         f"multiple or a divisor of {nkv})")
    if spec.intermediate_size % tp:
        raise ModelError(f"{spec.name}: intermediate_size={spec.intermediate_size} does not divide by "
                         f"tensor_parallel_size {tp}")
    if spec.vocab_size % tp:
        raise ModelError(f"{spec.name}: vocab_size={spec.vocab_size} does not divide by tensor_parallel_size {tp} "
                         f"(the vocabulary is split evenly, not padded)")


def rank_layout(spec: ModelSpec, tp: int, rank: int) -> RankLayout:
    """What rank ``rank`` of ``tp`` holds (``check_tensor_parallel`` first)."""
    check_tensor_parallel(spec, tp)
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} outside 0..{tp - 1}")
    nh_r, i_r, v_r = spec.num_heads // tp, spec.intermediate_size // tp, spec.vocab_size // tp
    nkv = spec.num_kv_heads
    if nkv >= tp:
        kv_r = nkv // tp
        kv = (rank * kv_r, (rank + 1) * kv_r)
    else:
        head = rank // (tp // nkv)
        kv = (head, head + 1)
    return RankLayout(tp=tp, rank=rank, heads=(rank * nh_r, (rank + 1) * nh_r), kv_heads=kv,
                      intermediate=(rank * i_r, (rank + 1) * i_r), vocab=(rank * v_r, (rank + 1) * v_r),
                      kv_replicas=max(1, tp // nkv))


def rank_spec(spec: ModelSpec, tp: int) -> ModelSpec:
    """The model one rank computes: ``spec`` with its heads, KV heads, intermediate size and vocabulary
    divided by ``tp`` (KV heads at least 1: replicated). The same for every rank."""
    check_tensor_parallel(spec, tp)
    if tp == 1:
        return spec
    return dataclasses.replace(
        spec, name=f"{spec.name}-tp{tp}", num_heads=spec.num_heads // tp,
        num_kv_heads=max(1, spec.num_kv_heads // tp), intermediate_size=spec.intermediate_size // tp,
        vocab_size=spec.vocab_size // tp, tensor_parallel=tp)
