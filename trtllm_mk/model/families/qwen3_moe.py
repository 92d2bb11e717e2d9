"""Qwen3-MoE: the Qwen3 step (QK-norm) whose sparse layers route each token to k of E SwiGLU experts
(softmax over the router's logits, top-k, renormalised when the config's norm_topk_prob says so)."""
from . import MOE_STEP, Family

FAMILY = Family("qwen3_moe", architecture="Qwen3MoeForCausalLM", model_type="qwen3_moe", qk_norm=True,
                rejects_use_sliding_window=True, moe_block="mlp", step=tuple(MOE_STEP.items()))
