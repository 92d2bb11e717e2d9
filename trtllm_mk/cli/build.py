"""``build``: deployment YAML -> engine directory (also build_scripts/build_engine.py).

    python build_scripts/build_engine.py --config configs/l20_bs1.yaml [--output-dir D] [--seed N] [--budget S] [--dry-run]

Loads and validates the config (every mistake ends as one line on stderr and exit code 2), applies
the command-line overrides, prints the resolved deployment, then runs the offline schedule search
(progress bar), validates the schedule, generates and compiles the megakernel for the config's GPU
and writes the engine directory with its report and Gantt chart. Works without a GPU.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from trtllm_mk.config import DEFAULT_CONFIG, DeploymentConfig, load_config, with_overrides
from trtllm_mk.deployment import describe
from trtllm_mk.errors import run_cli
from trtllm_mk.report import floor_text


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Build a megakernel engine for one deployment config.")
    ap.add_argument("--config", default=str(DEFAULT_CONFIG),
                    help="deployment YAML (default: the shipped L20 / Qwen3-8B / batch 1 config)")
    ap.add_argument("--output-dir", help="engine directory (overrides megakernel.output_dir)")
    ap.add_argument("--seed", type=int, help="search seed (overrides megakernel.seed)")
    ap.add_argument("--budget", type=float, help="search budget in seconds (overrides megakernel.search_budget_s)")
    ap.add_argument("--dry-run", action="store_true", help="validate the config and print the deployment only")
    return ap.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> DeploymentConfig:
    cfg = load_config(args.config)
    overrides = {key: value for key, value in (("output_dir", args.output_dir), ("seed", args.seed),
                                               ("search_budget_s", args.budget)) if value is not None}
    if overrides:
        cfg = with_overrides(cfg, {"megakernel": overrides}, where=f"{args.config} with command-line overrides")
    return cfg


def build(cfg: DeploymentConfig, args: argparse.Namespace) -> int:
    """Print the resolved deployment, build the engine of ``cfg`` and summarise the result."""
    from trtllm_mk.build import build_engine, check_buildable
    print(describe(cfg), end="")
    check_buildable(cfg)
    if getattr(args, "dry_run", False):
        # the checks a build makes before its search: a compiler, and an output folder it may write
        from trtllm_mk.codegen import find_nvcc
        from trtllm_mk.engine_target import check_target
        find_nvcc()
        check_target(cfg.megakernel.output_dir)
        return 0
    print(flush=True)
    out, rep = build_engine(cfg, log=lambda line: print(line, flush=True))
    print(summary(out, rep, cfg.tensor_parallel_size))
    return 0


def _bytes(n: int) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.3f} MB"


def summary(out: Path, rep: dict, tensor_parallel: int = 1) -> str:
    b = rep.get("build", {})
    tp = tensor_parallel
    lines = [
        f"engine written to {out}/",
        *([f"  tensor parallel         {tp} GPUs, each running this kernel on its shard (figures per GPU); "
           f"torchrun --nproc-per-node {tp} -m trtllm_mk run --engine {out} ..."] if tp > 1 else []),
        f"  predicted decode step   {rep['predicted_step_us'] / 1000:.3f} ms/token "
        f"({100 * rep['bandwidth_utilization']:.0f}% of read bandwidth)",
        f"  weights streamed        {_bytes(rep['weight_bytes_per_step'])} per step, "
        f"{rep.get('weight_format', 'bfloat16')} (bandwidth floor {floor_text(rep['floor_us'])}/token)",
        f"  naive schedule          {rep['naive_step_us'] / 1000:.3f} ms/token "
        f"(searched is {rep['improvement_pct']:.1f}% faster)",
        f"  search / compile        {b.get('search_s', 0):.1f} s / {b.get('compile_s', 0):.1f} s; {b.get('validation', '')}",
    ]
    k = rep.get("kernel")
    if k:
        skipped = len(k.get("plans_skipped") or [])
        lines.append(f"  kernel                  {k['registers']} registers, " + (
            f"SPILLS {k['spill_stores']} B stores / {k['spill_loads']} B loads (allowed by megakernel.allow_spills)"
            if k.get("spills") else "no spills") + (f"; {skipped} spilling plan(s) skipped" if skipped else ""))
    lines += [
        f"  report                  {out / 'report.md'}, {out / 'gantt.png'}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return build(config_from_args(args), args)

