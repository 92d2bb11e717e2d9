"""``verify``: re-check an engine directory: file integrity, one deployment in config, schedule and
cubin (EngineDir.open), schedule validity (deadlock and race freedom), that the kernel layout
matches the schedule, and that the checkpoint it was built from is unchanged (a checkpoint that is not
on this machine is reported, not an error: run, bench and serve then take --weights).

    python -m trtllm_mk verify --engine engines/h100_bs1
"""
from __future__ import annotations

import argparse

from ..codegen import kernel_smem_bytes
from ..engine import EngineDir
from ..errors import EngineError


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trtllm_mk verify", description="Re-validate an engine directory.")
    ap.add_argument("--engine", required=True)
    args = ap.parse_args(argv)
    from ..verify import check
    eng = EngineDir.open(args.engine)
    graph = eng.schedule.graph()
    report = check(eng.schedule, graph)
    if eng.layout.grid != eng.schedule.num_sms or eng.layout.smem_bytes != kernel_smem_bytes(graph):
        raise EngineError(f"{eng.path}: kernel.json does not match schedule.json; rebuild the engine")
    print(f"{eng.path}: files intact; {report.summary()}; kernel {eng.target}, {eng.layout.grid} CTAs x "
          f"{eng.layout.block} threads, {eng.layout.smem_bytes} B shared memory")
    print(checkpoint_state(eng))
    return 0


def checkpoint_state(eng: EngineDir) -> str:
    """One line on the checkpoint the engine was built from; a changed one is an error (run refuses it)."""
    from pathlib import Path
    from ..model.consistency import check_unchanged
    rec = eng.checkpoint
    if rec is None:
        return "checkpoint: none (built from an architecture name; run takes --weights)"
    if not (Path(rec["path"]) / "config.json").is_file():
        return f"checkpoint {rec['path']}: not on this machine (run, bench and serve need --weights)"
    check_unchanged(rec)
    return f"checkpoint {rec['path']}: unchanged since the build"
