"""The PyTorch Llama-family decoder, gpt-fast style, shared by the reference decoder, the torch
prefill backend and the benchmark baselines.

One block: RMSNorm -> fused QKV projection (Qwen2's bias) -> Qwen3's per-head QK-norm -> RoPE ->
attention -> output projection -> residual; RMSNorm -> fused gate/up projection -> SwiGLU -> down
projection -> residual. RoPE's inverse frequencies (llama3 scaling included) come from
``model.rope``, the single place that defines them.

Attention is the one part that differs between the users, so the block takes it as an argument
(``PagedAttention``): every user keeps K/V in the project's paged cache (TensorRT-LLM's layout,
``kv_cache.PagedKVCache``), and picks the kernel:
  ``eager``  HF's eager numerics over the K/V read back through the block table (the reference);
  ``sdpa``   ``F.scaled_dot_product_attention``: a prefill from position 0 attends over the fresh K/V
             (causal); a decode step reads the cache (a view when row b owns pool block b alone,
             as a static cache does).

Numerics follow HF: RMSNorm statistics in fp32, cast back before the gain; softmax in fp32. RoPE runs
in fp32 unless ``rope_in_fp32=False``, which rounds cos/sin to the activation dtype as HF's eager
model does (the reference needs that to match HF bit for bit in bf16).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelError
from ..kv_cache import PagedKVCache
from .rope import rope_inv_freq
from .spec import ModelSpec


# ---- the elementwise pieces ---------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: statistics in fp32, the normalised value cast back before the gain."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_cos_sin(pos: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[..., T, 1, head_dim]`` for positions ``pos [..., T]``: angles in fp32, then cast to
    ``dtype``."""
    ang = pos.float()[..., None] * inv_freq
    ang = torch.cat([ang, ang], -1)[..., None, :]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on ``x [..., T, heads, head_dim]``, computed in cos's dtype, returned in x's."""
    xc = x.to(cos.dtype)
    h = x.shape[-1] // 2
    return (xc * cos + torch.cat([-xc[..., h:], xc[..., :h]], -1) * sin).to(x.dtype)


# ---- attention over the paged KV cache ----------------------------------------------------------

def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                    sliding_window: int | None = None) -> torch.Tensor:
    """HF's eager attention of queries ``q [N, T, heads, d]`` at positions ``pos [N, T]`` over cache
    slots ``k, v [N, kv_heads, S, d]`` (slot s holds position s); returns ``[N, T, heads, d]``.
    Scores and P@V in q's dtype, softmax in fp32 then cast back."""
    N, T, nh, d = q.shape
    S, group = k.shape[2], nh // k.shape[1]
    slot = torch.arange(S, device=q.device)
    visible = slot <= pos[..., None]                                  # [N, T, S]: causal + length
    if sliding_window is not None:                                    # HF/Mistral: q - kv < window
        visible &= slot > pos[..., None] - sliding_window
    # Slots past a sequence's last token may hold anything (poison in tests, NaN in a fresh pool).
    # Their probabilities are exactly 0, but 0 * NaN is NaN, so they are zeroed, not just masked.
    written = (slot <= pos[:, -1:])[:, None, :, None]                # [N, 1, S, 1]
    k = torch.where(written, k.to(q.dtype), 0).repeat_interleave(group, dim=1)  # query head h reads
    v = torch.where(written, v.to(q.dtype), 0).repeat_interleave(group, dim=1)  # KV head h // group
    scores = (q.transpose(1, 2) @ k.transpose(-1, -2)) * d ** -0.5    # [N, heads, T, S]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return (probs @ v).transpose(1, 2)


def sdpa_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                sliding_window: int | None = None) -> torch.Tensor:
    """One query per row, ``q [N, 1, heads, d]`` at ``pos [N, 1]``, over cache slots ``k, v
    [N, kv_heads, S, d]`` with SDPA. Unwritten slots are masked, so they must hold finite values (a
    zeroed pool, or stale K/V). GQA without repeating K/V: the G query heads of a KV head become G
    query rows of it."""
    N, _, nh, d = q.shape
    kvh, S = k.shape[1], k.shape[2]
    slot = torch.arange(S, device=q.device)
    mask = slot <= pos
    if sliding_window is not None:
        mask &= slot > pos - sliding_window
    o = F.scaled_dot_product_attention(q.view(N, kvh, nh // kvh, d), k, v, attn_mask=mask.view(N, 1, 1, S))
    return o.reshape(N, 1, nh, d)


def sdpa_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention of tokens at positions 0..T-1 over themselves: ``q [N, T, heads, d]``,
    ``k, v [N, T, kv_heads, d]`` -> ``[N, T, heads, d]``."""
    T, group = q.shape[1], q.shape[2] // k.shape[2]
    # Repeating K/V keeps prefill on the fused causal kernels whatever the torch version's GQA
    # support; it costs one copy of this layer's K/V, small next to the activations.
    k = k.transpose(1, 2).repeat_interleave(group, dim=1)
    v = v.transpose(1, 2).repeat_interleave(group, dim=1)
    if sliding_window is not None and T > sliding_window:
        i = torch.arange(T, device=q.device)
        mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - sliding_window)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask)
    else:
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True)
    return o.transpose(1, 2)


class PagedAttention:
    """Attention of one forward pass over a ``PagedKVCache``: tokens at positions ``pos [N, T]`` of the
    cache sequences ``rows [N]``. Each layer writes its K/V into their slots (K after RoPE and QK-norm,
    as HF and TensorRT-LLM store it), then attends with ``kernel``:

    ``eager``  reads every slot of the rows back through the block table (this step's K/V get the
               cache's rounding, like every earlier token's) and runs ``eager_attention``;
    ``sdpa``   with ``prefill=True`` (positions 0..T-1 of every row) attends over the fresh K/V;
               otherwise one token per row over the cache, read as a view when ``rows_own_blocks``
               (row b of the batch is sequence b and pool block b holds all of it), else gathered.
    """

    def __init__(self, cache: PagedKVCache, rows: torch.Tensor, pos: torch.Tensor, kernel: str = "sdpa",
                 prefill: bool = False, sliding_window: int | None = None, rows_own_blocks: bool = False):
        if kernel not in ("eager", "sdpa"):
            raise ValueError(f"PagedAttention: kernel must be 'eager' or 'sdpa', not {kernel!r}")
        tpb = cache.tokens_per_block
        self.cache, self.rows, self.pos = cache, rows, pos
        self.kernel, self.prefill, self.window, self.rows_own_blocks = kernel, prefill, sliding_window, rows_own_blocks
        # the pool block and offset of every token, computed once for all layers
        self.blocks = cache.block_table[rows[:, None], pos // tpb].long()    # [N, T]
        self.offsets = pos % tpb

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k, v [N, T, kv_heads, d]`` in this pass's slots."""
        pool = self.cache.pool
        pool[layer, self.blocks, 0, :, self.offsets] = k.to(pool.dtype)
        pool[layer, self.blocks, 1, :, self.offsets] = v.to(pool.dtype)

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every slot of the rows, by position: k, v ``[N, kv_heads, S, d]``. The caller masks slots past
        each sequence's length (reading the whole table keeps the host out of the loop)."""
        pool = self.cache.pool[layer]
        N = self.rows.shape[0]
        if self.rows_own_blocks:
            return pool[:N, 0], pool[:N, 1]
        kv = pool[self.cache.block_table[self.rows].long()]               # [N, blocks, 2, kvh, tpb, d]
        _, nb, _, kvh, tpb, d = kv.shape
        kv = kv.permute(0, 2, 3, 1, 4, 5).reshape(N, 2, kvh, nb * tpb, d)
        return kv[:, 0], kv[:, 1]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q ``[N, T, heads, d]``, this pass's k, v ``[N, T, kv_heads, d]`` -> ``[N, T, heads, d]``."""
        self.write(layer, k, v)
        if self.kernel == "sdpa" and self.prefill:
            return sdpa_prefill(q, k, v, self.window)
        k_all, v_all = self.read(layer)
        if self.kernel == "sdpa":
            return sdpa_decode(q, k_all, v_all, self.pos, self.window)
        return eager_attention(q, k_all, v_all, self.pos, self.window)


# ---- the model ----------------------------------------------------------------------------------

def _param(t: torch.Tensor) -> nn.Parameter:
    # Parameters (not plain attributes) so torch.compile / cudagraph trees treat them as static inputs.
    return nn.Parameter(t, requires_grad=False)


class DecoderBlock(nn.Module):
    """One decoder layer over HF-named weights. With ``fuse`` (gpt-fast style) Q/K/V and gate/up are
    packed into one matrix each (copies); without it every weight is used in place, for users that
    share the weights with another engine and must not hold a second copy (the prefill backend)."""

    def __init__(self, spec: ModelSpec, w: dict[str, torch.Tensor], layer: int, dtype: torch.dtype,
                 fuse: bool = True):
        super().__init__()
        self.spec, self.layer = spec, layer
        p = f"model.layers.{layer}."
        a, m = p + "self_attn.", p + "mlp."
        qkv = [w[a + n + "_proj.weight"] for n in "qkv"]
        qkv_bias = [w[a + n + "_proj.bias"] for n in "qkv"] if spec.qkv_bias else [None] * 3
        gate_up = [w[m + "gate_proj.weight"], w[m + "up_proj.weight"]]
        if fuse:
            # concatenated in the checkpoint's dtype, then converted: one copy, no converted temporaries
            self.wqkv = _param(torch.cat(qkv).to(dtype))
            self.bqkv = _param(torch.cat(qkv_bias).to(dtype)) if spec.qkv_bias else None
            self.w13 = _param(torch.cat(gate_up).to(dtype))
            self.qkv_parts = self.qkv_bias_parts = self.gate_up_parts = None
        else:
            self.wqkv = self.bqkv = self.w13 = None
            self.qkv_parts = nn.ParameterList(_param(t.to(dtype)) for t in qkv)
            self.qkv_bias_parts = (nn.ParameterList(_param(t.to(dtype)) for t in qkv_bias) if spec.qkv_bias
                                   else None)
            self.gate_up_parts = nn.ParameterList(_param(t.to(dtype)) for t in gate_up)
        self.q_norm = _param(w[a + "q_norm.weight"].to(dtype)) if spec.qk_norm else None
        self.k_norm = _param(w[a + "k_norm.weight"].to(dtype)) if spec.qk_norm else None
        self.wo = _param(w[a + "o_proj.weight"].to(dtype))
        self.w2 = _param(w[m + "down_proj.weight"].to(dtype))
        self.attention_norm = _param(w[p + "input_layernorm.weight"].to(dtype))
        self.ffn_norm = _param(w[p + "post_attention_layernorm.weight"].to(dtype))

    def _qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.spec
        if self.wqkv is not None:
            return F.linear(h, self.wqkv, self.bqkv).split([s.q_size, s.kv_size, s.kv_size], dim=-1)
        bias = self.qkv_bias_parts if self.qkv_bias_parts is not None else (None, None, None)
        return tuple(F.linear(h, wt, b) for wt, b in zip(self.qkv_parts, bias))

    def _gate_up(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.w13 is not None:
            return F.linear(h, self.w13).chunk(2, dim=-1)
        return F.linear(h, self.gate_up_parts[0]), F.linear(h, self.gate_up_parts[1])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention,
                stage=lambda t: t) -> torch.Tensor:
        """x ``[N, T, hidden]``; ``attention(layer, q, k, v)`` as ``PagedAttention``; ``stage`` rounds
        the input of every linear layer (see ``Decoder``)."""
        s = self.spec
        N, T, _ = x.shape
        h = stage(rms_norm(x, self.attention_norm, s.rms_norm_eps))
        q, k, v = self._qkv(h)
        q = q.view(N, T, s.num_heads, s.head_dim)
        k = k.view(N, T, s.num_kv_heads, s.head_dim)
        v = v.view(N, T, s.num_kv_heads, s.head_dim)
        if s.qk_norm:  # Qwen3: RMSNorm over each head's vector, before RoPE
            q = rms_norm(q, self.q_norm, s.rms_norm_eps)
            k = rms_norm(k, self.k_norm, s.rms_norm_eps)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        o = attention(self.layer, q, k, v)
        x = x + F.linear(stage(o.reshape(N, T, s.q_size)), self.wo)
        h = stage(rms_norm(x, self.ffn_norm, s.rms_norm_eps))
        g, u = self._gate_up(h)
        return x + F.linear(stage(F.silu(g) * u), self.w2)


class Decoder(nn.Module):
    """Embedding, the decoder blocks, the final norm and the LM head of a Llama-family model.

    ``dtype`` (default: the weights') is the compute dtype; the weights are converted once (the fused
    matrices are always copies; every other tensor is used in place when its dtype matches).
    ``fuse``: pack Q/K/V and gate/up (see ``DecoderBlock``).
    ``gemv_input_dtype`` (e.g. torch.bfloat16 with fp32 compute) rounds the input of every linear
    layer to that dtype, exactly where the megakernel stages its activations in shared memory, and
    nowhere else.
    """

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], dtype: torch.dtype | None = None,
                 gemv_input_dtype: torch.dtype | None = None, rope_in_fp32: bool = True, fuse: bool = True):
        super().__init__()
        expected = spec.expected_tensors()
        missing = [n for n in expected if n not in weights]
        if missing:
            raise ModelError(f"decoder: {len(missing)} weight(s) missing, first '{missing[0]}'")
        for name, shape in expected.items():
            if tuple(weights[name].shape) != shape:
                raise ModelError(f"decoder: '{name}' has shape {tuple(weights[name].shape)}, expected {shape}")
        self.spec = spec
        embed = weights["model.embed_tokens.weight"]
        self.dtype = dtype or embed.dtype
        self.gemv_input_dtype = gemv_input_dtype
        self.rope_in_fp32 = rope_in_fp32
        self.tok_embeddings = _param(embed.to(self.dtype))
        self.layers = nn.ModuleList(DecoderBlock(spec, weights, i, self.dtype, fuse) for i in range(spec.num_layers))
        self.norm = _param(weights["model.norm.weight"].to(self.dtype))
        # tied embeddings (Llama-3.2, small Qwens): the checkpoint has no lm_head.weight
        self.output = (self.tok_embeddings if spec.tie_word_embeddings
                       else _param(weights["lm_head.weight"].to(self.dtype)))
        self.register_buffer("inv_freq", rope_inv_freq(spec).to(embed.device), persistent=False)

    def _stage(self, x: torch.Tensor) -> torch.Tensor:
        g = self.gemv_input_dtype
        return x if g is None or g == x.dtype else x.to(g).to(x.dtype)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, attention) -> torch.Tensor:
        """Tokens ``ids [N, T]`` at positions ``pos [N, T]``; ``attention`` keeps their K/V (a
        ``PagedAttention`` over the same rows and positions). Logits ``[N, V]`` of each row's last
        token, in the compute dtype."""
        x = F.embedding(ids, self.tok_embeddings)
        cos, sin = rope_cos_sin(pos, self.inv_freq, torch.float32 if self.rope_in_fp32 else self.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, attention, self._stage)
        h = rms_norm(x[:, -1], self.norm, self.spec.rms_norm_eps)
        return F.linear(self._stage(h), self.output)
