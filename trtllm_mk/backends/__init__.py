"""Prefill backends: ``torch`` (default everywhere) and ``tensorrt_llm`` (where installed)."""
from __future__ import annotations


def resolve_backend(name: str) -> str:
    """``auto`` -> tensorrt_llm when importable, else torch."""
    if name != "auto":
        return name
    from .tensorrt_llm_backend import is_available
    return "tensorrt_llm" if is_available() else "torch"


def make_prefill(name: str, spec, weights, **kw):
    name = resolve_backend(name)
    if name == "torch":
        from .torch_prefill import TorchPrefill
        return TorchPrefill(spec, weights)
    from .tensorrt_llm_backend import TensorRTLLMPrefill
    return TensorRTLLMPrefill(spec=spec, weights=weights, **kw)
