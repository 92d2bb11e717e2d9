"""The PyTorch Llama-family decoder block, gpt-fast style, and the decoder around it.

One definition of the block math, shared by the reference decoder (``trtllm_mk/reference.py``), the
torch prefill backend (``trtllm_mk/backends/torch_prefill.py``) and the benchmark baselines
(``benchmarks/baselines.py``):

    x += o_proj(attention(rope(qk_norm(split(qkv_proj(rms_norm(x)))))))
    x += down_proj(silu(gate) * up),  gate, up = split(gate_up_proj(rms_norm(x)))

``qkv_proj`` and ``gate_up_proj`` are single matrices, the checkpoint's q/k/v (and Qwen2's biases)
and gate/up rows concatenated once when the decoder is built, so each is one GEMM per layer.
A mixture-of-experts model's sparse layers replace the dense MLP by the routed experts
(``model.moe.MoeMlp``, each expert's gate/up rows and the down matrices stacked the same way).
Qwen3's per-head q/k RMSNorm runs before RoPE. RoPE (inverse frequencies with llama3 scaling, the
cos/sin tables and the rotation) comes from ``model.rope``.

Attention over the KV cache is the part the users do differently, so the block takes it as an
argument: ``attention(layer, q, k, v)`` gets this pass's ``q [N, T, heads, d]`` and ``k, v
[N, T, kv_heads, d]`` (after QK-norm and RoPE: what HF and TensorRT-LLM store), keeps k and v in its
cache and returns the attention output ``[N, T, heads, d]``. The reference reads the paged cache
back with HF's eager math, the prefill runs SDPA over the fresh K/V, and the baseline keeps
gpt-fast's contiguous static cache, which torch.compile fuses best.

Numerics follow HF's eager model in the compute dtype: RMSNorm statistics in fp32, cast back before
the gain; RoPE in the dtype of the cos/sin tables it is given (HF rounds them to the activation dtype;
fp32 tables give fp32 RoPE); everything else in the compute dtype. ``stage`` (optional) is applied to
the input of every linear layer: the reference uses it to round those inputs where the megakernel
stages its activations. A stage whose ``router_through_o`` is true also sums a sparse layer's router
logits as the megakernel's fused expert plans do (``DecoderBlock.chain_logits``). A decoder layer's
weight may also be a module that applies a weight kept in another format (``linear``: the int4
benchmark baseline swaps in torch's tinygemm linears).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelError
from .moe import MoeMlp, router_through_o
from .rope import apply_rotary
from .spec import ModelSpec

# attention(layer, q [N, T, heads, d], k [N, T, kv_heads, d], v [N, T, kv_heads, d]) -> [N, T, heads, d]
Attention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Stage = Callable[[torch.Tensor], torch.Tensor]

QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")


# ---- the elementwise pieces ---------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: statistics in fp32, the normalised value cast back before the gain."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


# ---- fused weights ------------------------------------------------------------------------------

def concat_rows(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)`` along dim 0, without a copy when the parts already are consecutive rows of
    one tensor (see ``share_fused_storage``)."""
    first = parts[0]
    adjacent = all(p.is_contiguous() and p.dtype == first.dtype and p.shape[1:] == first.shape[1:]
                   and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() for p in parts)
    if adjacent:
        for a, b in zip(parts, parts[1:]):
            adjacent &= b.data_ptr() == a.data_ptr() + a.numel() * a.element_size()
    if not adjacent:
        return torch.cat(list(parts))
    rows = sum(p.shape[0] for p in parts)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


def _fused_groups(spec: ModelSpec, layer: int) -> list[list[str]]:
    """Checkpoint names of the tensors that are fused into one, per group, in row order."""
    a, m = f"model.layers.{layer}.self_attn.", f"model.layers.{layer}.mlp."
    groups = [[a + n + ".weight" for n in QKV]]
    if spec.is_moe_layer(layer):   # experts stacked in index order: gate_0, up_0, gate_1, ... and down_0, ...
        _, experts = spec.moe_names(layer)
        groups += [[n for g, u, _ in experts for n in (g, u)], [d for _, _, d in experts]]
    else:
        groups.append([m + n + ".weight" for n in GATE_UP])
    if spec.qkv_bias:
        groups.append([a + n + ".bias" for n in QKV])
    return groups


def share_fused_storage(spec: ModelSpec, weights: dict[str, torch.Tensor],
                        transposed_down: bool = False) -> dict[str, torch.Tensor]:
    """A dict of the same tensors in which each layer's q/k/v (and biases) and gate/up are rows of one
    fused tensor (copied once, one layer at a time). A decoder built from it fuses without a copy, and
    every other user of the dict (the megakernel binds each name) reads the same memory, so an engine
    holds one copy of its weights; the originals are freed once the caller drops ``weights``.
    ``transposed_down``: a sparse layer's expert down matrices ([H, I] each) become transposed views
    of one [E, I, H] tensor, the layout the megakernel's fused expert tiles stream (kinds/emlp.py) and
    MoeMlp reads as it is."""
    out = dict(weights)
    for i in range(spec.num_layers):
        groups = _fused_groups(spec, i)
        if transposed_down and spec.is_moe_layer(i):
            downs = [d for _, _, d in spec.moe_names(i)[1]]
            groups.remove(downs)
            stacked = torch.stack([weights[n].t() for n in downs])   # [E, I, H], one copy
            out.update({n: stacked[e].t() for e, n in enumerate(downs)})
        for names in groups:
            parts = [weights.get(n) for n in names]
            if any(not isinstance(t, torch.Tensor) or t.dtype != parts[0].dtype or t.device != parts[0].device
                   or t.shape[1:] != parts[0].shape[1:] for t in parts):
                continue   # not plain row blocks of one kind (the decoder's own check names what is wrong)
            fused = concat_rows(parts)
            r = 0
            for n in names:
                rows = weights[n].shape[0]
                out[n] = fused[r:r + rows]
                r += rows
    return out


def check_weights(spec: ModelSpec, weights: dict[str, torch.Tensor]) -> None:
    """Every tensor the spec expects, in its shape, or a ModelError naming the first that is not."""
    expected = spec.expected_tensors()
    missing = [n for n in expected if n not in weights]
    if missing:
        raise ModelError(f"decoder weights: {len(missing)} weight(s) missing, first '{missing[0]}'")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ModelError(f"decoder weights: '{name}' has shape {tuple(weights[name].shape)}, expected {shape}")


def linear(x: torch.Tensor, weight: torch.Tensor | nn.Module, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for a weight tensor ``[out, in]``, or ``weight(x)`` (+ bias) for a module
    that holds the weight in its own format."""
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias)
    y = weight(x)
    return y if bias is None else y + bias


def _weight(parts: Sequence[torch.Tensor | nn.Module], dtype: torch.dtype) -> nn.Parameter | nn.Module:
    """One layer linear's weight from its row parts: tensors concatenated and converted to ``dtype``, or
    modules holding their weight in another format, joined by their class's ``cat``."""
    if isinstance(parts[0], nn.Module):
        return parts[0] if len(parts) == 1 else type(parts[0]).cat(list(parts))
    return _param(concat_rows(parts).to(dtype))


def _param(t: torch.Tensor) -> nn.Parameter:
    # Parameters (not plain attributes) so torch.compile / cudagraph trees treat them as static inputs.
    return nn.Parameter(t, requires_grad=False)


# ---- the block ----------------------------------------------------------------------------------

class DecoderBlock(nn.Module):
    """One decoder layer over HF-named weights, converted to ``dtype`` (in place where it matches)."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], layer: int, dtype: torch.dtype):
        super().__init__()
        self.spec, self.layer = spec, layer
        p = f"model.layers.{layer}."
        a, m = p + "self_attn.", p + "mlp."
        self.attention_norm = _param(weights[p + "input_layernorm.weight"].to(dtype))
        # concatenated in the checkpoint's dtype, then converted: one copy, no converted temporaries
        self.wqkv = _weight([weights[a + n + ".weight"] for n in QKV], dtype)
        self.bqkv = _param(concat_rows([weights[a + n + ".bias"] for n in QKV]).to(dtype)) if spec.qkv_bias else None
        self.q_norm = _param(weights[a + "q_norm.weight"].to(dtype)) if spec.qk_norm else None
        self.k_norm = _param(weights[a + "k_norm.weight"].to(dtype)) if spec.qk_norm else None
        self.wo = _weight([weights[a + "o_proj.weight"]], dtype)
        self.ffn_norm = _param(weights[p + "post_attention_layernorm.weight"].to(dtype))
        self._router_o = None   # chain_logits' router through o_proj (fp32 values of the bf16 matrix), made on first use
        if spec.is_moe_layer(layer):
            self.moe = MoeMlp(spec, weights, layer, dtype)
            self.w_gate_up = self.w_down = None
        else:
            self.moe = None
            self.w_gate_up = _weight([weights[m + n + ".weight"] for n in GATE_UP], dtype)
            self.w_down = _weight([weights[m + "down_proj.weight"]], dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: Attention,
                stage: Stage | None = None) -> torch.Tensor:
        """``x [N, T, hidden]`` -> the same, for tokens whose RoPE tables are ``cos, sin [N, T, 1, d]``."""
        o = self.attention_output(x, cos, sin, attention, stage)
        after = x + linear(o, self.wo)
        logits = self.chain_logits(x, o, after) if getattr(stage, "router_through_o", False) else None
        return after + self.mlp_delta(after, stage, logits)

    # The two residual updates are separate so that a tensor-parallel rank (``trtllm_mk.parallel``) can
    # all-reduce its partial o_proj / down_proj output before it is added to the residual.

    def attention_delta(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: Attention,
                        stage: Stage | None = None) -> torch.Tensor:
        """What the attention half adds to the residual ``x [N, T, hidden]``: o_proj of the attention."""
        return linear(self.attention_output(x, cos, sin, attention, stage), self.wo)

    def attention_output(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: Attention,
                         stage: Stage | None = None) -> torch.Tensor:
        """The attention's output ``[N, T, q_size]``, o_proj's input (staged)."""
        s = self.spec
        N, T, _ = x.shape
        h = rms_norm(x, self.attention_norm, s.rms_norm_eps)
        if stage is not None:
            h = stage(h)
        q, k, v = linear(h, self.wqkv, self.bqkv).split([s.q_size, s.kv_size, s.kv_size], dim=-1)
        q = q.view(N, T, s.num_heads, s.head_dim)
        k = k.view(N, T, s.num_kv_heads, s.head_dim)
        v = v.view(N, T, s.num_kv_heads, s.head_dim)
        if self.q_norm is not None:  # Qwen3: RMSNorm over each head's vector, before RoPE
            q = rms_norm(q, self.q_norm, s.rms_norm_eps)
            k = rms_norm(k, self.k_norm, s.rms_norm_eps)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        o = attention(self.layer, q, k, v).reshape(N, T, s.q_size)
        return o if stage is None else stage(o)

    def chain_logits(self, x: torch.Tensor, o: torch.Tensor, after: torch.Tensor) -> torch.Tensor | None:
        """A sparse layer's router logits as the megakernel's fused expert plans sum them along the
        attention chain (kinds/router.py), from the residual ``x`` at the layer's start, the staged
        attention output ``o`` and the residual ``after`` it: router(ln2 * x) in fp32 plus
        router_through_o(o), times the norm's 1 / rms of ``after``. None for a dense layer."""
        if self.moe is None:
            return None
        if self._router_o is None:
            self._router_o = router_through_o(self.moe.router, self.ffn_norm, self.wo).float()
        f32 = torch.float32
        u = F.linear(x.to(f32) * self.ffn_norm.to(f32), self.moe.router.to(f32))
        u = u + F.linear(o.to(f32), self._router_o)
        a = after.to(f32)
        return u * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + self.spec.rms_norm_eps)

    def mlp_delta(self, x: torch.Tensor, stage: Stage | None = None, logits: torch.Tensor | None = None) -> torch.Tensor:
        """What the MLP half adds to the residual ``x``: down_proj of silu(gate) * up (or the routed experts'
        sum; ``logits``: a sparse layer's router logits when they are not those of its normed rows)."""
        h = rms_norm(x, self.ffn_norm, self.spec.rms_norm_eps)
        if stage is not None:
            h = stage(h)
        if self.moe is not None:
            return self.moe(h, stage, logits)
        gate, up = linear(h, self.w_gate_up).chunk(2, dim=-1)
        act = F.silu(gate) * up
        if stage is not None:
            act = stage(act)
        return linear(act, self.w_down)


class Decoder(nn.Module):
    """Embedding, the decoder blocks, the final norm and the LM head of a Llama-family model.

    ``dtype`` (default: the embedding's) is the compute dtype; weights are converted once (the fused
    matrices are copies unless ``share_fused_storage`` laid them out already; every other tensor is
    used in place when its dtype matches)."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], dtype: torch.dtype | None = None):
        super().__init__()
        check_weights(spec, weights)
        self.spec = spec
        embed = weights["model.embed_tokens.weight"]
        self.dtype = dtype or embed.dtype
        self.tok_embeddings = _param(embed.to(self.dtype))
        self.layers = nn.ModuleList(DecoderBlock(spec, weights, i, self.dtype) for i in range(spec.num_layers))
        self.norm = _param(weights["model.norm.weight"].to(self.dtype))
        # tied embeddings (Llama-3.2, small Qwens): the checkpoint has no lm_head.weight
        self.output = (self.tok_embeddings if spec.tie_word_embeddings
                       else _param(weights["lm_head.weight"].to(self.dtype)))

    def forward(self, ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: Attention,
                stage: Stage | None = None) -> torch.Tensor:
        """Tokens ``ids [N, T]`` with RoPE tables ``cos, sin [N, T, 1, d]`` of their positions; ``attention``
        keeps their K/V. Logits ``[N, V]`` of each row's last token, in the compute dtype."""
        x = F.embedding(ids, self.tok_embeddings)
        for block in self.layers:
            x = block(x, cos, sin, attention, stage)
        h = rms_norm(x[:, -1], self.norm, self.spec.rms_norm_eps)
        if stage is not None:
            h = stage(h)
        return F.linear(h, self.output)
