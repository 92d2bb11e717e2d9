"""Local improvement of a task -> SM assignment by simulated moves.

An assignment maps every head, layer-template and tail task to an SM; each SM's program lists its
tasks in template order (one global topological order, so no assignment can deadlock). A step
proposes one change, simulates it, and keeps it only if the predicted step time drops:
  rebalance  pick a kind with probability proportional to how far its last SM ends after its median
             SM; move one of its tasks from one of the two SMs where it ends last to one of the
             four where it ends first (or to any SM)
  move       a random GEMV or attention task to a random SM
  swap       two random tasks of different kinds on different SMs trade places
Moves are drawn from the seeded generator only, and the number of steps is fixed by the caller, so
the result is a function of (graph, start assignment, seed, steps).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..graph.tasks import HEAD, LAYER, TAIL, StepGraph
from ..schedule import SMProgram
from .simulate import SimResult, Simulator

PHASES = (HEAD, LAYER, TAIL)


def assignment_of(programs: list[SMProgram]) -> dict[str, dict[int, int]]:
    out: dict[str, dict[int, int]] = {HEAD: {}, LAYER: {}, TAIL: {}}
    for s, p in enumerate(programs):
        for ph in PHASES:
            for i in getattr(p, ph):
                out[ph][i] = s
    return out


def programs_of(assign: dict[str, dict[int, int]], num_sms: int) -> list[SMProgram]:
    progs = [SMProgram() for _ in range(num_sms)]
    for ph in PHASES:
        for i in sorted(assign[ph]):
            getattr(progs[assign[ph][i]], ph).append(i)
    return progs


@dataclass
class ImproveStats:
    steps: int = 0
    accepted: int = 0
    start_us: float = 0.0
    end_us: float = 0.0


def _kind_ends(res: SimResult, sim: Simulator) -> dict[int, np.ndarray]:
    """Per kind of the last simulated layer: end time per SM (nan where the SM has none)."""
    nsm = max(res.sm) + 1
    last = sim.Ls - 1
    ends: dict[int, np.ndarray] = {}
    for u, l in enumerate(res.layer):
        if l != last:
            continue
        arr = ends.setdefault(res.kind[u], np.full(nsm, np.nan))
        s = res.sm[u]
        if np.isnan(arr[s]) or res.end[u] > arr[s]:
            arr[s] = res.end[u]
    return ends


def _propose(graph: StepGraph, assign: dict, ends: dict[int, np.ndarray], kinds_of: dict[int, list[int]],
             num_sms: int, rng: np.random.Generator) -> dict | None:
    """One candidate assignment (a copy), or None when the drawn move does not apply."""
    nl, nt = len(graph.layer), len(graph.tail)
    r = rng.random()
    if r < 0.5:
        spread = {k: float(np.nanmax(e) - np.nanmedian(e)) for k, e in sorted(ends.items())
                  if np.count_nonzero(~np.isnan(e)) > 1}
        total = sum(spread.values())
        if total <= 0.0:
            return None
        keys = list(spread)
        k = keys[int(rng.choice(len(keys), p=[spread[x] / total for x in keys]))]
        e = ends[k]
        late = np.argsort(np.where(np.isnan(e), -np.inf, e), kind="stable")[::-1][:2]
        src = int(late[rng.integers(len(late))])
        cand = [i for i in kinds_of[k] if assign[LAYER][i] == src]
        if rng.random() < 0.5:
            early = np.argsort(np.where(np.isnan(e), np.inf, e), kind="stable")[:4]
            dst = int(early[rng.integers(len(early))])
        else:
            dst = int(rng.integers(num_sms))
        if not cand or dst == src:
            return None
        trial = {ph: dict(a) for ph, a in assign.items()}
        trial[LAYER][cand[-1]] = dst
        return trial
    trial = {ph: dict(a) for ph, a in assign.items()}
    if r < 0.8:
        if nt and rng.random() < 0.15:
            trial[TAIL][int(rng.integers(nt))] = int(rng.integers(num_sms))
        else:
            trial[LAYER][int(rng.integers(nl))] = int(rng.integers(num_sms))
        return trial
    i, j = int(rng.integers(nl)), int(rng.integers(nl))
    if graph.layer[i].kind == graph.layer[j].kind or assign[LAYER][i] == assign[LAYER][j]:
        return None
    trial[LAYER][i], trial[LAYER][j] = assign[LAYER][j], assign[LAYER][i]
    return trial


def improve(graph: StepGraph, sim: Simulator, programs: list[SMProgram], num_sms: int, steps: int,
            rng: np.random.Generator, progress=None) -> tuple[list[SMProgram], SimResult, ImproveStats]:
    """``steps`` proposals; returns the best programs, their (recorded) simulation and statistics."""
    assign = assignment_of(programs)
    best = sim.run(programs, record=True)
    stats = ImproveStats(start_us=best.step_us)
    kinds_of: dict[int, list[int]] = {}
    for i, t in enumerate(graph.layer):
        kinds_of.setdefault(int(t.kind), []).append(i)
    ends = _kind_ends(best, sim)
    for step in range(steps):
        trial = _propose(graph, assign, ends, kinds_of, num_sms, rng)
        stats.steps += 1
        if trial is not None:
            progs = programs_of(trial, num_sms)
            if sim.run(progs).step_us < best.step_us - 1e-9:
                assign = trial
                best = sim.run(progs, record=True)
                ends = _kind_ends(best, sim)
                stats.accepted += 1
        if progress is not None:
            progress(step + 1, steps)
    stats.end_us = best.step_us
    return programs_of(assign, num_sms), best, stats
