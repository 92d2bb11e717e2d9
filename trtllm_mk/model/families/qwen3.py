"""Qwen3: the Llama step with per-head RMSNorm of q and k (QK-norm) before RoPE."""
from . import Family

FAMILY = Family("qwen3", architecture="Qwen3ForCausalLM", model_type="qwen3", qk_norm=True,
                rejects_use_sliding_window=True)
