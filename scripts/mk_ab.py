"""A/B of megakernel variants in one process, timed in interleaved rounds.

    python scripts/mk_ab.py llama-3.2-1b --variant shipped --variant merge8:o_merge=1,o_ksplit=8,o_rows=128 \
        --variant nopref:+prefetch_next=0 [--batch 1] [--context 512] [--rounds 7] [--steps 100]
    python scripts/mk_ab.py llama-3.2-1b --variant ... --prebuild          # compile only (no GPU needed)
    python scripts/mk_ab.py llama-3.1-8b --weights w4a16 --variant ...      # 4-bit layer weights

A variant is ``NAME[:ITEM,ITEM...]``: ``field=value`` replaces a tile plan field of the benchmark's
schedule (scripts/mk_trace.py --set), ``cp_async=N`` runs the weight ring of sm_80/89 (16-byte
cp.async copies from N loader warps) compiled for this GPU, ``+name=value`` sets a diagnostic switch of the kernel
(trtllm_mk/codegen/diagnostics.py), ``src=FILE.cu`` runs a kernel source generated elsewhere for the same schedule
(e.g. by an older release, ``--dump-schedule`` writes the schedule to generate it from) with this
tree's runtime: the A/B of two releases, valid while their kernel parameters keep one layout;
``schedule=FILE.json`` runs a schedule saved elsewhere (``--dump-schedule``, or the build of another
calibration) with this tree's kernel: the A/B of two searches' plans. Every variant binds the same random weights; each round times every variant once
(median of ``--steps`` CUDA-graph replays after warm-up), in a rotated order, so slow drift of the
GPU (clocks, temperature) shows up as spread within a variant instead of as a difference between
variants. Prints per variant the median of its rounds' medians, their range, and the change against
the first variant with the range of the per-round differences.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from mk_trace import (add_weights_args, captured_step, make_schedule, prebuild, saved_schedule,  # noqa: E402
                      step_weights, weights_spec)
from trtllm_mk.codegen.diagnostics import Diagnostics  # noqa: E402
from trtllm_mk.gpus import detect_gpu, get_gpu  # noqa: E402
from trtllm_mk.model.registry import resolve_model  # noqa: E402


def parse_variant(text: str) -> tuple[str, dict, tuple[str, ...], str | None, str | None, int]:
    name, _, items = text.partition(":")
    sets, switches, src, sched, cp_async = {}, [], None, None, 0
    for it in filter(None, items.split(",")):
        if it.startswith("cp_async=") and it[len("cp_async="):].isdigit():
            cp_async = int(it[len("cp_async="):])
        elif it.startswith("+"):
            switches.append(it[1:])
        elif it.startswith("src="):
            src = it[4:]
        elif it.startswith("schedule="):
            sched = it[len("schedule="):]
        else:
            k, eq, v = it.partition("=")
            if not eq or not v.lstrip("-").isdigit():
                sys.exit(f"--variant {text}: {it}: expected FIELD=INTEGER, +SWITCH=VALUE, src=FILE, schedule=FILE "
                         "or cp_async=N")
            sets[k] = int(v)
    return name, sets, Diagnostics.parse(switches), src, sched, cp_async


def params_fields(source: str) -> list[str]:
    """The field names of ``struct Params`` in a generated kernel source, in order."""
    import re
    if "struct Params {" not in source:
        return []
    body = source.split("struct Params {", 1)[1].split("};", 1)[0]
    return re.findall(r"(\w+);", re.sub(r"//[^\n]*", "", body))


def check_params_prefix(source: str, where: str) -> None:
    """A src= kernel gets this tree's Params (seam.pack_params): it runs only if its own struct is a prefix of
    this tree's, each field where this tree packs it. Otherwise one line, before anything launches."""
    from trtllm_mk import seam
    theirs, ours = params_fields(source), [f.name for f in seam.PARAMS]
    if not theirs or theirs != ours[:len(theirs)]:
        at = next((i for i, (t, o) in enumerate(zip(theirs, ours)) if t != o), min(len(theirs), len(ours)))
        sys.exit(f"error: {where}: its kernel's Params is not a prefix of this tree's (they part at field {at}: "
                 f"{theirs[at] if at < len(theirs) else 'end'} vs {ours[at] if at < len(ours) else 'end'}); "
                 "this tree would pass it misplaced pointers")


def variant_schedule(spec, batch: int, context: int, gpu, sets: dict, sched: str | None):
    """The variant's schedule: the file's (it must be of this model, batch and context), or the
    benchmark's with ``sets`` applied."""
    if sched is None:
        return make_schedule(spec, batch, context, gpu, sets)
    if sets:
        sys.exit(f"error: {sched}: a schedule= variant takes no field= ({', '.join(sorted(sets))}): save the changed "
                 "plan as a schedule of its own")
    s = saved_schedule(sched, gpu)
    if (s.spec.name, s.batch, s.context_len) != (spec.name, batch, context):
        sys.exit(f"error: {sched}: a schedule of {s.spec.name} b{s.batch} ctx {s.context_len}, not of "
                 f"{spec.name} b{batch} ctx {context}")
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--variant", action="append", required=True, help="NAME[:field=v,+MACRO=v,...]")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--prebuild", action="store_true")
    ap.add_argument("--gpu", default="H100-SXM", help="with --prebuild: the target GPU")
    ap.add_argument("--dump-schedule", metavar="FILE", help="write the benchmark's schedule (no GPU needed) and exit")
    add_weights_args(ap)
    a = ap.parse_args()
    spec = weights_spec(resolve_model(a.model).spec, a)
    variants = [parse_variant(v) for v in a.variant]
    for _, _, _, src, _, _ in variants:
        if src:
            check_params_prefix(Path(src).read_text(), src)
    if a.dump_schedule:
        Path(a.dump_schedule).write_text(make_schedule(spec, a.batch, a.context, get_gpu(a.gpu), {}).to_json())
        return
    if a.prebuild:
        for name, sets, diag, src, sched, cp_async in variants:
            s = variant_schedule(spec, a.batch, a.context, get_gpu(a.gpu), sets, sched)
            path = prebuild(s, a.context, get_gpu(a.gpu), diag, cp_async)
            if src:
                from trtllm_mk.codegen import compile_cubin
                path, _ = compile_cubin(Path(src).read_text(), get_gpu(a.gpu).nvcc_arch)
            print(f"{name}: predicted {s.predicted_step_us:.1f} us -> {path.name}")
        return

    import torch
    from benchmarks.timing import time_steps
    gpu = detect_gpu()
    w = step_weights(spec)
    tokens = torch.randint(0, spec.vocab_size, (a.batch,))
    pos = torch.full((a.batch,), a.context)
    runs = []
    for name, sets, diag, src, sched, cp_async in variants:
        s = variant_schedule(spec, a.batch, a.context, gpu, sets, sched)
        dec, graph = captured_step(s, w, a.context, gpu, diag, tokens, Path(src).read_text() if src else None, cp_async)
        runs.append((name, s, dec, graph))
        ring = f"; cp.async ring, {cp_async} loader warps" if cp_async else ""
        print(f"{name}: plan {s.plan.to_dict()} diagnostics {diag.changed()}{ring}; predicted {s.predicted_step_us:.1f} us",
              flush=True)
    p50 = {name: [] for name, *_ in runs}
    for r in range(a.rounds):
        order = runs[r % len(runs):] + runs[:r % len(runs)]
        for name, _, dec, graph in order:
            dec.set_state(tokens, pos)   # every round decodes the same positions
            p50[name].append(time_steps(graph.replay, steps=a.steps, warmup=20).p50 * 1e3)
            dec.synchronize()
    ref = runs[0][0]
    print(f"\n{a.model} b{a.batch} ctx {a.context} on {torch.cuda.get_device_name(0)}: median of {a.rounds} rounds "
          f"of {a.steps}-replay medians (us)")
    print("| variant | predicted | median | range | vs " + ref + " (range) |")
    print("|---|---|---|---|---|")
    for name, s, *_ in runs:
        v = p50[name]
        diff = [x - y for x, y in zip(v, p50[ref])]
        print(f"| {name} | {s.predicted_step_us:.1f} | {statistics.median(v):.1f} | {min(v):.1f}..{max(v):.1f} | "
              f"{statistics.median(diff):+.1f} ({min(diff):+.1f}..{max(diff):+.1f}) |")


if __name__ == "__main__":
    main()
