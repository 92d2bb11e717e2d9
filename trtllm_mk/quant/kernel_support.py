"""Which quantized weights an engine can be built for, and the model spec the megakernel is built with.

The megakernel streams a decoder layer's linear weights as 4-bit integers with one bf16 scale (and a
zero point) per group of input columns, or as FP8 e4m3 bytes with one scale per output row
(``kernel_layout.py``). A checkpoint or a deployment's ``quantization`` section that declares exactly
that (GPTQ, AWQ or compressed-tensors pack-quantized, 4-bit, grouped or per-channel, symmetric or with
zero points, groups in column order) gives a spec with ``weight_bits=4`` and the layout's group; FP8
weights with per-channel or per-tensor scales (compressed-tensors float-quantized, ModelOpt, fbgemm
FP8) give ``weight_bits=8`` and ``weight_group`` = the layout's tile. Anything else is named here, in
one sentence, as what the kernel does not implement.
"""
from __future__ import annotations

import dataclasses

from .kernel_layout import BITS, FP8_BITS, SUPPORTED_GROUPS, check_layout, check_layout_fp8, is_layer_linear, tile_cols
from .scheme import PER_CHANNEL, PER_TENSOR, QuantScheme

# per-channel scales are repeated over groups of this many columns (the largest that fits the model)
PER_CHANNEL_GROUPS = (128, 64, 32)


class UnsupportedQuantization(ValueError):
    """The kernel cannot stream these weights; the message is one sentence saying which part is missing."""


def unsupported_reason(scheme: QuantScheme) -> str | None:
    """What of ``scheme`` the megakernel does not implement, or None when it streams these weights."""
    if scheme.weight_type == "fp8":
        if scheme.group_size not in (PER_CHANNEL, PER_TENSOR):
            return (f"{scheme.describe()}: FP8 weights with block scales (group size {scheme.group_size}) are not "
                    "implemented in the megakernel (it takes one scale per output channel or per tensor)")
    elif scheme.weight_type != "int":
        return f"{scheme.describe()}: {scheme.weight_type} weights are not implemented in the megakernel"
    elif scheme.bits != BITS:
        return (f"{scheme.describe()}: {scheme.bits}-bit integer weights (W{scheme.bits}A16) are not implemented in the "
                "megakernel (its quantized GEMV kinds take 4-bit integer or FP8 weights); requantize with --bits 4")
    if scheme.weight_type == "int" and scheme.group_size != PER_CHANNEL and scheme.group_size not in SUPPORTED_GROUPS:
        return (f"{scheme.describe()}: group size {scheme.group_size} is not one the megakernel's weight layout "
                f"implements ({', '.join(map(str, SUPPORTED_GROUPS))}, or per-channel)")
    # Activation order (desc_act) and modules left dense are decided by the tensors, layer by layer
    # (kernel_layout.layer_reason, in the builder's read of the checkpoint): a desc_act checkpoint whose
    # groups are in column order streams as any other, an exclusion outside the decoder layers is moot.
    return None


def kernel_group(spec, scheme: QuantScheme) -> int:
    """Columns per scale word of ``spec``'s weights under ``scheme``: the scheme's group, or for a
    per-channel scheme the largest of 128/64/32 that divides every layer linear's input columns."""
    if scheme.group_size != PER_CHANNEL:
        return scheme.group_size
    ins = {shape[1] for name, shape in spec.expected_tensors().items() if is_layer_linear(name, shape)}
    for g in PER_CHANNEL_GROUPS:
        if all(k % g == 0 for k in ins):
            return g
    raise UnsupportedQuantization(f"{scheme.describe()}: the layers' input channels ({', '.join(map(str, sorted(ins)))}) "
                                  "are not all multiples of 32, which the megakernel's weight layout needs")


def quantized_spec(spec, scheme: QuantScheme):
    """``spec`` as the megakernel streams ``scheme``'s weights (``weight_bits=4`` and the layout's group;
    FP8: ``weight_bits=8``, ``weight_group`` = ``tile_cols(spec)``), or UnsupportedQuantization saying
    what the kernel does not implement."""
    reason = unsupported_reason(scheme)
    if reason:
        raise UnsupportedQuantization(reason)
    try:
        tile = tile_cols(spec)
    except ValueError as e:
        raise UnsupportedQuantization(f"{scheme.describe()}: {e}") from None
    fp8 = scheme.weight_type == "fp8"
    group = tile if fp8 else kernel_group(spec, scheme)
    for name, shape in spec.expected_tensors().items():
        if is_layer_linear(name, shape):
            try:
                if fp8:
                    check_layout_fp8(shape[0], shape[1], tile)
                else:
                    check_layout(shape[0], shape[1], group, tile)
            except ValueError as e:
                raise UnsupportedQuantization(f"{scheme.describe()}: {name} [{shape[0]}, {shape[1]}] cannot be laid out "
                                              f"for the megakernel: {e}") from None
    return dataclasses.replace(spec, weight_bits=FP8_BITS if fp8 else BITS, weight_group=group)


def weight_format(spec) -> str:
    """How ``spec``'s decoder layer weights are streamed, for reports: "W4A16 (group 128)",
    "FP8 (e4m3, per-channel scales)" or the dtype."""
    if spec.weight_bits == FP8_BITS:
        return "FP8 (e4m3, per-channel scales)"
    if spec.quantized:
        return f"W{spec.weight_bits}A16 (group {spec.weight_group})"
    return spec.dtype
