"""compressed-tensors checkpoints (llmcompressor, ``quant_method: compressed-tensors``): the
``pack-quantized`` integer weights (W4A16, W8A16) and the ``float-quantized`` FP8 weights.

pack-quantized, per linear layer ``P`` (``G`` groups, one for the ``channel`` strategy):
  ``P.weight_packed``     int32 ``[out, in * bits / 32]``: ``q + 2**(bits-1)`` packed along the inputs;
  ``P.weight_scale``      ``[out, G]`` in the model's dtype;
  ``P.weight_zero_point`` int32 ``[out * bits / 32, G]``: ``zp + 2**(bits-1)`` packed along the outputs
                          (asymmetric only; symmetric weights have ``zp = 0``);
  ``P.weight_shape``      int ``[2]``: ``[out, in]``;
  ``P.weight_g_idx``      int32 ``[in]`` (``actorder: group`` only).
``W = scale * (q - zp)`` with signed ``q, zp``: the unsigned codes of the canonical form are exactly the
packed fields, and the symmetric zero is the midpoint code.
float-quantized: ``P.weight`` float8_e4m3fn ``[out, in]``, ``P.weight_scale`` ``[out, 1]`` (channel) or
``[1]`` (tensor), ``W = weight * scale``; a static ``P.input_scale`` is kept on the object.
Transforms (rotations), sparsity, other bit widths, block scales and quantized activations of the
integer formats change the arithmetic and are refused.
"""
from __future__ import annotations

import torch

from ..errors import ModelError
from .common import Getter, check_codes_fit, checked_g_idx, groups_of, need, option
from .linear import Fp8Linear, IntLinear
from .packing import SUPPORTED_BITS, pack_last, unpack_last
from .scheme import PER_CHANNEL, PER_TENSOR, QuantScheme

METHODS = ("compressed-tensors",)
PACKED, FLOAT, NAIVE = "pack-quantized", "float-quantized", "naive-quantized"
FORMATS = (PACKED, FLOAT, NAIVE)   # naive-quantized: FP8 weights only (the tensors of float-quantized)
GROUP_SIZES = (32, 64, 128)
_SCALE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def marker(scheme: QuantScheme) -> str:
    return "weight_packed" if scheme.variant == PACKED else "weight_scale"


def _weights_args(qcfg: dict, where: str) -> dict:
    groups = option(qcfg, "config_groups", where, (dict,))
    if not groups:
        raise ModelError(f"{where}: compressed-tensors quantization_config has no config_groups")
    schemes = []
    for name, g in groups.items():
        if not isinstance(g, dict) or not isinstance(g.get("weights"), dict):
            raise ModelError(f"{where}: config_groups.{name} has no 'weights' arguments (weight quantization)")
        if g.get("output_activations") is not None:
            raise ModelError(f"{where}: config_groups.{name}: quantized output activations are not supported")
        schemes.append((g["weights"], g.get("input_activations"), g.get("format")))
    if any(s != schemes[0] for s in schemes[1:]):
        raise ModelError(f"{where}: config_groups quantize layers differently (mixed precision); one scheme "
                         "for every quantized layer is supported")
    w, act, fmt = schemes[0]
    return {"weights": w, "input_activations": act, "format": fmt}


def parse(qcfg: dict, where: str) -> QuantScheme:
    for key, label in (("transform_config", "transforms (rotations)"), ("sparsity_config", "sparsity")):
        if qcfg.get(key):
            raise ModelError(f"{where}: compressed-tensors {label} {'is' if key == 'sparsity_config' else 'are'} not "
                             "supported")
    status = option(qcfg, "quantization_status", where, (str,), default="compressed")
    if status != "compressed":
        raise ModelError(f"{where}: compressed-tensors quantization_status '{status}' is not supported (save the "
                         "model compressed: quantization_status 'compressed')")
    args = _weights_args(qcfg, where)
    fmt = args["format"] or option(qcfg, "format", where, (str,))
    if fmt not in FORMATS:
        raise ModelError(f"{where}: compressed-tensors format '{fmt}' is not supported (supported: "
                         f"{', '.join(FORMATS)})")
    w, act = args["weights"], args["input_activations"]
    wt = f"{where}: config_groups weights"
    kind = option(w, "type", wt, (str,), default="int", choices=("int", "float"))
    if fmt == NAIVE:
        # what compressed-tensors writes for FP8 weights when no format is forced: float-quantized's tensors
        if kind != "float":
            raise ModelError(f"{where}: compressed-tensors naive-quantized integer weights (unpacked codes) are not "
                             "supported; save them pack-quantized")
        fmt = FLOAT
    bits = option(w, "num_bits", wt, (int,), default=8)
    strategy = option(w, "strategy", wt, (str,), default="tensor")
    symmetric = option(w, "symmetric", wt, (bool,), default=True)
    if option(w, "dynamic", wt, (bool, str), default=False):
        raise ModelError(f"{where}: dynamically quantized weights are not supported")
    ignore = tuple(str(m) for m in option(qcfg, "ignore", where, (list,), default=[]))
    if fmt == PACKED:
        if kind != "int" or bits not in SUPPORTED_BITS:
            raise ModelError(f"{where}: pack-quantized {kind}{bits} weights are not supported (int4 and int8 are)")
        if act is not None:
            raise ModelError(f"{where}: pack-quantized weights with quantized input activations (W{bits}A8) are "
                             "not supported; weight-only (input_activations null) is")
        if strategy == "group":
            gs = option(w, "group_size", wt, (int,), choices=GROUP_SIZES)
        elif strategy == "channel":
            gs = PER_CHANNEL
        else:
            raise ModelError(f"{where}: pack-quantized strategy '{strategy}' is not supported (group, channel)")
        actorder = option(w, "actorder", wt, (str, bool), default=None)
        return QuantScheme(method="compressed-tensors", weight_type="int", bits=bits, group_size=gs,
                           has_zero_point=not symmetric, desc_act=actorder in ("group", True), variant=PACKED,
                           exclude_modules=ignore)
    if kind != "float" or bits != 8:
        raise ModelError(f"{where}: float-quantized {kind}{bits} weights are not supported (fp8 e4m3 is)")
    if strategy not in ("channel", "tensor"):
        raise ModelError(f"{where}: float-quantized strategy '{strategy}' is not supported (channel, tensor; "
                         "block scales are not)")
    if not symmetric:
        raise ModelError(f"{where}: asymmetric FP8 weights are not supported")
    return QuantScheme(method="compressed-tensors", weight_type="fp8", bits=8,
                       group_size=PER_CHANNEL if strategy == "channel" else PER_TENSOR, has_zero_point=False,
                       variant=FLOAT, exclude_modules=ignore)


def read(get: Getter, prefix: str, out: int, k: int, scheme: QuantScheme, where: str):
    if scheme.variant == FLOAT:
        return _read_fp8(get, prefix, out, k, scheme, where)
    bits = scheme.bits
    gs = k if scheme.group_size == PER_CHANNEL else scheme.group_size
    groups = groups_of(k, scheme.group_size)
    what = f"compressed-tensors int{bits} group_size={scheme.group_size}"
    check_codes_fit(f"{prefix} inputs", where, k, bits)
    packed = need(get, f"{prefix}.weight_packed", where, torch.int32, (out, k * bits // 32), what)
    scale = need(get, f"{prefix}.weight_scale", where, _SCALE_DTYPES, (out, groups), what)
    shape = get(f"{prefix}.weight_shape")
    if shape is None or shape.numel() != 2 or [int(v) for v in shape] != [out, k]:
        got = "absent" if shape is None else [int(v) for v in shape.reshape(-1)]
        raise ModelError(f"{where}: {prefix}.weight_shape is {got}, expected [{out}, {k}]")
    zeros = None
    if scheme.has_zero_point:
        check_codes_fit(f"{prefix} outputs", where, out, bits)
        zp = need(get, f"{prefix}.weight_zero_point", where, torch.int32, (out * bits // 32, groups), what)
        zeros = unpack_last(zp.T.contiguous(), bits, out).T.contiguous()
    g_idx = checked_g_idx(get, f"{prefix}.weight_g_idx", where, k, gs, groups, scheme.desc_act, what)
    if g_idx is None and k % gs:
        raise ModelError(f"{where}: {prefix}: {k} inputs are not a whole number of groups of {gs}")
    return IntLinear(name=prefix, out_features=out, in_features=k, bits=bits, group_size=gs, qweight=packed,
                     scales=scale, zeros=zeros, g_idx=g_idx)


def _read_fp8(get: Getter, prefix: str, out: int, k: int, scheme: QuantScheme, where: str) -> Fp8Linear:
    what = f"compressed-tensors fp8 {'per-tensor' if scheme.group_size == PER_TENSOR else 'per-channel'}"
    weight = need(get, f"{prefix}.weight", where, torch.float8_e4m3fn, (out, k), what)
    s = get(f"{prefix}.weight_scale")
    ok = s is not None and s.dtype in _SCALE_DTYPES and (
        s.numel() == 1 if scheme.group_size == PER_TENSOR else tuple(s.shape) in ((out, 1), (out,)))
    if not ok:
        got = "absent" if s is None else f"{s.dtype} {list(s.shape)}"
        raise ModelError(f"{where}: {prefix}.weight_scale is {got}, not the scale {what} requires")
    scale = s.float().reshape(()) if scheme.group_size == PER_TENSOR else s.float().reshape(out)
    inp = get(f"{prefix}.input_scale")
    return Fp8Linear(name=prefix, out_features=out, in_features=k, weight=weight, scale=scale,
                     input_scale=None if inp is None else inp.float().reshape(()))


def write(lin, scheme: QuantScheme, scale_dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    if isinstance(lin, Fp8Linear):
        scale = lin.scale.reshape(1) if not lin.per_channel else lin.scale[:, None]
        return {"weight": lin.weight, "weight_scale": scale.to(scale_dtype)}
    t = {"weight_packed": lin.qweight, "weight_scale": lin.scales.to(scale_dtype),
         "weight_shape": torch.tensor([lin.out_features, lin.in_features], dtype=torch.int64)}
    if lin.zeros is not None:
        t["weight_zero_point"] = pack_last(lin.zeros.T.contiguous(), lin.bits).T.contiguous()
    return t


def hf_config(scheme: QuantScheme) -> dict:
    if scheme.weight_type == "fp8":
        strategy = "tensor" if scheme.group_size == PER_TENSOR else "channel"
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "group_size": None,
                   "dynamic": False, "actorder": None, "block_structure": None, "observer": "minmax"}
        # Activations are quantized per token at run time (no calibration), as llmcompressor's FP8_DYNAMIC.
        act = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True,
               "group_size": None, "actorder": None, "block_structure": None, "observer": None}
        fmt = FLOAT
    else:
        grouped = scheme.group_size != PER_CHANNEL
        weights = {"num_bits": scheme.bits, "type": "int", "symmetric": not scheme.has_zero_point,
                   "strategy": "group" if grouped else "channel", "group_size": scheme.group_size if grouped else None,
                   "dynamic": False, "actorder": None, "block_structure": None, "observer": "minmax"}
        act, fmt = None, PACKED
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": act,
                                          "output_activations": None, "format": fmt}},
            "ignore": list(scheme.exclude_modules) or ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {},
            "transform_config": {}, "global_compression_ratio": None}
