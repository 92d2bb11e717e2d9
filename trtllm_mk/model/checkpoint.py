"""Load an HF safetensors checkpoint (one file or sharded with an index) and check it against a ModelSpec.

A mixture-of-experts checkpoint holds each expert's matrices as separate tensors under HF's names
(``ModelSpec.expected_tensors``: ``mlp.experts.N.gate_proj.weight``, Mixtral's
``block_sparse_moe.experts.N.w1.weight``), as transformers' ``save_pretrained`` writes them.

Every file's header is read and checked first (names, shapes, dtypes), so a wrong checkpoint fails in
well under a second with a message naming the tensors at fault, before gigabytes are read
(``check_checkpoint``: the builder runs it before its search). Tensors are then read through
``safe_open`` (memory-mapped) one at a time, straight onto ``device``. Any float dtype loads, whatever
``torch_dtype`` says and tensor by tensor (checkpoints often keep norms in fp32 beside bf16 matrices):
the engine computes with bf16 weights, and each tensor is cast as it is read.
"""
from __future__ import annotations

import warnings
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..errors import ModelError, read_json_object
from .spec import ModelSpec

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# safetensors header dtype codes of the float dtypes a checkpoint may store weights in.
FLOAT_DTYPES = ("BF16", "F16", "F32")
_MAX_LISTED = 5


def _listing(items: list[str]) -> str:
    shown = ", ".join(items[:_MAX_LISTED])
    return shown + (f" (+{len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else "")


def _is_ignorable_extra(name: str, spec: ModelSpec) -> bool:
    # Older checkpoints saved RoPE's inv_freq buffer; we derive it from the config (rope.py).
    # A tied model's lm_head.weight, when saved, is a copy of the embedding we already read (checked:
    # _check_tied_copy).
    return name.endswith("rotary_emb.inv_freq") or (name == TIED_HEAD and spec.tie_word_embeddings)


def weight_files(ckpt_dir: str | Path) -> dict[str, list[str] | None]:
    """Safetensors files of a checkpoint -> the tensor names its index assigns them (None: single file)."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        raise ModelError(f"{d}: checkpoint directory not found (expected config.json + *.safetensors)")
    if (d / SINGLE_FILE).is_file():
        return {SINGLE_FILE: None}
    index_path = d / INDEX_FILE
    singles = sorted(p.name for p in d.glob("*.safetensors") if p.is_file())
    if not index_path.is_file() and len(singles) == 1:
        # one file of another name (AutoGPTQ's gptq_model-4bit-128g.safetensors): the checkpoint's weights
        return {singles[0]: None}
    if not index_path.is_file():
        others = sorted(p.name for p in d.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".pth"))
        found = f" (found: {_listing(others)})" if others else ""
        raise ModelError(f"{d}: no {SINGLE_FILE} or {INDEX_FILE}{found}; "
                         f"save the model with save_pretrained(..., safe_serialization=True)")
    index = read_json_object(index_path, ModelError, "copy or download the checkpoint again")
    wmap = index.get("weight_map")
    if not isinstance(wmap, dict) or not wmap:
        raise ModelError(f"{index_path}: no 'weight_map' object mapping tensor names to shard files")
    files: dict[str, list[str]] = {}
    for name, fname in wmap.items():
        if not isinstance(fname, str) or "/" in fname or fname in ("", ".", ".."):
            raise ModelError(f"{index_path}: weight_map entry {name!r} names no shard file in the checkpoint ({fname!r})")
        files.setdefault(fname, []).append(name)
    missing = sorted(f for f in files if not (d / f).is_file())
    if missing:
        raise ModelError(f"{d}: shard file(s) listed in {INDEX_FILE} are missing: {_listing(missing)}")
    return files


def _open(stack: ExitStack, path: Path, device: str):
    try:
        return stack.enter_context(safe_open(str(path), framework="pt", device=device))
    except (SafetensorError, OSError) as e:
        raise ModelError(f"{path}: unreadable safetensors file, truncated or corrupt ({e}); "
                         f"copy or download it again") from None


def tensor_handles(stack: ExitStack, d: Path, dev: str) -> dict[str, object]:
    """Every tensor name of the checkpoint -> its file's open safetensors handle (closed with ``stack``);
    a shard that lacks what the index places in it is one ModelError."""
    where: dict[str, object] = {}
    for fname, indexed in weight_files(d).items():
        handle = _open(stack, d / fname, dev)
        keys = set(handle.keys())
        if indexed is not None:
            absent = [n for n in indexed if n not in keys]
            if absent:
                raise ModelError(f"{d / fname}: {INDEX_FILE} places {_listing(absent)} in this file "
                                 f"but it does not hold them; the index and shards do not match")
            keys = set(indexed)
        for n in keys:
            where[n] = handle
    return where


def _checked_sources(stack: ExitStack, d: Path, spec: ModelSpec, dev: str) -> dict[str, object]:
    """Every expected tensor's open safetensors handle, after the headers were checked against ``spec``."""
    expected = spec.expected_tensors()
    where = tensor_handles(stack, d, dev)
    missing = [n for n in expected if n not in where]
    packed = sorted(n for n in where if n.endswith((".qweight", ".weight_packed")))
    if missing and packed:
        raise ModelError(f"{d}: holds packed quantized tensors ({_listing(packed)}) but its config.json has no "
                         "quantization_config; restore the checkpoint's config.json")
    fused = sorted(n for n in where if n.endswith((".experts.gate_up_proj", ".experts.down_proj")))
    if missing and fused:
        raise ModelError(f"{d}: holds the experts fused into 3-D tensors ({_listing(fused)}); per-expert "
                         "tensors (experts.N.gate_proj.weight, ...) are expected, as save_pretrained writes them")
    if missing:
        raise ModelError(f"{d}: checkpoint lacks {len(missing)} tensor(s) the config requires: "
                         f"{_listing(missing)}; the config.json does not match these weights")
    bad: list[str] = []
    for name, shape in expected.items():
        sl = where[name].get_slice(name)
        got_shape, got_dtype = tuple(sl.get_shape()), sl.get_dtype()
        if got_shape != shape:
            bad.append(f"{name} shape {list(got_shape)} (expected {list(shape)})")
        elif got_dtype not in FLOAT_DTYPES:
            bad.append(f"{name} dtype {got_dtype} (expected one of {', '.join(FLOAT_DTYPES)})")
    if bad:
        raise ModelError(f"{d}: {len(bad)} tensor(s) do not match the config: {_listing(bad)}")
    extra = sorted(n for n in where if n not in expected and not _is_ignorable_extra(n, spec))
    if extra:
        warnings.warn(f"{d}: ignoring {len(extra)} tensor(s) the {spec.family} config does not use: "
                      f"{_listing(extra)}", stacklevel=3)
    if spec.tie_word_embeddings and TIED_HEAD in where:
        _check_tied_copy(d, where)
    return {n: where[n] for n in expected}


EMBEDDING, TIED_HEAD = "model.embed_tokens.weight", "lm_head.weight"


def _check_tied_copy(d: Path, where: dict[str, object]) -> None:
    """A tied model's saved lm_head.weight must be the embedding's copy: transformers unties a head that
    differs (and decodes with it), which the engine, reading the embedding, would not. Compared in
    blocks of rows, so no more than a few MB of either is held at once."""
    emb, head = where[EMBEDDING].get_slice(EMBEDDING), where[TIED_HEAD].get_slice(TIED_HEAD)
    shape = tuple(emb.get_shape())
    same = tuple(head.get_shape()) == shape
    step = max(1, (1 << 22) // max(1, shape[-1]))
    for r in range(0, shape[0] if same else 0, step):
        if not torch.equal(emb[r:r + step].float(), head[r:r + step].float()):
            same = False
            break
    if not same:
        raise ModelError(f"{d}: config.json ties the LM head to the embedding (tie_word_embeddings true), but the "
                         f"checkpoint's {TIED_HEAD} differs from {EMBEDDING}, and transformers decodes with it; set "
                         "tie_word_embeddings to false in config.json")


def check_checkpoint(ckpt_dir: str | Path, spec: ModelSpec) -> set[str]:
    """Refuse (ModelError) a checkpoint whose tensors do not match ``spec``: from the headers alone, or for
    a quantized checkpoint by reading its layers one at a time. Returns the float dtypes it stores."""
    d = Path(ckpt_dir)
    from ..quant import check_quantized, read_scheme
    scheme = read_scheme(d) if (d / "config.json").is_file() else None
    if scheme is not None:
        return check_quantized(d, spec, scheme)
    with ExitStack() as stack:
        return {h.get_slice(n).get_dtype() for n, h in _checked_sources(stack, d, spec, "cpu").items()}


def load_checkpoint(ckpt_dir: str | Path, spec: ModelSpec, device: str | torch.device = "cpu",
                    dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Tensors of ``spec.expected_tensors()`` by HF name, checked, on ``device``, cast to ``dtype``
    (default: the spec's ``torch_dtype``).

    Missing or misshaped tensors raise ModelError; unknown extra tensors are not loaded and reported
    with a warning, since they usually mean the config.json does not match the weights.
    A quantized checkpoint (config.json's ``quantization_config``) loads dequantized (``trtllm_mk.quant``).
    """
    d = Path(ckpt_dir)
    from ..quant import load_dequantized, read_scheme   # the quant package reads checkpoints through this module
    scheme = read_scheme(d) if (d / "config.json").is_file() else None
    if scheme is not None:
        return load_dequantized(d, spec, scheme, device=device, dtype=dtype)
    want = dtype or getattr(torch, spec.dtype)
    with ExitStack() as stack:
        out: dict[str, torch.Tensor] = {}
        for name, handle in _checked_sources(stack, d, spec, str(torch.device(device))).items():
            t = handle.get_tensor(name)
            out[name] = t if t.dtype == want else t.to(want)
    return out
