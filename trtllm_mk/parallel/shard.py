"""Split HF-named weights into each tensor-parallel rank's shard, and join shards back.

A rank's shard is a dict with the same HF names and the shapes of ``rank_spec(spec, tp)``: the tensors
its engine binds (``seam.LAYER_WEIGHTS`` names them per layer). Which slice goes where is
``layout.rank_layout``:

    q_proj (and its bias)       rows of the rank's query heads          column-parallel
    k_proj, v_proj (and biases) rows of the rank's KV heads (replicated when fewer than ranks)
    gate_proj, up_proj          rows of the rank's intermediate range   column-parallel
    o_proj                      columns of the rank's query heads       row-parallel: partial sums
    down_proj                   columns of the rank's intermediate range, likewise
    embed_tokens, lm_head       rows of the rank's vocabulary range     vocab-parallel
    every norm                  the whole tensor                        replicated

Shards are contiguous tensors; row slices share memory with the full tensor (no copy).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import ModelError
from ..model.spec import ModelSpec
from .layout import RankLayout, rank_layout, rank_spec

ROWS, COLS, REPLICATED = "rows", "cols", "replicated"


def _rule(name: str) -> tuple[str, str | None]:
    """(how the tensor splits, along which of the layout's ranges) for an HF tensor name."""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return ROWS, "vocab"
    if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
        return ROWS, "heads"
    if name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias",
                      "self_attn.v_proj.weight", "self_attn.v_proj.bias")):
        return ROWS, "kv_heads"
    if name.endswith("self_attn.o_proj.weight"):
        return COLS, "heads"
    if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
        return ROWS, "intermediate"
    if name.endswith("mlp.down_proj.weight"):
        return COLS, "intermediate"
    if name.endswith("norm.weight"):   # input/post-attention layernorms, the final norm, q_norm, k_norm
        return REPLICATED, None
    raise ModelError(f"tensor parallelism: no sharding rule for '{name}'")


def _span(spec: ModelSpec, lay: RankLayout, axis: str) -> tuple[int, int]:
    """The rank's range along ``axis`` in rows/columns of the tensor (heads count head_dim each)."""
    lo, hi = getattr(lay, axis)
    unit = spec.head_dim if axis in ("heads", "kv_heads") else 1
    return lo * unit, hi * unit


def shard_weights(spec: ModelSpec, weights: dict[str, torch.Tensor], tp: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s shard of ``weights`` (every tensor ``spec.expected_tensors()`` names), in the
    shapes of ``rank_spec(spec, tp)``."""
    lay = rank_layout(spec, tp, rank)
    out: dict[str, torch.Tensor] = {}
    for name in spec.expected_tensors():
        if name not in weights:
            raise ModelError(f"tensor parallelism: weights lack '{name}'")
        t = weights[name]
        how, axis = _rule(name)
        if how == REPLICATED:
            out[name] = t
            continue
        lo, hi = _span(spec, lay, axis)
        out[name] = (t[lo:hi] if how == ROWS else t[:, lo:hi]).contiguous()
    return out


def shard_all(spec: ModelSpec, weights: dict[str, torch.Tensor], tp: int) -> list[dict[str, torch.Tensor]]:
    """Every rank's shard, rank 0 first."""
    return [shard_weights(spec, weights, tp, r) for r in range(tp)]


def unshard_weights(spec: ModelSpec, shards: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The full weights back from every rank's shard (rank 0 first): the inverse of ``shard_all``.
    Copies that must agree (replicated norms, KV heads held by several ranks) are checked to be equal."""
    tp = len(shards)
    layouts = [rank_layout(spec, tp, r) for r in range(tp)]
    want = rank_spec(spec, tp).expected_tensors()
    out: dict[str, torch.Tensor] = {}
    for name in spec.expected_tensors():
        parts = [s[name] for s in shards]
        for r, p in enumerate(parts):
            if tuple(p.shape) != want[name]:
                raise ValueError(f"rank {r}: '{name}' has shape {tuple(p.shape)}, expected {want[name]}")
        how, axis = _rule(name)
        if how == REPLICATED:
            keep = parts[:1]
        else:
            # one part per distinct range, in order; the replicas of a range must match the first
            first: dict[tuple[int, int], torch.Tensor] = {}
            for lay, p in zip(layouts, parts):
                span = getattr(lay, axis)
                if span in first:
                    if not torch.equal(first[span], p):
                        raise ValueError(f"rank {lay.rank}: '{name}' differs from another rank's copy of {axis} {span}")
                else:
                    first[span] = p
            keep = [first[s] for s in sorted(first)]
        if how == REPLICATED:
            for r, p in enumerate(parts[1:], 1):
                if not torch.equal(parts[0], p):
                    raise ValueError(f"rank {r}: replicated '{name}' differs from rank 0's")
        out[name] = keep[0] if len(keep) == 1 else torch.cat(keep, dim=0 if how == ROWS else 1)
    return out
