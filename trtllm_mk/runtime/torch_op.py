"""``torch.ops.trtllm_mk.decode_step``: one megakernel step as a PyTorch custom op.

The op mutates the decode state it is given (tokens, positions, KV pool), which tells torch.compile,
CUDA-graph capture and TensorRT-LLM's PyTorch backend what the step reads and writes; the bound
MegakernelDecoder is found by an integer handle, since custom ops take tensors, not objects.
"""
from __future__ import annotations

from itertools import count

import torch

from .megakernel import MegakernelDecoder

_DECODERS: dict[int, MegakernelDecoder] = {}
_HANDLES = count(1)     # never reused: a stale handle must not reach a later decoder


def register(decoder: MegakernelDecoder) -> int:
    """Make ``decoder`` callable from the op; returns its handle."""
    handle = next(_HANDLES)
    _DECODERS[handle] = decoder
    return handle


def unregister(handle: int) -> None:
    """Drop the op's reference to the decoder under ``handle`` (its buffers can then be freed)."""
    _DECODERS.pop(handle, None)


@torch.library.custom_op("trtllm_mk::decode_step", mutates_args=("tokens", "pos", "kv_pool", "logits"))
def decode_step(handle: int, tokens: torch.Tensor, pos: torch.Tensor, kv_pool: torch.Tensor,
                logits: torch.Tensor) -> None:
    """Advance every sequence by one token: tokens <- argmax, pos <- pos + 1, K/V appended in kv_pool,
    logits <- this step's logits. ``tokens``/``pos``/``logits`` must be the decoder's own buffers
    (``decoder.buf``) so that the step needs no host work but its launch."""
    dec = _DECODERS.get(handle)
    if dec is None:
        raise RuntimeError(f"trtllm_mk::decode_step: no decoder registered under handle {handle}")
    if tokens.data_ptr() != dec.buf.tokens.data_ptr() or pos.data_ptr() != dec.buf.pos.data_ptr() \
            or kv_pool.data_ptr() != dec.cache.pool.data_ptr() or logits.data_ptr() != dec.buf.logits.data_ptr():
        raise RuntimeError("trtllm_mk::decode_step: pass the decoder's own buffers (decoder.buf.tokens, "
                           "decoder.buf.pos, decoder.cache.pool, decoder.buf.logits)")
    dec.step()


@decode_step.register_fake
def _(handle, tokens, pos, kv_pool, logits):
    return None


def step_op(decoder: MegakernelDecoder, handle: int) -> None:
    """Convenience: call the op on a decoder's own buffers."""
    torch.ops.trtllm_mk.decode_step(handle, decoder.buf.tokens, decoder.buf.pos, decoder.cache.pool,
                                    decoder.buf.logits)
