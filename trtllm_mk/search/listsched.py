"""List scheduling: the initial task -> SM assignment of the search.

Tasks are taken in template order (a topological order: head, then per layer QKV by KV group, ATTN,
COMBINE, OPROJ, GATEUP, DOWN, then tail) and each goes to the SM where it would *finish* first
(earliest finish time, HEFT without insertion). The finish estimate uses a per-SM state of the
simulator's loader / consumer model (search/simulate.py), vectorized over SMs with numpy, with two
simplifications: the ring space the loader waits for is estimated from the consumer's free time at
the task's own rate, or from the last GEMV's consumption when the byte lies in it, and no task
reuses a staged input (the predecessor on the SM is not known yet). tests/test_timing_models.py
holds the two models to each other on every shipped config:
  consumer  start = max(consumer free, ready + sync) + pre; end >= start + math
  loader    may run one ring (C bytes) ahead of the consumer: the task's first min(W, C) bytes issue
            at max(loader free + head / rate, consumer free - (C - head) / rate, when the last GEMV
            consumed byte (bytes so far + head - C) if it did, and byte (bytes so far - C) plus
            head / rate if it did), the rest after the consumer started the
            task; end >= last issue + landing latency + one slot's math; its events are seen
            ``publish_us`` after its end (the signaller's release; ``publish_idle_us`` when the
            consumer set the end, or the task streams nothing).
Because GEMV tiles of one kind are equal, "finishes first" balances each phase's bytes across SMs
while letting the SMs that end a phase early take the attention work; the loader's run-ahead makes
it prefer SMs whose ring is not yet full. Ties go to the SM first in a seeded permutation, so
different seeds give different (equally good) starting points and one seed always the same one.

Each SM's program keeps template order, which is one global topological order, so the programs can
never deadlock (the earliest unfinished task in that order is always runnable).
"""
from __future__ import annotations

import numpy as np

from ..graph.tasks import StepGraph
from ..schedule import SMProgram
from .calibration import Calibration
from .cost import CostTable, TaskCost


class _State:
    """Per SM: when its consumer is free, when its loader issued its last byte, the ring bytes loaded
    so far, and the last GEMV's bytes and consumption span (first byte, last byte: the simulator
    interpolates between them)."""

    def __init__(self, nsm: int):
        self.cons = np.zeros(nsm)
        self.ld = np.zeros(nsm)
        self.pos = np.zeros(nsm)
        self.w = np.zeros(nsm)
        self.f0 = np.zeros(nsm)
        self.f1 = np.zeros(nsm)


def _place(state: _State, c: TaskCost, ready: float, cal: Calibration, order: np.ndarray,
           loader_ready: float = -1.0) -> tuple[int, float, float, float]:
    """Put one task on the SM (scanned in ``order``) where it ends first; returns (sm, end, when its
    input is staged: its staged signals go out then, Task.staged_signals; its release's publish time).
    ``loader_ready`` (>= 0): when the event its loader waits for is signalled (kinds' LOADER_WAITS)."""
    cons = state.cons[order]
    st = np.maximum(cons, ready + cal.sync_us) if ready >= 0.0 else cons
    if c.gemv:
        ld = state.ld[order] + cal.loader_task_us
        if loader_ready >= 0.0:   # it streams what an event decides
            ld = np.maximum(ld, loader_ready + cal.sync_us)
        head = min(c.weight, c.ring)
        # when byte (pos + head - C) was consumed: the consumer's free time less the ring's remainder at
        # this task's rate, and no earlier than the last GEMV's own consumption (the simulator's linear
        # span from its first to its last byte) says, when the byte lies in that GEMV
        back = c.ring - head
        w, f0, f1, pos = state.w[order], state.f0[order], state.f1[order], state.pos[order]

        def consumed(d):   # when byte (pos - d) was consumed, if the last GEMV held it
            return f1 - d * (f1 - f0) / np.maximum(w, 1.0)
        within = np.where((back <= w) & (pos > back), consumed(back), 0.0)
        # and the head's first byte's space (byte pos - C), after which the head streams at the rate: a
        # byte before the last GEMV was consumed by that GEMV's first consumption at the latest
        within0 = np.where(pos > c.ring, np.where(c.ring <= w, consumed(c.ring), f0) + head / c.rate, 0.0)
        t_head = np.maximum(np.maximum(ld + head / c.rate, cons - back / c.rate), np.maximum(within, within0))
        cs = st + c.pre
        body = c.weight - head
        t_issue = np.maximum(t_head, cs) + body / c.rate if body > 0 else t_head
        streamed = t_issue + cal.landing_us + c.slot_t
        end = np.maximum(streamed, cs + c.comp)
        j = int(np.argmin(end))
        s = int(order[j])
        pub = cal.publish_us if streamed[j] >= cs[j] + c.comp else cal.publish_idle_us
        state.ld[s] = t_issue[j] if body > 0 else t_head[j]
        state.f0[s] = max(float(t_head[j]) - head / c.rate + cal.landing_us, float(cs[j]))
        state.f1[s] = float(end[j])
        state.w[s] = c.weight
        state.pos[s] += c.weight
        staged = float(cs[j])
    else:
        end = st + c.dur
        j = int(np.argmin(end))
        s = int(order[j])
        staged = float(end[j])
        pub = cal.publish_idle_us
    state.cons[s] = end[j]
    return s, float(end[j]), staged, pub


def list_schedule(graph: StepGraph, costs: CostTable, num_sms: int, cal: Calibration,
                  rng: np.random.Generator, ends: list[float] | None = None) -> list[SMProgram]:
    """Earliest-finish-time assignment of head, one layer template and tail (see module doc).
    ``ends``: when given, each task's estimated finish is appended (head, layer, tail order), which
    tests/test_timing_models.py compares with the simulator's."""
    order = rng.permutation(num_sms)
    state = _State(num_sms)
    progs = [SMProgram() for _ in range(num_sms)]
    done: dict[tuple[str, int, int], float] = {}   # (event, relative row, slot) -> latest signal time

    shift = graph.num_layers - 1   # one layer is laid out: tail rows of per-layer events move back

    def key(r, tail: bool) -> tuple[str, int, int]:
        row = r.index - shift if tail and graph.events[r.event].per_layer else r.index
        return r.event, row, r.slot

    # a cross-rank event (tensor parallelism) is seen a GPU-to-GPU synchronisation later (simulate.py)
    link = cal.link_sync_us if graph.dims.tensor_parallel > 1 else 0.0
    extra = {name: link if ev.cross_rank else 0.0 for name, ev in graph.events.items()}
    # a polled event is seen poll_us after its producer's end, the waiter's sync_us included (poll_us 0:
    # as a counted one)
    polled = {name for name, ev in graph.events.items() if ev.polled and cal.poll_us}

    def run(tasks, tcosts, attr: str) -> None:
        tail = attr == "tail"
        for i, (t, c) in enumerate(zip(tasks, tcosts)):
            ready = max((done.get(key(r, tail), 0.0) for r in t.waits), default=-1.0)
            lready = (done.get(key(t.waits[0], tail), 0.0)
                      if t.waits and getattr(t.kind.module, "LOADER_WAITS", False) else -1.0)
            s, end, staged, pub = _place(state, c, ready, cal, order, lready)
            if ends is not None:
                ends.append(end)
            getattr(progs[s], attr).append(i)
            for n, r in enumerate(t.signals):   # done: when a waiter can see the event's last signal
                k = key(r, tail)
                if r.event in polled:
                    seen = end + cal.poll_us - cal.sync_us + extra[r.event]
                else:
                    seen = (staged + cal.publish_us if n < t.staged_signals else end + pub) + extra[r.event]
                done[k] = max(done.get(k, 0.0), seen)

    run(graph.head, costs.head, "head")
    run(graph.layer, costs.layer, "layer")
    run(graph.tail, costs.tail, "tail")
    return progs
