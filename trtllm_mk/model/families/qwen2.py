"""Qwen2: the Llama step with a bias on the q/k/v projections."""
from . import Family

FAMILY = Family("qwen2", architecture="Qwen2ForCausalLM", model_type="qwen2", qkv_bias=True,
                rejects_use_sliding_window=True,
                config_defaults=(("num_key_value_heads", 32), ("rms_norm_eps", 1e-6), ("rope_theta", 10000.0),
                                 ("max_position_embeddings", 32768)))
