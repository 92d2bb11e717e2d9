"""CI regression gate on predicted decode latency: search every shipped deployment config (no GPU,
no compile; deterministic for its seed and budget) and compare each predicted per-token step time
with the baseline stored for its GPU in benchmarks/baselines/<gpu>.json. A change that makes the
searched schedules slower fails CI and says which config regressed and by how much.

    python -m benchmarks.predicted_gate check  [--tolerance 0.01]
    python -m benchmarks.predicted_gate update         # after an intended change: record new baselines
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

from benchmarks.regress import (baseline_path, compare, config_name, load_baseline, predicted_report,
                                update_baseline)
from trtllm_mk.config import load_config
from trtllm_mk.errors import run_cli
from trtllm_mk.search import search

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


def predicted_reports(config_dir: Path = CONFIG_DIR) -> dict[str, dict]:
    """{gpu: predicted report} over every shipped config (YAML files directly in configs/)."""
    per_gpu: dict[str, dict[str, float]] = defaultdict(dict)
    for path in sorted(config_dir.glob("*.yaml")):
        cfg = load_config(path)
        if cfg.quantization is not None or cfg.model_spec.is_moe:   # the cost model counts dense bf16 steps only,
            continue                                                   # so nothing to gate yet
        mk = cfg.megakernel
        # one rank's share under tensor parallelism, as the builder searches it
        sched, _ = search(cfg.rank_spec, cfg.max_batch_size, cfg.gpu_spec, context_len=mk.context_len,
                          budget_s=mk.search_budget_s, seed=mk.seed)
        name = f"{path.stem}:" + config_name(cfg.model_spec.name, cfg.max_batch_size, mk.context_len)
        per_gpu[cfg.gpu_spec.name][name] = sched.predicted_step_us
        print(f"{name:<52} {cfg.gpu_spec.name:<9} predicted {sched.predicted_step_us / 1e3:8.3f} ms/token", flush=True)
    return {gpu: predicted_report(entries, gpu) for gpu, entries in per_gpu.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.predicted_gate", description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=["check", "update"])
    ap.add_argument("--tolerance", type=float, default=0.01)
    a = ap.parse_args(argv)
    failed = False
    for gpu, rep in predicted_reports().items():
        current = {k: v for k, v in rep["configs"].items()}
        path = baseline_path(gpu)
        if a.action == "update":
            update_baseline(path, "predicted", gpu, current)
            print(f"recorded {len(current)} predicted baselines in {path}")
            continue
        cmp = compare(load_baseline(path, "predicted", gpu), current, a.tolerance)
        for line in cmp.regressions:
            print(f"REGRESSED  {line}")
        for line in cmp.missing:
            print(f"MISSING    {line}")
        print(f"{'FAIL' if cmp.failed() else 'ok'}: predicted {gpu}: {cmp.compared} configs compared "
              f"(tolerance {a.tolerance:.0%}), {len(cmp.regressions)} regressed, {len(cmp.improvements)} improved")
        failed |= cmp.failed()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    run_cli(main)
