"""Engine report: predicted latency, bandwidth use, shared memory, naive vs searched, search statistics,
and the compiled kernel's registers and spills (with the plans the build skipped for spilling).

``write_report`` writes into the engine directory:
  report.json  machine-readable (the numbers below, plus the search statistics verbatim)
  report.md    the same as readable tables
  gantt.png    per-SM timeline of the simulated step: head and the first two layers on the left,
               the last layer and the tail on the right, colored by task kind
All numbers are predictions of the cost model (search/simulate.py); measured step times, when a
benchmark adds them, sit next to them in the benchmark's own report.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from .gpus import GpuSpec, get_gpu  # noqa: E402
from .graph.tasks import Kind, StepGraph  # noqa: E402
from .quant.kernel_support import weight_format  # noqa: E402
from .schedule import Schedule  # noqa: E402
from .search.calibration import load_calibration  # noqa: E402
from .search.search import predict  # noqa: E402
from .smem import SmemBreakdown, plan_smem  # noqa: E402

KIND_COLORS = {
    Kind.EMBED: "#7f7f7f", Kind.QKV: "#1f77b4", Kind.ATTN: "#d62728", Kind.COMBINE: "#ff9896",
    Kind.OPROJ: "#9467bd", Kind.GATEUP: "#2ca02c", Kind.DOWN: "#bcbd22", Kind.LMHEAD: "#17becf",
    Kind.ARGMAX: "#000000", Kind.ROUTER: "#e377c2", Kind.ROUTE: "#8c564b", Kind.EGATEUP: "#98df8a",
    Kind.EDOWN: "#dbdb8d", Kind.EMLP: "#637939",
}


def kind_color(kind: Kind) -> str:
    """The Gantt chart's colour of a task kind: its KIND_COLORS entry, else one of the tab20 colormap
    picked by the kind's number, so a kind added without an entry still draws."""
    c = KIND_COLORS.get(kind)
    return c if c is not None else to_hex(plt.get_cmap("tab20")(int(kind) % 20))


SMEM_KINDS = ("QKV", "ATTN", "OPROJ", "GATEUP", "DOWN", "ROUTER", "EGATEUP", "EDOWN", "EMLP", "LMHEAD")


def _kb(n: float) -> str:
    return f"{n / 1024:.1f} KB"


def _stats_dict(stats) -> dict:
    if stats is None:
        return {}
    return stats.to_dict() if hasattr(stats, "to_dict") else dict(stats)


def build_report(schedule: Schedule, stats=None, smem: SmemBreakdown | None = None, graph: StepGraph | None = None,
                 gpu: GpuSpec | None = None, sim=None, kernel: dict | None = None) -> dict:
    """The report as a dict (what report.json holds); ``sim`` is a recorded exact simulation of
    ``schedule`` (computed when not given); ``kernel``: the compiled kernel's resources as the builder
    records them (registers, spill bytes, per function, plans skipped), when there is one."""
    gpu = gpu or get_gpu(schedule.gpu)
    graph = graph or schedule.graph()
    spec, plan, B = schedule.spec, schedule.plan, schedule.batch
    st = _stats_dict(stats) or dict(schedule.meta.get("search", {}))
    sim = sim or predict(schedule, gpu, record=True)
    step = sim.step_us
    smem = smem or plan_smem(spec, B, plan)
    nosplit = plan_smem(spec, B, replace(plan, o_ksplit=1, down_ksplit=1))
    weight = graph.weight_bytes()
    bw = load_calibration(gpu).resolved(gpu).read_bandwidth     # datasheet x measured fraction, or measured
    rep = {
        "model": spec.name, "family": spec.family, "batch": B, "gpu": gpu.name, "num_sms": schedule.num_sms,
        "context_len": schedule.context_len,
        "predicted_step_us": round(step, 2),
        "predicted_tokens_per_s": round(B * 1e6 / step, 1),
        "weight_format": weight_format(spec),
        "weight_bytes_per_step": weight,
        "floor_us": round(weight / bw * 1e6, 2),
        "bandwidth_utilization": round(weight / (step * 1e-6) / bw, 4),
        "bandwidth_utilization_datasheet": round(weight / (step * 1e-6) / gpu.hbm_bandwidth, 4),
        "read_bandwidth_gbps": round(bw / 1e9, 1),
        "naive_step_us": st.get("naive_us"),
        "improvement_pct": st.get("improvement_pct"),
        "plan": plan.to_dict(),
        "smem": {
            "limit": gpu.smem_per_block_optin,
            "chosen": smem.to_dict(),
            "same_plan_without_ksplit": nosplit.to_dict(),
            "ksplit_comparison": st.get("ksplit", {}),
        },
        "per_layer_us": round(sim.period_us, 2),
        "phase_spans_us": _phase_spans(sim, graph),
        "search": {k: v for k, v in st.items() if k != "ksplit"},
    }
    if kernel is not None:
        rep["kernel"] = kernel
    return rep


def _phase_spans(sim, graph: StepGraph) -> dict:
    """First start to last end of each kind in a middle layer (how the phases overlap)."""
    if not sim.sm:
        return {}
    mid = graph.num_layers // 2
    spans: dict[str, list[float]] = {}
    for u, l in enumerate(sim.layer):
        if l != mid:
            continue
        k = Kind(sim.kind[u]).name
        a = spans.setdefault(k, [float("inf"), 0.0])
        a[0], a[1] = min(a[0], sim.start[u]), max(a[1], sim.end[u])
    base = min(a[0] for a in spans.values())
    return {k: [round(a[0] - base, 2), round(a[1] - base, 2)] for k, a in spans.items()}


def floor_text(us: float) -> str:
    """A floor in ms, or in us below 0.1 ms (tiny models), where three decimals of ms would read 0."""
    return f"{us / 1000:.3f} ms" if us >= 100 else f"{us:.2f} us"


def render_markdown(rep: dict) -> str:
    s = rep["search"]
    sm = rep["smem"]
    lines = [
        f"# Engine report: {rep['model']} ({rep['family']}), batch {rep['batch']}, {rep['gpu']} "
        f"({rep['num_sms']} SMs), context {rep['context_len']}",
        "",
        "All times are predictions of the cost model (simulated decode step incl. launch).",
        "",
        "| metric | value |",
        "|---|---|",
        f"| predicted per-token latency (TPOT) | **{rep['predicted_step_us'] / 1000:.3f} ms** |",
        f"| predicted output tokens/s (all users) | {rep['predicted_tokens_per_s']:.1f} |",
        f"| decoder layer weights | {rep.get('weight_format', 'bfloat16')} |",
        f"| weights streamed per step | {rep['weight_bytes_per_step'] / 1e9:.3f} GB |",
        f"| bandwidth floor at {rep['read_bandwidth_gbps']} GB/s (the calibration's read bandwidth) | "
        f"{floor_text(rep['floor_us'])} |",
        f"| bandwidth utilization (of read bandwidth / of datasheet) | {100 * rep['bandwidth_utilization']:.1f}% / "
        f"{100 * rep['bandwidth_utilization_datasheet']:.1f}% |",
        f"| steady-state time per layer | {rep['per_layer_us']:.1f} us |",
    ]
    if rep.get("naive_step_us"):
        lines += [f"| naive schedule (round-robin, barrier per phase) | {rep['naive_step_us'] / 1000:.3f} ms |",
                  f"| searched vs naive | {rep['improvement_pct']:.1f}% faster |"]
    p = rep["plan"]
    lines += ["", "## Tile plan", "",
              "| field | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in p.items()]
    ch, ns = sm["chosen"], sm["same_plan_without_ksplit"]
    lines += ["", f"## Shared memory per CTA (limit {_kb(sm['limit'])})", "",
              f"K-split: o_ksplit={ch['o_ksplit']}, down_ksplit={ch['down_ksplit']}. A kind's need is the ring, its "
              "resident activation (or attention scratch), its reduction scratch and 4 KB fixed; the kernel "
              "allocates the largest activation / scratch of all kinds.", "",
              "| task kind | activation (K-split) | need (K-split) | activation (no split) | need (no split) |",
              "|---|---|---|---|---|"]
    for k in SMEM_KINDS:
        a, b = ch["per_kind"].get(k), ns["per_kind"].get(k)
        if a and b:
            lines.append(f"| {k} | {_kb(a['activation'])} | {_kb(a['total'])} | {_kb(b['activation'])} | "
                         f"{_kb(b['total'])} |")
    lines.append(f"| **peak (allocated)** | {_kb(ch['activation'])} | **{_kb(ch['peak'])}** | "
                 f"{_kb(ns['activation'])} | **{_kb(ns['peak'])}** |")
    lines += _ksplit_section(sm.get("ksplit_comparison") or {})
    spans = rep.get("phase_spans_us") or {}
    if spans:
        lines += ["", "## Phases of a middle layer (first start .. last end, us from the layer's start)", "",
                  "| kind | start | end |", "|---|---|---|"]
        for k, (a, b) in sorted(spans.items(), key=lambda kv: kv[1][0]):
            lines.append(f"| {k} | {a:.1f} | {b:.1f} |")
    lines += _kernel_section(rep.get("kernel"))
    lines += ["", "## Search", "", "| statistic | value |", "|---|---|"]
    for k in ("seed", "budget_s", "search_time_s", "plan_evals", "work_budget", "sweeps", "list_schedule_us",
              "improve_steps", "improve_accepted", "improved_us", "sim_layers", "calibration"):
        if k in s:
            v = s[k]
            lines.append(f"| {k} | {v:.3f} |" if isinstance(v, float) else f"| {k} | {v} |")
    lines += ["", "![per-SM timeline](gantt.png)", ""]
    return "\n".join(lines)


def _kernel_section(k: dict | None) -> list[str]:
    """Registers and spills of the compiled kernel (ptxas), and the plans skipped for spilling."""
    if not k:
        return []
    lines = ["", f"## Kernel ({k['target']}, ptxas)", ""]
    if k.get("spills"):
        lines += [f"**WARNING: the kernel spills registers: {k['spill_stores']} B of spill stores, "
                  f"{k['spill_loads']} B of spill loads ({k['spills']}); shipped because megakernel.allow_spills "
                  "is set. The step is slower than predicted.**", ""]
    regs = "unknown" if k["registers"] is None else k["registers"]
    lines += [f"{regs} registers per thread, {k['stack_frame']} B stack frame, "
              f"{k['spill_stores']} B spill stores, {k['spill_loads']} B spill loads; "
              f"plan {k['plan_rank']} compiled of the search's ranked plans (best first; plans expected to "
              "spill as a compiled one did are passed over).", "",
              "| function | stack frame | spill stores | spill loads | registers |", "|---|---|---|---|---|"]
    for name, f in k["functions"].items():
        regs = "" if f["registers"] is None else f["registers"]
        lines.append(f"| {name} | {f['stack_frame']} B | {f['spill_stores']} B | {f['spill_loads']} B | {regs} |")
    if k.get("plans_skipped"):
        lines += ["", "Plans skipped because their kernels spill registers:", "",
                  "| rank | predicted step | spill stores | spill loads | spilling functions |", "|---|---|---|---|---|"]
        for s in k["plans_skipped"]:
            lines.append(f"| {s['rank']} | {s['predicted_step_us'] / 1000:.3f} ms | {s['spill_stores']} B | "
                         f"{s['spill_loads']} B | {s['spills']} |")
    return lines


FAMILY_TITLES = {"no_ksplit": "no task K-split (rows may stream in pieces)",
                 "no_k_tiling": "no K-splitting at all (K tile = K: Ada-MK's baseline)"}


def _ksplit_section(cmp: dict) -> list[str]:
    """Chosen plan against the best plans without K-splitting, at equal predicted time."""
    if not cmp:
        return []
    ch, tol = cmp["chosen"], cmp["tolerance_pct"]
    lines = ["", "### What K-splitting saves", "",
             f"Plan-stage predictions (list schedule, before local improvement); \"equal time\" = within {tol:.2f}%. "
             "Each family's reference is its least-smem plan at its own best time.", "",
             "| plan | predicted step | peak smem | smem cut by K-split at equal time |", "|---|---|---|---|",
             f"| chosen (K-split allowed) | {ch['predicted_us'] / 1000:.3f} ms | {_kb(ch['peak_smem'])} | |"]
    notes = []
    for name, title in FAMILY_TITLES.items():
        f = cmp.get(name)
        if not f:
            continue
        if not f.get("exists", f.get("fits")):
            lines.append(f"| best with {title} | no plan exists | | |")
            continue
        over = "" if f.get("fits") else " (over the limit: cannot run)"
        iso = f["iso_time"]
        cut = ("no plan that fits is as fast" if iso is None else
               f"**{iso['cut_pct']:.1f}%** (K-split plan at {iso['predicted_us'] / 1000:.3f} ms needs "
               f"{_kb(iso['peak_smem'])})")
        lines.append(f"| best with {title} | {f['best_us'] / 1000:.3f} ms | {_kb(f['peak_smem'])}{over} | {cut} |")
        if not f.get("fits"):
            notes.append(f"- {title}: no plan fits the {_kb(cmp['limit'])} per-block limit, so this family is "
                         "searched on the same GPU with the limit lifted (and slots of whole 16-row blocks); its "
                         "row says what the baseline would need.")
    lines.append("")
    for name, title in FAMILY_TITLES.items():
        f = cmp.get(name)
        if f and f.get("exists", f.get("fits")):
            a = f.get("at_chosen_time")
            lines.append(f"- {title}: " + (
                f"reaches the chosen plan's time with {_kb(a['peak_smem'])}; the chosen plan needs "
                f"{a['cut_pct']:.1f}% less." if a else
                f"cannot reach the chosen plan's time (best {f['best_us'] / 1000:.3f} ms, "
                f"{100 * (f['best_us'] / ch['predicted_us'] - 1):.2f}% slower)."))
    lines += notes
    return lines


def plot_gantt(sim, graph: StepGraph, path: Path, title: str = "") -> None:
    """Per-SM consumer timeline: head + layers 0-1 (left), last layer + tail (right)."""
    L = graph.num_layers
    nsm = max(sim.sm) + 1
    left_end = sim.layer_end[min(1, L - 1)]
    right_start = sim.layer_end[L - 2] if L >= 2 else 0.0
    step_end = max(sim.end)
    windows = [(0.0, left_end, f"head + layer 0{'-1' if L > 1 else ''}")]
    if L > 2:
        windows.append((right_start, step_end, f"layer {L - 1} + tail"))
    elif L >= 1:
        windows[0] = (0.0, step_end, "whole step")
    widths = [w[1] - w[0] for w in windows]
    fig, axes = plt.subplots(1, len(windows), figsize=(16, max(4.0, 2.0 + nsm * 0.06)), sharey=True,
                             gridspec_kw={"width_ratios": widths}, squeeze=False)
    axes = axes[0]
    bars: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for u in range(len(sim.sm)):
        if sim.sm[u] >= 0:
            bars.setdefault((sim.sm[u], sim.kind[u]), []).append((sim.start[u], sim.end[u] - sim.start[u]))
    for ax, (a, b, name) in zip(axes, windows):
        for (s, k), segs in bars.items():
            vis = [(x, w) for x, w in segs if x < b and x + w > a]
            if vis:
                ax.broken_barh(vis, (s - 0.4, 0.8), facecolors=kind_color(Kind(k)), edgecolors="none")
        for t in sim.layer_end:
            if a < t < b:
                ax.axvline(t, color="k", lw=0.6, ls=":")
        ax.set_xlim(a, b)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("time (us)")
    axes[0].set_ylim(nsm - 0.5, -0.5)
    axes[0].set_ylabel("SM")
    used = sorted({k for _, k in bars})
    fig.legend(handles=[Patch(color=kind_color(Kind(k)), label=Kind(k).name) for k in used],
               loc="upper center", ncol=len(used), frameon=False, bbox_to_anchor=(0.5, 0.995))
    fig.suptitle(title, y=0.955, fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(engine_dir: str | Path, schedule: Schedule, stats=None, smem: SmemBreakdown | None = None,
                 graph: StepGraph | None = None, gpu: GpuSpec | None = None, kernel: dict | None = None) -> dict:
    """Write report.json, report.md and gantt.png into ``engine_dir``; return the report dict.
    ``stats`` (SearchStats or its dict) defaults to the statistics stored in ``schedule.meta``;
    ``kernel`` as in ``build_report``."""
    out = Path(engine_dir)
    out.mkdir(parents=True, exist_ok=True)
    gpu = gpu or get_gpu(schedule.gpu)
    graph = graph or schedule.graph()
    sim = predict(schedule, gpu, record=True)
    rep = build_report(schedule, stats, smem, graph, gpu, sim, kernel)
    (out / "report.json").write_text(json.dumps(rep, indent=1, sort_keys=True) + "\n")
    (out / "report.md").write_text(render_markdown(rep))
    title = (f"{rep['model']} b{rep['batch']} on {rep['gpu']}: predicted {rep['predicted_step_us'] / 1000:.3f} ms/step, "
             f"{100 * rep['bandwidth_utilization']:.0f}% of read bandwidth")
    plot_gantt(sim, graph, out / "gantt.png", title)
    return rep
