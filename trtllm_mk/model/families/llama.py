"""Llama: the plain decoder step."""
from . import Family

FAMILY = Family("llama", architecture="LlamaForCausalLM", model_type="llama")
