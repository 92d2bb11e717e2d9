"""Model description (ModelSpec), architecture registry, checkpoint loading and random weights.

``tiny`` (tiny test checkpoints) is imported on its own: ``from trtllm_mk.model.tiny import ...``,
so that ``python -m trtllm_mk.model.tiny`` runs it without a second copy of the module.
"""
from .checkpoint import load_checkpoint
from .random_weights import random_weights
from .registry import ResolvedModel, list_models, resolve_model
from .spec import ModelSpec, load_spec, spec_from_hf_config

__all__ = ["ModelSpec", "ResolvedModel", "list_models", "load_checkpoint", "load_spec", "random_weights",
           "resolve_model", "spec_from_hf_config"]
