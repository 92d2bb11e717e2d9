"""The mixture-of-experts MLP of a sparse layer: routing, and the weighted sum of the selected
experts' SwiGLU outputs (Qwen3-MoE, Mixtral).

    probs = softmax(router(h)) in fp32;  the k most probable experts (ties: lowest index first)
    w = their probabilities, divided by their sum when the spec renormalises (norm_topk_prob)
    out = sum over the selected experts e, in ascending index order, of w_e * down_e(silu(gate_e(h)) * up_e(h))

Tie-breaking is a rule here, not an accident of the library: ``torch.topk`` leaves the order of
equal values unspecified, so the experts are ranked by a stable descending sort, which keeps equal
probabilities in expert-index order; the lowest index wins a tie. The megakernel's router must
apply the same rule. The outputs are summed in ascending expert index, rounding after each add in
the compute dtype, which is the order of HF's per-expert ``index_add_`` loop.

Numerics follow HF's eager modules: router logits and the experts' GEMMs in the compute dtype;
softmax, top-k and renormalisation in fp32; the weights rounded to the compute dtype before they
scale the outputs (Qwen3-MoE), or the outputs scaled in fp32 and then rounded (Mixtral,
``Family.expert_weights_fp32``).

Two evaluations of the same math: a few tokens (a decode step: tokens x k <= E) gather the selected
experts' matrices and run batched GEMVs, with no host synchronisation (so a decode step can be
captured in a CUDA graph); more tokens (a prefill) loop over the experts that some token selected,
each expert one GEMM over its tokens, as HF does.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from .families import FAMILIES
from .spec import ModelSpec


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing of ``logits [..., E]``: fp32 weights and expert indices ``[..., top_k]``, the experts in
    ascending index order. The k most probable experts win; among equal probabilities the lowest
    expert index wins."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    ranked = torch.sort(probs, dim=-1, descending=True, stable=True).indices[..., :top_k]
    weights = probs.gather(-1, ranked)
    if normalize:   # summed in rank order, as HF sums topk's (descending) values
        weights = weights / weights.sum(dim=-1, keepdim=True)
    experts, perm = ranked.sort(dim=-1)
    return weights.gather(-1, perm), experts


def router_through_o(router: torch.Tensor, ln2: torch.Tensor, wo: torch.Tensor) -> torch.Tensor:
    """The router through the o-projection, ``router diag(ln2) wo`` ``[E, q_size]`` in bf16: the logits
    that the attention output ``o`` adds to a sparse layer's router (its input is ln2 * (x + wo o)
    before the norm). Computed in fp64 and rounded once, so every device computes the same bf16 matrix
    from the same weights (the megakernel's fused expert plans stream it: kinds/router.py)."""
    m = (router.to(torch.float64) * ln2.to(torch.float64)) @ wo.to(torch.float64)
    return m.to(torch.bfloat16)


class MoeMlp(nn.Module):
    """A sparse layer's MLP over HF-named weights: the router ``[E, H]`` and the experts stacked as
    ``w_gate_up [E, 2*Im, H]`` (each expert's gate rows, then its up rows) and ``w_down [E, H, Im]`` (a
    transposed view of ``[E, Im, H]`` when the checkpoint's down matrices are stored so)."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], layer: int, dtype: torch.dtype):
        super().__init__()
        from .decoder_block import concat_rows   # the block imports this module
        self.spec = spec
        self.fp32_scale = FAMILIES[spec.family].expert_weights_fp32
        router, experts = spec.moe_names(layer)
        E, H, Im = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
        self.router = nn.Parameter(weights[router].to(dtype), requires_grad=False)
        # one copy each, in the checkpoint's dtype, then converted; no copy when share_fused_storage
        # laid the experts out as consecutive rows already
        gate_up = concat_rows([weights[n] for g, u, _ in experts for n in (g, u)])
        downs = [weights[d] for _, _, d in experts]
        if all(w.t().is_contiguous() for w in downs):   # transposed storage (share_fused_storage transposed_down)
            down = concat_rows([w.t() for w in downs]).view(E, Im, H).transpose(1, 2)
        else:
            down = concat_rows(downs).view(E, H, Im)
        self.w_gate_up = nn.Parameter(gate_up.view(E, 2 * Im, H).to(dtype), requires_grad=False)
        self.w_down = nn.Parameter(down.to(dtype), requires_grad=False)

    def forward(self, h: torch.Tensor, stage=None, logits: torch.Tensor | None = None) -> torch.Tensor:
        """``h [..., H]`` (the normed, staged residual) -> the MLP output, same shape and dtype. ``logits
        [..., E]``: the router's logits when they are not those of ``h`` (DecoderBlock.forward)."""
        s = self.spec
        x = h.reshape(-1, s.hidden_size)
        r = F.linear(x, self.router) if logits is None else logits.reshape(-1, s.num_experts)
        weights, experts = route(r, s.num_experts_per_tok, s.norm_topk_prob)
        if x.shape[0] * s.num_experts_per_tok <= s.num_experts:
            y = self._gathered(x, experts, stage)
        else:
            y = self._grouped(x, experts, stage)
        scale = weights if self.fp32_scale else weights.to(x.dtype)
        y = (y * scale[..., None]).to(x.dtype)                     # [n, k, H]
        out = y[:, 0]
        for j in range(1, y.shape[1]):                             # ascending expert index
            out = out + y[:, j]
        return out.view(h.shape)

    def _act(self, gate_up: torch.Tensor, stage) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.silu(gate) * up
        return act if stage is None else stage(act)

    def _gathered(self, x: torch.Tensor, experts: torch.Tensor, stage) -> torch.Tensor:
        """Expert outputs ``[n, k, H]``, reading only the selected experts' matrices."""
        gate_up = (self.w_gate_up[experts] @ x[:, None, :, None]).squeeze(-1)     # [n, k, 2*Im]
        act = self._act(gate_up, stage)
        return (self.w_down[experts] @ act[..., None]).squeeze(-1)               # [n, k, H]

    def _grouped(self, x: torch.Tensor, experts: torch.Tensor, stage) -> torch.Tensor:
        """Expert outputs ``[n, k, H]``, one GEMM per selected expert over the tokens that chose it."""
        y = x.new_empty(*experts.shape, x.shape[-1])
        for e in experts.unique().tolist():
            tok, slot = (experts == e).nonzero(as_tuple=True)
            act = self._act(F.linear(x[tok], self.w_gate_up[e]), stage)
            y[tok, slot] = F.linear(act, self.w_down[e])
        return y


def check_buildable_moe(spec: ModelSpec, where) -> None:
    """Refuse building an engine of a mixture-of-experts layout the megakernel's expert kinds do not
    implement (graph.builder.check_moe_supported), in one line."""
    if not spec.is_moe:
        return
    from ..errors import ModelError
    from ..graph.builder import check_moe_supported
    try:
        check_moe_supported(spec)
    except ModelError as e:
        raise ConfigError(f"{where}: model: {e}; the reference decoder and the torch prefill run it") from None
