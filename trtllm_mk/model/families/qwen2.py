"""Qwen2: the Llama step with a bias on the q/k/v projections."""
from . import Family

FAMILY = Family("qwen2", architecture="Qwen2ForCausalLM", model_type="qwen2", qkv_bias=True,
                rejects_use_sliding_window=True)
