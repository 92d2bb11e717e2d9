"""FP8 e4m3 checkpoints in NVIDIA ModelOpt's naming (``quant_method: modelopt``, or an
``hf_quant_config.json`` beside config.json, as TensorRT-LLM's and ModelOpt's exports write it), and
transformers' ``fbgemm_fp8`` (per-channel weight scales, activations scaled per token at run time).

Per linear layer ``P``: ``P.weight`` float8_e4m3fn ``[out, in]``; ``P.weight_scale`` float32, a scalar
for ``quant_algo: FP8`` or ``[out]`` / ``[out, 1]`` for ``FP8_PER_CHANNEL_PER_TOKEN``;
``W = weight * weight_scale``. ``P.input_scale`` (FP8's static activation scale) is kept on the object.
KV-cache scales (``k_scale``, ``v_scale``) are not read: the engine's KV cache stays bf16.
Block-scaled FP8 (``FP8_BLOCK_SCALES``) and other algorithms are refused.
"""
from __future__ import annotations

import torch

from ..errors import ModelError
from .common import Getter, need, option
from .linear import Fp8Linear
from .scheme import PER_CHANNEL, PER_TENSOR, QuantScheme

METHODS = ("modelopt", "fbgemm_fp8")
MARKER = "weight_scale"
QUANT_FILE = "hf_quant_config.json"
ALGOS = {"FP8": PER_TENSOR, "FP8_PER_CHANNEL_PER_TOKEN": PER_CHANNEL}


def parse(qcfg: dict, where: str) -> QuantScheme:
    if qcfg.get("quant_method") == "fbgemm_fp8":
        skip = option(qcfg, "modules_to_not_convert", where, (list,), default=["lm_head"])
        return QuantScheme(method="fbgemm_fp8", weight_type="fp8", bits=8, group_size=PER_CHANNEL,
                           has_zero_point=False, variant="FP8_PER_CHANNEL_PER_TOKEN",
                           exclude_modules=tuple(str(m) for m in skip))
    inner = qcfg.get("quantization") if isinstance(qcfg.get("quantization"), dict) else qcfg
    algo = option(inner, "quant_algo", where, (str,))
    if algo not in ALGOS:
        raise ModelError(f"{where}: ModelOpt quant_algo '{algo}' is not supported (supported: {', '.join(ALGOS)})")
    exclude = option(inner, "exclude_modules", where, (list,), default=[])
    return QuantScheme(method="modelopt", weight_type="fp8", bits=8, group_size=ALGOS[algo], has_zero_point=False,
                       variant=algo, exclude_modules=tuple(str(m) for m in exclude))


def read(get: Getter, prefix: str, out: int, k: int, scheme: QuantScheme, where: str) -> Fp8Linear:
    per_tensor = scheme.group_size == PER_TENSOR
    what = f"ModelOpt {scheme.variant}"
    weight = need(get, f"{prefix}.weight", where, torch.float8_e4m3fn, (out, k), what)
    s = get(f"{prefix}.weight_scale")
    ok = s is not None and s.dtype in (torch.float32, torch.bfloat16, torch.float16) and (
        s.numel() == 1 if per_tensor else tuple(s.shape) in ((out,), (out, 1)))
    if not ok:
        got = "absent" if s is None else f"{s.dtype} {list(s.shape)}"
        raise ModelError(f"{where}: {prefix}.weight_scale is {got}, not the scale {what} requires")
    inp = get(f"{prefix}.input_scale")
    return Fp8Linear(name=prefix, out_features=out, in_features=k, weight=weight,
                     scale=s.float().reshape(()) if per_tensor else s.float().reshape(out),
                     input_scale=None if inp is None else inp.float().reshape(()))


def write(lin: Fp8Linear, scheme: QuantScheme) -> dict[str, torch.Tensor]:
    return {"weight": lin.weight, "weight_scale": lin.scale.float()}


def hf_config(scheme: QuantScheme) -> dict:
    return {"quant_method": "modelopt", "quant_algo": scheme.variant, "kv_cache_quant_algo": None,
            "exclude_modules": list(scheme.exclude_modules) or ["lm_head"]}


def quant_file(scheme: QuantScheme) -> dict:
    """hf_quant_config.json, the file TensorRT-LLM's loader reads for ModelOpt checkpoints."""
    return {"producer": {"name": "trtllm_mk", "version": "round-to-nearest"},
            "quantization": {"quant_algo": scheme.variant, "kv_cache_quant_algo": None,
                             "exclude_modules": list(scheme.exclude_modules) or ["lm_head"]}}
