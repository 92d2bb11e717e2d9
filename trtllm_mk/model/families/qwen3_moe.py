"""Qwen3-MoE: the Qwen3 step (QK-norm) whose sparse layers route each token to k of E SwiGLU experts
(softmax over the router's logits, top-k, renormalised when the config's norm_topk_prob says so)."""
from . import MOE_STEP, Family

FAMILY = Family("qwen3_moe", architecture="Qwen3MoeForCausalLM", model_type="qwen3_moe", qk_norm=True,
                rejects_use_sliding_window=True, moe_block="mlp", step=tuple(MOE_STEP.items()),
                config_defaults=(("num_key_value_heads", 4), ("rms_norm_eps", 1e-6), ("rope_theta", 10000.0),
                                 ("max_position_embeddings", 32768)))
