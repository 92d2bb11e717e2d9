"""Mistral: the Llama step; its config's sliding window is read (and checked against the context)."""
from . import Family

FAMILY = Family("mistral", architecture="MistralForCausalLM", model_type="mistral", reads_sliding_window=True)
