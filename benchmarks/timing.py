"""Per-step timing of a callable: CUDA events on a GPU, ``time.perf_counter`` on the CPU.

Every step is timed on its own (one event pair per step, all read after one final synchronize), so
the statistics see the real distribution of step times, not an average over a loop. The CPU path
exists for tests and the ``--cpu-smoke`` run; CPU numbers are not benchmarks.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np
import torch


@dataclass(frozen=True)
class TimingStats:
    """Statistics of per-step times, all in milliseconds (``times_ms`` holds every sample)."""
    steps: int
    avg: float
    p50: float
    p90: float
    p95: float
    p99: float
    min: float
    max: float
    std: float
    times_ms: tuple[float, ...]

    def to_dict(self, with_samples: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if with_samples:
            d["times_ms"] = list(self.times_ms)
        else:
            del d["times_ms"]
        return d


def summarize(times_ms) -> TimingStats:
    """Statistics of a sequence of step times in ms (numpy's linear-interpolation percentiles)."""
    t = np.asarray(times_ms, dtype=np.float64)
    if t.ndim != 1 or t.size == 0:
        raise ValueError("summarize: need a non-empty 1-D sequence of step times")
    p50, p90, p95, p99 = np.percentile(t, [50, 90, 95, 99])
    return TimingStats(steps=int(t.size), avg=float(t.mean()), p50=float(p50), p90=float(p90), p95=float(p95),
                       p99=float(p99), min=float(t.min()), max=float(t.max()), std=float(t.std()),
                       times_ms=tuple(float(x) for x in t))


def _device_of(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def time_steps(step: Callable[[], Any], steps: int = 100, warmup: int = 10,
               device: str | torch.device | None = None) -> TimingStats:
    """Call ``step`` ``warmup`` times untimed, then ``steps`` times, each timed separately.

    On CUDA the time of a step is the GPU time between an event recorded before its launch and one
    recorded after it, on the current stream: a step whose host work outruns the GPU shows its host
    time, which is what a user of that step would see too.
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"time_steps: steps must be >= 1 and warmup >= 0 (got {steps}, {warmup})")
    dev = _device_of(device)
    for _ in range(warmup):
        step()
    if dev.type == "cuda":
        with torch.cuda.device(dev):
            torch.cuda.synchronize()
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
            for s, e in zip(starts, ends):
                s.record()
                step()
                e.record()
            torch.cuda.synchronize()
            return summarize([s.elapsed_time(e) for s, e in zip(starts, ends)])
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    return summarize(times)
