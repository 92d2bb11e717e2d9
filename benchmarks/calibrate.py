"""Cost-model calibration: fit the constants the simulator cannot know from datasheets and write
trtllm_mk/data/calibration/<gpu>.json, which the search reads. Two sources:

    python benchmarks/calibrate.py [--out trtllm_mk/data/calibration] [--models llama-3.2-1b ...]     # GPU
    python benchmarks/calibrate.py --from-trace trace_llama-3.2-1b_b1.json [...]               # no GPU
    python benchmarks/calibrate.py --from-measured benchmarks/results/<run>/measured.json        # no GPU
    python benchmarks/calibrate.py --from-links nvlink.json                                      # no GPU

On the GPU it measures megakernel steps of several shapes and fits event-sync latency, per-task
overhead and launch cost (coordinate descent on the squared relative error of predicted vs measured
step time; the report prints both per workload). From traces (scripts/mk_trace.py) it reads the
per-task constants directly: the event latency (signal -> waiter released), the loaded L2 round trip
(one-pass staging of OPROJ / DOWN), the fixed part of ATTN / COMBINE task bodies (traced body
minus the model's bandwidth terms), and merges them into the existing file (the time per weight-row
copy of the loader comes from benchmarks/micro/ring_stream.cu, one streaming SM). From
measured step times of known plans it fits the remaining per-task overhead. From the link
micro-benchmark (benchmarks/micro/nvlink.cu --json, run on a machine with several GPUs) it writes the
tensor-parallel constants: what a cross-rank event adds to a local one, the link bandwidth (one-shot
all-reduce fit) and the cost of the epilogue's remote adds.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.baselines import measure_read_bandwidth  # noqa: E402
from benchmarks.decode_latency import label_spec  # noqa: E402
from benchmarks.timing import time_steps  # noqa: E402
from trtllm_mk.gpus import detect_gpu  # noqa: E402
from trtllm_mk.kv_cache import PagedKVCache  # noqa: E402
from trtllm_mk.model.random_weights import random_weights  # noqa: E402
from trtllm_mk.model.registry import resolve_model  # noqa: E402
from trtllm_mk.model.spec import spec_from_hf_config  # noqa: E402
from trtllm_mk.runtime.megakernel import build_decoder  # noqa: E402
from trtllm_mk.search import Calibration, load_calibration, predict, search  # noqa: E402

FIT_FIELDS = ("sync_us", "task_overhead_us", "launch_us")
TRACE_FIELDS = ("sync_us", "l2_latency_us", "attn_fixed_us", "combine_fixed_us", "merge_split_us", "publish_us",
                "landing_us", "emlp_route_us")
# the kinds whose tasks stream long enough for their hand-off and landing to be read off a trace
STREAMING_KINDS = ("GATEUP", "DOWN", "EGATEUP", "EDOWN", "EMLP")


def constants_from_trace(summary: dict, gpu, cal: Calibration) -> dict:
    """Per-task constants read off one trace summary (runtime/trace.py's ``summarize`` output); of
    COMBINE's fixed part and the per-split merge cost, the one the traced plan shows: a plan with
    COMBINE tasks has the former, one whose OPROJ merges the partials (o_merge) the latter."""
    from trtllm_mk.graph import TilePlan, build_step_graph
    from trtllm_mk.graph.tasks import Kind
    from trtllm_mk.kinds.attn import fixed_scale
    from trtllm_mk.kinds.combine import merge_rounds, merge_units
    from trtllm_mk.search.cost import cost_table
    kinds = summary["kinds"]
    known = TilePlan.__dataclass_fields__
    plan = TilePlan.from_dict({k: v for k, v in summary["plan"].items() if k in known})
    spec = resolve_model(summary["model"]).spec
    graph = build_step_graph(spec, summary["batch"], plan, summary["context"])
    # the model's ATTN / COMBINE time without the fixed part: what the traced body has beyond it is the fixed part
    ct = cost_table(graph, gpu, replace(cal, attn_fixed_us=0.0, combine_fixed_us=0.0, emlp_route_us=0.0).resolved(gpu))
    base, stage, attn_rows = {}, {}, []
    for t, c in zip(graph.layer, ct.layer):
        base.setdefault(t.kind, c.dur)
        stage.setdefault(t.kind, c.stage)
        if t.kind == Kind.ATTN:
            attn_rows.append(t.rows)
    # one-pass stagings of a plain slice: DOWN's (EDOWN's in a sparse model), and OPROJ's unless it
    # merges the partials; a fused expert plan (EMLP) with merged partials has none
    down = "DOWN" if "DOWN" in kinds else "EDOWN" if "EDOWN" in kinds else None
    staged = [kinds[k]["mean_staging_us"] for k in ((down,) if plan.o_merge else ("OPROJ", down)) if k in kinds]
    out = {
        "sync_us": summary["event_latency_us"]["median"],
        # the group's staging (q, k, v from L2, norms, RoPE) and body beyond the model's other terms, per
        # batch row (a task runs its rows one after another) and for attn.FIXED_WIDTH values of a group
        "attn_fixed_us": max(0.0, kinds["ATTN"]["mean_staging_us"] + kinds["ATTN"]["mean_body_us"] - base[Kind.ATTN])
        / (sum(attn_rows) / len(attn_rows)) / fixed_scale(graph.dims),
    }
    if staged:
        out["l2_latency_us"] = sum(staged) / len(staged)
    if "EMLP" in kinds:   # its staging beyond the activation's read is the consumers' routing
        out["emlp_route_us"] = max(0.0, kinds["EMLP"]["mean_staging_us"] - stage[Kind.EMLP])
    # hand-off -> published: the signaller's release, which waiters see and the consumer does not wait for
    # (older summaries lack it; a kind whose events after its body are all polled publishes nothing then)
    published = [k for k in STREAMING_KINDS if "mean_signal_us" in kinds.get(k, {})]
    if published:
        out["publish_us"] = sum(kinds[k]["mean_signal_us"] for k in published) / len(published)
    landed = [k for k in STREAMING_KINDS if "mean_landing_us" in kinds.get(k, {})]   # older summaries lack it
    if landed:
        slot = {t.kind.name: c.slot_t for t, c in zip(graph.layer, ct.layer) if t.kind.name in landed}
        out["landing_us"] = sum(max(0.0, kinds[k]["mean_landing_us"] - slot[k]) for k in landed) / len(landed)
    # (the time per bulk copy, copy_issue_us, is not read here: no kind's rows are short enough for a
    # trace to isolate it; benchmarks/micro/ring_stream.cu measures it on one streaming SM)
    if plan.o_merge and down:   # OPROJ's staging beyond a plain slice's is the merge of the S splits
        o = next(t for t in graph.layer if t.kind == Kind.OPROJ)
        args = (plan.attn_splits, graph.batch * (o.k1 - o.k0), plan.consumer_warps)
        # a merge round after the first waits one more L2 round trip (kinds/combine.py merge_cost)
        merge = kinds["OPROJ"]["mean_staging_us"] - kinds[down]["mean_staging_us"]
        merge -= (merge_rounds(*args) - 1) * out["l2_latency_us"]
        out["merge_split_us"] = max(0.0, merge) / merge_units(*args)
    elif not plan.o_merge:
        out["combine_fixed_us"] = max(0.0, kinds["COMBINE"]["mean_body_us"] - base[Kind.COMBINE])
    return out


def merge_calibration(path: Path, values: dict, note_key: str, note: str) -> Path:
    """Update some constants of a calibration file (created if absent), keeping the others. The note
    names where the new values come from; a note already under ``note_key`` about constants this
    update leaves alone is kept after it."""
    data = json.loads(path.read_text()) if path.exists() else {}
    old = data.get(note_key)
    if isinstance(old, str) and old.split(":", 1)[0] not in (note.split(":", 1)[0], ""):
        note = f"{note}; {old}"
    data.update(values)
    data[note_key] = note
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def schedule_of(entry: dict, gpu, cal: Calibration, where: Path = Path(".")):
    """The schedule of a measured plan: the saved schedule the entry names (``"schedule"``, a path
    relative to the file ``where`` it came from: the measured programs exactly), else the plan
    list-scheduled under ``cal`` as the search would."""
    from trtllm_mk.graph import TilePlan
    from trtllm_mk.schedule import Schedule
    from trtllm_mk.search import schedule_plan
    if "schedule" in entry:
        return Schedule.load(where.parent / entry["schedule"])
    known = TilePlan.__dataclass_fields__
    plan = TilePlan.from_dict({k: v for k, v in entry["plan"].items() if k in known})
    return schedule_plan(label_spec(entry["model"]), entry["batch"], gpu, plan, entry["context"],
                         calibration=cal)


MEGAKERNEL = "trtllm_mk megakernel"
MEASURED_FIT_FIELDS = ("task_overhead_us", "mem_latency_us", "loader_task_us", "sync_us", "attn_fixed_us",
                       "combine_fixed_us", "attn_late_token_us", "slot_overhead_us", "publish_idle_us",
                       "quant_consumer_cost", "quant_slot_overhead_us", "quant_task_overhead_us", "l2_bw_factor",
                       "norm_stage_bw_factor", "emlp_route_us")


def measured_entries(data) -> list[dict]:
    """The measured workloads of a ``--from-measured`` file: a JSON list of {model, batch, context,
    plan, measured_us[, schedule]}, or a decode_latency report.json, whose megakernel rows carry their plan.
    A model is named as the report names it (``decode_latency.weights_label``: quantized runs carry
    their format)."""
    if not (isinstance(data, dict) and "configs" in data):
        return data
    out = []
    for c in data["configs"]:
        r = c.get("systems", {}).get(MEGAKERNEL, {})
        if r.get("status") == "ok" and "plan" in r.get("info", {}):
            out.append({"model": c["model"], "batch": c["batch"], "context": c["context_len"],
                        "plan": r["info"]["plan"], "measured_us": round(r["tpot_ms"]["p50"] * 1e3, 1),
                        "gpu": data.get("gpu", "H100-SXM")})
    return out


def calibrate_from_measured(path: str, out_dir: Path, fit_fields=("task_overhead_us",)) -> int:
    """Fit ``fit_fields`` to measured step times of known plans (``measured_entries``); print
    predicted vs measured per workload, before and after."""
    from trtllm_mk.gpus import get_gpu
    try:
        entries = measured_entries(json.loads(Path(path).read_text()))
        gpu = get_gpu(entries[0].get("gpu", "H100-SXM"))
    except (OSError, json.JSONDecodeError, IndexError, KeyError) as e:
        print(f"error: {path}: not a readable list of measured workloads ({e})", file=sys.stderr)
        return 2
    cal0 = load_calibration(gpu, out_dir)
    workloads = [(schedule_of(e, gpu, cal0, Path(path)), e["measured_us"]) for e in entries]
    cal = fit(workloads, gpu, cal0, fit_fields)
    print(f"{'workload':<38}{'measured us':>12}{'before':>10}{'after':>10}{'error':>8}")
    for e, (sch, m) in zip(entries, workloads):
        before = predict(sch, gpu, cal0.resolved(gpu)).step_us
        after = predict(sch, gpu, cal.resolved(gpu)).step_us
        ring = f"{sch.plan.stages}x{sch.plan.slot_bytes // 1024}KB"
        print(f"{e['model'] + ' b' + str(e['batch']) + ' ctx' + str(e['context']) + ' ' + ring:<38}{m:>12.1f}{before:>10.1f}{after:>10.1f}"
              f"{100 * (after / m - 1):>7.1f}%")
    path_out = merge_calibration(out_dir / f"{gpu.name}.json", {f: round(getattr(cal, f), 4) for f in fit_fields},
                                 "_measured_source",
                                 f"{', '.join(fit_fields)}: fitted to {path} (benchmarks/calibrate.py --from-measured)")
    print("fitted " + ", ".join(f"{f}={getattr(cal, f):.3f}" for f in fit_fields) + f"; wrote {path_out}")
    return 0


def constants_from_links(data: dict, reduce_bandwidth: float) -> dict:
    """Link constants from benchmarks/micro/nvlink.cu's JSON (module docstring)."""
    from trtllm_mk.parallel.allreduce_cost import fit_one_shot
    tp = int(data["tp"])
    fitted = fit_one_shot([tuple(x) for x in data["one_shot"]], tp, reduce_bandwidth=reduce_bandwidth)
    # the cross-GPU barrier round against the same round between CTAs of one GPU with a local event's
    # operations: what the link and the system scope add to an event; measured while the SMs stream from
    # HBM where the file has it (the kernel's events are waited on under the loaders' traffic)
    key = "_loaded_us" if "sync_loaded_us" in data else "_us"
    cross, local = data["sync" + key], data["sync_one_gpu" + key]
    sync = cross - local
    if sync <= 0:
        raise ValueError(f"the cross-GPU round ({cross} us) is not slower than the one-GPU round ({local} us)")
    # one SM's adds: the slope between the two largest messages, per KB and per other rank
    (b0, t0), (b1, t1) = sorted(tuple(x) for x in data["remote_add_one_sm"])[-2:]
    per_kb = (t1 - t0) / ((b1 - b0) / 1024) / (tp - 1)
    if per_kb <= 0:
        raise ValueError("remote adds of more bytes did not take longer")
    return {"link_sync_us": round(sync, 3), "link_bandwidth": round(fitted.link_bandwidth, -6),
            "link_add_us_per_kb": round(per_kb, 4)}


def calibrate_from_links(path: str, out_dir: Path) -> int:
    from trtllm_mk.errors import ConfigError
    from trtllm_mk.gpus import get_gpu
    try:
        data = json.loads(Path(path).read_text())
        gpu = get_gpu(data["gpu"])
        values = constants_from_links(data, load_calibration(gpu, out_dir).resolved(gpu).read_bandwidth)
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        print(f"error: {path}: not a benchmarks/micro/nvlink.cu result ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    except (ConfigError, ValueError) as e:
        print(f"error: {path}: {e}", file=sys.stderr)
        return 2
    for k, v in values.items():
        print(f"{k:<20} {v}")
    out = merge_calibration(out_dir / f"{gpu.name}.json", values, "_link_source",
                            f"{', '.join(values)}: {data['tp']} x {data['gpu']}, benchmarks/micro/nvlink.cu "
                            f"({path}; benchmarks/calibrate.py --from-links)")
    print(f"wrote {out}")
    return 0


def calibrate_from_traces(paths: list[str], out_dir: Path, only: list[str] | None = None) -> int:
    from trtllm_mk.gpus import get_gpu
    summaries = []
    for p in paths:
        try:
            summaries.append(json.loads(Path(p).read_text()))
        except (OSError, json.JSONDecodeError) as e:
            print(f"error: {p}: not a readable trace summary ({e})", file=sys.stderr)
            return 2
    gpu_names = {s.get("gpu") or "H100-SXM" for s in summaries}
    if len(gpu_names) != 1:
        print(f"error: traces from different GPU types: {sorted(gpu_names)}", file=sys.stderr)
        return 2
    gpu = get_gpu(gpu_names.pop())
    cal = load_calibration(gpu, out_dir)
    per = [constants_from_trace(s, gpu, cal) for s in summaries]
    # each averaged over the traces that show it
    fields = [f for f in TRACE_FIELDS if any(f in p for p in per) and (not only or f in only)]
    if not fields:
        print(f"error: none of {', '.join(only or TRACE_FIELDS)} can be read off these traces", file=sys.stderr)
        return 2
    fitted = {f: round(sum(p[f] for p in per if f in p) / sum(f in p for p in per), 3) for f in fields}
    print(f"{'trace':<34}" + "".join(f"{f:>18}" for f in fields))
    for s, p in zip(summaries, per):
        print(f"{s['model'] + ' b' + str(s['batch']):<34}"
              + "".join(f"{p[f]:>18.3f}" if f in p else f"{'-':>18}" for f in fields))
    print(f"{'mean (written)':<34}" + "".join(f"{fitted[f]:>18.3f}" for f in fields))
    path = merge_calibration(out_dir / f"{gpu.name}.json", fitted, "_trace_source",
                             f"{', '.join(fields)}: from traces of "
                             + ", ".join(f"{s['model']} b{s['batch']}" for s in summaries)
                             + f" on {summaries[0].get('device', gpu.name)} (benchmarks/calibrate.py --from-trace)")
    print(f"wrote {path}")
    return 0


def tiny_spec(layers: int):
    return spec_from_hf_config(dict(architectures=["LlamaForCausalLM"], hidden_size=256, intermediate_size=512,
                                    num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2,
                                    head_dim=32, vocab_size=512, max_position_embeddings=4096), f"tiny-L{layers}")


def measure(spec, batch, gpu, context: int, budget_s: float):
    sched, _ = search(spec, batch, gpu, context_len=context, budget_s=budget_s, seed=0)
    w = random_weights(spec, device="cuda", seed=0)
    cache = PagedKVCache.allocate(spec, batch, max(2048, context + 512), 32, device="cuda")
    dec = build_decoder(sched, w, cache, gpu.nvcc_arch, gpu.has_tma)
    dec.set_state(torch.randint(0, spec.vocab_size, (batch,)), torch.full((batch,), context))
    us = time_steps(dec.step, steps=200, warmup=20, device=torch.device("cuda")).p50 * 1e3
    del dec, w, cache
    torch.cuda.empty_cache()
    return sched, us


def fit(workloads, gpu, cal0: Calibration, fit_fields=FIT_FIELDS) -> Calibration:
    def loss(cal):
        cal = cal.resolved(gpu)
        return sum((predict(s, gpu, cal).step_us / m - 1) ** 2 for s, m in workloads)

    best, best_loss = cal0, loss(cal0)
    # a constant at 0 (e.g. attn_late_token_us before its first fit) starts from a unit step, which
    # for a per-token constant is far too large: the steps halve down to 2^-16 of where they began
    step = {f: (getattr(cal0, f) or 1.0) * 0.5 for f in fit_fields}
    for _ in range(16):  # coordinate descent with shrinking steps
        for f in fit_fields:
            for sign in (1, -1):
                while True:
                    v = getattr(best, f) + sign * step[f]
                    if v <= 0:
                        break
                    cand = replace(best, **{f: v})
                    l = loss(cand)
                    if l < best_loss:
                        best, best_loss = cand, l
                    else:
                        break
            step[f] *= 0.5
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "calibration"))
    ap.add_argument("--models", nargs="*", default=["llama-3.2-1b"])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--budget", type=float, default=10.0, help="search budget per workload (s)")
    ap.add_argument("--from-trace", nargs="+", metavar="TRACE_JSON",
                    help="read per-task constants from trace summaries (scripts/mk_trace.py); no GPU needed")
    ap.add_argument("--from-measured", metavar="MEASURED_JSON",
                    help="fit the per-task overhead to measured step times of known plans (a list of "
                         "workloads or a decode_latency report.json); no GPU needed")
    ap.add_argument("--from-links", metavar="NVLINK_JSON",
                    help="write the tensor-parallel link constants from benchmarks/micro/nvlink.cu --json; no GPU needed")
    ap.add_argument("--fit", nargs="+", default=["task_overhead_us"], choices=sorted(MEASURED_FIT_FIELDS),
                    help="constants --from-measured fits (default: task_overhead_us)")
    ap.add_argument("--fields", nargs="+", choices=TRACE_FIELDS,
                    help="constants --from-trace writes (default: every one the traces show)")
    args = ap.parse_args(argv)
    if args.from_trace:
        return calibrate_from_traces(args.from_trace, Path(args.out), args.fields)
    if args.from_links:
        return calibrate_from_links(args.from_links, Path(args.out))
    if args.from_measured:
        return calibrate_from_measured(args.from_measured, Path(args.out), tuple(args.fit))
    if not torch.cuda.is_available():
        print("error: calibration needs a CUDA GPU", file=sys.stderr)
        return 2
    gpu = detect_gpu()
    bw = measure_read_bandwidth("cuda")["bytes_per_s"]
    cal0 = replace(load_calibration(gpu), read_bandwidth=bw, source="defaults+measured bandwidth")
    workloads, names = [], []
    for layers in (1, 4, 16):
        s, us = measure(tiny_spec(layers), 1, gpu, args.context, 2.0)
        workloads.append((s, us)); names.append(f"tiny L={layers} b1")
    for m in args.models:
        spec = resolve_model(m).spec
        for batch in (1, 4):
            s, us = measure(spec, batch, gpu, args.context, args.budget)
            workloads.append((s, us)); names.append(f"{m} b{batch}")
    cal = fit(workloads, gpu, cal0)
    cal = replace(cal, source=f"measured on {torch.cuda.get_device_name(0)} {time.strftime('%Y-%m-%d')}")
    rows = []
    for n, (s, m) in zip(names, workloads):
        before = predict(s, gpu, cal0.resolved(gpu)).step_us
        after = predict(s, gpu, cal.resolved(gpu)).step_us
        rows.append(dict(workload=n, measured_us=round(m, 1), predicted_default_us=round(before, 1),
                         predicted_calibrated_us=round(after, 1), error_pct=round(100 * (after / m - 1), 1)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = {f: getattr(cal, f) for f in (*FIT_FIELDS, "read_bandwidth")}
    data["_source"] = cal.source
    (out / f"{gpu.name}.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / f"{gpu.name}.fit.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(f"read bandwidth {bw / 1e12:.2f} TB/s; fitted " + ", ".join(f"{f}={getattr(cal, f):.3f}" for f in FIT_FIELDS))
    print(f"{'workload':<22}{'measured':>10}{'default':>10}{'calibrated':>12}{'error':>8}")
    for r in rows:
        print(f"{r['workload']:<22}{r['measured_us']:>10}{r['predicted_default_us']:>10}"
              f"{r['predicted_calibrated_us']:>12}{r['error_pct']:>7}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
