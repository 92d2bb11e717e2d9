"""The tensor-parallel baseline: gpt-fast's decoder split Megatron-style over the ranks of a process
group, one rank per process (``torchrun``), as users of gpt-fast or torch.compile run it.

Each rank is the project's shared decoder block (``trtllm_mk.model.decoder_block``: fused QKV and
gate/up) over its weight shard (``trtllm_mk.parallel.shard``: the same split as the megakernel's ranks)
and gpt-fast's static KV cache of its KV heads (``baselines.StaticKVCache``). The partial sums of
o_proj and down_proj, and the vocabulary-parallel embedding, are added across ranks with
``torch.distributed._functional_collectives.all_reduce`` (NCCL on GPUs), which torch.compile traces into
the graph; the LM head is vocabulary-parallel too and the ranks' logits are gathered. So a step is
what gpt-fast's ``tp.py`` runs, with the LM head split as well (gpt-fast keeps it whole on every rank:
more bytes per step), compiled with ``mode="reduce-overhead"``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trtllm_mk.model.decoder_block import Decoder, rms_norm
from trtllm_mk.model.rope import rope_cos_sin, rope_inv_freq
from trtllm_mk.model.spec import ModelSpec
from trtllm_mk.parallel import rank_layout, rank_spec
from trtllm_mk.parallel.emulate import embed_rows

from .baselines import StaticKVCache


class TensorParallelStaticDecoder(nn.Module):
    """Rank ``rank`` of ``spec`` over the ``tp`` ranks of ``group``: ``shard`` is its weights
    (``shard_weights(spec, weights, tp, rank)``)."""

    def __init__(self, spec: ModelSpec, shard: dict[str, torch.Tensor], tp: int, rank: int, group,
                 max_batch: int, max_seq: int):
        super().__init__()
        self.spec, self.share, self.tp, self.group = spec, rank_spec(spec, tp), tp, group
        self.layout = rank_layout(spec, tp, rank)
        self.decoder = Decoder(self.share, shard)
        emb = self.decoder.tok_embeddings
        self.kv = nn.ModuleList(StaticKVCache(self.share, max_batch, max_seq, emb.dtype, emb.device)
                                for _ in range(spec.num_layers))
        cos, sin = rope_cos_sin(torch.arange(max_seq), rope_inv_freq(spec), torch.float32)
        self.register_buffer("rope_cos", cos.to(emb.device), persistent=False)
        self.register_buffer("rope_sin", sin.to(emb.device), persistent=False)
        self.register_buffer("key_pos", torch.arange(max_seq, device=emb.device), persistent=False)
        self.max_seq = max_seq

    def _sum(self, t: torch.Tensor) -> torch.Tensor:
        from torch.distributed import _functional_collectives as funcol
        return funcol.all_reduce(t, "sum", self.group)

    def _forward(self, ids: torch.Tensor, cos, sin, attention) -> torch.Tensor:
        d = self.decoder
        x = self._sum(embed_rows(ids, self.layout, d))
        for block in d.layers:
            x = x + self._sum(block.attention_delta(x, cos, sin, attention))
            x = x + self._sum(block.mlp_delta(x))
        h = rms_norm(x[:, -1], d.norm, self.spec.rms_norm_eps)
        from torch.distributed import _functional_collectives as funcol
        local = F.linear(h, d.output)                                    # [N, V / tp]
        return funcol.all_gather_tensor(local.contiguous(), 0, self.group).view(self.tp, *local.shape) \
            .permute(1, 0, 2).reshape(local.shape[0], -1)               # [N, V], rank 0's ids first

    def decode_step(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """One token per row at its own position -> the whole vocabulary's logits [B, V]."""
        B = tokens.shape[0]
        pos = input_pos[:, None]
        mask = (self.key_pos[None, :] <= pos).view(B, 1, 1, self.max_seq)

        def attention(layer, q, k, v):
            return self.kv[layer].decode(q, k, v, input_pos, mask)
        return self._forward(tokens[:, None], self.rope_cos[pos], self.rope_sin[pos], attention)

    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        """Prompts of equal length: tokens [B, T] at positions 0..T-1 -> logits of the last [B, V]."""
        B, T = tokens.shape

        def attention(layer, q, k, v):
            return self.kv[layer].prefill(q, k, v)
        cos, sin = self.rope_cos[:T].expand(B, T, 1, -1), self.rope_sin[:T].expand(B, T, 1, -1)
        return self._forward(tokens, cos, sin, attention)
