"""Checks that two checkouts of trtllm_mk compute the same decode steps: for every shipped config,
one schedule (searched by the reference checkout with the config's seed, on the config's model cut to
a few layers) runs N CPU-executor steps under each checkout, and the tokens and logits must be
bit-identical, and so must the cost model's table of the schedule's graph.

With --ptx, the generated kernel source of each schedule is also compiled to PTX (nvcc -ptx for the
config's GPU) under both checkouts, and the PTX must be identical once comments and line information
(.loc / .file) are stripped.

Usage: python scripts/mk_equiv.py REFERENCE_CHECKOUT [--configs configs/*.yaml] [--layers 2]
           [--steps 3] [--budget 2] [--work DIR] [--ptx]
The current checkout is the one this script lives in. Exit code 0 when every config matches.

Worker mode (run under one checkout's PYTHONPATH): --worker search|run CONFIG SCHEDULE [...]."""
from __future__ import annotations

import argparse
import dataclasses
import glob
import hashlib
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def _spec_and_cfg(config: str, layers: int):
    from trtllm_mk.config import load_config
    cfg = load_config(config)
    return cfg, dataclasses.replace(cfg.model_spec, num_layers=min(layers, cfg.model_spec.num_layers))


def worker_search(config: str, out: str, layers: int, budget: float) -> None:
    from trtllm_mk.search.search import search
    cfg, spec = _spec_and_cfg(config, layers)
    sched, _ = search(spec, cfg.max_batch_size, cfg.gpu_spec, context_len=cfg.megakernel.context_len,
                      budget_s=budget, seed=cfg.megakernel.seed)
    sched.save(out)


def worker_run(config: str, schedule: str, layers: int, steps: int) -> None:
    import torch
    from trtllm_mk.executor import CpuExecutor
    from trtllm_mk.kv_cache import PagedKVCache
    from trtllm_mk.model.random_weights import random_weights
    from trtllm_mk.schedule import Schedule
    torch.set_num_threads(1)
    cfg, spec = _spec_and_cfg(config, layers)
    sched = Schedule.load(schedule)
    B = sched.batch
    w = random_weights(spec, seed=0, std=0.1)
    max_seq = 1024
    cache = PagedKVCache.allocate(spec, B, max_seq, cfg.kv_cache_config.tokens_per_block, seed=0, fill=1.0)
    ex = CpuExecutor(spec, w, sched, cache)
    g = torch.Generator().manual_seed(1)
    tok = torch.randint(0, spec.vocab_size, (B,), generator=g, dtype=torch.int32)
    pos = torch.tensor([(97 + 211 * b) % (max_seq - steps - 1) for b in range(B)], dtype=torch.int32)
    h = hashlib.sha256()
    for t in range(steps):
        logits, tok = ex.step(tok, pos + t)
        h.update(logits.numpy().tobytes())
        h.update(tok.numpy().tobytes())
        print("tokens", tok.tolist())
    h.update(cache.pool.view(torch.int16).numpy().tobytes())
    # the cost model's view of the same graph (what the search optimises)
    from trtllm_mk.search.cost import cost_table, load_calibration
    costs = cost_table(sched.graph(), cfg.gpu_spec, load_calibration(cfg.gpu_spec))
    print("costs", hashlib.sha256(repr(costs).encode()).hexdigest())
    # the lowering under plan variants the search may pick (o_merge, K-splits)
    from trtllm_mk.graph import build_step_graph
    gh = hashlib.sha256()
    for o_merge in (False, True):
        for o_ksplit in sorted({1, 2, spec.num_kv_heads} & set(range(1, spec.num_kv_heads + 1))):
            if spec.num_kv_heads % o_ksplit:
                continue
            for down_ksplit in (1, 2):
                plan = dataclasses.replace(sched.plan, o_merge=o_merge, o_ksplit=o_ksplit, down_ksplit=down_ksplit)
                try:
                    g = build_step_graph(spec, B, plan, sched.context_len)
                except ValueError as e:   # a split the model's widths do not allow: the same in both checkouts
                    gh.update(str(e).encode())
                    continue
                gh.update(repr((g.head, g.layer, g.tail, sorted(g.events.items()))).encode())
    print("graphs", gh.hexdigest())
    print("digest", h.hexdigest())


def worker_ptx(config: str, schedule: str, out: str) -> None:
    import re
    from trtllm_mk.codegen.source import generate_source
    from trtllm_mk.schedule import Schedule
    cfg, _ = _spec_and_cfg(config, 1)
    arch = cfg.gpu_spec.nvcc_arch                       # sm_90a, sm_89, ...
    src, _ = generate_source(Schedule.load(schedule), cfg.kv_cache_config.tokens_per_block, cfg.max_seq_len,
                             use_bulk_copy=cfg.gpu_spec.has_tma)
    Path(out + ".cu").write_text(src)
    subprocess.run(["nvcc", "-ptx", "-std=c++17", "-O3", f"-gencode=arch={arch.replace('sm_', 'compute_')},code={arch}",
                    out + ".cu", "-o", out + ".ptx"], check=True, capture_output=True)
    # internal-linkage symbols carry the source file's name and hashes (_ZN41_INTERNAL_<hash>_<len>_<name>_cu_<hash>),
    # which differ between the two checkouts' files
    keep = [re.sub(r"_ZN\d+_INTERNAL_[0-9a-f]+_\d+_\w+?_cu_[0-9a-f]{8}", "_INTERNAL_", re.sub(r"\s*//.*$", "", ln))
            for ln in Path(out + ".ptx").read_text().splitlines() if not ln.strip().startswith(("//", ".loc", ".file"))]
    print("ptx", hashlib.sha256("\n".join(keep).encode()).hexdigest())


def _worker(root: Path, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(root))
    r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", *args], cwd=root, env=env,
                       capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"worker {args[0]} under {root} failed:\n{r.stderr[-3000:]}")
    return r.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reference", nargs="?")
    ap.add_argument("--configs", nargs="*", default=None)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--budget", type=float, default=2.0)
    ap.add_argument("--work", default="/tmp/mk_equiv")
    ap.add_argument("--ptx", action="store_true")
    ap.add_argument("--worker", nargs="+")
    a = ap.parse_args()
    if a.worker:
        mode, config, path = a.worker[:3]
        if mode == "search":
            worker_search(config, path, a.layers, a.budget)
        elif mode == "ptx":
            worker_ptx(config, path, a.worker[3])
        else:
            worker_run(config, path, a.layers, a.steps)
        return 0
    if not a.reference:
        print("mk_equiv: give the reference checkout", file=sys.stderr)
        return 2
    ref = Path(a.reference).resolve()
    configs = a.configs or sorted(glob.glob(str(HERE / "configs" / "*.yaml")))
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    bad = 0
    for config in configs:
        config = str(Path(config).resolve())
        sched = work / (Path(config).stem + f".L{a.layers}.schedule.json")
        if not sched.exists():
            _worker(ref, "search", config, str(sched), "--layers", str(a.layers), "--budget", str(a.budget))
        outs = [_worker(root, "run", config, str(sched), "--layers", str(a.layers), "--steps", str(a.steps))
                for root in (ref, HERE)]
        if a.ptx:
            outs = [o + _worker(root, "ptx", config, str(sched), str(work / f"{Path(config).stem}.{i}"))
                    for i, (o, root) in enumerate(zip(outs, (ref, HERE)))]
        same = outs[0] == outs[1]
        bad += not same
        print(f"{Path(config).name}: {'identical' if same else 'DIFFERENT'} "
              f"({outs[0].split()[-1][:16]} vs {outs[1].split()[-1][:16]})", flush=True)
        if not same:   # which of the worker's lines (tokens and logits, costs, graphs, digest, ptx) differ
            for x, y in zip(outs[0].splitlines(), outs[1].splitlines()):
                if x != y:
                    print(f"  {x.split()[0] if x else '?'}: {x[-16:]} vs {y[-16:]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
