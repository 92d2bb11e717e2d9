"""Tensor-parallel megakernels on GPUs: one kernel per rank, connected through each other's cross-rank
buffers (seam.PEER_FIELDS: the residual x, the event counters, the LM-head maxima).

* ``RanksOnOneGpu``: every rank in this process on one GPU, each kernel on its own stream and its own
  share of the SMs (a schedule searched for ``sm_count // tp`` SMs). The kernels run at once and talk
  through the same protocol as on several GPUs: a functional check of the cross-rank events and
  writes on a single GPU, not a speed measurement.
* ``connect_over_process_group``: one rank per process (``torchrun``), the cross-rank buffers in
  torch's symmetric memory, which maps every rank's buffer into every rank's address space.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import EngineError
from ..runtime.megakernel import MegakernelDecoder


def connect_on_one_gpu(decoders: Sequence[MegakernelDecoder]) -> None:
    """Give each decoder (rank r = its position) every rank's buffers: on one GPU, plain addresses."""
    peers = [d.peer_pointers() for d in decoders]
    for r, d in enumerate(decoders):
        d.connect(r, peers)


class RanksOnOneGpu:
    """Steps every rank's kernel at once, each on its own stream (decoders built with
    ``cooperative=False``: a cooperative launch would wait for the whole GPU)."""

    def __init__(self, decoders: Sequence[MegakernelDecoder]):
        devices = {d.device for d in decoders}
        if len(devices) != 1:
            raise EngineError(f"RanksOnOneGpu: the ranks are on {len(devices)} devices")
        sms = sum(d.layout.grid for d in decoders)
        have = torch.cuda.get_device_properties(decoders[0].device).multi_processor_count
        if sms > have:
            raise EngineError(f"the ranks' kernels need {sms} SMs together but the GPU has {have}: search each "
                              f"rank's schedule for at most {have // len(decoders)} SMs")
        self.decoders = list(decoders)
        connect_on_one_gpu(self.decoders)
        self.streams = [torch.cuda.Stream(self.decoders[0].device) for _ in self.decoders]

    def set_state(self, tokens: torch.Tensor, pos: torch.Tensor) -> None:
        for d in self.decoders:
            d.set_state(tokens, pos)

    def step(self) -> None:
        """One decode step of every rank (asynchronous; ordered after the current stream's work)."""
        cur = torch.cuda.current_stream(self.decoders[0].device)
        for d, s in zip(self.decoders, self.streams):
            s.wait_stream(cur)
            d.step(s)
        for s in self.streams:
            cur.wait_stream(s)

    def synchronize(self) -> None:
        for d in self.decoders:
            d.synchronize()

    @property
    def logits(self) -> torch.Tensor:
        """[B, V]: the ranks' vocabulary shards side by side."""
        return torch.cat([d.logits for d in self.decoders], -1)

    @property
    def tokens(self) -> list[torch.Tensor]:
        """Every rank's next tokens (they agree when the ranks do)."""
        return [d.tokens for d in self.decoders]


def symmetric_allocator(group):
    """A ``peer_alloc`` for MegakernelDecoder whose buffers live in torch's symmetric memory of
    ``group`` (torch.distributed): every rank's buffer is mapped into every rank's address space."""
    import torch.distributed._symmetric_memory as symm_mem

    device = torch.device("cuda", torch.cuda.current_device())

    def alloc(shape, dtype):
        return symm_mem.empty(shape, dtype=dtype, device=device)
    return alloc


def connect_over_process_group(decoder: MegakernelDecoder, group) -> None:
    """Rendezvous this rank's cross-rank buffers (allocated with ``symmetric_allocator(group)``) with
    the other ranks' and connect the decoder to them. Collective: every rank calls it."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    peers: list[dict[str, int]] = [{} for _ in range(world)]
    for name in decoder.peer_pointers():
        t = getattr(decoder.buf, name)
        handle = symm_mem.rendezvous(t, group)
        base = handle.buffer_ptrs[rank]
        for r in range(world):   # the tensor sits at the same offset of every rank's symmetric buffer
            peers[r][name] = handle.buffer_ptrs[r] + (t.data_ptr() - base)
    decoder.connect(rank, peers)
