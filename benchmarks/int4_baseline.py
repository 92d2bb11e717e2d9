"""The int4 weight-only baseline: gpt-fast's int4 decode path, on the benchmark's static-cache decoder.

Every decoder-layer linear of ``baselines.StaticCacheDecoder`` (fused q/k/v, o, fused gate/up, down)
runs torch's tinygemm kernel, ``aten._weight_int4pack_mm`` (bf16 activations, 4-bit weights packed by
``aten._convert_weight_to_int4pack``, one bf16 scale and offset per group of input columns), exactly as
gpt-fast's ``WeightOnlyInt4Linear`` does; embeddings, norms, attention and the LM head stay bf16. The
codes and scales are those of the ``W4A16Weights`` the megakernel binds, so both decode the same model.

tinygemm dequantizes ``w = (q - 8) * scale + offset``; a checkpoint's ``w = scale * (q - zero)`` is the
same with ``offset = scale * (8 - zero)`` (0 for symmetric codes, whose zero is 8).

Systems (registered on import; ``decode_latency --weights w4a16`` imports this module):
  torch.compile int4   the step compiled as the bf16 torch.compile system is (reduce-overhead, fullgraph)
  eager int4           the same decoder, kernel by kernel (also on the CPU, through tinygemm's CPU ops)
"""
from __future__ import annotations

import torch
from torch import nn

from trtllm_mk.model.spec import ModelSpec
from trtllm_mk.quant.linear import IntLinear

from .baselines import SystemRun, _require_cuda, compiled_step, prefilled_decoder, register_system, swap_layer_linears

NAME = "torch.compile int4"
EAGER_NAME = "eager int4"
TINYGEMM_GROUPS = (32, 64, 128, 256)
INNER_K_TILES = (8, 4, 2)           # tinygemm's choices; gpt-fast takes 8 where K allows it
MIN_CAPABILITY = (8, 0)             # tinygemm's CUDA kernel uses bf16 tensor-core mma


def tinygemm_ops(device: torch.device, namespace=None):
    """(pack, mm): tinygemm's weight packing and matmul for ``device`` from ``namespace`` (default
    ``torch.ops.aten``); a RuntimeError saying what is missing when this torch or GPU has none."""
    names = (("_convert_weight_to_int4pack", "_weight_int4pack_mm") if device.type == "cuda"
             else ("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu"))
    ns = torch.ops.aten if namespace is None else namespace
    ops = [getattr(ns, n, None) for n in names]
    for n, op in zip(names, ops):
        if op is None:
            raise RuntimeError(f"torch {torch.__version__} has no aten.{n} (tinygemm's int4 kernel), which the "
                               f"int4 baseline runs; it needs a torch with tinygemm (2.5 or later)")
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < MIN_CAPABILITY:
        raise RuntimeError(f"tinygemm's int4 kernel needs compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} "
                           f"or newer ({torch.cuda.get_device_name(device)})")
    return ops


def inner_k_tiles(k: int) -> int:
    for t in INNER_K_TILES:
        if k % (16 * t) == 0:
            return t
    raise ValueError(f"tinygemm needs input channels in multiples of 32 (got {k})")


def tinygemm_scales_and_zeros(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """bf16 ``[groups, out, 2]`` (scale, offset) for tinygemm from per-row, per-group ``scale`` and
    integer ``zero`` codes ``[out, groups]``."""
    s = scale.float()
    return torch.stack([s, s * (8 - zero.float())], -1).transpose(0, 1).to(torch.bfloat16).contiguous()


class TinygemmLinear(nn.Module):
    """One or more quantized linears with the same input (their rows stacked, as the decoder fuses
    q/k/v and gate/up) applied by tinygemm: ``x [..., in] -> [..., sum of out]``."""

    def __init__(self, parts: list[IntLinear], device: torch.device):
        super().__init__()
        first = parts[0]
        for p in parts:
            if (p.bits != 4 or p.g_idx is not None or p.group_size != first.group_size
                    or p.in_features != first.in_features):
                raise ValueError(f"{p.name}: tinygemm takes 4-bit weights with one group size and no activation order")
        if first.group_size not in TINYGEMM_GROUPS:
            raise ValueError(f"{first.name}: tinygemm takes groups of {', '.join(map(str, TINYGEMM_GROUPS))} "
                             f"columns, not {first.group_size}")
        pack, self._mm = tinygemm_ops(device)
        self.in_features, self.group = first.in_features, first.group_size
        codes = torch.cat([p.codes() for p in parts]).to(device=device, dtype=torch.int32)   # [out, in]
        self.out_features = codes.shape[0]
        if device.type == "cuda":   # the CUDA packer takes two codes a byte, the even column high
            codes = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
        self.register_buffer("weight", pack(codes.contiguous(), inner_k_tiles(self.in_features)), persistent=False)
        sz = tinygemm_scales_and_zeros(torch.cat([p.scales for p in parts]), torch.cat([p.zero_codes() for p in parts]))
        self.register_buffer("scales_and_zeros", sz.to(device), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()   # tinygemm takes a dense 2-D input
        y = self._mm(a, self.weight, self.group, self.scales_and_zeros)
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


def to_tinygemm(spec: ModelSpec, decoder: nn.Module, linears: dict[str, IntLinear]) -> None:
    """Replace every decoder-layer linear of ``decoder`` (a ``StaticCacheDecoder``) by a TinygemmLinear
    of the quantized ``linears`` (HF weight names)."""
    device = decoder.decoder.tok_embeddings.device
    swap_layer_linears(spec, decoder, lambda names: TinygemmLinear([linears[n] for n in names], device), "int4")


def _linears(weights) -> dict[str, IntLinear]:
    linears = getattr(weights, "linears", None)
    if linears is None:
        raise ValueError("the int4 baselines decode 4-bit weights: run the benchmark with --weights w4a16")
    return linears


def int4_decoder(spec, weights, batch: int, context_len: int, device: torch.device):
    """``prefilled_decoder`` with tinygemm linears: (decoder, tokens, input_pos) of a step at ``context_len``."""
    linears = _linears(weights)
    tinygemm_ops(device)   # the clear message before any memory is spent
    return prefilled_decoder(spec, weights, batch, context_len, device,
                             convert=lambda dec: to_tinygemm(spec, dec, linears))


def compile_int4_system(spec, weights, batch, context_len, device) -> SystemRun:
    _require_cuda(device, NAME)
    dec, tok, pos = int4_decoder(spec, weights, batch, context_len, device)
    step, close = compiled_step(dec, tok, pos)
    return SystemRun(step=step, close=close, info={"cache_len": dec.max_seq, "kernel": "tinygemm int4",
                                                   "group": weights.group})


def eager_int4_system(spec, weights, batch, context_len, device) -> SystemRun:
    dec, tok, pos = int4_decoder(spec, weights, batch, context_len, device)
    return SystemRun(step=lambda: dec.decode_step(tok, pos), info={"cache_len": dec.max_seq, "kernel": "tinygemm int4",
                                                                   "group": weights.group})


register_system(NAME, compile_int4_system, replace=True)
register_system(EAGER_NAME, eager_int4_system, replace=True)
