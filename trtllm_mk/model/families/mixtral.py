"""Mixtral: the Mistral step whose every layer routes each token to k of E SwiGLU experts (w1 gate,
w3 up, w2 down), the top-k weights always renormalised."""
from . import MOE_STEP, Family

FAMILY = Family("mixtral", architecture="MixtralForCausalLM", model_type="mixtral", reads_sliding_window=True,
                moe_block="block_sparse_moe", expert_linears=("w1", "w3", "w2"), always_norm_topk=True,
                expert_weights_fp32=True, step=tuple(MOE_STEP.items()),
                config_defaults=(("num_key_value_heads", 8), ("rms_norm_eps", 1e-5), ("rope_theta", 1e6),
                                 ("max_position_embeddings", 131072)))
