"""Tensor-parallel decode steps on the CPU: every rank's schedule run by the CPU executor, with the
cross-rank writes of the megakernel (graph.builder's tensor-parallel note).

Each rank is a ``CpuExecutor`` over its weight shard and its own KV cache. The buffers the kernel's
ranks write into each other's memory (x, lm_val, lm_idx) are one tensor shared by every rank here: a
rank's OPROJ and DOWN add into it (the all-reduce), its EMBED writes the rows of its tokens, its
LM-head tiles fill its columns of lm_val / lm_idx. The ranks run the same schedule, so one event
machine drives them in lock step: each task runs on every rank before the next task starts, which
honours the cross-rank events (a task's cross-rank waits name the same task indices on every rank).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import ModelError
from ..executor import CpuExecutor
from ..kv_cache import PagedKVCache
from ..model.spec import ModelSpec
from ..schedule import Schedule
from .layout import rank_spec
from .shard import shard_all


class TensorParallelCpuExecutor:
    """Decode steps of ``spec`` over ``tp`` ranks, each running ``schedule`` (searched for the rank's
    share, ``rank_spec(spec, tp)``) on its shard of ``weights`` and its cache in ``caches``."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], tp: int, schedule: Schedule,
                 caches: Sequence[PagedKVCache], round_activations: bool = True):
        share = rank_spec(spec, tp)
        if schedule.spec.tensor_parallel != tp:
            raise ModelError(f"the schedule is for tensor_parallel {schedule.spec.tensor_parallel}, not {tp}")
        if len(caches) != tp:
            raise ValueError(f"{len(caches)} KV caches for {tp} ranks")
        self.tp = tp
        self.ranks = [CpuExecutor(share, shard, schedule, cache, validate=(r == 0), round_activations=round_activations)
                      for r, (shard, cache) in enumerate(zip(shard_all(spec, weights, tp), caches))]
        first = self.ranks[0]
        for r, ex in enumerate(self.ranks):
            ex.rank = r
            ex.x, ex.lm_val, ex.lm_idx = first.x, first.lm_val, first.lm_idx   # every rank's memory of them

    @property
    def logprobs(self) -> torch.Tensor:   # never asked for: greedy only (set_sampling)
        return self.ranks[0].logprobs

    @property
    def top_ids(self) -> torch.Tensor:
        return self.ranks[0].top_ids

    def set_sampling(self, row: int, params) -> None:
        if params is not None and not params.plain_greedy:
            raise ModelError("tensor parallelism decodes greedily: sampling and log-probabilities need every "
                             "rank's logits")

    def step(self, tokens: torch.Tensor, pos: torch.Tensor, interleave: str = "round_robin",
             seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """One step on every rank. Returns (logits [B, V]: the ranks' shards side by side, next tokens
        [B]: every rank's, which must agree)."""
        tokens = torch.as_tensor(tokens).to(torch.int32).reshape(-1)
        pos = torch.as_tensor(pos).to(torch.int32).reshape(-1)
        for ex in self.ranks:
            ex.tokens.copy_(tokens)
            ex.pos.copy_(pos)

        def every_rank(task, layer):
            for ex in self.ranks:
                ex._execute(task, layer)

        self.ranks[0].machine.run(every_rank, interleave, seed)
        toks = [ex.tokens.clone() for ex in self.ranks]
        if any(not torch.equal(toks[0], t) for t in toks[1:]):
            raise AssertionError(f"ranks chose different tokens: {[t.tolist() for t in toks]}")
        return torch.cat([ex.logits for ex in self.ranks], -1).clone(), toks[0]
