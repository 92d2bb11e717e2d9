"""``bench``: latency and throughput of an engine, reported as trtllm-bench reports them.

Request latency, time to first token (TTFT) and time per output token (TPOT) as avg / P50 / P90 / P95 /
P99 / min / max, request and output-token throughput, per-user output tokens/s, and a JSON report.
Each run fills every batch slot with a random prompt of --input-len tokens and decodes exactly
--output-len tokens per request (end-of-sequence ignored). Weights: the checkpoint the engine was built
from, another one with --weights, or --weights random.

    python -m trtllm_mk bench --engine engines/h100_bs1 [--input-len 512 --output-len 128 --runs 5] [--simulate]

A tensor-parallel engine: ``torchrun --nproc-per-node N -m trtllm_mk bench ...`` (rank 0 reports).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from ..errors import UserError


STATS = ("avg", "p50", "p90", "p95", "p99", "min", "max")


def latency_stats(values_ms: list[float]) -> dict:
    """avg / percentiles / min / max of a latency list; None each when there is none (one output token
    has no time per output token), which JSON writes as null."""
    a = np.asarray(values_ms, dtype=float)
    if a.size == 0:
        return {k: None for k in STATS} | {"n": 0}
    return {"avg": float(a.mean()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p95": float(np.percentile(a, 95)), "p99": float(np.percentile(a, 99)), "min": float(a.min()),
            "max": float(a.max()), "n": int(a.size)}


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m trtllm_mk bench", description=__doc__.splitlines()[0])
    ap.add_argument("--engine", required=True, help="engine directory written by build")
    ap.add_argument("--weights", help="HF checkpoint directory, or 'random' for random weights (default: the "
                                      "checkpoint the engine was built from)")
    ap.add_argument("--input-len", type=int, default=512, help="prompt tokens per request")
    ap.add_argument("--output-len", type=int, default=128, help="generated tokens per request")
    ap.add_argument("--runs", type=int, default=5, help="timed runs, each filling every batch slot")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs first (first launch, prefill kernels)")
    ap.add_argument("--simulate", action="store_true", help="decode on the CPU executor instead of the GPU")
    ap.add_argument("--seed", type=int, default=0, help="seed of random weights and prompts")
    ap.add_argument("--json", help="write the report here")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    for name in ("input_len", "output_len", "runs"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        raise UserError("--warmup must be >= 0")
    if args.json:   # checked before the runs, not after them
        out = Path(args.json)
        if out.is_dir() or not out.parent.is_dir():
            raise UserError(f"--json {args.json}: not a file in an existing directory")
    import torch
    from tqdm import tqdm

    from ..runtime.hybrid import HybridEngine
    eng = HybridEngine(args.engine, weights=args.weights, simulate=args.simulate, seed=args.seed)
    if args.input_len > eng.max_input_len:
        raise UserError(f"--input-len {args.input_len} exceeds the engine's max_input_len {eng.max_input_len}")
    if args.input_len + args.output_len > eng.max_seq_len:
        raise UserError(f"--input-len {args.input_len} + --output-len {args.output_len} exceeds the engine's "
                        f"max_seq_len {eng.max_seq_len}")
    main_rank = eng.rank == 0   # tensor parallel: every rank runs the same requests, rank 0 reports
    gen = torch.Generator().manual_seed(args.seed)

    def prompts():
        return [torch.randint(0, eng.spec.vocab_size, (args.input_len,), generator=gen).tolist()
                for _ in range(eng.batch)]

    for _ in range(args.warmup):
        eng.generate(prompts(), min(args.output_len, 4), eos_ids=())
    ttft, tpot, step, latency = [], [], [], []
    wall = 0.0
    for _ in tqdm(range(args.runs), desc="bench", unit="run", disable=not main_rank):
        t0 = time.perf_counter()
        r = eng.generate(prompts(), args.output_len, eos_ids=())
        wall += time.perf_counter() - t0
        ttft.extend(r.request_ttft_ms)
        latency.extend(r.request_latency_ms)
        step.extend(r.tpot_ms)
        if args.output_len > 1:   # per request: the time between its first and its last token
            tpot.extend((lat - first) / (args.output_len - 1) for lat, first in zip(r.request_latency_ms,
                                                                                     r.request_ttft_ms))
    n_req = args.runs * eng.batch
    out_tokens = n_req * args.output_len
    t, p, s, lat = latency_stats(ttft), latency_stats(tpot), latency_stats(step), latency_stats(latency)
    device = "CPU executor (--simulate)" if args.simulate else torch.cuda.get_device_name(0)
    report = {
        "engine": str(args.engine), "device": device, "batch": eng.batch, "input_len": args.input_len,
        "output_len": args.output_len, "num_requests": n_req, "total_time_s": wall,
        "request_latency_ms": lat, "ttft_ms": t, "tpot_ms": p, "step_ms": s,
        "request_throughput_req_per_s": n_req / wall,
        "output_throughput_tok_per_s": out_tokens / wall,
        "total_throughput_tok_per_s": n_req * (args.input_len + args.output_len) / wall,
        "tokens_per_sec_per_user": 1e3 / p["avg"] if p["n"] else None,
        "predicted_step_ms": eng.schedule.predicted_step_us / 1e3,
        **({"tensor_parallel_size": eng.tp} if eng.tp > 1 else {}),
    }
    if not main_rank:
        eng.close()
        return 0
    print(f"{device}, batch {eng.batch}, {n_req} requests of {args.input_len} -> {args.output_len} tokens")
    print(f"{'metric':<22}" + "".join(f"{k:>10}" for k in STATS))
    for name, st in (("request latency ms", lat), ("TTFT ms", t), ("TPOT ms", p), ("decode step ms", s)):
        print(f"{name:<22}" + "".join(f"{st[k]:>10.3f}" if st[k] is not None else f"{'n/a':>10}" for k in STATS))
    per_user = report["tokens_per_sec_per_user"]
    print(f"throughput: {report['request_throughput_req_per_s']:.2f} req/s, "
          f"{report['output_throughput_tok_per_s']:.1f} output tok/s, "
          f"{report['total_throughput_tok_per_s']:.1f} total tok/s; per user "
          f"{'n/a' if per_user is None else f'{per_user:.1f}'} tok/s; predicted step {report['predicted_step_ms']:.3f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    eng.close()
    return 0
