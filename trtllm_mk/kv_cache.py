"""The paged KV cache, in TensorRT-LLM's layout, shared by the reference, the CPU executor and the
megakernel (so decode can take over a cache that TRT-LLM prefill wrote).

Per layer: ``[num_blocks, 2 (K, V), num_kv_heads, tokens_per_block, head_dim]`` ("HND" inside a
block); all layers live in one tensor ``pool[layer]``. ``block_table[b, j]`` (int32) is the pool block
holding tokens ``j*tokens_per_block .. (j+1)*tokens_per_block-1`` of sequence ``b``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .model.spec import ModelSpec


@dataclass
class PagedKVCache:
    pool: torch.Tensor         # [layers, num_blocks, 2, kv_heads, tokens_per_block, head_dim]
    block_table: torch.Tensor  # int32 [batch, max_blocks_per_seq]
    tokens_per_block: int

    @classmethod
    def allocate(cls, spec: ModelSpec, batch: int, max_seq_len: int, tokens_per_block: int = 32,
                 dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                 shuffle_blocks: bool = True, seed: int = 0, fill: float | None = None) -> "PagedKVCache":
        """A pool just large enough for ``batch`` sequences of ``max_seq_len`` tokens.

        ``shuffle_blocks`` hands blocks out in a random order so that tests exercise the block table
        rather than an accidentally contiguous layout. ``fill`` (e.g. 1e4) poisons every slot so a
        read beyond a sequence's length shows up as garbage in the result.
        """
        if tokens_per_block <= 0 or tokens_per_block & (tokens_per_block - 1):
            raise ValueError(f"tokens_per_block={tokens_per_block} must be a power of two")
        per_seq = -(-max_seq_len // tokens_per_block)
        nblocks = batch * per_seq
        shape = (spec.num_layers, nblocks, 2, spec.num_kv_heads, tokens_per_block, spec.head_dim)
        if fill is None:
            pool = torch.zeros(shape, dtype=dtype, device=device)
        else:
            g = torch.Generator(device="cpu").manual_seed(seed + 1)
            pool = (torch.randn(shape, generator=g) * fill).to(dtype=dtype, device=device)
        order = torch.arange(nblocks, dtype=torch.int32)
        if shuffle_blocks:
            g = torch.Generator(device="cpu").manual_seed(seed)
            order = order[torch.randperm(nblocks, generator=g)]
        table = order.view(batch, per_seq).to(device)
        return cls(pool=pool, block_table=table, tokens_per_block=tokens_per_block)

    @property
    def max_seq_len(self) -> int:
        return self.block_table.shape[1] * self.tokens_per_block

    def slot(self, b: int, t: int) -> tuple[int, int]:
        """(pool block, offset in block) of token t of sequence b."""
        return int(self.block_table[b, t // self.tokens_per_block]), t % self.tokens_per_block

    def write(self, layer: int, b: int, t0: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v ``[T, kv_heads, head_dim]`` for tokens t0..t0+T-1 of sequence b."""
        tpb = self.tokens_per_block
        T = k.shape[0]
        pos = torch.arange(t0, t0 + T, device=self.block_table.device)
        blocks = self.block_table[b, pos // tpb].long()
        offs = (pos % tpb).long()
        self.pool[layer, blocks, 0, :, offs] = k.to(self.pool.dtype)
        self.pool[layer, blocks, 1, :, offs] = v.to(self.pool.dtype)

    def read(self, layer: int, b: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v ``[length, kv_heads, head_dim]`` of sequence b (a gather through the block table)."""
        tpb = self.tokens_per_block
        pos = torch.arange(length, device=self.block_table.device)
        blocks = self.block_table[b, pos // tpb].long()
        offs = (pos % tpb).long()
        k = self.pool[layer, blocks, 0, :, offs]
        v = self.pool[layer, blocks, 1, :, offs]
        return k, v
