"""``bench``: latency of an engine as trtllm-bench reports it: TTFT and TPOT (avg, P50/P90/P95/P99),
per-user output tokens/s, and a JSON report. Random prompts of --input-len tokens, random weights
unless --weights is given.

    python -m trtllm_mk bench --engine engines/h100_bs1 [--input-len 512 --output-len 128 --runs 5]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def latency_stats(values_ms: list[float]) -> dict:
    a = np.asarray(values_ms, dtype=float)
    return {"avg": float(a.mean()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p95": float(np.percentile(a, 95)), "p99": float(np.percentile(a, 99)), "n": int(a.size)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trtllm_mk bench", description=__doc__.splitlines()[0])
    ap.add_argument("--engine", required=True)
    ap.add_argument("--weights", help="HF checkpoint directory, or 'random' (default: the engine's checkpoint)")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args(argv)
    import torch
    from tqdm import tqdm

    from ..runtime.hybrid import HybridEngine
    eng = HybridEngine(args.engine, weights=args.weights)
    gen = torch.Generator().manual_seed(0)
    ttft, tpot = [], []
    eng.generate([[1] * 8] * eng.batch, 4, eos_ids=())  # warm-up: first launch, prefill kernels
    for _ in tqdm(range(args.runs), desc="bench", unit="run"):
        prompts = [torch.randint(0, eng.spec.vocab_size, (args.input_len,), generator=gen).tolist()
                   for _ in range(eng.batch)]
        r = eng.generate(prompts, args.output_len, eos_ids=())
        ttft.append(r.ttft_ms)
        tpot.extend(r.tpot_ms)
    t, p = latency_stats(ttft), latency_stats(tpot)
    report = {"engine": str(args.engine), "device": torch.cuda.get_device_name(0), "batch": eng.batch,
              "input_len": args.input_len, "output_len": args.output_len, "ttft_ms": t, "tpot_ms": p,
              "tokens_per_sec_per_user": 1e3 / p["avg"],
              "predicted_tpot_ms": eng.schedule.predicted_step_us / 1e3}
    print(f"{'metric':<10}{'avg':>9}{'p50':>9}{'p90':>9}{'p95':>9}{'p99':>9}")
    for name, s in (("TTFT ms", t), ("TPOT ms", p)):
        print(f"{name:<10}" + "".join(f"{s[k]:>9.3f}" for k in ("avg", "p50", "p90", "p95", "p99")))
    print(f"per-user output tokens/s {report['tokens_per_sec_per_user']:.1f}; predicted TPOT "
          f"{report['predicted_tpot_ms']:.3f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0
