"""python -m trtllm_mk build|run|serve|bench|verify|quantize [...]  (each subcommand has --help)."""
from __future__ import annotations

import importlib
import sys

from .errors import run_cli

COMMANDS = {"build": "build an engine from a deployment YAML", "run": "generate with an engine",
            "serve": "OpenAI-compatible HTTP server over an engine",
            "bench": "TTFT/TPOT latency report of an engine", "verify": "re-validate an engine directory",
            "quantize": "round-to-nearest quantized copy of a checkpoint"}


def _main() -> int:
    argv = sys.argv[1:]
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__.strip())
        for name, what in COMMANDS.items():
            print(f"  {name:<8} {what}")
        if argv and argv[0] not in ("-h", "--help"):
            print(f"error: unknown command '{argv[0]}'", file=sys.stderr)
            return 2
        return 0
    mod = importlib.import_module(f".cli.{argv[0]}", __package__)
    sys.argv[0] = f"python -m trtllm_mk {argv[0]}"   # argparse's usage line names the command typed
    return mod.main(argv[1:])


def main() -> None:
    run_cli(_main)


if __name__ == "__main__":
    main()
