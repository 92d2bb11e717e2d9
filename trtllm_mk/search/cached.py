"""Searched schedules kept beside the cubin cache, so that a machine that only runs kernels (a lent GPU)
finds the schedules a CPU machine searched instead of searching again.

The search is deterministic for its arguments, the calibration file and the package's source
(search/search.py), so those are the key; any change of the package's Python files gives new keys, and so
does any change of its device sources, which decide what a build ships (its spill checks compile them).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..gpus import GpuSpec
from ..model.spec import ModelSpec
from ..schedule import Schedule

PACKAGE = Path(__file__).resolve().parent.parent


def schedule_key(spec: ModelSpec, batch: int, gpu: GpuSpec, context_len: int, budget_s: float,
                 num_sms: int | None = None) -> str:
    """Everything the search's result depends on, hashed."""
    from .calibration import load_calibration
    h = hashlib.sha256(json.dumps([spec.to_dict(), batch, context_len, gpu.name, budget_s, 0]
                                  + ([num_sms] if num_sms else []), sort_keys=True, default=str).encode())
    cal = load_calibration(gpu).source
    if Path(cal).is_file():
        h.update(Path(cal).read_bytes())
    for f in sorted([*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.cuh")]):
        h.update(f.relative_to(PACKAGE).as_posix().encode() + f.read_bytes())
    return h.hexdigest()[:24]


def cached_schedule(key: str, make) -> Schedule:
    """The schedule stored under ``key`` (a ``schedule_key``, perhaps with a suffix naming what was
    made from the search) in codegen.compile.cache_dir()/schedules, or ``make()``'s, stored there."""
    from ..codegen.compile import cache_dir
    path = cache_dir() / "schedules" / f"{key}.json"
    if path.is_file():
        return Schedule.load(path)
    sched = make()
    path.parent.mkdir(parents=True, exist_ok=True)
    sched.save(path)
    return sched


def cached_search(spec: ModelSpec, batch: int, gpu: GpuSpec, context_len: int, budget_s: float,
                  num_sms: int | None = None) -> Schedule:
    """``search(spec, batch, gpu, context_len, budget_s, seed=0, num_sms)``'s schedule, from the cache
    when an earlier search left it there."""
    from .search import search
    return cached_schedule(schedule_key(spec, batch, gpu, context_len, budget_s, num_sms),
                           lambda: search(spec, batch, gpu, context_len=context_len, budget_s=budget_s, seed=0,
                                          num_sms=num_sms)[0])
