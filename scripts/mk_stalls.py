"""Where each task kind's warps stall: Nsight Compute's warp-state samples of one decode step, by kind.

    python scripts/mk_stalls.py llama-3.2-1b [--batch 1] [--context 512] [--weights w4a16] [--set F=V] --out DIR
    python scripts/mk_stalls.py --csv SOURCE.csv[.gz] --cubin KERNEL.cubin --out DIR   # an exported report

The first form compiles the benchmark's schedule (``--set`` replaces tile plan fields, as in
scripts/mk_trace.py), runs one CUDA-graph replay of the step under ``ncu`` (WarpStateStats and
SourceCounters: program-counter samples of every warp) and exports the per-instruction table
(``ncu --page source --csv --print-source sass``). Both forms then place each sampled instruction in the
task kind whose ``run_task<KIND>`` holds it (the cubin's function symbols) and write DIR/stalls.md: each
kind's share of all samples with its main stall reasons, and the instructions that hold most of each
kind's samples. A sample counts a warp of any role (consumer, loader, signaller), so a kind's share is
warp-time, not the step's critical path: a consumer warp waiting at its barrier for the task's events
shows as ``barrier`` on the instruction after the barrier, a wait on a ring slot or an event counter as
``long_sb`` on the branch of its polling loop.
"""
from __future__ import annotations

import argparse
import csv
import gzip
import re
import shutil
import struct
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SAMPLES = "Warp Stall Sampling (All Samples)"


def function_symbols(cubin: Path) -> list[tuple[int, int, str]]:
    """(offset, size, name) of the functions in a cubin's symbol table (ELF64), the kernel itself left
    out (it spans the whole text section): the offsets are from the kernel's first instruction."""
    b = cubin.read_bytes()
    shoff, = struct.unpack_from("<Q", b, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", b, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", b, shoff + i * shentsize) for i in range(shnum)]
    out = []
    for sh in sections:
        if sh[1] != 2:   # SHT_SYMTAB
            continue
        strtab = sections[sh[6]]
        for off in range(sh[4], sh[4] + sh[5], 24):
            name_at, info, _, _, value, size = struct.unpack_from("<IBBHQQ", b, off)
            if info & 0xF != 2 or size == 0:   # STT_FUNC
                continue
            s = strtab[4] + name_at
            out.append((value, size, b[s:b.index(b"\0", s)].decode()))
    whole = max((sz for _, sz, _ in out), default=0)
    return sorted(f for f in out if f[1] != whole)


def kind_of(name: str) -> str:
    """The task kind of a device function's mangled name (``run_task<N>``), or what else it is."""
    from trtllm_mk.kinds import Kind
    m = re.search(r"run_taskILi(\d+)E", name)
    if m:
        return Kind(int(m.group(1))).name
    for part in ("run_program", "prefetch_next_step"):
        if part in name:
            return part
    return "other"


def read_rows(path: Path) -> tuple[list[str], list[list[str]]]:
    """The header and instruction rows of an ncu source-page CSV (first line: the kernel's name)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        rows = [r for r in csv.reader(f)]
    start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    return rows[start], rows[start + 1:]


def by_kind(header: list[str], rows: list[list[str]], funcs) -> tuple[dict, list]:
    """Per kind: a Counter of samples ('all' and each stall reason); and every row with its kind."""
    col = {h: i for i, h in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "(Not Issued)" not in h]
    base = int(rows[0][0], 16)
    kinds: dict[str, Counter] = defaultdict(Counter)
    placed = []
    for r in rows:
        off = int(r[0], 16) - base
        kind = next((kind_of(n) for v, s, n in funcs if v <= off < v + s), "kernel entry")
        n = int(r[col[SAMPLES]] or 0)
        if not n:
            continue
        c = kinds[kind]
        c["all"] += n
        for h in reasons:
            c[h[len("stall_"):]] += int(r[col[h]] or 0)
        placed.append((kind, off, n, r[col["Source"]].strip(),
                       sorted(((int(r[col[h]] or 0), h[len("stall_"):]) for h in reasons), reverse=True)[:2]))
    return kinds, placed


def report(kinds: dict, placed: list, top: int) -> str:
    total = sum(c["all"] for c in kinds.values())
    lines = [f"{total} warp samples", "", "| kind | samples | share | main stall reasons |", "|---|---|---|---|"]
    for kind, c in sorted(kinds.items(), key=lambda kv: -kv[1]["all"]):
        why = sorted(((v, k) for k, v in c.items() if k != "all" and v), reverse=True)[:6]
        lines.append(f"| {kind} | {c['all']} | {100 * c['all'] / total:.1f}% | "
                     + ", ".join(f"{k} {100 * v / c['all']:.0f}%" for v, k in why) + " |")
    for kind, c in sorted(kinds.items(), key=lambda kv: -kv[1]["all"]):
        if c["all"] < total / 100:
            continue
        lines += ["", f"{kind}: the instructions holding most of its {c['all']} samples", "",
                  "| offset | samples | share | instruction | reasons |", "|---|---|---|---|---|"]
        mine = sorted((p for p in placed if p[0] == kind), key=lambda p: -p[2])[:top]
        for _, off, n, src, why in mine:
            lines.append(f"| {off:#x} | {n} | {100 * n / c['all']:.1f}% | `{src[:70]}` | "
                         + ", ".join(f"{k} {v}" for v, k in why if v) + " |")
    return "\n".join(lines) + "\n"


def profile(a: argparse.Namespace, out: Path) -> tuple[Path, Path]:
    """Compile the step's kernel, run one graph replay of it under ncu, export the source page:
    (csv, cubin)."""
    from mk_trace import make_schedule, parse_sets, prebuild, weights_spec
    from trtllm_mk.codegen.diagnostics import Diagnostics
    from trtllm_mk.gpus import detect_gpu
    from trtllm_mk.model.registry import resolve_model
    ncu = shutil.which("ncu")
    if ncu is None:
        sys.exit("error: ncu (Nsight Compute) is not on PATH")
    gpu = detect_gpu()
    spec = weights_spec(resolve_model(a.model).spec, a)
    s = make_schedule(spec, a.batch, a.context, gpu, parse_sets(a.set))
    cubin = prebuild(s, a.context, gpu, Diagnostics.parse([]))
    shutil.copy(cubin, out / "kernel.cubin")
    rep = out / "stalls"
    child = [sys.executable, __file__, a.model, "--batch", str(a.batch), "--context", str(a.context),
             "--weights", a.weights, "--group", str(a.group), "--child"] + [f"--set={x}" for x in a.set]
    # the child runs 3 warm-up steps and one capture; the replay after them is the one profiled
    subprocess.run([ncu, "--section", "WarpStateStats", "--section", "SourceCounters", "-k", "regex:mk_decode_step",
                    "--launch-skip", "4", "-c", "1", "-f", "-o", str(rep)] + child, check=True)
    src = out / "source.csv.gz"
    text = subprocess.run([ncu, "-i", f"{rep}.ncu-rep", "--page", "source", "--csv", "--print-source", "sass"],
                          check=True, capture_output=True, text=True).stdout
    with gzip.open(src, "wt") as f:
        f.write(text)
    return src, out / "kernel.cubin"


def child(a: argparse.Namespace) -> None:
    """Under ncu: the step's decoder, warmed up, and a few graph replays."""
    import torch
    from mk_trace import captured_step, make_schedule, parse_sets, step_weights, weights_spec
    from trtllm_mk.codegen.diagnostics import Diagnostics
    from trtllm_mk.gpus import detect_gpu
    from trtllm_mk.model.registry import resolve_model
    gpu = detect_gpu()
    spec = weights_spec(resolve_model(a.model).spec, a)
    s = make_schedule(spec, a.batch, a.context, gpu, parse_sets(a.set))
    tokens = torch.randint(0, spec.vocab_size, (a.batch,))
    dec, graph = captured_step(s, step_weights(spec), a.context, gpu, Diagnostics.parse([]), tokens)
    for _ in range(3):
        dec.set_state(tokens, torch.full((a.batch,), a.context))
        graph.replay()
    dec.synchronize()


def main() -> None:
    from mk_trace import add_weights_args
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--set", action="append", default=[], help="tile plan field=value")
    add_weights_args(ap)
    ap.add_argument("--csv", help="an exported ncu source page (ncu -i R --page source --csv --print-source sass)")
    ap.add_argument("--cubin", help="with --csv: the kernel it profiled")
    ap.add_argument("--top", type=int, default=12, help="instructions listed per kind")
    ap.add_argument("--out", default="stalls_out")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.csv:
        if not a.cubin:
            ap.error("--csv needs --cubin")
        src, cubin = Path(a.csv), Path(a.cubin)
    elif a.model:
        src, cubin = profile(a, out)
    else:
        ap.error("a model (or --csv and --cubin) is needed")
    header, rows = read_rows(src)
    kinds, placed = by_kind(header, rows, function_symbols(cubin))
    text = report(kinds, placed, a.top)
    (out / "stalls.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
