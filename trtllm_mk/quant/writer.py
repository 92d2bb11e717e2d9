"""Write a quantized copy of an HF checkpoint (round-to-nearest), in a format's standard layout with
the matching ``quantization_config``: the checkpoints ``python -m trtllm_mk quantize`` produces.

Every linear layer of the decoder blocks is quantized but a mixture-of-experts layer's router (as
quantization libraries leave it); the embedding, the norms and the LM head stay as they are. The copy
is assembled in a hidden folder beside ``out`` and renamed into place when complete; an existing
``out`` is replaced only when an earlier run of this command wrote it (its ``MARK_FILE``) or when it
is empty.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from ..errors import UserError
from ..model.checkpoint import INDEX_FILE, load_checkpoint
from ..model.spec import ROUTER_SUFFIXES, is_layer_linear, load_spec
from . import awq, compressed_tensors, fp8, gptq
from .detect import read_scheme
from .rtn import quantize_fp8, quantize_int
from .scheme import PER_CHANNEL, PER_TENSOR, QuantScheme

MARK_FILE = "trtllm_mk_quantize.json"
# compressed-tensors' ignore entries of the routers ("re:" patterns over module names)
ROUTER_IGNORE = tuple("re:.*" + s[1:-len(".weight")].replace(".", r"\.") + "$" for s in ROUTER_SUFFIXES)
FORMATS = ("gptq", "awq", "fp8", "ct-w4a16", "ct-fp8")
MAX_SHARD_BYTES = 4 << 30
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")   # and their indexes
_MODULE = {"gptq": gptq, "awq": awq, "fp8": fp8, "ct-w4a16": compressed_tensors, "ct-fp8": compressed_tensors}


def make_scheme(fmt: str, bits: int | None = None, group_size: int | None = None, zero_point: bool = False,
                per_tensor: bool = False) -> QuantScheme:
    """The scheme ``quantize --format fmt`` writes; impossible combinations are one UserError."""
    if fmt not in FORMATS:
        raise UserError(f"--format {fmt}: not one of {', '.join(FORMATS)}")
    if fmt in ("fp8", "ct-fp8"):
        if bits not in (None, 8) or group_size is not None or zero_point:
            raise UserError(f"--format {fmt}: FP8 weights take no --bits, --group-size or --zero-point")
        if fmt == "fp8":
            if per_tensor:
                raise UserError("--format fp8 --per-tensor: ModelOpt's per-tensor FP8 needs calibrated activation "
                                "scales; use --format ct-fp8 --per-tensor (activation scales per token at run time)")
            return QuantScheme("modelopt", "fp8", 8, PER_CHANNEL, False, variant="FP8_PER_CHANNEL_PER_TOKEN",
                               exclude_modules=("lm_head",))
        return QuantScheme("compressed-tensors", "fp8", 8, PER_TENSOR if per_tensor else PER_CHANNEL, False,
                           variant=compressed_tensors.FLOAT, exclude_modules=("lm_head",))
    if per_tensor:
        raise UserError(f"--per-tensor is for FP8 formats; --format {fmt} takes --group-size")
    gs = 128 if group_size is None else group_size
    if fmt == "awq":
        if bits not in (None, 4):
            raise UserError(f"--format awq --bits {bits}: AWQ's GEMM layout is 4-bit")
        if gs not in awq.GROUP_SIZES:
            raise UserError(f"--group-size {gs}: AWQ takes {', '.join(map(str, awq.GROUP_SIZES))}")
        return QuantScheme("awq", "int", 4, gs, True, variant="gemm", exclude_modules=("lm_head",))
    bits = 4 if bits is None else bits
    if bits not in (4, 8):
        raise UserError(f"--bits {bits}: 4 or 8")
    sizes = gptq.GROUP_SIZES if fmt == "gptq" else (*compressed_tensors.GROUP_SIZES, PER_CHANNEL)
    if gs not in sizes:
        raise UserError(f"--group-size {gs}: {fmt} takes {', '.join(map(str, sizes))} (-1: per output channel)")
    if fmt == "gptq":
        return QuantScheme("gptq", "int", bits, gs, zero_point, variant="gptq", exclude_modules=("lm_head",))
    return QuantScheme("compressed-tensors", "int", bits, gs, zero_point, variant=compressed_tensors.PACKED,
                       exclude_modules=("lm_head",))


def _quantize_layer(name: str, w: torch.Tensor, scheme: QuantScheme):
    if scheme.weight_type == "fp8":
        scale_dtype = torch.float32 if scheme.method == "modelopt" else torch.bfloat16
        return quantize_fp8(name, w, scheme.group_size, scale_dtype)
    scale_dtype = torch.float16 if scheme.method in ("gptq", "awq") else torch.bfloat16
    # GPTQ's own layout stores zero - 1, so a zero code must be at least 1 there.
    min_zero = 1 if scheme.method == "gptq" and scheme.variant == "gptq" else 0
    return quantize_int(name, w, scheme.bits, scheme.group_size, not scheme.has_zero_point, scale_dtype, min_zero)


def _check_out(src: Path, out: Path) -> None:
    if out.resolve() == src.resolve():
        raise UserError(f"{out}: the output would overwrite the source checkpoint; choose another folder")
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: exists and is not a folder; choose another output path")
    if out.is_dir() and any(out.iterdir()) and not (out / MARK_FILE).is_file():
        raise UserError(f"{out}: exists and was not written by quantize (no {MARK_FILE}); choose another folder "
                        "or empty it yourself")


def _shards(tensors: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > limit:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += n
    return shards


def _save(tensors: dict[str, torch.Tensor], d: Path, limit: int) -> None:
    shards = _shards(tensors, limit)
    if len(shards) == 1:
        save_file(shards[0], str(d / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, group in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(group, str(d / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in group})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (d / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def quantize_checkpoint(src: str | Path, out: str | Path, scheme: QuantScheme, max_shard_bytes: int = MAX_SHARD_BYTES,
                        show_progress: bool = True) -> Path:
    """Write ``src`` quantized by ``scheme`` (make_scheme) into ``out``; returns ``out``."""
    src, out = Path(src), Path(out)
    spec = load_spec(src)
    if read_scheme(src) is not None:
        raise UserError(f"{src}: is already quantized ({read_scheme(src).describe()}); quantize the unquantized model")
    _check_out(src, out)
    tensors = load_checkpoint(src, spec)
    mod = _MODULE[_format_name(scheme)]
    layers = [n for n, shape in spec.expected_tensors().items() if is_layer_linear(n, shape)]   # not the routers
    if spec.is_moe and scheme.method == "compressed-tensors":   # its ignore list names every Linear left as is
        scheme = replace(scheme, exclude_modules=(*scheme.exclude_modules, *ROUTER_IGNORE))
    for name in layers:   # every group must be whole before any work is done
        k = tensors[name].shape[1]
        if scheme.weight_type == "int":
            gs = k if scheme.group_size == PER_CHANNEL else scheme.group_size
            if k % gs or k * scheme.bits % 32 or tensors[name].shape[0] * scheme.bits % 32:
                raise UserError(f"{name}: shape {list(tensors[name].shape)} does not split into groups of {gs} "
                                f"and whole int32 words of {scheme.bits}-bit codes; choose another --group-size")
    result: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name not in layers:
            result[name] = t
    for name in tqdm(layers, desc="quantizing", unit="layer", disable=not show_progress):
        prefix = name[:-len(".weight")]
        lin = _quantize_layer(prefix, tensors[name], scheme)
        for suffix, t in mod.write(lin, scheme).items():
            result[f"{prefix}.{suffix}"] = t
    ordered = dict(sorted(result.items()))

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.quantizing-", dir=out.parent))   # new, so ours to remove
    try:
        _save(ordered, tmp, max_shard_bytes)
        cfg = json.loads((src / "config.json").read_text())
        cfg["quantization_config"] = mod.hf_config(scheme)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        if scheme.method == "modelopt":
            (tmp / fp8.QUANT_FILE).write_text(json.dumps(fp8.quant_file(scheme), indent=2) + "\n")
        if scheme.method == "gptq":   # AutoGPTQ's own loaders read the scheme from this file
            (tmp / "quantize_config.json").write_text(json.dumps(cfg["quantization_config"], indent=2) + "\n")
        for f in sorted(src.iterdir()):   # tokenizer, generation config, chat template, ...
            if f.is_file() and not f.name.startswith(".") and f.name not in ("config.json", MARK_FILE, fp8.QUANT_FILE,
                                                                             "quantize_config.json") \
                    and not f.name.endswith(_WEIGHT_FILES):
                shutil.copy2(f, tmp / f.name)
        mark = {"source": str(src.resolve()), "format": _format_name(scheme), "scheme": asdict(scheme),
                "quant_algo": scheme.quant_algo, "method": "round-to-nearest"}
        (tmp / MARK_FILE).write_text(json.dumps(mark, indent=2) + "\n")
        if out.exists():
            _check_out(src, out)      # again: minutes passed since the first check
            shutil.rmtree(out)        # ours (MARK_FILE) or empty: _check_out refused anything else
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _format_name(scheme: QuantScheme) -> str:
    if scheme.method == "compressed-tensors":
        return "ct-fp8" if scheme.weight_type == "fp8" else "ct-w4a16"
    return {"modelopt": "fp8"}.get(scheme.method, scheme.method)
