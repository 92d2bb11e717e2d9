"""Discrete-event simulation of one decode step of a schedule on the GPU's SMs.

Machine model (the megakernel's, see trtllm_mk/device/mk_gemv.cuh):
  * Per SM a LOADER streams the weights of the SM's GEMV tasks in program order, never waiting on
    events, only on ring space: byte q may be issued only once byte q - C was consumed (C = the ring's
    capacity for the task's kind). Issued bytes land ``landing_us`` later.
  * Per SM a CONSUMER runs the tasks in program order: it starts a task when the previous one ended
    and every waited event slot has all its signals (+ sync latency), spends ``pre`` (overhead +
    activation staging; no staging when the previous task on the SM staged the same input), then
    consumes the ring; the task ends after both its math and the arrival of its last slot, and
    hands its events to the SM's signaller warp, whose release publishes them ``publish_us`` later
    while the consumer goes on (``publish_idle_us`` when the consumer, not the stream, set the task's
    end, and for tasks that stream nothing: the SM's loader is then not streaming through the release).
    A polled event (its data carries it: graph.tasks Event.polled) reaches its waiters ``poll_us``
    after its producer's end, the waiter's sync included (poll_us 0: as a counted event).

The loader is a fluid model per task (exact for the two regimes that matter, approximate in between):
  head  the first min(W, C) bytes may be prefetched before the consumer reaches the task; the last
        head byte issues at max(loader free + head / rate, F(pos + head - C), F(pos - C) + head / rate)
        where F(q) is the time byte q was consumed (linear within each earlier task, from its first
        arrival to its end): the head waits for ring space, and streams at the rate once it has some.
  body  the remaining W - C bytes need ring space that only this task's own consumption frees, so
        they stream from max(head issued, consumer start) at the task's sustained ``rate`` (which
        already folds in Little's law for the ring and the consumer's pace).

Bandwidth: the SMs that run tasks of a GEMV kind share the read bandwidth while streaming it
(cost.py); the per-kind SM counts come from the schedule being simulated.

Counters are per (event, row, slot) like the kernel's; a wait completes when the slot's count
reaches the graph's per-step count. The event loop passes over the SMs, advancing each until its
next task has an unmet wait; a pass without progress is a deadlock (SimulationError). Predicted step
time = launch overhead + the last task's end. ``barrier=True`` adds, for the naive baseline, a grid-wide barrier
between consecutive phases (every task waits for all tasks of the previous phase).

Speed: the schedule is unrolled into flat Python lists once per model (waits, signals and costs per
task instance) and the event loop touches each instance once. With ``layers=k`` only k layers are
simulated and the remaining L - k are extrapolated with the period between the last two simulated
layers: the loader runs at most one ring ahead, so the state a layer hands to the next converges
after the first layer (checked against the exact run in tests/test_search.py).
"""
from __future__ import annotations

import gc
from bisect import bisect_right
from contextlib import contextmanager
from dataclasses import dataclass, field

from ..gpus import GpuSpec
from ..graph.tasks import HEAD, LAYER, TAIL, Kind, StepGraph
from ..schedule import SMProgram
from .calibration import Calibration
from .cost import CostTable, Streaming, cost_table, streaming_key


@contextmanager
def gc_paused():
    """Pause the cyclic garbage collector: the simulator allocates many small lists and no cycles,
    and collections triggered by them cost more than the simulation itself."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class SimulationError(ValueError):
    """The schedule cannot run to completion (a wait that is never satisfied)."""


@dataclass
class SimResult:
    step_us: float                      # predicted decode step (launch + makespan, extrapolated)
    makespan_us: float                  # of the simulated layers
    period_us: float                    # steady-state time per layer
    layers_simulated: int
    layer_end: list[float]              # end of each simulated layer
    # per task instance (only with record=True): unrolled id -> (sm, start, end)
    sm: list[int] = field(default_factory=list)
    start: list[float] = field(default_factory=list)
    end: list[float] = field(default_factory=list)
    kind: list[int] = field(default_factory=list)
    layer: list[int] = field(default_factory=list)   # -1 outside layers


def streaming_sms(programs: list[SMProgram], graph: StepGraph) -> Streaming:
    """Per GEMV kind, the SMs that stream its weights (they share the read bandwidth)."""
    sms: dict[int, set[int]] = {}
    for s, p in enumerate(programs):
        for tasks, idx in ((graph.head, p.head), (graph.layer, p.layer), (graph.tail, p.tail)):
            for i in idx:
                k = tasks[i].kind
                if k.streams_weights:
                    sms.setdefault(int(k), set()).add(s)
    return streaming_key({k: len(v) for k, v in sms.items()})


class Simulator:
    """Precomputed unrolled task arrays of one graph; ``run`` simulates any schedule of that graph."""

    def __init__(self, graph: StepGraph, gpu: GpuSpec, cal: Calibration, layers: int | None = None,
                 barrier: bool = False, costs: CostTable | None = None, reuse_staged: bool = True):
        self.graph, self.gpu, self.cal = graph, gpu, cal.resolved(gpu)
        self.barrier = barrier
        self.reuse_staged = reuse_staged   # False: every task stages its input (the list scheduler's view)
        L = graph.num_layers
        self.Ls = L if layers is None else max(1, min(L, layers))
        self.nh, self.nt, self.ntail = len(graph.head), len(graph.layer), len(graph.tail)
        self.n = self.nh + self.Ls * self.nt + self.ntail
        self._costs: dict[Streaming, tuple] = {}
        self._tables: dict[Streaming, CostTable] = {}
        self._reuse_memo: dict[tuple, bool] = {}
        if costs is not None:                      # a table the caller already computed
            self._tables[costs.streaming] = costs
        with gc_paused():
            self._build_events()

    # ------------------------------------------------------------------ unrolled structure
    def _build_events(self) -> None:
        g, L, Ls = self.graph, self.graph.num_layers, self.Ls
        shift = L - Ls                     # tail tasks refer to the last layers' rows
        offset, rows_of = {}, {}
        ncnt = 0
        for name in sorted(g.events):
            ev = g.events[name]
            rows = ev.rows - shift if ev.per_layer else ev.rows
            offset[name], rows_of[name] = ncnt, rows
            ncnt += rows * ev.slots
        target = [0] * ncnt
        # a cross-rank event (tensor parallelism) is seen a GPU-to-GPU synchronisation later
        link_us = self.cal.link_sync_us if g.dims.tensor_parallel > 1 else 0.0
        extra = [0.0] * ncnt
        # a polled event's waiters see it poll_us after its producer's end (poll_us 0: as a counted one)
        polled = [False] * ncnt
        for name in sorted(g.events):
            ev = g.events[name]
            if ev.polled and self.cal.poll_us:
                for i in range(offset[name], offset[name] + rows_of[name] * ev.slots):
                    polled[i] = True
            if ev.cross_rank:
                for i in range(offset[name], offset[name] + rows_of[name] * ev.slots):
                    extra[i] = link_us
            for r in range(rows_of[name]):
                orig = r if (not ev.per_layer or r < Ls) else r + shift
                for s in range(ev.slots):
                    target[offset[name] + r * ev.slots + s] = ev.counts[orig][s]

        def cid(ref, phase: str) -> int:
            """Counter id (of layer 0 for LAYER tasks; layer l adds l * slots)."""
            ev = g.events[ref.event]
            row = ref.index
            if phase == TAIL and ev.per_layer:
                row -= shift
            return offset[ref.event] + row * ev.slots + ref.slot

        def stride(ref) -> int:
            ev = g.events[ref.event]
            return ev.slots if ev.per_layer else 0

        waits, signals, kinds, layer_of, tmpl = [], [], [], [], []
        for i, t in enumerate(g.head):
            waits.append([cid(r, HEAD) for r in t.waits]); signals.append([cid(r, HEAD) for r in t.signals])
            kinds.append(int(t.kind)); layer_of.append(-1); tmpl.append((HEAD, i))
        lw = [[(cid(r, LAYER), stride(r)) for r in t.waits] for t in g.layer]
        ls = [[(cid(r, LAYER), stride(r)) for r in t.signals] for t in g.layer]
        lk = [int(t.kind) for t in g.layer]
        for l in range(Ls):
            waits.extend([b + l * st for b, st in refs] for refs in lw)
            signals.extend([b + l * st for b, st in refs] for refs in ls)
            kinds.extend(lk)
            layer_of.extend([l] * len(lk))
            tmpl.extend((LAYER, i) for i in range(len(lk)))
        for i, t in enumerate(g.tail):
            waits.append([cid(r, TAIL) for r in t.waits]); signals.append([cid(r, TAIL) for r in t.signals])
            kinds.append(int(t.kind)); layer_of.append(-1); tmpl.append((TAIL, i))

        if self.barrier:
            # phase of an instance: head, then per layer each kind in template order, then tail kinds
            order = []
            for t in g.layer:
                if t.kind not in order:
                    order.append(t.kind)
            tail_order = []
            for t in g.tail:
                if t.kind not in tail_order:
                    tail_order.append(t.kind)
            phase_of = []
            for u in range(self.n):
                ph, i = tmpl[u]
                if ph == HEAD:
                    phase_of.append(0)
                elif ph == LAYER:
                    phase_of.append(1 + layer_of[u] * len(order) + order.index(g.layer[i].kind))
                else:
                    phase_of.append(1 + Ls * len(order) + tail_order.index(g.tail[i].kind))
            nph = max(phase_of) + 1
            counts = [0] * nph
            for p in phase_of:
                counts[p] += 1
            base = ncnt
            target += counts
            ncnt += nph
            for u in range(self.n):
                p = phase_of[u]
                signals[u] = signals[u] + [base + p]
                if p > 0:
                    waits[u] = waits[u] + [base + p - 1]
        self.ncnt, self.target, self.extra = ncnt, target, extra + [0.0] * (ncnt - len(extra))
        self.polled = polled + [False] * (ncnt - len(polled))
        self.waits, self.signals, self.kinds, self.layer_of, self.tmpl = waits, signals, kinds, layer_of, tmpl
        # how many of an instance's signals are staged (published after its staging: Task.staged_signals)
        self.staged = [g.phase_tasks(ph)[i].staged_signals for ph, i in tmpl]
        # the counter a task's loader waits for before it streams (its first wait; -1: none), for the
        # kinds whose weights an event decides (kinds' LOADER_WAITS)
        self.loader_wait = [w[0] if w and getattr(Kind(k).module, "LOADER_WAITS", False) else -1
                            for w, k in zip(waits, kinds)]

    def _cost_arrays(self, streaming: Streaming) -> tuple:
        if streaming not in self._costs:
            ct = self._tables.get(streaming) or cost_table(self.graph, self.gpu, self.cal, streaming)
            per = [ct.phase(ph)[i] for ph, i in self.tmpl]
            self._costs[streaming] = (
                [c.gemv for c in per], [c.weight for c in per], [c.pre for c in per], [c.comp for c in per],
                [c.slot_t for c in per], [c.ring for c in per], [c.rate for c in per], [c.dur for c in per],
                [c.stage for c in per])
        return self._costs[streaming]

    def sequences(self, programs: list[SMProgram]) -> list[list[int]]:
        nh, nt = self.nh, self.nt
        base_tail = nh + self.Ls * nt
        seqs = []
        for p in programs:
            seq = list(p.head)
            for l in range(self.Ls):
                off = nh + l * nt
                seq.extend(off + i for i in p.layer)
            seq.extend(base_tail + i for i in p.tail)
            seqs.append(seq)
        return seqs

    def staged_reuse(self, seqs: list[list[int]]) -> list[list[bool]]:
        """Per SM and position: the task reuses its predecessor's staged activation (codegen emits
        stage = 0 for it, see Task.reuses_staged_input), so its ``stage`` time is not spent."""
        if not self.reuse_staged:
            return [[False] * len(seq) for seq in seqs]
        tmpl, layer_of, memo = self.tmpl, self.layer_of, self._reuse_memo
        out = []
        for seq in seqs:
            flags = [False] * len(seq)
            for p in range(1, len(seq)):
                u, v = seq[p - 1], seq[p]
                if layer_of[u] != layer_of[v]:
                    continue
                key = (tmpl[u], tmpl[v])
                r = memo.get(key)
                if r is None:
                    (pa, ia), (pb, ib) = key
                    r = memo[key] = self.graph.phase_tasks(pb)[ib].reuses_staged_input(self.graph.phase_tasks(pa)[ia])
                flags[p] = r
            out.append(flags)
        return out

    # ------------------------------------------------------------------ event loop
    def run(self, programs: list[SMProgram], record: bool = False) -> SimResult:
        with gc_paused():
            return self._run(programs, record)

    def _run(self, programs: list[SMProgram], record: bool) -> SimResult:
        gemv, W, pre, comp, slot_t, ring, rate, dur, stage = self._cost_arrays(streaming_sms(programs, self.graph))
        seqs = self.sequences(programs)
        reuse = self.staged_reuse(seqs)
        waits, signals, target, extra = self.waits, self.signals, self.target, self.extra
        staged = self.staged
        lwait = self.loader_wait
        sync, lat, ltask = self.cal.sync_us, self.cal.landing_us, self.cal.loader_task_us
        pub_stream, pub_idle = self.cal.publish_us, self.cal.publish_idle_us
        polled, poll = self.polled, self.cal.poll_us - sync   # the waiter adds sync to what it sees
        nsm = len(seqs)
        cnt = [0] * self.ncnt
        rt = [0.0] * self.ncnt
        ptr = [0] * nsm
        cons = [0.0] * nsm          # consumer free
        ld_t = [0.0] * nsm          # loader: issue time of the last byte issued
        ld_pos = [0.0] * nsm        # loader: bytes issued so far
        # consumption history per SM: task byte ranges [p0, p1) consumed linearly over [f0, f1]
        h_p0 = [[] for _ in range(nsm)]
        h_p1 = [[] for _ in range(nsm)]
        h_f0 = [[] for _ in range(nsm)]
        h_f1 = [[] for _ in range(nsm)]
        layer_of = self.layer_of
        lend = [0.0] * self.Ls
        rec_sm = [-1] * self.n if record else None
        rec_st = [0.0] * self.n if record else None
        rec_en = [0.0] * self.n if record else None
        remaining = sum(len(s) for s in seqs)
        makespan = 0.0
        while remaining:
            progress = False
            for s in range(nsm):
                seq = seqs[s]
                reuse_s = reuse[s]
                p = ptr[s]
                n_s = len(seq)
                while p < n_s:
                    u = seq[p]
                    ready = -1.0
                    blocked = False
                    for c in waits[u]:
                        if cnt[c] < target[c]:
                            blocked = True
                            break
                        if rt[c] > ready:
                            ready = rt[c]
                    if blocked:
                        break
                    st = cons[s]
                    if ready >= 0.0 and ready + sync > st:
                        st = ready + sync
                    if gemv[u]:
                        w, C, r = W[u], ring[u], rate[u]
                        pos0 = ld_pos[s]
                        head = w if w < C else C
                        # ring space for the last head byte: byte (pos0 + head - C) must be consumed;
                        # and for the first, byte (pos0 - C), after which the head still streams at r
                        fq = 0.0
                        for q, after in ((pos0 + head - C, 0.0), (pos0 - C, head / r)):
                            if q <= 0.0:
                                continue
                            p1 = h_p1[s]
                            k = bisect_right(p1, q)
                            if k < len(p1):
                                a0 = h_p0[s][k]
                                f0 = h_f0[s][k]
                                f = f0 + (q - a0) / (p1[k] - a0) * (h_f1[s][k] - f0) if q > a0 else f0
                            else:
                                f = h_f1[s][-1]
                            if f + after > fq:
                                fq = f + after
                        lstart = ld_t[s] + ltask
                        cw = lwait[u]
                        if cw >= 0 and rt[cw] + sync > lstart:   # it streams what an event decides
                            lstart = rt[cw] + sync
                        t_head = lstart + head / r
                        if fq > t_head:
                            t_head = fq
                        cs = st + (pre[u] - stage[u] if reuse_s[p] else pre[u])
                        body = w - head
                        if body > 0.0:
                            t_issue = (t_head if t_head > cs else cs) + body / r
                        else:
                            t_issue = t_head
                        end = t_issue + lat + slot_t[u]
                        pub = pub_stream
                        if cs + comp[u] > end:   # consumer-bound: its loader sits on a full ring
                            end = cs + comp[u]
                            pub = pub_idle
                        first = t_head - head / r + lat
                        h_p0[s].append(pos0)
                        h_p1[s].append(pos0 + w)
                        h_f0[s].append(first if first > cs else cs)
                        h_f1[s].append(end)
                        ld_pos[s] = pos0 + w
                        ld_t[s] = t_issue
                    else:
                        end = st + dur[u]
                        cs = end
                        pub = pub_idle
                    cons[s] = end
                    k = staged[u]   # the first k signals go out once the input is staged (at cs)
                    for i, c in enumerate(signals[u]):   # rt: when a waiter can see the counter's last signal
                        cnt[c] += 1
                        seen = (end + poll if polled[c] else cs + pub_stream if i < k else end + pub) + extra[c]
                        if seen > rt[c]:
                            rt[c] = seen
                    lu = layer_of[u]
                    if lu >= 0 and end > lend[lu]:
                        lend[lu] = end
                    if end > makespan:
                        makespan = end
                    if record:
                        rec_sm[u], rec_st[u], rec_en[u] = s, st, end
                    p += 1
                if p != ptr[s]:
                    remaining -= p - ptr[s]
                    ptr[s] = p
                    progress = True
            if not progress:
                stuck = [f"SM {s}: task #{ptr[s]} ({self._label(seqs[s][ptr[s]])})"
                         for s in range(nsm) if ptr[s] < len(seqs[s])][:4]
                raise SimulationError("schedule deadlocks: no SM can proceed; " + "; ".join(stuck))
        L = self.graph.num_layers
        if self.Ls < L:
            period = lend[-1] - lend[-2] if self.Ls >= 2 else lend[0]
        else:
            period = (lend[-1] - lend[-2]) if L >= 2 else lend[0]
        total = makespan + (L - self.Ls) * period
        res = SimResult(step_us=total + self.cal.launch_us, makespan_us=makespan, period_us=period,
                        layers_simulated=self.Ls, layer_end=lend)
        if record:
            res.sm, res.start, res.end = rec_sm, rec_st, rec_en
            res.kind, res.layer = list(self.kinds), list(layer_of)
        return res

    def _label(self, u: int) -> str:
        ph, i = self.tmpl[u]
        t = self.graph.phase_tasks(ph)[i]
        return t.label() + (f" layer {self.layer_of[u]}" if ph == LAYER else f" {ph}")


def simulate(graph: StepGraph, programs: list[SMProgram], gpu: GpuSpec, cal: Calibration, *,
             barrier: bool = False, layers: int | None = None, record: bool = False) -> SimResult:
    """One-shot simulation (build a Simulator to simulate many schedules of one graph)."""
    return Simulator(graph, gpu, cal, layers=layers, barrier=barrier).run(programs, record=record)

