"""Tensor parallelism over torch.distributed: one rank per process, as ``torchrun --nproc-per-node N``
starts them.

``join_ranks`` checks the launch against the engine (the world size must be its tensor_parallel_size)
and joins the process group (NCCL on GPUs, gloo on CPUs); ``RankPrefill`` is the prefill of one rank:
the shared decoder block over the rank's shard, the same forward as the emulation
(``emulate.rank_forward``) with the partial sums added over the process group.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from ..errors import UserError
from ..kv_cache import PagedKVCache
from ..model.decoder_block import Decoder
from ..model.rope import rope_inv_freq
from ..model.spec import ModelSpec
from ..reference import prompt_inputs
from .emulate import cross_rank_argmax, rank_forward
from .layout import rank_layout, rank_spec


def launched_world() -> tuple[int, int] | None:
    """(rank, world size) when this process was started by torchrun (its environment), else None."""
    if "WORLD_SIZE" not in os.environ:
        return None
    try:
        return int(os.environ.get("RANK", "0")), int(os.environ["WORLD_SIZE"])
    except ValueError:
        raise UserError(f"torchrun's RANK / WORLD_SIZE are not integers: {os.environ.get('RANK')!r}, "
                        f"{os.environ.get('WORLD_SIZE')!r}") from None


def join_ranks(tp: int, what: str, backend: str | None = None):
    """(rank, process group) of this process among the ``tp`` ranks ``what`` needs (a one-line
    UserError when the launch does not match). Sets this rank's GPU from LOCAL_RANK under NCCL."""
    import torch.distributed as dist
    world = launched_world()
    launch = f"torchrun --nproc-per-node {tp} -m trtllm_mk ..."
    if world is None:
        raise UserError(f"{what} runs on {tp} GPUs (tensor_parallel_size {tp}): launch it with {launch}")
    rank, size = world
    if size != tp:
        raise UserError(f"{what} runs on {tp} GPUs (tensor_parallel_size {tp}) but torchrun started {size} "
                        f"processes: launch it with {launch}")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank))
        if local >= torch.cuda.device_count():
            raise UserError(f"rank {rank} wants GPU {local} but this host shows {torch.cuda.device_count()} GPUs")
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        kw = {"device_id": torch.device("cuda", torch.cuda.current_device())} if backend == "nccl" else {}
        dist.init_process_group(backend, **kw)
    return dist.get_rank(), dist.group.WORLD


class RankPrefill:
    """Prefill of rank ``rank`` of ``spec`` over ``tp`` processes: prompts into this rank's KV cache (its
    KV heads), the whole vocabulary's logits (gathered) on every rank."""

    def __init__(self, spec: ModelSpec, shard: dict[str, torch.Tensor], tp: int, rank: int, group=None,
                 compute_dtype: torch.dtype | None = None):
        self.spec, self.tp, self.rank, self.group = spec, tp, rank, group
        self.layout = rank_layout(spec, tp, rank)
        self.decoder = Decoder(rank_spec(spec, tp), shard, compute_dtype)
        self.dtype = self.decoder.dtype
        self.device = self.decoder.tok_embeddings.device
        self.inv_freq = rope_inv_freq(spec).to(self.device)

    def _sum(self, parts: Sequence[torch.Tensor], exact: bool = False) -> torch.Tensor:
        """This rank's partial result added to every other rank's (in fp32, rounded once)."""
        import torch.distributed as dist
        (part,) = parts
        total = part.float()
        dist.all_reduce(total, group=self.group)
        return total.to(part.dtype)

    def _gather(self, local: torch.Tensor) -> list[torch.Tensor]:
        import torch.distributed as dist
        out = [torch.empty_like(local) for _ in range(self.tp)]
        dist.all_gather(out, local.contiguous(), group=self.group)
        return out

    @torch.inference_mode()
    def prefill(self, prompts: Sequence[Sequence[int]], cache: PagedKVCache) -> torch.Tensor:
        """Prompt b into cache row b of this rank's cache; fp32 logits ``[B, V]`` of the last tokens (the
        ranks' vocabulary shards side by side). Collective: every rank calls it with the same prompts."""
        shards = [rank_forward(self.spec, [self.decoder], [self.layout], ids, pos, rows, [cache], self.inv_freq,
                               self.dtype, None, self._sum)[0] for ids, pos, rows in prompt_inputs(prompts, self.device)]
        return torch.cat(self._gather(torch.cat(shards)), -1)

    def first_tokens(self, prompts: Sequence[Sequence[int]], cache: PagedKVCache) -> torch.Tensor:
        """The greedy first token of each prompt (the cross-rank argmax), the same on every rank."""
        logits = self.prefill(prompts, cache)
        return cross_rank_argmax([logits.chunk(self.tp, -1)[r] for r in range(self.tp)])
