"""GPTQ checkpoints (AutoGPTQ / GPTQModel / optimum, ``quant_method: gptq``), 4 and 8 bits.

Per linear layer ``P`` (``in`` inputs, ``out`` outputs, ``G`` groups):
  ``P.qweight`` int32 ``[in * bits / 32, out]``: codes packed along the inputs;
  ``P.qzeros``  int32 ``[G, out * bits / 32]``: zero codes packed along the outputs, stored as
                ``zero - 1`` in the original layout (``checkpoint_format: gptq``), as is in ``gptq_v2``;
  ``P.scales``  fp16 ``[G, out]``;
  ``P.g_idx``   int32 ``[in]``: each input's group (``k // group_size`` unless ``desc_act``).
``W[o, k] = scales[g, o] * (code[k, o] - zero[g, o])`` with ``g = g_idx[k]``. The v1 zero is the
stored field plus one without masking (AutoGPTQ's kernels), so it can reach ``2**bits``.
Exllama / Marlin repacked layouts are refused: they are device-specific permutations.
"""
from __future__ import annotations

import torch

from ..errors import ModelError
from .common import Getter, check_codes_fit, checked_g_idx, groups_of, need, option
from .linear import IntLinear
from .packing import SUPPORTED_BITS, pack_last, unpack_last
from .scheme import PER_CHANNEL, QuantScheme

METHODS = ("gptq",)
MARKER = "qweight"
FORMATS = ("gptq", "gptq_v2")
GROUP_SIZES = (32, 64, 128, PER_CHANNEL)
SCALE_DTYPE = torch.float16


def parse(qcfg: dict, where: str) -> QuantScheme:
    bits = option(qcfg, "bits", where, (int,), choices=SUPPORTED_BITS)
    group_size = option(qcfg, "group_size", where, (int,), default=PER_CHANNEL, choices=GROUP_SIZES)
    # GPTQModel writes the layout as "format" where checkpoint_format is absent
    fmt = option(qcfg, "checkpoint_format", where, (str,), default=None) or option(qcfg, "format", where, (str,),
                                                                                  default="gptq")
    if fmt not in FORMATS:
        raise ModelError(f"{where}: GPTQ checkpoint_format '{fmt}' is not supported (a device-specific repacking; "
                         f"supported: {', '.join(FORMATS)}): export the model in the plain GPTQ layout")
    sym = option(qcfg, "sym", where, (bool,), default=True)
    desc_act = option(qcfg, "desc_act", where, (bool,), default=False)
    lm_head = option(qcfg, "lm_head", where, (bool,), default=False)
    return QuantScheme(method="gptq", weight_type="int", bits=bits, group_size=group_size, has_zero_point=not sym,
                       desc_act=desc_act, variant=fmt, exclude_modules=() if lm_head else ("lm_head",))


def _what(s: QuantScheme) -> str:
    return f"GPTQ bits={s.bits} group_size={s.group_size}"


def read(get: Getter, prefix: str, out: int, k: int, scheme: QuantScheme, where: str) -> IntLinear:
    bits, what = scheme.bits, _what(scheme)
    gs = k if scheme.group_size == PER_CHANNEL else scheme.group_size
    groups = groups_of(k, scheme.group_size)
    check_codes_fit(f"{prefix} inputs", where, k, bits)
    check_codes_fit(f"{prefix} outputs", where, out, bits)
    qweight = need(get, f"{prefix}.qweight", where, torch.int32, (k * bits // 32, out), what)
    qzeros = need(get, f"{prefix}.qzeros", where, torch.int32, (groups, out * bits // 32), what)
    scales = need(get, f"{prefix}.scales", where, (torch.float16, torch.bfloat16, torch.float32), (groups, out), what)
    g_idx = checked_g_idx(get, f"{prefix}.g_idx", where, k, gs, groups, scheme.desc_act, what)
    if g_idx is None and k % gs:
        raise ModelError(f"{where}: {prefix}: {k} inputs are not a whole number of groups of {gs}")
    zeros = unpack_last(qzeros, bits, out).T.contiguous()          # [out, G]
    if scheme.variant == "gptq":
        zeros = zeros + 1
    mid = 1 << (bits - 1)
    symmetric = bool((zeros == mid).all())
    if not symmetric and not scheme.has_zero_point:
        # sym: true with other zeros is a mislabelled checkpoint: in the other checkpoint_format's zero
        # convention every zero is one off the midpoint; either way its weights would decode wrong
        seen = sorted({int(z) for z in zeros.unique()[:3]})
        hint = (f"every zero point reads {seen[0]}: a checkpoint_format {scheme.variant} / "
                f"{'gptq_v2' if scheme.variant == 'gptq' else 'gptq'} mix-up?" if len(seen) == 1 and abs(seen[0] - mid) == 1
                else f"zero points {', '.join(map(str, seen))}...: an asymmetric checkpoint?")
        raise ModelError(f"{where}: {prefix}: config.json declares sym: true (zero point {mid}), but its qzeros do "
                         f"not ({hint}); correct sym or checkpoint_format in its quantization_config")
    codes = unpack_last(qweight.T.contiguous(), bits, k)            # [out, in]
    return IntLinear(name=prefix, out_features=out, in_features=k, bits=bits, group_size=gs,
                     qweight=pack_last(codes, bits), scales=scales.T.contiguous(),
                     zeros=None if symmetric else zeros.to(torch.int32), g_idx=g_idx)


def write(lin: IntLinear, scheme: QuantScheme) -> dict[str, torch.Tensor]:
    """The GPTQ tensors of ``lin`` (suffix -> tensor), in ``scheme.variant``'s zero convention."""
    zeros = lin.zero_codes() - (1 if scheme.variant == "gptq" else 0)
    if int(zeros.min()) < 0:
        raise ValueError(f"{lin.name}: a zero code of 0 has no encoding in GPTQ's original layout")
    g_idx = lin.group_of_input().to(torch.int32)
    return {"qweight": pack_last(lin.codes(), lin.bits).T.contiguous(),
            "qzeros": pack_last(zeros.T.contiguous(), lin.bits),
            "scales": lin.scales.T.contiguous().to(SCALE_DTYPE), "g_idx": g_idx}


def hf_config(scheme: QuantScheme) -> dict:
    return {"quant_method": "gptq", "bits": scheme.bits, "group_size": scheme.group_size,
            "desc_act": scheme.desc_act, "sym": not scheme.has_zero_point, "static_groups": False,
            "true_sequential": True, "damp_percent": 0.01, "checkpoint_format": scheme.variant or "gptq",
            "lm_head": "lm_head" not in scheme.exclude_modules,
            "meta": {"quantizer": ["trtllm_mk round-to-nearest"]}}
