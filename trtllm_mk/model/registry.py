"""Resolve the ``model:`` a user names: a known architecture, an HF checkpoint directory, or a config.json.

Known architectures are HF config.json files (shapes only, no weights) in ``configs/models/``, named
``<name>.json`` and matched case-insensitively. A directory given in ``$TRTLLM_MK_CONFIG_DIR`` (whose
``models/`` subdirectory holds more such files) is searched first, so it can add or replace entries.
"""
from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelError
from .spec import ModelSpec, load_spec

CONFIG_DIR_ENV = "TRTLLM_MK_CONFIG_DIR"


def _shipped_config_dir() -> Path:
    """The shipped deployment YAMLs and architecture files: package data of an installed wheel
    (setup.py copies the repository's configs/ into it), or configs/ of a source checkout (an
    editable install)."""
    package = Path(__file__).resolve().parent.parent
    inside = package / "configs"
    return inside if inside.is_dir() else package.parent / "configs"


REPO_CONFIG_DIR = _shipped_config_dir()


@dataclass(frozen=True)
class ResolvedModel:
    spec: ModelSpec
    checkpoint_dir: Path | None  # None: shapes only, weights must come from elsewhere (e.g. random)
    source: str                  # "builtin:<file>" or the path it was read from


def model_config_dirs() -> list[Path]:
    """Directories searched for ``<name>.json``, highest priority first."""
    dirs = []
    env = os.environ.get(CONFIG_DIR_ENV)
    if env:
        d = Path(env).expanduser() / "models"
        if not d.is_dir():
            raise ModelError(f"{CONFIG_DIR_ENV}={env}: no models/ directory there; "
                             f"point it at a directory containing models/<name>.json or unset it")
        dirs.append(d)
    dirs.append(REPO_CONFIG_DIR / "models")
    return dirs


def _known() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for d in reversed(model_config_dirs()):  # later (higher-priority) directories overwrite
        if d.is_dir():
            found.update({p.stem.lower(): p for p in sorted(d.glob("*.json"))})
    return found


def list_models() -> list[str]:
    """Names accepted by ``resolve_model`` besides paths, sorted."""
    return sorted(_known())


def _looks_like_path(model: str) -> bool:
    return os.sep in model or model.startswith((".", "~")) or model.endswith(".json")


def resolve_model(model: str) -> ResolvedModel:
    """A ModelSpec for ``model`` (architecture name, checkpoint directory or config.json path)."""
    if not isinstance(model, str) or not model.strip():
        raise ModelError(f"model: expected an architecture name or a checkpoint path, got {model!r}")
    model = model.strip()
    path = Path(model).expanduser()
    if path.is_dir():
        return _resolve_checkpoint_dir(path)
    if path.is_file():
        return ResolvedModel(load_spec(path), None, str(path))
    known = _known()
    key = model.lower()
    if key in known:
        return ResolvedModel(load_spec(known[key], name=key), None, f"builtin:{known[key]}")
    if _looks_like_path(model):
        raise ModelError(f"model: {path}: no such checkpoint directory or config.json file")
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise ModelError(f"model: unknown architecture '{model}'; {hint}known: {', '.join(sorted(known))} "
                     f"(or give a path to an HF checkpoint directory)")


def _resolve_checkpoint_dir(d: Path) -> ResolvedModel:
    if not (d / "config.json").is_file():
        raise ModelError(f"{d}: no config.json in this checkpoint directory; copy the model's HF config.json there")
    spec = load_spec(d)
    if not any(d.glob("*.safetensors")):
        raise ModelError(f"{d}: no *.safetensors weights in this directory; add them, "
                         f"or pass {d / 'config.json'} to use the shapes with random weights")
    return ResolvedModel(spec, d, str(d))
