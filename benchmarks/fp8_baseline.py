"""The FP8 weight-only baseline: gpt-fast's weight-only quantized decode path with e4m3 weights.

Every decoder-layer linear of ``baselines.StaticCacheDecoder`` (fused q/k/v, o, fused gate/up, down)
holds its e4m3 codes and one fp32 scale per output row, and computes ``(x @ W_fp8.to(bf16).T) * scale``,
the form of gpt-fast's ``WeightOnlyInt8Linear``: under torch.compile, inductor fuses the conversion
into the matrix-vector product, so a decode step reads one byte per weight. Embeddings, norms,
attention and the LM head stay bf16. The codes and scales are those of the weights the megakernel
binds (``w4a16_weights.fp8_spec``), so both decode the same model (up to where the scale is applied:
here to the fp32 product, in the megakernel to the dequantized bf16 weight).

Systems (registered on import; ``decode_latency --weights fp8`` imports this module):
  torch.compile fp8   the step compiled as the bf16 torch.compile system is (reduce-overhead, fullgraph)
  eager fp8           the same decoder, kernel by kernel (also on the CPU)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trtllm_mk.model.spec import ModelSpec
from trtllm_mk.quant.linear import Fp8Linear

from .baselines import SystemRun, _require_cuda, compiled_step, prefilled_decoder, register_system, swap_layer_linears

NAME = "torch.compile fp8"
EAGER_NAME = "eager fp8"


class Fp8WeightOnlyLinear(nn.Module):
    """One or more FP8 linears with the same input (rows stacked, as the decoder fuses q/k/v and
    gate/up): ``x [..., in] -> [..., sum of out]``."""

    def __init__(self, parts: list[Fp8Linear], device: torch.device):
        super().__init__()
        for p in parts:
            if not p.per_channel or p.in_features != parts[0].in_features:
                raise ValueError(f"{p.name}: the FP8 baseline takes per-channel scales and one input width")
        self.register_buffer("weight", torch.cat([p.weight for p in parts]).to(device), persistent=False)
        self.register_buffer("scale", torch.cat([p.scale.float() for p in parts]).to(device), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (F.linear(x, self.weight.to(x.dtype)).float() * self.scale).to(x.dtype)


def to_fp8(spec: ModelSpec, decoder: nn.Module, linears: dict[str, Fp8Linear]) -> None:
    """Replace every decoder-layer linear of ``decoder`` (a ``StaticCacheDecoder``) by an
    Fp8WeightOnlyLinear of the FP8 ``linears`` (HF weight names)."""
    device = decoder.decoder.tok_embeddings.device
    swap_layer_linears(spec, decoder, lambda names: Fp8WeightOnlyLinear([linears[n] for n in names], device), "FP8")


def fp8_decoder(spec, weights, batch: int, context_len: int, device: torch.device):
    """``prefilled_decoder`` with FP8 linears: (decoder, tokens, input_pos) of a step at ``context_len``."""
    linears = getattr(weights, "linears", None)
    if not linears or not all(isinstance(v, Fp8Linear) for v in linears.values()):
        raise ValueError("the FP8 baselines decode FP8 weights: run the benchmark with --weights fp8")
    return prefilled_decoder(spec, weights, batch, context_len, device, convert=lambda dec: to_fp8(spec, dec, linears))


def compile_fp8_system(spec, weights, batch, context_len, device) -> SystemRun:
    _require_cuda(device, NAME)
    dec, tok, pos = fp8_decoder(spec, weights, batch, context_len, device)
    step, close = compiled_step(dec, tok, pos)
    return SystemRun(step=step, close=close, info={"cache_len": dec.max_seq, "kernel": "inductor fp8 weight-only"})


def eager_fp8_system(spec, weights, batch, context_len, device) -> SystemRun:
    dec, tok, pos = fp8_decoder(spec, weights, batch, context_len, device)
    return SystemRun(step=lambda: dec.decode_step(tok, pos), info={"cache_len": dec.max_seq, "kernel": "fp8 weight-only"})


register_system(NAME, compile_fp8_system, replace=True)
register_system(EAGER_NAME, eager_fp8_system, replace=True)
