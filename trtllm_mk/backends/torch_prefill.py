"""PyTorch prefill backend: batched-over-tokens prefill with SDPA that writes the paged KV cache.

Prefill is compute-bound and runs once per request, so plain PyTorch kernels (cuBLAS GEMMs, flash
SDPA) are the right tool; the decode steps that follow are the megakernel's. Numerics follow HF in
the weights' dtype (bf16): RMSNorm in fp32, RoPE in fp32, GEMMs in bf16.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kv_cache import PagedKVCache
from ..model.rope import apply_rope, rope_inv_freq
from ..model.spec import ModelSpec


def _rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class TorchPrefill:
    name = "torch"

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor]):
        self.spec, self.w = spec, weights
        dev = weights["model.embed_tokens.weight"].device
        self.inv_freq = rope_inv_freq(spec).to(dev)
        self.lm_head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])

    def _layer(self, i: int, x: torch.Tensor, pos: torch.Tensor, cache: PagedKVCache, b: int) -> torch.Tensor:
        s, w, p = self.spec, self.w, f"model.layers.{i}."
        T = x.shape[0]
        h = _rmsnorm(x, w[p + "input_layernorm.weight"], s.rms_norm_eps)
        q = F.linear(h, w[p + "self_attn.q_proj.weight"], w.get(p + "self_attn.q_proj.bias"))
        k = F.linear(h, w[p + "self_attn.k_proj.weight"], w.get(p + "self_attn.k_proj.bias"))
        v = F.linear(h, w[p + "self_attn.v_proj.weight"], w.get(p + "self_attn.v_proj.bias"))
        q = q.view(T, s.num_heads, s.head_dim)
        k = k.view(T, s.num_kv_heads, s.head_dim)
        v = v.view(T, s.num_kv_heads, s.head_dim)
        if s.qk_norm:
            q = _rmsnorm(q, w[p + "self_attn.q_norm.weight"], s.rms_norm_eps)
            k = _rmsnorm(k, w[p + "self_attn.k_norm.weight"], s.rms_norm_eps)
        q = apply_rope(q.float(), pos, self.inv_freq).to(x.dtype)
        k = apply_rope(k.float(), pos, self.inv_freq).to(x.dtype)
        cache.write(i, b, 0, k, v)
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           is_causal=True, enable_gqa=True)
        x = x + F.linear(o[0].transpose(0, 1).reshape(T, s.q_size), w[p + "self_attn.o_proj.weight"])
        h = _rmsnorm(x, w[p + "post_attention_layernorm.weight"], s.rms_norm_eps)
        g = F.linear(h, w[p + "mlp.gate_proj.weight"])
        u = F.linear(h, w[p + "mlp.up_proj.weight"])
        return x + F.linear(F.silu(g) * u, w[p + "mlp.down_proj.weight"])

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], cache: PagedKVCache) -> torch.Tensor:
        """Fill the cache with every prompt's K/V (positions 0..len-1); fp32 logits [B, V] of each
        prompt's last token."""
        out = []
        emb = self.w["model.embed_tokens.weight"]
        for b, prompt in enumerate(prompts):
            ids = torch.tensor(prompt, device=emb.device, dtype=torch.long)
            x = emb[ids]
            pos = torch.arange(len(prompt), device=emb.device)
            for i in range(self.spec.num_layers):
                x = self._layer(i, x, pos, cache, b)
            h = _rmsnorm(x[-1:], self.w["model.norm.weight"], self.spec.rms_norm_eps)
            out.append(F.linear(h, self.lm_head).float()[0])
        return torch.stack(out)
