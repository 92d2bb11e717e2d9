#!/usr/bin/env python3
"""Build a megakernel engine for one deployment YAML (see trtllm_mk/cli/build.py).

    python build_scripts/build_engine.py --config configs/l20_bs1.yaml [--output-dir D] [--seed N] [--budget S]
"""
import sys
from pathlib import Path

try:
    import trtllm_mk  # noqa: F401  (installed: pip install -e .)
except ImportError:  # run from a source checkout that was never installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trtllm_mk.cli.build import build, config_from_args, main, parse_args, summary  # noqa: E402,F401
from trtllm_mk.errors import run_cli  # noqa: E402

if __name__ == "__main__":
    run_cli(main)
