"""AWQ checkpoints (AutoAWQ / llm-awq, ``quant_method: awq``, ``version: gemm``), 4 bits with zero points.

Per linear layer ``P`` (``in`` inputs, ``out`` outputs, ``G = in / group_size`` groups):
  ``P.qweight`` int32 ``[in, out / 8]``: codes packed along the outputs, the eight codes of a word in
                the order of outputs ``0 2 4 6 1 3 5 7`` (AutoAWQ's GEMM interleave);
  ``P.qzeros``  int32 ``[G, out / 8]``: zero codes, packed the same way;
  ``P.scales``  fp16 ``[G, out]``.
``W[o, k] = scales[k // group_size, o] * (code[k, o] - zero[k // group_size, o])``. The GEMV, Marlin and
exllama versions are other layouts and are refused.
"""
from __future__ import annotations

import torch

from ..errors import ModelError
from .common import Getter, check_codes_fit, need, option
from .linear import IntLinear
from .packing import pack_last, unpack_last
from .scheme import QuantScheme

METHODS = ("awq",)
MARKER = "qweight"
BITS = 4
GROUP_SIZES = (32, 64, 128)
SCALE_DTYPE = torch.float16
# Word position p holds output 8c + _ORDER[p]; output 8c + j sits at position _INVERSE[j].
_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_INVERSE = (0, 4, 1, 5, 2, 6, 3, 7)


def parse(qcfg: dict, where: str) -> QuantScheme:
    bits = option(qcfg, "bits", where, (int,), default=None) or option(qcfg, "w_bit", where, (int,))
    if bits != BITS:
        raise ModelError(f"{where}: AWQ with {bits} bits is not supported (AutoAWQ's GEMM layout is 4-bit)")
    gs = option(qcfg, "group_size", where, (int,), default=None) or option(qcfg, "q_group_size", where, (int,))
    if gs not in GROUP_SIZES:
        raise ModelError(f"{where}: AWQ group_size {gs} is not supported (supported: "
                         f"{', '.join(map(str, GROUP_SIZES))})")
    version = option(qcfg, "version", where, (str,), default="gemm").lower()
    if version != "gemm":
        raise ModelError(f"{where}: AWQ version '{version}' is not supported (only the GEMM layout is): "
                         "export the model with version='gemm'")
    if not option(qcfg, "zero_point", where, (bool,), default=True):
        raise ModelError(f"{where}: AWQ without zero points is not supported (AutoAWQ's GEMM layout stores them)")
    skip = option(qcfg, "modules_to_not_convert", where, (list,), default=[])
    return QuantScheme(method="awq", weight_type="int", bits=BITS, group_size=gs, has_zero_point=True,
                       variant="gemm", exclude_modules=tuple(dict.fromkeys([*map(str, skip), "lm_head"])))


def _interleave(out: int) -> torch.Tensor:
    """Column permutation taking outputs in order to AWQ's packed order (apply before packing)."""
    base = torch.arange(0, out, 8)[:, None]
    return (base + torch.tensor(_ORDER)).reshape(-1)


def _deinterleave(out: int) -> torch.Tensor:
    base = torch.arange(0, out, 8)[:, None]
    return (base + torch.tensor(_INVERSE)).reshape(-1)


def read(get: Getter, prefix: str, out: int, k: int, scheme: QuantScheme, where: str) -> IntLinear:
    gs = scheme.group_size
    what = f"AWQ group_size={gs}"
    check_codes_fit(f"{prefix} outputs", where, out, BITS)
    if k % gs:
        raise ModelError(f"{where}: {prefix}: {k} inputs are not a whole number of groups of {gs}")
    groups = k // gs
    qweight = need(get, f"{prefix}.qweight", where, torch.int32, (k, out // 8), what)
    qzeros = need(get, f"{prefix}.qzeros", where, torch.int32, (groups, out // 8), what)
    scales = need(get, f"{prefix}.scales", where, (torch.float16, torch.bfloat16, torch.float32), (groups, out), what)
    back = _deinterleave(out)
    codes = unpack_last(qweight, BITS, out)[:, back].T.contiguous()     # [out, in]
    zeros = unpack_last(qzeros, BITS, out)[:, back].T.contiguous()      # [out, G]
    return IntLinear(name=prefix, out_features=out, in_features=k, bits=BITS, group_size=gs,
                     qweight=pack_last(codes, BITS), scales=scales.T.contiguous(), zeros=zeros)


def write(lin: IntLinear, scheme: QuantScheme) -> dict[str, torch.Tensor]:
    fwd = _interleave(lin.out_features)
    return {"qweight": pack_last(lin.codes().T[:, fwd].contiguous(), BITS),
            "qzeros": pack_last(lin.zero_codes().T[:, fwd].contiguous(), BITS),
            "scales": lin.scales.T.contiguous().to(SCALE_DTYPE)}


def hf_config(scheme: QuantScheme) -> dict:
    return {"quant_method": "awq", "bits": BITS, "group_size": scheme.group_size, "zero_point": True,
            "version": "gemm", "modules_to_not_convert": None}
