#!/usr/bin/env python3
"""Build a megakernel engine for one deployment YAML.

    python build_scripts/build_engine.py --config configs/l20_bs1.yaml [--output-dir D] [--seed N] [--budget S]

Loads and validates the config (every mistake ends as one line on stderr and exit code 2), applies
the command-line overrides, and prints the resolved deployment summary.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    import trtllm_mk  # noqa: F401  (installed: pip install -e .)
except ImportError:  # run from a source checkout that was never installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trtllm_mk.config import DEFAULT_CONFIG, DeploymentConfig, load_config, with_overrides
from trtllm_mk.deployment import describe
from trtllm_mk.errors import run_cli


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Build a megakernel engine for one deployment config.")
    ap.add_argument("--config", default=str(DEFAULT_CONFIG),
                    help="deployment YAML (default: the shipped L20 / Qwen3-8B / batch 1 config)")
    ap.add_argument("--output-dir", help="engine directory (overrides megakernel.output_dir)")
    ap.add_argument("--seed", type=int, help="search seed (overrides megakernel.seed)")
    ap.add_argument("--budget", type=float, help="search budget in seconds (overrides megakernel.search_budget_s)")
    return ap.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> DeploymentConfig:
    cfg = load_config(args.config)
    overrides = {key: value for key, value in (("output_dir", args.output_dir), ("seed", args.seed),
                                               ("search_budget_s", args.budget)) if value is not None}
    if overrides:
        cfg = with_overrides(cfg, {"megakernel": overrides}, where=f"{args.config} with command-line overrides")
    return cfg


def build(cfg: DeploymentConfig, args: argparse.Namespace) -> int:
    """Build the engine of ``cfg``. For now: print the resolved deployment summary."""
    print(describe(cfg), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return build(config_from_args(args), args)


if __name__ == "__main__":
    run_cli(main)
