"""Static schedule validator: a schedule is accepted only if it is complete, every wait is exactly
satisfiable, the per-SM order cannot deadlock, and no two conflicting accesses are unordered.

Machine model (the GPU megakernel's): one persistent CTA per SM, all co-resident; each SM runs its
unrolled program (``Schedule.unrolled``) strictly in order; a task waits until each slot it waits on
reaches the slot's per-step count, runs, then adds 1 to each slot it signals.

Checks, in order (each assumes the previous ones passed):
  structure  programs count == num_sms, indices in range, every head/tail task and every layer
             template task scheduled exactly once over all SMs.
  counts     every (event, row, slot) gets exactly ``count`` signals per step. Fewer: a waiter can
             never pass (deadlock). More: a waiter may pass before the producers it relies on (race),
             and monotonic counters drift from their targets on the next steps.
  deadlock   with exact counts, a wait passes iff every signaller of its slot has finished, so the
             machine runs to completion iff the graph of task instances with edges
             signaller -> slot -> waiter plus per-SM program order is acyclic (a topological order
             is a complete run; on a cycle no task can finish first). One junction node per slot
             keeps the edge count linear instead of signallers x waiters.
  races      happens-before is reachability in that graph. Two accesses conflict if their element
             ranges overlap in the same buffer (and layer), at least one writes, and they are not both
             atomic adds. Each conflicting pair must be ordered.

Race check cost: ancestor and descendant sets are Python-int bitsets over the task instances, built
in one pass each over a topological order. For every writing access we build (once per distinct
buffer/layer/range/mode, with numpy) the bitset of accesses it conflicts with, and test
``conflicts & ~(ancestors | descendants)`` - one big-int expression per access instead of a loop over
pairs, so buffers that every task touches (x, read by every norm prologue of every layer) cost
O(accesses x tasks / 64) word operations, not O(pairs). No layer-periodicity shortcut is taken: every
layer instance is checked explicitly, which is exact by construction.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .errors import EngineError
from .graph import HEAD, LAYER, TAIL, StepGraph, Task
from .schedule import Schedule

_READ, _WRITE, _ADD = 0, 1, 2
_MODE_WORD = {_READ: "reads", _WRITE: "writes", _ADD: "adds into"}
MAX_ERRORS = 20


class ScheduleError(EngineError):
    """A schedule (or graph) that the megakernel must not run: incomplete, deadlocking or racy."""


@dataclass
class ValidationReport:
    ok: bool
    errors: list[str] = field(default_factory=list)
    failed_check: str | None = None   # structure | counts | deadlock | races
    tasks: int = 0                    # scheduled task instances (all layers unrolled)
    edges: int = 0                    # program-order + signal + wait edges
    checked_pairs: int = 0            # conflicting access pairs whose order was tested
    seconds: float = 0.0

    def summary(self) -> str:
        head = "valid" if self.ok else f"INVALID ({self.failed_check}): {self.errors[0]}"
        return (f"schedule {head}; {self.tasks} tasks, {self.edges} edges, {self.checked_pairs} access pairs "
                f"checked in {self.seconds:.2f} s")


def check(schedule: Schedule, graph: StepGraph | None = None) -> ValidationReport:
    """Validate and raise ScheduleError naming the first offending task if the schedule is unsafe."""
    rep = validate(schedule, graph)
    if not rep.ok:
        more = f" (+{len(rep.errors) - 1} more)" if len(rep.errors) > 1 else ""
        raise ScheduleError(f"invalid schedule ({rep.failed_check}): {rep.errors[0]}{more}")
    return rep


def validate(schedule: Schedule, graph: StepGraph | None = None) -> ValidationReport:
    t0 = time.perf_counter()
    g = graph if graph is not None else schedule.graph()
    v = _Validator(schedule, g)
    rep = ValidationReport(ok=False)
    for name, stage in (("structure", v.check_structure), ("counts", v.check_counts),
                        ("deadlock", v.check_deadlock), ("races", v.check_races)):
        errors = stage()
        if errors:
            rep.errors, rep.failed_check = errors, name
            break
    else:
        rep.ok = True
    rep.tasks, rep.edges, rep.checked_pairs = v.n_instances, v.n_edges, v.checked_pairs
    rep.seconds = time.perf_counter() - t0
    return rep


class _Validator:
    """Task instances get global ids: head tasks, then layer l template task i at
    ``n_head + l * n_layer + i``, then tail tasks; event slots get ids after the tasks."""

    def __init__(self, schedule: Schedule, graph: StepGraph):
        self.s, self.g = schedule, graph
        self.nh, self.nl, self.L = len(graph.head), len(graph.layer), graph.num_layers
        self.n_instances = self.nh + self.L * self.nl + len(graph.tail)
        # A task with staged signals is two nodes in program order: its staging (waits, staged reads,
        # staged signals) and the rest. Staging nodes get the ids after the task instances.
        self.staging: dict[int, int] = {}    # task instance -> its staging node
        self.staged_of: list[int] = []       # staging node - n_instances -> its task instance
        for node in range(self.n_instances):
            if self.instance(node)[0].staged_signals:
                self.staging[node] = self.n_instances + len(self.staged_of)
                self.staged_of.append(node)
        self.n_tasks = self.n_instances + len(self.staged_of)   # nodes that access buffers
        self.n_edges = 0
        self.checked_pairs = 0
        self.where: list[tuple[int, int] | None] = [None] * self.n_tasks   # (sm, position in unrolled program)
        self.programs: list[list[int]] = []                               # per SM, unrolled node ids

    # ------------------------------------------------------------------ naming
    def instance(self, node: int) -> tuple[Task, int]:
        if node >= self.n_instances:
            node = self.staged_of[node - self.n_instances]
        if node < self.nh:
            return self.g.head[node], -1
        node -= self.nh
        if node < self.L * self.nl:
            return self.g.layer[node % self.nl], node // self.nl
        return self.g.tail[node - self.L * self.nl], -1

    def name(self, node: int) -> str:
        task, layer = self.instance(node)
        what = f"layer {layer} {task.label()}" if layer >= 0 else f"{task.phase} {task.label()}"
        if node >= self.n_instances:
            what += " staging"
        w = self.where[node]
        return f"SM {w[0]} task {w[1]} ({what})" if w else f"unscheduled ({what})"

    def _id(self, phase: str, idx: int, layer: int) -> int:
        if phase == HEAD:
            return idx
        if phase == LAYER:
            return self.nh + layer * self.nl + idx
        return self.nh + self.L * self.nl + idx

    # ------------------------------------------------------------------ structure
    def check_structure(self) -> list[str]:
        s, g = self.s, self.g
        errors: list[str] = []
        if len(s.programs) != s.num_sms:
            errors.append(f"schedule has {len(s.programs)} SM programs but num_sms={s.num_sms}")
        seen: dict[str, list[list[tuple[int, int]]]] = {
            ph: [[] for _ in g.phase_tasks(ph)] for ph in (HEAD, LAYER, TAIL)}
        for sm, prog in enumerate(s.programs):
            for ph, idxs in ((HEAD, prog.head), (LAYER, prog.layer), (TAIL, prog.tail)):
                n = len(g.phase_tasks(ph))
                for j, i in enumerate(idxs):
                    if not isinstance(i, (int, np.integer)) or not 0 <= i < n:
                        errors.append(f"SM {sm} {ph}[{j}] = {i!r} is out of range (the graph has {n} {ph} tasks)")
                    else:
                        seen[ph][i].append((sm, j))
        for ph in (HEAD, LAYER, TAIL):
            for i, places in enumerate(seen[ph]):
                label = g.phase_tasks(ph)[i].label()
                if not places:
                    errors.append(f"{ph} task {i} ({label}) is scheduled on no SM")
                elif len(places) > 1:
                    at = ", ".join(f"SM {sm} {ph}[{j}]" for sm, j in places)
                    errors.append(f"{ph} task {i} ({label}) is scheduled {len(places)} times ({at})")
        errors += self._check_refs()
        if errors:
            return errors[:MAX_ERRORS]
        for sm in range(s.num_sms):
            prog, ids = s.programs[sm], []
            ids += [self._id(HEAD, i, -1) for i in prog.head]
            for layer in range(self.L):
                ids += [self._id(LAYER, i, layer) for i in prog.layer]
            ids += [self._id(TAIL, i, -1) for i in prog.tail]
            ids = [x for node in ids for x in ((self.staging[node], node) if node in self.staging else (node,))]
            for pos, node in enumerate(ids):
                self.where[node] = (sm, pos)
            self.programs.append(ids)
        return []

    def _check_refs(self) -> list[str]:
        """Every event reference of every task instance names an existing (event, row, slot)."""
        errors = []
        for ph in (HEAD, LAYER, TAIL):
            layers = range(self.L) if ph == LAYER else (-1,)
            for task in self.g.phase_tasks(ph):
                for what, refs in (("waits", task.waits), ("signals", task.signals)):
                    for ref in refs:
                        ev = self.g.events.get(ref.event)
                        for layer in layers:
                            _, row, slot = self.g.resolve(task, layer, ref)
                            if ev is None or not (0 <= row < ev.rows and 0 <= slot < ev.slots):
                                shape = f"[{ev.rows}, {ev.slots}]" if ev else "(no such event)"
                                at = f"layer {layer} " if layer >= 0 else f"{ph} "
                                errors.append(f"{at}{task.label()} {what} {ref.event}[{row}][{slot}] outside "
                                              f"event {ref.event} {shape}")
                                break
        return errors

    # ------------------------------------------------------------------ counts
    def _refs(self, node: int, which: str) -> list[tuple[str, int, int]]:
        task, layer = self.instance(node)
        refs = getattr(task, which)
        if task.staged_signals:   # the staging node waits and publishes the staged signals
            staging, k = node >= self.n_instances, task.staged_signals
            refs = (refs if staging else ()) if which == "waits" else (refs[:k] if staging else refs[k:])
        return [self.g.resolve(task, layer, r) for r in refs]

    def check_counts(self) -> list[str]:
        self.signallers: dict[tuple[str, int, int], list[int]] = {}
        for node in range(self.n_tasks):
            for key in self._refs(node, "signals"):
                self.signallers.setdefault(key, []).append(node)
        errors: list[str] = []
        for ids in self.programs:
            for node in ids:
                for key in self._refs(node, "waits"):
                    have, need = len(self.signallers.get(key, ())), self._count(key)
                    if have != need:
                        why = (f"can reach only {have} of {need} signals" if have < need else
                               f"gets {have} signals but passes at {need} (it may pass before all its producers)")
                        errors.append(f"{self.name(node)} waits {key[0]}[{key[1]}][{key[2]}] which {why}")
        for name, ev in sorted(self.g.events.items()):
            for row in range(ev.rows):
                for slot in range(ev.slots):
                    have, need = len(self.signallers.get((name, row, slot), ())), ev.counts[row][slot]
                    if have != need:
                        errors.append(f"event {name}[{row}][{slot}] gets {have} signals per step but its count is "
                                      f"{need} (monotonic counter targets drift on the next steps)")
        return errors[:MAX_ERRORS]

    def _count(self, key: tuple[str, int, int]) -> int:
        return self.g.events[key[0]].counts[key[1]][key[2]]

    # ------------------------------------------------------------------ deadlock
    def check_deadlock(self) -> list[str]:
        n = self.n_tasks
        slot_id = {key: n + i for i, key in enumerate(sorted(self._all_slots()))}
        total = n + len(slot_id)
        succ: list[list[int]] = [[] for _ in range(total)]
        pred: list[list[int]] = [[] for _ in range(total)]

        def edge(a: int, b: int) -> None:
            succ[a].append(b)
            pred[b].append(a)

        for ids in self.programs:
            for a, b in zip(ids, ids[1:]):
                edge(a, b)
        for key, nodes in self.signallers.items():
            for a in nodes:
                edge(a, slot_id[key])
        self.wait_slots: list[list[int]] = [[] for _ in range(n)]
        for node in range(n):
            for key in self._refs(node, "waits"):
                edge(slot_id[key], node)
                self.wait_slots[node].append(slot_id[key])
        self.n_edges = sum(len(s) for s in succ)
        self.succ, self.pred, self.slot_id = succ, pred, slot_id

        indeg = [len(p) for p in pred]
        queue = deque(i for i in range(total) if indeg[i] == 0)
        order: list[int] = []
        while queue:
            a = queue.popleft()
            order.append(a)
            for b in succ[a]:
                indeg[b] -= 1
                if indeg[b] == 0:
                    queue.append(b)
        self.order = order
        if len(order) == total:
            return []
        done = bytearray(total)
        for a in order:
            done[a] = 1
        return self._deadlock_report(done)

    def _all_slots(self) -> set[tuple[str, int, int]]:
        keys = set(self.signallers)
        for node in range(self.n_tasks):
            keys.update(self._refs(node, "waits"))
        return keys

    def _deadlock_report(self, done: bytearray) -> list[str]:
        """The machine's maximal run is exactly the processed prefix of the topological sort, so the
        first unprocessed task of each SM is where that SM is stuck."""
        key_of = {v: k for k, v in self.slot_id.items()}
        heads = []
        for ids in self.programs:
            stuck = next((x for x in ids if not done[x]), None)
            if stuck is not None:
                heads.append(stuck)
        msgs = []
        for node in heads:
            for sl in self.wait_slots[node]:
                if not done[sl]:
                    ev, row, slot = key_of[sl]
                    got = sum(done[x] for x in self.pred[sl])
                    msgs.append(f"{self.name(node)} waits {ev}[{row}][{slot}] which can reach only {got} of "
                                f"{len(self.pred[sl])} signals")
                    break
        cycle = self._find_cycle(heads[0], done)
        stuck = "; ".join(self.name(h) for h in heads)
        return [f"{msgs[0]}; cycle: {cycle}; stuck SM heads: {stuck}"] + msgs[1:MAX_ERRORS]

    def _find_cycle(self, start: int, done: bytearray) -> str:
        """Every unprocessed node has an unprocessed predecessor; walking them must repeat a node."""
        key_of = {v: k for k, v in self.slot_id.items()}
        path, pos = [start], {start: 0}
        while True:
            nxt = next(p for p in self.pred[path[-1]] if not done[p])
            if nxt in pos:
                cyc = path[pos[nxt]:][::-1]   # predecessor walk reversed: execution direction
                break
            pos[nxt] = len(path)
            path.append(nxt)
        parts = []
        for i, x in enumerate(cyc):
            if x < self.n_tasks:
                parts.append(self.name(x))
                y = cyc[(i + 1) % len(cyc)]
                if y < self.n_tasks:
                    parts.append("-(program order)->")
            else:
                ev, row, slot = key_of[x]
                parts.append(f"-({ev}[{row}][{slot}])->")
        return " ".join(parts) + " ..."

    # ------------------------------------------------------------------ races
    def check_races(self) -> list[str]:
        n = self.n_tasks
        succ, pred, order = self.succ, self.pred, self.order
        anc: list[int] = [0] * len(order)
        for a in order:
            acc = 0
            for p in pred[a]:
                acc |= anc[p] | (1 << p) if p < n else anc[p]
            anc[a] = acc
        desc: list[int] = [0] * len(order)
        for a in reversed(order):
            acc = 0
            for q in succ[a]:
                acc |= desc[q] | (1 << q) if q < n else desc[q]
            desc[a] = acc

        groups = self._access_groups()
        masks: dict[tuple, int] = {}
        errors: list[str] = []
        writers = sorted(((self.where[node], node, key, lo, hi, mode)
                          for key, accs in groups.items() for node, lo, hi, mode in accs[4] if mode != _READ))
        for _, node, key, lo, hi, mode in writers:
            if hi <= lo:
                continue
            mkey = (key, lo, hi, mode)
            mask = masks.get(mkey)
            if mask is None:
                mask = masks[mkey] = self._conflicts(groups[key], lo, hi, mode)
            mask &= ~(1 << node)
            self.checked_pairs += mask.bit_count()
            bad = mask & ~(anc[node] | desc[node])
            if bad:
                other = (bad & -bad).bit_length() - 1
                o_mode, o_lo, o_hi = self._access_of(groups[key], other, lo, hi, mode)
                buf, layer = key
                lay = f" of layer {layer}" if layer >= 0 else ""
                errors.append(f"race on {buf}{lay}[{max(lo, o_lo)}:{min(hi, o_hi)}]: {self.name(node)} "
                              f"{_MODE_WORD[mode]} it and {self.name(other)} {_MODE_WORD[o_mode]} it with no "
                              f"happens-before order between them")
                if len(errors) >= MAX_ERRORS:
                    break
        return errors

    def _access_groups(self) -> dict[tuple[str, int], tuple]:
        """(buffer, concrete layer or -1) -> numpy arrays (node, lo, hi, mode) and the raw list."""
        raw: dict[tuple[str, int], list[tuple[int, int, int, int]]] = {}
        # a buffer some task accesses in part of the batch rows only (Access.rows) is checked per row:
        # its accesses are keyed "buf row b" for each row they cover
        g = self.g
        per_row = {a.buf for t in g.head + g.layer + g.tail for a in t.reads + t.writes if a.rows is not None}
        for node in range(self.n_tasks):
            task, layer = self.instance(node)
            for accs, is_write in ((task.reads, False), (task.writes, True)):
                if task.staged_signals:   # staged reads at the staging node, the rest at the task's
                    staging = node >= self.n_instances
                    accs = [a for a in accs if (not is_write and a.staged) == staging]
                for a in accs:
                    lay = a.layer + layer if (a.layer >= 0 and task.phase == LAYER) else a.layer
                    mode = (_ADD if a.add else _WRITE) if is_write else _READ
                    if a.buf in per_row:
                        for b in range(*(a.rows or (0, g.batch))):
                            raw.setdefault((f"{a.buf} row {b}", lay), []).append((node, a.lo, a.hi, mode))
                    else:
                        raw.setdefault((a.buf, lay), []).append((node, a.lo, a.hi, mode))
        out = {}
        for key, lst in raw.items():
            arr = np.array(lst, dtype=np.int64).reshape(-1, 4)
            out[key] = (arr[:, 0], arr[:, 1], arr[:, 2], arr[:, 3], lst)
        return out

    def _conflicts(self, grp: tuple, lo: int, hi: int, mode: int) -> int:
        """Bitset of the task instances whose accesses conflict with a write/add of [lo, hi)."""
        nodes, los, his, modes, _ = grp
        hit = (los < hi) & (his > lo) & (los < his)
        if mode == _ADD:
            hit &= modes != _ADD   # atomic adds commute with each other
        bits = np.zeros(self.n_tasks, dtype=bool)
        bits[nodes[hit]] = True
        return int.from_bytes(np.packbits(bits, bitorder="little").tobytes(), "little")

    @staticmethod
    def _access_of(grp: tuple, node: int, lo: int, hi: int, mode: int) -> tuple[int, int, int]:
        for x, a, b, m in grp[4]:
            if x == node and a < hi and b > lo and a < b and not (mode == _ADD and m == _ADD):
                return m, a, b
        raise AssertionError("conflicting access vanished")
