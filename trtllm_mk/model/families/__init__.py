"""Model families: one module each, composing the task kinds (trtllm_mk.kinds) into the decode step
and naming the optional numerics the family needs. A new family is one module here plus its line in
``_MODULES``; ``model.spec`` recognises checkpoints by ``architecture`` and ``model_type``."""
from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module

# The step's kinds per phase (by kind name), in program order: the embedding lookup, the layer
# template repeated for every layer, then the LM head and the argmax.
DECODER_STEP = {"head": ("EMBED",), "layer": ("QKV", "ATTN", "COMBINE", "OPROJ", "GATEUP", "DOWN"),
                "tail": ("LMHEAD", "ARGMAX")}
# A mixture-of-experts layer: the router's logits, the routing into expert slots, then each slot's
# expert MLP (kinds/route.py): EGATEUP and EDOWN tasks, or under TilePlan.expert_fused EMLP tasks
# that do both halves of a tile (the kinds' ``active``).
MOE_STEP = {**DECODER_STEP, "layer": ("QKV", "ATTN", "COMBINE", "OPROJ", "ROUTER", "ROUTE", "EGATEUP", "EDOWN",
                                      "EMLP")}


@dataclass(frozen=True)
class Family:
    name: str                      # ModelSpec.family
    architecture: str              # HF config "architectures" entry
    model_type: str                # HF config "model_type"
    qkv_bias: bool = False         # q/k/v projections carry a bias (added by QKV)
    qk_norm: bool = False          # per-head RMSNorm of q and k before RoPE (applied by ATTN)
    reads_sliding_window: bool = False    # the config's sliding_window applies (Mistral)
    rejects_use_sliding_window: bool = False   # use_sliding_window=true is unsupported (Qwen)
    # Mixture of experts: the checkpoint module of a sparse layer's MLP ("mlp" for Qwen3-MoE,
    # "block_sparse_moe" for Mixtral; None: a dense family), the names of one expert's gate, up and
    # down projections under it, whether the top-k routing weights are always renormalised (else the
    # config's norm_topk_prob says), and whether the expert outputs are scaled by the fp32 routing
    # weights before rounding (Mixtral) rather than by the weights rounded to the activation dtype.
    moe_block: str | None = None
    expert_linears: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    always_norm_topk: bool = False
    expert_weights_fp32: bool = False
    step: tuple[tuple[str, tuple[str, ...]], ...] = tuple(DECODER_STEP.items())   # (phase, kind names)
    # What transformers' config class of the family takes for a key config.json leaves out (5.x), for
    # the keys the spec reads with a default: a config written by hand or by an older library then
    # decodes as transformers loads it
    config_defaults: tuple[tuple[str, object], ...] = ()


_MODULES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")
FAMILIES: dict[str, Family] = {f.name: f for f in (import_module(f".{m}", __name__).FAMILY for m in _MODULES)}


def family(name: str) -> Family:
    return FAMILIES[name]


__all__ = ["DECODER_STEP", "FAMILIES", "Family", "MOE_STEP", "family"]
