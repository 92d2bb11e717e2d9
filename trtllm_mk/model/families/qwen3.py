"""Qwen3: the Llama step with per-head RMSNorm of q and k (QK-norm) before RoPE."""
from . import Family

FAMILY = Family("qwen3", architecture="Qwen3ForCausalLM", model_type="qwen3", qk_norm=True,
                rejects_use_sliding_window=True,
                config_defaults=(("num_key_value_heads", 32), ("head_dim", 128), ("rms_norm_eps", 1e-6),
                                 ("rope_theta", 10000.0), ("max_position_embeddings", 32768)))
