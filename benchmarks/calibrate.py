"""Cost-model calibration on the GPU: measure megakernel steps of several shapes, fit the constants
the simulator cannot know from datasheets (event-sync latency, per-task overhead, launch cost,
streaming read bandwidth), write benchmarks/calibration/<gpu>.json, which the search reads.

    python benchmarks/calibrate.py [--out benchmarks/calibration] [--models llama-3.2-1b ...]

The fit minimises the squared relative error of predicted vs measured step time over all workloads
by coordinate descent; the report prints both, before and after, per workload.
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
from benchmarks.timing import time_steps  # noqa: E402
from trtllm_mk.gpus import detect_gpu  # noqa: E402
from trtllm_mk.kv_cache import PagedKVCache  # noqa: E402
from trtllm_mk.model.random_weights import random_weights  # noqa: E402
from trtllm_mk.model.registry import resolve_model  # noqa: E402
from trtllm_mk.model.spec import spec_from_hf_config  # noqa: E402
from trtllm_mk.runtime.megakernel import build_decoder  # noqa: E402
from trtllm_mk.search import Calibration, load_calibration, predict, search  # noqa: E402

FIT_FIELDS = ("sync_us", "task_overhead_us", "launch_us")


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


def fit(workloads, gpu, cal0: Calibration) -> Calibration:
    def loss(cal):
        cal = cal.resolved(gpu)
        return sum((predict(s, gpu, cal).step_us / m - 1) ** 2 for s, m in workloads)

    best, best_loss = cal0, loss(cal0)
    step = {f: getattr(cal0, f) * 0.5 for f in FIT_FIELDS}
    for _ in range(6):  # coordinate descent with shrinking steps
        for f in FIT_FIELDS:
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
    args = ap.parse_args(argv)
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
