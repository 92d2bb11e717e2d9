"""Which quantization a checkpoint declares: its config.json ``quantization_config`` (or ModelOpt's
``hf_quant_config.json``), read into a QuantScheme by the format module of its ``quant_method``."""
from __future__ import annotations

from pathlib import Path
from types import ModuleType

from ..errors import ModelError, read_json_object
from . import awq, compressed_tensors, fp8, gptq
from .scheme import QuantScheme

_MODULES = (gptq, awq, compressed_tensors, fp8)
AUTOGPTQ_FILE = "quantize_config.json"
_BY_METHOD: dict[str, ModuleType] = {m: mod for mod in _MODULES for m in mod.METHODS}


def format_module(scheme: QuantScheme) -> ModuleType:
    return _BY_METHOD[scheme.method]


def marker(scheme: QuantScheme) -> str:
    """The tensor suffix whose presence marks a linear layer of this format as quantized."""
    mod = format_module(scheme)
    return mod.marker(scheme) if hasattr(mod, "marker") else mod.MARKER


def scheme_from_config(cfg: dict, where: str, ckpt_dir: str | Path | None = None) -> QuantScheme | None:
    """The QuantScheme an HF config.json dict declares (None: unquantized). ``ckpt_dir`` lets a ModelOpt
    checkpoint that has only an ``hf_quant_config.json`` be recognised."""
    # compressed-tensors' earlier key for the same object, which its own loader still reads
    q = cfg.get("quantization_config", cfg.get("compression_config"))
    if q is None and ckpt_dir is not None and (Path(ckpt_dir) / AUTOGPTQ_FILE).is_file():
        # AutoGPTQ's own file, beside a config.json that does not repeat it (its format has no quant_method)
        qf = Path(ckpt_dir) / AUTOGPTQ_FILE
        return gptq.parse(read_json_object(qf, ModelError, "copy the checkpoint again"), str(qf))
    if q is None and ckpt_dir is not None and (Path(ckpt_dir) / fp8.QUANT_FILE).is_file():
        qf = Path(ckpt_dir) / fp8.QUANT_FILE
        return fp8.parse(read_json_object(qf, ModelError, "copy the checkpoint again"), str(qf))
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ModelError(f"{where}: 'quantization_config' must be an object, got {q!r}")
    method = q.get("quant_method")
    if method not in _BY_METHOD:
        raise ModelError(f"{where}: quantization '{method}' is not supported (supported: gptq, awq, "
                         "compressed-tensors pack-quantized / float-quantized, modelopt FP8, fbgemm_fp8)")
    return _BY_METHOD[method].parse(q, where)


def read_scheme(ckpt_dir: str | Path) -> QuantScheme | None:
    """The quantization of the checkpoint directory ``ckpt_dir`` (None: unquantized)."""
    d = Path(ckpt_dir)
    path = d / "config.json"
    cfg = read_json_object(path, ModelError, "expected an HF config.json")
    return scheme_from_config(cfg, str(path), d)
