"""Llama: the plain decoder step."""
from . import Family

FAMILY = Family("llama", architecture="LlamaForCausalLM", model_type="llama",
                config_defaults=(("rms_norm_eps", 1e-6), ("rope_theta", 10000.0), ("max_position_embeddings", 2048)))
