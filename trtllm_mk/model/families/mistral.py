"""Mistral: the Llama step; its config's sliding window is read (and checked against the context)."""
from . import Family

FAMILY = Family("mistral", architecture="MistralForCausalLM", model_type="mistral", reads_sliding_window=True,
                config_defaults=(("num_key_value_heads", 8), ("sliding_window", 4096), ("rms_norm_eps", 1e-6),
                                 ("rope_theta", 10000.0), ("max_position_embeddings", 131072)))
