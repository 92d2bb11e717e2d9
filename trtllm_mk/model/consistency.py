"""An engine and the checkpoint it decodes must describe the same model.

The builder records the checkpoint an engine was built from (path and fingerprint: a hash of its
config.json and of its tensor index, names, dtypes and shapes from the safetensors headers); the
runtime loads that checkpoint by default and refuses, in one line naming the first difference, a
checkpoint whose architecture, shapes, tying, rope or norm settings differ from the engine's model.
The dtype it stores its weights in may differ: every checkpoint loads cast to bf16.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from safetensors import SafetensorError, safe_open

from ..errors import ModelError
from .checkpoint import weight_files
from .spec import ModelSpec, load_spec

# What must agree between an engine's model and a checkpoint (the name and EOS ids need not).
COMPARED = ("family", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
            "vocab_size", "tie_word_embeddings", "rope_theta", "rope_scaling", "rms_norm_eps", "sliding_window",
            "max_position_embeddings", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
            "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")


def fingerprint(ckpt_dir: str | Path) -> dict:
    """{path, config_sha256, tensors_sha256} of a checkpoint directory, from its headers only."""
    d = Path(ckpt_dir).resolve()
    try:
        config = (d / "config.json").read_bytes()
    except OSError as e:
        raise ModelError(f"{d}: config.json cannot be read ({e.strerror})") from None
    index = []
    for fname in sorted(weight_files(d)):
        try:
            with safe_open(str(d / fname), framework="pt") as f:
                for name in sorted(f.keys()):
                    sl = f.get_slice(name)
                    index.append([name, sl.get_dtype(), list(sl.get_shape())])
        except (SafetensorError, OSError) as e:
            raise ModelError(f"{d / fname}: unreadable safetensors file ({e})") from None
    return {"path": str(d), "config_sha256": hashlib.sha256(config).hexdigest(),
            "tensors_sha256": hashlib.sha256(json.dumps(index).encode()).hexdigest()}


def first_difference(engine: ModelSpec, ckpt: ModelSpec) -> str | None:
    for key in COMPARED:
        a, b = getattr(engine, key), getattr(ckpt, key)
        if a != b:
            return f"{key} is {b!r} in the checkpoint but {a!r} in the engine"
    return None


def check_matches(engine: ModelSpec, ckpt_dir: str | Path) -> None:
    """Refuse a checkpoint that does not describe the engine's model."""
    ckpt = load_spec(ckpt_dir)
    diff = first_difference(engine, ckpt)
    if diff:
        raise ModelError(f"{ckpt_dir}: does not match the engine's model ({diff}); build an engine from this "
                         "checkpoint, or pass the checkpoint the engine was built from")


def check_unchanged(record: dict) -> None:
    """The recorded checkpoint still holds what the engine was built from."""
    if not (Path(record["path"]) / "config.json").is_file():
        raise ModelError(f"{record['path']}: the checkpoint this engine was built from is not there (moved or "
                         "deleted); pass --weights with its new place (or another checkpoint of the same model), "
                         "or rebuild the engine")
    now = fingerprint(record["path"])
    for key, what in (("config_sha256", "config.json"), ("tensors_sha256", "tensor index")):
        if now[key] != record[key]:
            raise ModelError(f"{record['path']}: its {what} changed since the engine was built; rebuild the engine "
                             "(or pass --weights to use another checkpoint explicitly)")
