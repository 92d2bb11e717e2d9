"""Trace one megakernel decode step on the GPU: where the time goes, per task kind and per SM.

    python scripts/mk_trace.py llama-3.2-1b --batch 1 --context 512 [--set stages=6 --set slot_bytes=32768]
        [--diag attn_mark=2] [--out DIR]
    python scripts/mk_trace.py llama-3.2-1b --prebuild --gpu H100-SXM     # compile only (no GPU needed)
    python scripts/mk_trace.py --summarize DIR/trace_X.npz --out NEWDIR     # summarize a saved trace again

The schedule is the one the benchmark uses (benchmarks/megakernel_system.py); ``--set`` replaces tile
plan fields and list-schedules the changed plan, to measure what the search did not pick. Prints the
predicted, measured (CUDA-graph replay, median of 100) and traced step, the per-kind table of
trtllm_mk/runtime/trace.py, and writes trace_<model>_b<B>[_<sets>].json / .png under --out.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields, replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.megakernel_system import HEADROOM, TOKENS_PER_BLOCK, schedule_for  # noqa: E402
from trtllm_mk.codegen.diagnostics import Diagnostics  # noqa: E402
from trtllm_mk.gpus import detect_gpu, get_gpu  # noqa: E402
from trtllm_mk.graph import TilePlan  # noqa: E402
from trtllm_mk.graph.builder import check_plan  # noqa: E402
from trtllm_mk.model.registry import resolve_model  # noqa: E402
from trtllm_mk.schedule import Schedule  # noqa: E402
from trtllm_mk.search import schedule_plan  # noqa: E402
from trtllm_mk.smem import plan_smem  # noqa: E402


def parse_sets(items: list[str]) -> dict:
    """``FIELD=INTEGER`` items as tile plan fields; a malformed one ends the script with one line."""
    out = {}
    for it in items:
        k, eq, v = it.partition("=")
        if not eq or not v.lstrip("-").isdigit():
            sys.exit(f"--set {it}: expected FIELD=INTEGER")
        out[k] = int(v)
    return out


def make_schedule(spec, batch: int, context: int, gpu, sets: dict) -> Schedule:
    if not sets:
        return schedule_for(spec, batch, context, gpu)
    check_fields(sets)   # before the search, which an unknown field would only end after
    return planned_variant(spec, batch, context, gpu, schedule_for(spec, batch, context, gpu).plan, sets)


def check_fields(sets: dict) -> None:
    """A name in ``sets`` that is not a tile plan field ends the script with one line."""
    names = [f.name for f in fields(TilePlan)]
    unknown = sorted(set(sets) - set(names))
    if unknown:
        sys.exit(f"error: {', '.join(unknown)}: not a tile plan field ({', '.join(names)})")


def planned_variant(spec, batch: int, context: int, gpu, plan: TilePlan, sets: dict) -> Schedule:
    """``plan`` with ``sets`` applied, list-scheduled. A plan the kernel cannot run (the builder's plan
    checks, or more shared memory than one CTA may use on ``gpu``, which would fail only at launch) ends
    the script with one line."""
    check_fields(sets)
    what = ",".join(f"{k}={v}" for k, v in sets.items())
    variant = replace(plan, **sets)
    try:
        check_plan(spec, variant, batch)
        need = plan_smem(spec, batch, variant).peak
    except ValueError as e:
        sys.exit(f"error: {what}: {e}")
    if need > gpu.smem_per_block_optin:
        sys.exit(f"error: {what}: the plan needs {need} B of shared memory at batch {batch}, more than the "
                 f"{gpu.smem_per_block_optin} B one CTA may use on {gpu.name}")
    return schedule_plan(spec, batch, gpu, variant, context)


def saved_schedule(path: str, gpu) -> Schedule:
    """A schedule saved elsewhere (scripts/mk_ab.py --dump-schedule), predicted again under this tree's
    calibration, as the schedules searched or list-scheduled here are."""
    from trtllm_mk.search import predict
    from trtllm_mk.search.simulate import SimulationError
    s = Schedule.load(path)
    try:
        s.predicted_step_us = predict(s, gpu).step_us
    except SimulationError:   # a schedule of another tree's task graph (an A/B against an older kernel's src=)
        s.predicted_step_us = float("nan")
    return s


def add_weights_args(ap: argparse.ArgumentParser) -> None:
    """--weights / --group: the layer weights a traced or A/B'd step binds."""
    ap.add_argument("--weights", choices=("bf16", "w4a16"), default="bf16",
                    help="w4a16: the decoder layers' weights RTN-quantized to 4 bits (benchmarks/w4a16_weights.py)")
    ap.add_argument("--group", type=int, default=128, help="with --weights w4a16: columns per scale")


def weights_spec(spec, a: argparse.Namespace):
    """``spec`` with the layer weights of ``a.weights`` (add_weights_args)."""
    if a.weights != "w4a16":
        return spec
    from benchmarks.w4a16_weights import w4a16_spec
    return w4a16_spec(spec, a.group)


def step_weights(spec):
    """Random weights of ``spec`` on the GPU as its kernel binds them (4-bit specs: packed codes)."""
    if spec.quantized:
        from benchmarks.w4a16_weights import w4a16_weights
        return w4a16_weights(spec, "cuda").kernel
    from trtllm_mk.model.random_weights import random_weights
    return random_weights(spec, device="cuda", seed=0)


def ring_args(gpu, cp_async: int = 0) -> dict:
    """generate_source's weight-ring arguments: the GPU's own ring, or (``cp_async`` > 0) the cp.async
    ring of sm_80/89 with that many loader warps, compiled for this GPU."""
    if cp_async:
        return dict(use_bulk_copy=False, loader_warps=cp_async)
    return dict(use_bulk_copy=gpu.has_tma)


def prebuild(s: Schedule, context: int, gpu, diag, cp_async: int = 0) -> Path:
    """Compile the kernel of schedule ``s`` with diagnostics ``diag`` into the cubin cache (no GPU)."""
    from trtllm_mk.codegen import compile_cubin, generate_source
    src, _ = generate_source(s, TOKENS_PER_BLOCK, context + HEADROOM, diagnostics=diag, **ring_args(gpu, cp_async))
    return compile_cubin(src, gpu.nvcc_arch)[0]


# what a trace summary's JSON holds beside runtime/trace.py's summary
SUMMARY_META = ("model", "batch", "context", "plan", "predicted_us", "measured_p50_us", "device", "gpu")


def write_summary(path: Path, summary: dict, meta: dict) -> None:
    """trace_X.json: the summary without its per-task records, and ``meta`` (SUMMARY_META)."""
    body = {k: v for k, v in summary.items() if k != "records"}
    body.update({k: meta[k] for k in SUMMARY_META if k in meta})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body, indent=1) + "\n")


def captured_step(s: Schedule, weights, context: int, gpu, diag, tokens, source: str | None = None,
                  cp_async: int = 0):
    """A decoder of ``s`` bound to ``weights`` and a cache holding ``context`` tokens, warmed up, and a
    CUDA graph of one of its steps: (decoder, graph). ``source``: a kernel source generated elsewhere
    for ``s`` (scripts/mk_ab.py src=) instead of this tree's; ``cp_async``: ring_args."""
    import torch
    from trtllm_mk.codegen import compile_cubin, generate_source
    from trtllm_mk.kv_cache import PagedKVCache
    from trtllm_mk.model.rope import rope_inv_freq
    from trtllm_mk.runtime.megakernel import MegakernelDecoder
    max_seq = context + HEADROOM
    cache = PagedKVCache.allocate(s.spec, s.batch, max_seq, TOKENS_PER_BLOCK, device="cuda", fill=1.0)
    src, layout = generate_source(s, TOKENS_PER_BLOCK, max_seq, diagnostics=diag, **ring_args(gpu, cp_async))
    cubin, _ = compile_cubin(source if source is not None else src, gpu.nvcc_arch)
    dec = MegakernelDecoder(s, cubin, layout, weights, cache, rope_inv_freq(s.spec))
    dec.set_state(tokens, torch.full((s.batch,), context))
    for _ in range(3):
        dec.step()
    dec.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dec.step()
    return dec, graph


def summarize_saved(npz: Path, out: Path) -> None:
    """trace_X.json of a saved trace_X.npz, summarized by this tree (fields added since it was taken),
    with the model, plan and measured figures of the JSON saved beside it."""
    from trtllm_mk.runtime.trace import summarize
    d = np.load(npz)
    s = Schedule.from_json(bytes(d["schedule"]).decode(), where=str(npz))
    saved = npz.with_suffix(".json")
    write_summary(out / saved.name, summarize(s, d["tasks"], d["per_sm"]),
                  json.loads(saved.read_text()) if saved.is_file() else {})
    print(f"wrote {out / saved.name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--summarize", metavar="NPZ", help="summarize a saved trace (.npz) again with this tree's "
                    "runtime/trace.py (no GPU): trace_X.json under --out, measured figures kept from the saved one")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--set", action="append", default=[], help="tile plan field=value")
    ap.add_argument("--diag", action="append", default=[],
                    help="name=value diagnostic switch (trtllm_mk/codegen/diagnostics.py), e.g. attn_mark=2")
    ap.add_argument("--out", default="trace_out")
    ap.add_argument("--prebuild", action="store_true")
    ap.add_argument("--gpu", default="H100-SXM", help="with --prebuild: the target GPU")
    ap.add_argument("--schedule", metavar="FILE", help="trace this saved schedule (scripts/mk_ab.py --dump-schedule) "
                    "instead of the benchmark's")
    add_weights_args(ap)
    a = ap.parse_args()
    if a.summarize:
        return summarize_saved(Path(a.summarize), Path(a.out))
    if not a.model:
        ap.error("a model is needed (or --summarize)")
    spec = weights_spec(resolve_model(a.model).spec, a)
    sets = parse_sets(a.set)
    diag = Diagnostics.parse(a.diag)
    tag = (f"{a.model}_b{a.batch}" + ("_w4a16" if a.weights == "w4a16" else "") + "".join(f"_{k}{v}" for k, v in sets.items())
           + "".join(f"_{d.replace('=', '')}" for d in a.diag))
    def schedule(gpu) -> Schedule:
        if a.schedule is None:
            return make_schedule(spec, a.batch, a.context, gpu, sets)
        s = saved_schedule(a.schedule, gpu)
        if (s.spec.name, s.batch, s.spec.weight_bits) != (spec.name, a.batch, spec.weight_bits) or sets:
            sys.exit(f"error: {a.schedule}: a schedule of {s.spec.name} b{s.batch} ({s.spec.weight_bits}-bit weights), "
                     f"not of {spec.name} b{a.batch} ({spec.weight_bits}-bit)" + (" (and it takes no --set)" if sets else ""))
        return s

    if a.prebuild:
        s = schedule(get_gpu(a.gpu))
        path = prebuild(s, a.context, get_gpu(a.gpu), diag)
        print(f"{tag}: predicted {s.predicted_step_us:.1f} us -> {path.name}")
        return

    import torch
    from benchmarks.timing import time_steps
    from trtllm_mk.runtime.trace import format_summary, plot_timeline, summarize
    gpu = detect_gpu()
    s = schedule(gpu)
    w = step_weights(spec)
    tokens = torch.randint(0, spec.vocab_size, (a.batch,))
    dec, graph = captured_step(s, w, a.context, gpu, diag, tokens)
    dec.set_state(tokens, torch.full((a.batch,), a.context))
    stats = time_steps(graph.replay, steps=100, warmup=20)
    dec.synchronize()
    dec.set_trace(True)
    dec.set_state(tokens, torch.full((a.batch,), a.context))
    for _ in range(3):
        dec.step()
    tasks, per_sm = dec.read_trace()
    summ = summarize(s, tasks.numpy(), per_sm.numpy())
    print(f"{tag}: plan {s.plan.to_dict()}")
    print(f"{tag}: predicted {s.predicted_step_us:.1f} us, measured p50 {stats.p50 * 1e3:.1f} us "
          f"(graph replay), traced {summ['step_us']:.1f} us")
    print(format_summary(summ))
    out = Path(a.out)
    write_summary(out / f"trace_{tag}.json", summ,
                  dict(model=a.model, batch=a.batch, context=a.context, plan=s.plan.to_dict(),
                       predicted_us=round(s.predicted_step_us, 2), measured_p50_us=round(stats.p50 * 1e3, 2),
                       device=torch.cuda.get_device_name(0), gpu=gpu.name))
    # the raw timeline and its schedule, for offline analysis (trtllm_mk.runtime.trace reads both)
    np.savez_compressed(out / f"trace_{tag}.npz", tasks=tasks.numpy(), per_sm=per_sm.numpy(),
                        schedule=np.frombuffer(s.to_json().encode(), dtype=np.uint8))
    plot_timeline(summ, out / f"trace_{tag}.png", title=f"{tag} on {torch.cuda.get_device_name(0)}")


if __name__ == "__main__":
    main()
