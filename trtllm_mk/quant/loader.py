"""Load a quantized checkpoint: every quantized linear layer as its canonical packed object
(linear.py), every other tensor as it is stored, all checked against the model's shapes first.

Which layers are quantized follows the tensors: a layer is quantized when the checkpoint holds its
format's packed tensor (GPTQ/AWQ ``qweight``, compressed-tensors ``weight_packed``, FP8
``weight_scale``), so the layers a checkpoint leaves in bf16 (its ``ignore`` / ``exclude_modules``
lists, usually the LM head) load as plain tensors without reading those lists' pattern syntaxes.
"""
from __future__ import annotations

import warnings
from contextlib import ExitStack
from pathlib import Path

import torch

from ..errors import ModelError
from ..model.checkpoint import FLOAT_DTYPES, _is_ignorable_extra, _listing, tensor_handles
from ..model.spec import ModelSpec, is_layer_linear
from .detect import format_module, marker
from .kernel_layout import layer_reason
from .kernel_support import weight_format
from .linear import Fp8Linear, IntLinear
from .scheme import QuantScheme

EMBEDDING = "model.embed_tokens.weight"
# Tensors that belong to a format but not to the weights (activation and KV-cache scales).
_FORMAT_EXTRAS = ("input_scale", "k_scale", "v_scale", "output_scale", "input_scale_ub")


def _read_quantized(ckpt_dir: str | Path, spec: ModelSpec, scheme: QuantScheme, device: str | torch.device,
                    keep: bool) -> tuple[dict[str, object], set[str]]:
    """(``spec.expected_tensors()`` by HF name, the float dtypes of the plain tensors): packed objects
    for quantized layers, tensors for the rest, each checked as it is read. ``keep`` False: every layer
    is read, checked and dropped (the builder's check of a checkpoint larger than memory)."""
    d = Path(ckpt_dir)
    dev = str(torch.device(device))
    mod, mark = format_module(scheme), marker(scheme)
    plain_dtype = getattr(torch, spec.dtype)
    with ExitStack() as stack:
        where = tensor_handles(stack, d, dev)
        used: set[str] = set()

        def get(name: str):
            if name not in where:
                return None
            used.add(name)
            return where[name].get_tensor(name)

        out: dict[str, object] = {}
        dtypes: set[str] = set()
        missing, bad, any_packed = [], [], False
        streamed = spec.quantized   # the megakernel streams the layers' linears in its quantized layout

        def check_streamable(name: str, shape, v) -> None:
            # what the kernel's layout needs of each layer linear, from the tensors rather than the
            # config's flags (a desc_act checkpoint with groups in column order, an exclusion list
            # naming modules outside the layers)
            if streamed and is_layer_linear(name, shape):
                why = layer_reason(spec, name, v)
                if why:
                    raise ModelError(f"{d}: cannot be laid out for this engine's {weight_format(spec)} kernel: {why}")

        for name, shape in spec.expected_tensors().items():
            prefix = name[:-len(".weight")]
            if len(shape) == 2 and f"{prefix}.{mark}" in where:
                if name == EMBEDDING:
                    raise ModelError(f"{d}: the embedding table is quantized ({prefix}.{mark}); quantized "
                                     "embeddings are not supported")
                used.add(name)
                lin = mod.read(get, prefix, shape[0], shape[1], scheme, str(d))
                check_streamable(name, shape, lin)
                any_packed = True
                if keep:
                    out[name] = lin
            elif name in where:
                check_streamable(name, shape, None)
                sl = where[name].get_slice(name)
                if tuple(sl.get_shape()) != shape:
                    bad.append(f"{name} shape {list(sl.get_shape())} (expected {list(shape)})")
                elif sl.get_dtype() not in FLOAT_DTYPES:
                    bad.append(f"{name} dtype {sl.get_dtype()} (expected one of {', '.join(FLOAT_DTYPES)})")
                else:
                    dtypes.add(sl.get_dtype())
                    used.add(name)
                    if keep:
                        t = get(name)
                        out[name] = t if t.dtype == plain_dtype else t.to(plain_dtype)
            else:
                missing.append(name)
        if missing:
            raise ModelError(f"{d}: checkpoint lacks {len(missing)} tensor(s) its {scheme.describe()} config "
                             f"requires: {_listing(missing)}; the tensors do not match the quantization_config")
        if bad:
            raise ModelError(f"{d}: {len(bad)} tensor(s) do not match the config: {_listing(bad)}")
        if not any_packed:
            raise ModelError(f"{d}: config.json declares {scheme.describe()} but no layer holds its packed "
                             f"tensors (*.{mark}); the tensors do not match the quantization_config")
        extra = sorted(n for n in where if n not in used and not _is_ignorable_extra(n, spec)
                       and not n.endswith(_FORMAT_EXTRAS))
        if extra:
            warnings.warn(f"{d}: ignoring {len(extra)} tensor(s) the {spec.family} config does not use: "
                          f"{_listing(extra)}", stacklevel=3)
    return out, dtypes


def load_quantized(ckpt_dir: str | Path, spec: ModelSpec, scheme: QuantScheme, device: str | torch.device = "cpu"
                   ) -> dict[str, "torch.Tensor | IntLinear | Fp8Linear"]:
    """``spec.expected_tensors()`` by HF name: packed objects for quantized layers (under the layer's
    ``.weight`` name), tensors for the rest (cast to the spec's dtype). Any mismatch with the scheme
    is one ModelError."""
    return _read_quantized(ckpt_dir, spec, scheme, device, keep=True)[0]


def check_quantized(ckpt_dir: str | Path, spec: ModelSpec, scheme: QuantScheme) -> set[str]:
    """Refuse (ModelError) a quantized checkpoint that does not match ``spec`` and ``scheme``, reading one
    layer at a time; returns the float dtypes of its plain tensors."""
    return _read_quantized(ckpt_dir, spec, scheme, "cpu", keep=False)[1]


def load_dequantized(ckpt_dir: str | Path, spec: ModelSpec, scheme: QuantScheme,
                     device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint's weights dequantized (``dtype``, default bfloat16), one tensor per HF name as
    ``model.checkpoint.load_checkpoint`` returns them: what the reference decoder and the CPU executor run."""
    dtype = dtype or torch.bfloat16
    out = {}
    for name, v in load_quantized(ckpt_dir, spec, scheme, device).items():
        if isinstance(v, (IntLinear, Fp8Linear)):
            out[name] = v.dequantize(dtype)
        else:
            out[name] = v if v.dtype == dtype else v.to(dtype)
    return out
