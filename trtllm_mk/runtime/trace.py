"""Read a megakernel step's per-task timeline and say where the time went.

With ``MegakernelDecoder.set_trace(True)`` consumer thread 0 of every SM records, per task, the
globaltimer (ns) at: task start (previous task done), waits satisfied, activation staged (GEMV kinds;
= waits satisfied otherwise), reduction done, handed to the signaller warp, task end, and the time it
waited for ring slots to fill; the signaller warp records when it published the task's events; the
loader warp records when it reached the task, when it had issued the task's last copy and how long of
that it waited for a free slot (or under the in-flight cap, TilePlan.inflight_slots); per SM, the
loader's total time blocked on a full ring or the cap (layout:
TRACE_WORD_NAMES in trtllm_mk/seam.py). This module turns that into:

  * per task kind: tasks, mean blocked (waiting on events), staging and body time, and of the body
    the ring wait (the weight stream is behind), the output stores + barrier, the time from hand-off
    to publication (the GPU-scope release: the cost model's ``publish_us``), the loader's issue span,
    and the landing time from the loader's last copy to the reduction done (``landing_us`` plus a
    slot's math);
  * event latency: for every wait that actually blocked, the time from the last producer's
    publication to the waiter seeing it (the cost model's ``sync_us``);
  * per SM: consumer busy fraction and loader ring-full time;
  * a timeline PNG (one row per SM, one bar per task, blocked time grey).

It is the measurement behind the cost model's per-task constants (scripts/mk_trace.py;
benchmarks/calibrate.py --from-trace reads its summaries).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..graph.tasks import HEAD, LAYER, TAIL, Kind
from ..schedule import Schedule


from ..seam import TRACE_SM_WORD_NAMES, TRACE_WORD_NAMES, TRACE_WORDS  # noqa: F401  (the kernel's trace words, one description)


# per-kind sums of the summary (us); each also gets a per-task mean, "mean_<name>"
KIND_TIMES = ("blocked_us", "staging_us", "body_us", "ring_wait_us", "loader_span_us", "loader_full_us",
              "epilogue_us", "signal_us", "landing_us")


@dataclass
class TaskRecord:
    sm: int
    kind: Kind
    layer: int
    index: int          # template index in its phase
    phase: str
    t0: float           # us from the step's first task start
    t1: float
    t2: float
    t3: float
    ring_wait: float = 0.0   # us the consumer waited for ring slots to fill (within the body)
    l0: float = 0.0          # loader reached the task (us; 0 for traces without loader words)
    l1: float = 0.0          # loader issued the task's last copy
    l_full: float = 0.0      # us of [l0, l1] the loader waited for a free slot or under the in-flight cap
    t_computed: float = 0.0  # reduction done, before the output stores (us; 0 without it)
    t_signal: float = 0.0    # handed to the signaller warp (after the task's last barrier)
    t_published: float = 0.0  # the signaller published the task's events (0: none / not recorded)
    # whether the signaller publishes some of the task's events after its body: a counted signal beyond
    # its staged ones (a polled event's data is its signal; the device keeps no counter for it)
    publishes_after_body: bool = True


def task_records(schedule: Schedule, tasks: np.ndarray) -> list[TaskRecord]:
    """Align the raw trace ([grid, trace_tasks, 4 or TRACE_WORDS] ns) with each SM's program."""
    graph = schedule.graph()
    L = graph.num_layers
    used = []
    for sm, prog in enumerate(schedule.programs):
        order = [(HEAD, i, -1) for i in prog.head] + [(LAYER, i, l) for l in range(L) for i in prog.layer] + \
                [(TAIL, i, -1) for i in prog.tail]
        for n, (phase, i, l) in enumerate(order):
            used.append((sm, n, phase, i, l))
    origin = min(int(tasks[sm, n, 0]) for sm, n, *_ in used) if used else 0
    out = []
    for sm, n, phase, i, l in used:
        row = [int(v) for v in tasks[sm, n]]
        t = [(v - origin) / 1e3 for v in row[:4]]   # start, waited, staged, signalled
        extra = {}
        if len(row) >= TRACE_WORDS:
            w = dict(zip(TRACE_WORD_NAMES, row))
            extra = dict(ring_wait=w["full_wait_ns"] / 1e3, l0=(w["loader_start"] - origin) / 1e3,
                         l1=(w["loader_issued"] - origin) / 1e3, l_full=w["loader_wait_ns"] / 1e3,
                         t_computed=(w["computed"] - origin) / 1e3, t_signal=(w["handed"] - origin) / 1e3,
                         t_published=(w["published"] - origin) / 1e3 if w["published"] else 0.0)
        task = graph.phase_tasks(phase)[i]
        after = any(not graph.events[r.event].polled for r in task.signals[task.staged_signals:])
        out.append(TaskRecord(sm, task.kind, l, i, phase, *t, **extra, publishes_after_body=after))
    return out


def event_latencies(schedule: Schedule, recs: list[TaskRecord], blocked_min_us: float = 0.05) -> list[float]:
    """For each task that blocked on its waits: waits satisfied - latest signal among the producers of
    the event slots it waited on (us). A staged signal (Task.staged_signals) counts from its task's
    staging mark (t2), a polled one from the task's end (its data is stored by then): the trace records
    when the signaller published only the task's last group. A polled wait is left out: the task polls
    the data in its staging, after the mark of its counted waits."""
    graph = schedule.graph()
    signalled: dict[tuple, float] = {}
    for r in recs:
        task = graph.phase_tasks(r.phase)[r.index]
        for n, ref in enumerate(task.signals):
            key = graph.resolve(task, max(r.layer, 0), ref)
            at = r.t2 if n < task.staged_signals else (r.t_published if r.publishes_after_body and r.t_published
                                                       else r.t3)
            signalled[key] = max(signalled.get(key, 0.0), at)
    out = []
    for r in recs:
        if r.t1 - r.t0 < blocked_min_us:
            continue
        task = graph.phase_tasks(r.phase)[r.index]
        last = [signalled.get(graph.resolve(task, max(r.layer, 0), ref)) for ref in task.waits
                if not graph.events[ref.event].polled]
        last = [v for v in last if v is not None]
        if last:
            out.append(r.t1 - max(last))
    return out


def layer_phases(recs: list[TaskRecord]) -> tuple[dict, float]:
    """Per kind of the layer tasks, mean over layers 1..L-1 of [first waits satisfied, last end] (us)
    relative to the previous layer's end (its last task's end), and the mean layer period: the
    critical path of a layer, phase by phase."""
    ends: dict[int, float] = {}
    win: dict[tuple[int, Kind], list[float]] = {}
    for r in recs:
        if r.layer < 0:
            continue
        ends[r.layer] = max(ends.get(r.layer, 0.0), r.t3)
        w = win.setdefault((r.layer, r.kind), [r.t1, r.t3])
        w[0], w[1] = min(w[0], r.t1), max(w[1], r.t3)
    layers = sorted(ends)
    if len(layers) < 2:
        return {}, 0.0
    acc: dict[str, list[list[float]]] = {}
    for l in layers[1:]:
        base = ends[l - 1]
        for (ll, k), (a, b) in win.items():
            if ll == l:
                acc.setdefault(k.name, []).append([a - base, b - base])
    phases = {k: {"start_us": round(float(np.mean([v[0] for v in vs])), 2),
                  "end_us": round(float(np.mean([v[1] for v in vs])), 2)} for k, vs in acc.items()}
    period = float(np.mean(np.diff([ends[l] for l in layers])))
    return dict(sorted(phases.items(), key=lambda kv: kv[1]["start_us"])), round(period, 2)


def summarize(schedule: Schedule, tasks: np.ndarray, per_sm: np.ndarray) -> dict:
    """JSON-ready summary of one traced step (see module doc)."""
    recs = task_records(schedule, tasks)
    kinds: dict[str, dict] = {}
    for r in recs:
        k = kinds.setdefault(r.kind.name, {"tasks": 0, **dict.fromkeys(KIND_TIMES, 0.0)})
        k["tasks"] += 1
        k["blocked_us"] += r.t1 - r.t0
        k["staging_us"] += r.t2 - r.t1
        k["body_us"] += r.t3 - r.t2
        k["ring_wait_us"] += r.ring_wait
        k["loader_span_us"] += max(r.l1 - r.l0, 0.0)
        k["loader_full_us"] += r.l_full
        if r.l1 > 0 and r.t_computed > 0:   # the last copy's issue -> the reduction done
            k["landing_us"] += r.t_computed - r.l1
        if r.t_signal > 0:
            k["epilogue_us"] += r.t_signal - r.t_computed
            if r.publishes_after_body:   # else nothing to publish
                k["signal_us"] += (r.t_published or r.t3) - r.t_signal
                k["signal_tasks"] = k.get("signal_tasks", 0) + 1
    for k in kinds.values():
        n = k["tasks"]
        for f in KIND_TIMES:
            k["mean_" + f] = round(k[f] / n, 3)
            k[f] = round(k[f], 1)
        # the signaller's release per task that has one (a kind whose events after its body are all
        # polled publishes none: its mean is left out, and the table shows "-")
        published = k.pop("signal_tasks", 0)
        if published:
            k["mean_signal_us"] = round(k["signal_us"] / published, 3)
        else:
            del k["mean_signal_us"], k["signal_us"]
    start = min(r.t0 for r in recs)
    end = max(r.t3 for r in recs)
    span = end - start
    nsm = len(schedule.programs)
    busy = np.zeros(nsm)
    blocked = np.zeros(nsm)
    for r in recs:
        busy[r.sm] += r.t3 - r.t1
        blocked[r.sm] += r.t1 - r.t0
    lat = event_latencies(schedule, recs)
    phases, period = layer_phases(recs)
    loader_full = per_sm[:, TRACE_SM_WORD_NAMES.index("loader_blocked_ns")] / 1e3
    # timer granularity: per SM the smallest positive difference between two of its stamps (median)
    grains = []
    for sm in range(tasks.shape[0]):
        d = np.diff(np.sort(tasks[sm][tasks[sm] > 0].astype(np.int64)))
        if (d > 0).any():
            grains.append(int(d[d > 0].min()))
    grain = int(np.median(grains)) if grains else 0
    return {
        "step_us": round(span, 2),
        "tasks": len(recs),
        "timer_grain_ns": grain,
        "kinds": kinds,
        "consumer_busy_frac": {"mean": round(float(busy.mean() / span), 3), "min": round(float(busy.min() / span), 3)},
        "consumer_blocked_us": {"mean": round(float(blocked.mean()), 1), "max": round(float(blocked.max()), 1)},
        "loader_ring_full_us": {"mean": round(float(loader_full.mean()), 1), "max": round(float(loader_full.max()), 1)},
        "layer_period_us": period,
        "layer_phases": phases,
        "event_latency_us": ({"waits": len(lat), "median": round(float(np.median(lat)), 3),
                              "p10": round(float(np.percentile(lat, 10)), 3),
                              "p90": round(float(np.percentile(lat, 90)), 3)} if lat else {"waits": 0}),
        "records": recs,
    }


def format_summary(s: dict) -> str:
    lines = [f"step {s['step_us']:.1f} us, {s['tasks']} tasks, timer grain {s['timer_grain_ns']} ns",
             "| kind | tasks | mean blocked us | mean staging us | mean body us | of it: ring wait | stores+sync | signal "
             "| loader span (full) |", "|---|---|---|---|---|---|---|---|---|"]
    for name, k in sorted(s["kinds"].items(), key=lambda kv: -kv[1]["body_us"]):
        lines.append(f"| {name} | {k['tasks']} | {k['mean_blocked_us']} | {k['mean_staging_us']} | {k['mean_body_us']} "
                     f"| {k['mean_ring_wait_us']} | {k['mean_epilogue_us']} | {k.get('mean_signal_us', '-')} "
                     f"| {k['mean_loader_span_us']} ({k['mean_loader_full_us']}) |")
    if s["layer_phases"]:
        lines.append(f"layer period {s['layer_period_us']} us; phases (from the previous layer's end): " +
                     ", ".join(f"{k} {v['start_us']}..{v['end_us']}" for k, v in s["layer_phases"].items()))
    e = s["event_latency_us"]
    lines.append(f"consumer busy {s['consumer_busy_frac']['mean']:.0%} of the step (min SM "
                 f"{s['consumer_busy_frac']['min']:.0%}); blocked per SM {s['consumer_blocked_us']['mean']} us; "
                 f"loader ring-full per SM {s['loader_ring_full_us']['mean']} us")
    if e["waits"]:
        lines.append(f"event latency (signal -> waiter released) median {e['median']} us, p10 {e['p10']}, "
                     f"p90 {e['p90']} over {e['waits']} blocking waits")
    return "\n".join(lines)


def _bars(x0: np.ndarray, x1: np.ndarray, y: np.ndarray, h: float = 0.8) -> np.ndarray:
    """Rectangles [x0, x1] x [y - h/2, y + h/2] as PolyCollection vertices, shape (n, 4, 2)."""
    lo, hi = y - h / 2, y + h / 2
    return np.stack([np.stack([x0, lo], 1), np.stack([x0, hi], 1), np.stack([x1, hi], 1), np.stack([x1, lo], 1)], 1)


def plot_timeline(s: dict, path: str | Path, title: str = "") -> None:
    """Per-SM timeline: a bar per task body coloured by kind, grey while it waits on events. One
    PolyCollection per kind (an artist per task made 8B steps, ~31k tasks, take minutes)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch
    recs: list[TaskRecord] = s["records"]
    nsm = max(r.sm for r in recs) + 1
    colors = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(16, max(4, nsm * 0.06)))
    t = np.array([(r.t0, r.t1, r.t3, r.sm, int(r.kind)) for r in recs], dtype=np.float64)
    wait = t[:, 1] > t[:, 0]
    ax.add_collection(PolyCollection(_bars(t[wait, 0], t[wait, 1], t[wait, 3]), facecolors="0.85", linewidths=0))
    handles = []
    for k in Kind:
        m = t[:, 4] == int(k)
        if not m.any():
            continue
        ends = np.maximum(t[m, 2], t[m, 1] + 1e-3)
        ax.add_collection(PolyCollection(_bars(t[m, 1], ends, t[m, 3]), facecolors=colors(int(k)), linewidths=0))
        handles.append(Patch(color=colors(int(k)), label=k.name))
    ax.set_xlim(float(t[:, 0].min()), float(t[:, 2].max()))
    ax.set_xlabel("us since the step's first task")
    ax.set_ylabel("SM")
    ax.set_ylim(-1, nsm)
    ax.set_title(title or "megakernel step timeline (grey: waiting on events)")
    ax.legend(handles=handles, loc="upper right", ncol=5, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
