"""PyTorch prefill backend: the shared decoder block with SDPA, writing the paged KV cache.

Prefill is compute-bound and runs once per request, so plain PyTorch kernels (cuBLAS GEMMs, flash
SDPA) are the right tool; the decode steps that follow are the megakernel's. Numerics follow HF in
the weights' dtype (bf16): RMSNorm in fp32, RoPE in fp32, GEMMs in bf16.

The decoder fuses each layer's q/k/v and gate/up matrices; given weights laid out by
``model.decoder_block.share_fused_storage`` (as the hybrid engine does) that costs no memory.
Mixture-of-experts layers run through the same block: one GEMM per selected expert over the
tokens that chose it (``model.moe``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kv_cache import PagedKVCache
from ..model.decoder_block import Attention, Decoder
from ..model.rope import rope_cos_sin, rope_inv_freq
from ..model.spec import ModelSpec
from ..reference import write_kv


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     sliding_window: int | None = None) -> torch.Tensor:
    """Tokens at positions 0..T-1 over themselves: ``q [N, T, heads, d]``, ``k, v [N, T, kv_heads, d]``
    -> ``[N, T, heads, d]`` (SDPA's fused causal kernels, GQA without repeating K/V)."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    T = q.shape[2]
    if sliding_window is not None and T > sliding_window:   # HF/Mistral: q - kv < window
        i = torch.arange(T, device=q.device)
        mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - sliding_window)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    else:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return o.transpose(1, 2)


def prefill_attention(cache: PagedKVCache, rows: torch.Tensor, pos: torch.Tensor,
                      sliding_window: int | None = None) -> Attention:
    """The block's attention for a prefill from position 0 (``pos [N, T]`` = 0..T-1) of the cache
    sequences ``rows [N]``: store the K/V, attend over them as computed."""
    def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        write_kv(cache, layer, rows, pos, k, v)
        return causal_attention(q, k, v, sliding_window)
    return attention


class TorchPrefill:
    name = "torch"

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor]):
        self.spec = spec
        self.model = Decoder(spec, weights)
        self.device = self.model.tok_embeddings.device
        self.inv_freq = rope_inv_freq(spec).to(self.device)

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], cache: PagedKVCache) -> torch.Tensor:
        """Fill the cache with every prompt's K/V (positions 0..len-1); fp32 logits [B, V] of each
        prompt's last token. Prompts run one at a time: their lengths differ."""
        out = []
        for b, prompt in enumerate(prompts):
            ids = torch.tensor([prompt], device=self.device, dtype=torch.long)
            pos = torch.arange(len(prompt), device=self.device)[None]
            rows = torch.tensor([b], device=self.device)
            cos, sin = rope_cos_sin(pos, self.inv_freq, torch.float32)
            attention = prefill_attention(cache, rows, pos, self.spec.sliding_window)
            out.append(self.model(ids, cos, sin, attention).float()[0])
        return torch.stack(out)
