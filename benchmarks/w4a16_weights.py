"""Random 4-bit weights (W4A16), or FP8 ones, for the decode benchmark, in every form its systems consume.

The decoder-layer linears (q, k, v, o, gate, up, down) of a random bf16 model are round-to-nearest
quantized to 4 bits (``quant.kernel_layout.quantize_model``); embeddings, norms and the LM head stay
bf16. ``W4A16Weights`` is the dict of the weights exactly as the megakernel computes with them
(dequantized to bf16: what the bf16 systems and the TTFT prefill run, same shapes as a bf16 model),
and carries the two quantized forms beside it: ``kernel``, what the megakernel binds (packed codes and
scale words), and ``linears``, the quantized linears themselves (the int4 baseline packs those for
torch's tinygemm kernel). All three describe the same weights. An FP8 spec (``fp8_spec``: e4m3 codes,
one fp32 scale per output row, laid out one scale word per row and tile) goes through the same
``w4a16_weights``; its ``linears`` are ``Fp8Linear``.
"""
from __future__ import annotations

import dataclasses

import torch

from trtllm_mk.errors import UserError
from trtllm_mk.model.decoder_block import share_fused_storage
from trtllm_mk.model.random_weights import random_weights
from trtllm_mk.model.spec import ModelSpec
from trtllm_mk.quant.kernel_layout import (FP8_BITS, check_layout, check_layout_fp8, is_layer_linear, kernel_weights,
                                           quantize_model, tile_cols)
from trtllm_mk.quant.linear import Fp8Linear, IntLinear

DEFAULT_GROUP = 128


class W4A16Weights(dict):
    """name -> the kernel's weights rounded once to bf16 (or ``dtype``); ``kernel``: what the megakernel
    binds; ``linears``: name -> IntLinear of every decoder-layer linear; ``group``, ``symmetric``."""

    def __init__(self, dense: dict[str, torch.Tensor], kernel: dict[str, torch.Tensor],
                 linears: dict[str, IntLinear], group: int, symmetric: bool):
        super().__init__(dense)
        self.kernel, self.linears, self.group, self.symmetric = kernel, linears, group, symmetric


def w4a16_spec(spec: ModelSpec, group: int = DEFAULT_GROUP) -> ModelSpec:
    """``spec`` with 4-bit decoder-layer linears in groups of ``group`` input columns; a UserError
    (one line) when the kernel cannot lay out one of its matrices in such groups."""
    try:
        tile = tile_cols(spec)
    except ValueError as e:
        raise UserError(f"--weights w4a16: {e}") from None
    for name, shape in spec.expected_tensors().items():
        if is_layer_linear(name, shape):
            try:
                check_layout(shape[0], shape[1], group, tile)
            except ValueError as e:
                raise UserError(f"--group {group}: {spec.name}'s {name}: {e}") from None
    return dataclasses.replace(spec, weight_bits=4, weight_group=group)


def fp8_spec(spec: ModelSpec) -> ModelSpec:
    """``spec`` with FP8 (e4m3) decoder-layer linears, one scale word per row and ``tile_cols`` columns;
    a UserError (one line) when the kernel cannot lay out one of its matrices."""
    try:
        tile = tile_cols(spec)
        for name, shape in spec.expected_tensors().items():
            if is_layer_linear(name, shape):
                check_layout_fp8(shape[0], shape[1], tile)
    except ValueError as e:
        raise UserError(f"--weights fp8: {spec.name}: {e}") from None
    return dataclasses.replace(spec, weight_bits=FP8_BITS, weight_group=tile)


def w4a16_weights(spec: ModelSpec, device: str | torch.device, dtype: torch.dtype = torch.bfloat16,
                  seed: int = 0, symmetric: bool = True) -> W4A16Weights:
    """Random weights of the quantized ``spec`` (``w4a16_spec``): bf16 random weights (as the bf16
    benchmark draws them) with every decoder-layer linear RTN-quantized in ``spec.weight_group`` groups
    (FP8 specs: to e4m3 with per-channel scales; ``symmetric`` does not apply).
    The dense dict shares one fused storage per layer for q/k/v and gate/up (a decoder built from it
    fuses without copying)."""
    if not spec.quantized:
        raise ValueError(f"w4a16_weights: {spec.name} is not a quantized spec (see w4a16_spec)")
    q = quantize_model(spec, random_weights(spec, device, torch.bfloat16, seed), symmetric=symmetric)
    bind, dense = kernel_weights(spec, q, dense_dtype=dtype)
    linears = {n: v for n, v in q.items() if isinstance(v, (IntLinear, Fp8Linear))}
    del q
    dense = share_fused_storage(spec, {n: t.to(dtype) for n, t in dense.items()})
    return W4A16Weights(dense, bind, linears, spec.weight_group, symmetric)
