"""What the format modules share: reading ``quantization_config`` fields with one-line errors, and
checking the tensors of one linear layer against the shapes its scheme implies."""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..errors import ModelError

_MISSING = object()

# Reads one tensor of the checkpoint by full name; None when the checkpoint has no such tensor.
Getter = Callable[[str], "torch.Tensor | None"]


def option(qcfg: dict, key: str, where: str, kinds: tuple[type, ...], default: Any = _MISSING,
           choices: tuple | None = None) -> Any:
    """``qcfg[key]``, checked for type (bool is not an int here) and, if given, membership in ``choices``."""
    if qcfg.get(key) is None:
        if default is _MISSING:
            raise ModelError(f"{where}: quantization_config has no '{key}'")
        return default
    v = qcfg[key]
    if (isinstance(v, bool) and bool not in kinds) or not isinstance(v, kinds):
        raise ModelError(f"{where}: quantization_config '{key}' must be {' or '.join(k.__name__ for k in kinds)}, "
                         f"got {v!r}")
    if choices is not None and v not in choices:
        raise ModelError(f"{where}: quantization_config {key}={v!r} is not supported (supported: "
                         f"{', '.join(map(repr, choices))})")
    return v


def need(get: Getter, name: str, where: str, dtype: torch.dtype | tuple[torch.dtype, ...],
         shape: tuple[int, ...], what: str) -> torch.Tensor:
    """Tensor ``name`` with the dtype and shape ``what`` (the scheme in words) implies; else one ModelError."""
    t = get(name)
    if t is None:
        raise ModelError(f"{where}: checkpoint lacks {name}, which {what} requires")
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in dtypes:
        raise ModelError(f"{where}: {name} is {t.dtype}, expected {' or '.join(map(str, dtypes))} for {what}; "
                         "the tensors do not match the quantization_config")
    if tuple(t.shape) != tuple(shape):
        raise ModelError(f"{where}: {name} has shape {list(t.shape)}, expected {list(shape)} for {what}; "
                         "the tensors do not match the quantization_config")
    return t


def check_codes_fit(name: str, where: str, k: int, bits: int) -> None:
    if k * bits % 32:
        raise ModelError(f"{where}: {name}: {k} values of {bits} bits do not fill whole int32 words")


def groups_of(in_features: int, group_size: int) -> int:
    return 1 if group_size <= 0 else -(-in_features // group_size)


def checked_g_idx(get: Getter, name: str, where: str, in_features: int, group_size: int, groups: int,
                  required: bool, what: str) -> torch.Tensor | None:
    """The checkpoint's g_idx as int32, or None when absent or when it is the contiguous ``k // group_size``
    (then nothing needs it)."""
    t = get(name)
    if t is None:
        if required:
            raise ModelError(f"{where}: checkpoint lacks {name}, which {what} requires (activation order)")
        return None
    if t.dtype not in (torch.int32, torch.int64) or tuple(t.shape) != (in_features,):
        raise ModelError(f"{where}: {name} must be int32 [{in_features}], got {t.dtype} {list(t.shape)}")
    g = t.to(torch.int32)
    if g.numel() and (int(g.min()) < 0 or int(g.max()) >= groups):
        raise ModelError(f"{where}: {name} names groups outside [0, {groups}); the checkpoint is corrupt")
    contiguous = torch.arange(in_features, dtype=torch.int32, device=g.device) // max(group_size, 1)
    if group_size > 0 and torch.equal(g, contiguous):
        return None
    return g
