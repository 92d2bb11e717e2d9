"""Prefill backends: ``torch`` (default everywhere) and ``tensorrt_llm`` (where installed).

Each backend turns prompts into their K/V in our paged cache and the first generated token:
``first_tokens(prompts, cache) -> int32 [B]``; decode then continues on the megakernel.
"""
from __future__ import annotations

from ..deployment import resolve_prefill_backend
from ..errors import UserError


def resolve_backend(name: str) -> str:
    """``auto`` -> tensorrt_llm when installed, else torch (one check, shared with the summary)."""
    return resolve_prefill_backend(name)[0]


class _TorchFirstTokens:
    def __init__(self, spec, weights):
        from .torch_prefill import TorchPrefill
        self.impl = TorchPrefill(spec, weights)

    def first_tokens(self, prompts, cache):
        return self.impl.prefill(prompts, cache).argmax(-1).int()


class _TrtllmFirstTokens:
    def __init__(self, engine_dir, weights_dir):
        from .tensorrt_llm_backend import TensorRTLLMPrefill
        self.impl = TensorRTLLMPrefill(engine_dir=engine_dir, weights_dir=weights_dir)

    def first_tokens(self, prompts, cache):
        first, _handover = self.impl.prefill(prompts, cache)
        return first.int()


def make_prefill(name: str, spec, weights, engine_dir=None, weights_dir=None):
    """The configured backend; ``tensorrt_llm`` loads the HF checkpoint itself (it keeps its own copy)."""
    name = resolve_backend(name)
    if name == "torch":
        return _TorchFirstTokens(spec, weights)
    if weights_dir is None:
        raise UserError("prefill.backend tensorrt_llm needs an HF checkpoint directory (--weights DIR); "
                        "random weights run with prefill.backend: torch")
    return _TrtllmFirstTokens(engine_dir, weights_dir)
