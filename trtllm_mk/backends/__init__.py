"""Prefill backends: ``torch`` (default everywhere) and ``tensorrt_llm`` (where installed)."""
from __future__ import annotations

from ..deployment import resolve_prefill_backend


def resolve_backend(name: str) -> str:
    """``auto`` -> tensorrt_llm when installed, else torch (one check, shared with the summary)."""
    return resolve_prefill_backend(name)[0]


def make_prefill(name: str, spec, weights, **kw):
    name = resolve_backend(name)
    if name == "torch":
        from .torch_prefill import TorchPrefill
        return TorchPrefill(spec, weights)
    from .tensorrt_llm_backend import TensorRTLLMPrefill
    return TensorRTLLMPrefill(spec=spec, weights=weights, **kw)
