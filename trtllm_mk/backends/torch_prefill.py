"""PyTorch prefill backend: the shared decoder block with SDPA, writing the paged KV cache.

Prefill is compute-bound and runs once per request, so plain PyTorch kernels (cuBLAS GEMMs, flash
SDPA) are the right tool; the decode steps that follow are the megakernel's. Numerics follow HF in
the weights' dtype (bf16): RMSNorm in fp32, RoPE in fp32, GEMMs in bf16.
"""
from __future__ import annotations

import torch

from ..kv_cache import PagedKVCache
from ..model.decoder import Decoder, PagedAttention
from ..model.spec import ModelSpec


class TorchPrefill:
    name = "torch"

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor]):
        self.spec = spec
        # unfused: the weights are the engine's own tensors, used in place (no second copy on the GPU)
        self.model = Decoder(spec, weights, fuse=False)
        self.device = self.model.tok_embeddings.device

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], cache: PagedKVCache) -> torch.Tensor:
        """Fill the cache with every prompt's K/V (positions 0..len-1); fp32 logits [B, V] of each
        prompt's last token. Prompts run one at a time: their lengths differ."""
        out = []
        for b, prompt in enumerate(prompts):
            ids = torch.tensor([prompt], device=self.device, dtype=torch.long)
            pos = torch.arange(len(prompt), device=self.device)[None]
            rows = torch.tensor([b], device=self.device)
            attention = PagedAttention(cache, rows, pos, kernel="sdpa", prefill=True,
                                       sliding_window=self.spec.sliding_window)
            out.append(self.model(ids, pos, attention).float()[0])
        return torch.stack(out)
