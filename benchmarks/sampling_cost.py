"""What choosing the token costs inside the step: one captured decode step of a model shape, timed with
each sampling mode in interleaved rounds (the mode is data the kernel reads, so one CUDA graph serves
every mode; device/mk_sampling.cuh).

    python -m benchmarks.sampling_cost llama-3.2-1b [--batch 1] [--context 512] [--rounds 7] [--steps 100]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

MODES = {
    "greedy": dict(),
    "temperature 0.8": dict(temperature=0.8, seed=1),
    "top-k 50": dict(temperature=0.8, top_k=50, seed=1),
    "top-p 0.9": dict(temperature=0.8, top_p=0.9, seed=1),
    "top-k 50 + top-p 0.9": dict(temperature=0.8, top_k=50, top_p=0.9, seed=1),
    "greedy + 5 logprobs": dict(logprobs=5),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()

    import torch
    from mk_trace import captured_step, make_schedule

    from benchmarks.timing import time_steps
    from trtllm_mk.codegen import Diagnostics
    from trtllm_mk.gpus import detect_gpu
    from trtllm_mk.model.random_weights import random_weights
    from trtllm_mk.model.registry import resolve_model
    from trtllm_mk.sampling import SamplingParams

    spec = resolve_model(a.model).spec
    gpu = detect_gpu()
    s = make_schedule(spec, a.batch, a.context, gpu, {})
    w = random_weights(spec, device="cuda", seed=0)
    tokens = torch.randint(0, spec.vocab_size, (a.batch,))
    dec, graph = captured_step(s, w, a.context, gpu, Diagnostics(), tokens)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    names = list(MODES)
    for r in range(a.rounds):
        for m in names[r % len(names):] + names[:r % len(names)]:
            for b in range(a.batch):
                dec.set_sampling(b, SamplingParams(**MODES[m]) if MODES[m] else None)
            dec.set_state(tokens, torch.full((a.batch,), a.context))
            times[m].append(time_steps(graph.replay, steps=a.steps, warmup=10).p50 * 1e3)
    dec.synchronize()
    base = statistics.median(times["greedy"])
    rows = []
    print(f"{a.model} batch {a.batch} context {a.context} on {gpu.name}: median of {a.rounds} rounds "
          f"(each the p50 of {a.steps} graph replays)")
    print("| mode | step us | vs greedy |\n|---|---|---|")
    for m in names:
        med = statistics.median(times[m])
        rows.append(dict(mode=m, step_us=med, delta_us=med - base, rounds=times[m]))
        print(f"| {m} | {med:.1f} | {med - base:+.1f} us |")
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / f"sampling_cost_{a.model}_b{a.batch}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
