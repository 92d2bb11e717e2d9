"""The engine directory: what the builder writes and what the runtime opens.

    config.json      resolved deployment config
    schedule.json    searched per-SM schedule (versioned, checksummed; holds the model spec)
    megakernel.cu    generated, self-contained CUDA source
    megakernel.cubin compiled for the config's GPU target
    kernel.json      launch layout for the host runtime and the TensorRT plugin
    ptxas.txt        registers / shared memory / spills of the compiled kernel
    report.json, report.md, gantt.png   predicted latency, smem, naive vs searched, search statistics
    manifest.json    sha256 of every file above (checked by `verify` and on open)
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

from . import seam
from .codegen import KERNEL_NAME, KernelLayout, compile_cubin, generate_source
from .errors import EngineError
from .schedule import Schedule

MANIFEST_FILES = ["config.json", "schedule.json", "megakernel.cu", "megakernel.cubin", "kernel.json"]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def kernel_json(schedule: Schedule, layout: KernelLayout, target: str) -> dict:
    """Launch layout + dimensions: everything a host (Python runtime, TensorRT plugin) needs."""
    g = schedule.graph()
    d = g.dims
    return {
        "kernel": KERNEL_NAME, "grid": layout.grid, "block": layout.block, "smem_bytes": layout.smem_bytes,
        "num_counters": layout.num_counters, "n_lm_tiles": layout.n_lm_tiles, "history_len": layout.history_len,
        "tokens_per_block": layout.tokens_per_block, "trace_tasks": layout.trace_tasks, "batch": schedule.batch, "attn_splits": schedule.plan.attn_splits,
        "event_offsets": layout.event_offsets, "target": target,
        "qk_norm": schedule.spec.qk_norm, "qkv_bias": schedule.spec.qkv_bias,
        "dims": {"L": d.layers, "H": d.hidden, "I": d.intermediate, "V": d.vocab, "NH": d.heads, "NKV": d.kv_heads, "D": d.head_dim,
                 "G": d.group, "QKVR": d.qkv_rows},
        "params": seam.params_layout_json(),
    }


def layout_from_kernel_json(k: dict) -> KernelLayout:
    return KernelLayout(grid=k["grid"], block=k["block"], smem_bytes=k["smem_bytes"],
                        event_offsets=dict(k["event_offsets"]), num_counters=k["num_counters"],
                        n_lm_tiles=k["n_lm_tiles"], history_len=k["history_len"],
                        tokens_per_block=k["tokens_per_block"], trace_tasks=k.get("trace_tasks", 0))


def write_kernel(engine_dir: Path, schedule: Schedule, tokens_per_block: int, max_seq_len: int, target: str,
                 use_bulk_copy: bool) -> KernelLayout:
    """Generate, compile (cached) and write the megakernel of ``schedule`` into ``engine_dir``."""
    src, layout = generate_source(schedule, tokens_per_block, max_seq_len, use_bulk_copy)
    (engine_dir / "megakernel.cu").write_text(src)
    _, ptxas = compile_cubin(src, target, out_path=engine_dir / "megakernel.cubin")
    (engine_dir / "ptxas.txt").write_text(ptxas)
    (engine_dir / "kernel.json").write_text(json.dumps(kernel_json(schedule, layout, target), indent=1) + "\n")
    return layout


def write_manifest(engine_dir: Path) -> None:
    files = {f: _sha256(engine_dir / f) for f in MANIFEST_FILES if (engine_dir / f).exists()}
    (engine_dir / "manifest.json").write_text(json.dumps({"built": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                                          "files": files}, indent=1) + "\n")


@dataclass
class EngineDir:
    """An opened, integrity-checked engine directory."""
    path: Path
    config: dict
    schedule: Schedule
    kernel: dict
    layout: KernelLayout

    @property
    def cubin(self) -> Path:
        return self.path / "megakernel.cubin"

    @property
    def target(self) -> str:
        return self.kernel["target"]

    @classmethod
    def open(cls, path: str | Path, check_hashes: bool = True) -> "EngineDir":
        p = Path(path)
        if not p.is_dir():
            raise EngineError(f"{p}: no such engine directory; build one with "
                              "python build_scripts/build_engine.py --config <config.yaml>")
        for f in MANIFEST_FILES + ["manifest.json"]:
            if not (p / f).exists():
                raise EngineError(f"{p}: missing {f}; the engine is incomplete, rebuild it")
        try:
            manifest = json.loads((p / "manifest.json").read_text())
            config = json.loads((p / "config.json").read_text())
            kernel = json.loads((p / "kernel.json").read_text())
        except json.JSONDecodeError as e:
            raise EngineError(f"{p}: corrupted JSON ({e.msg}); rebuild the engine") from None
        if check_hashes:
            for f, digest in manifest.get("files", {}).items():
                if _sha256(p / f) != digest:
                    raise EngineError(f"{p / f}: corrupted (checksum differs from manifest.json); rebuild the engine")
        schedule = Schedule.load(p / "schedule.json")
        try:
            layout = layout_from_kernel_json(kernel)
        except KeyError as e:
            raise EngineError(f"{p / 'kernel.json'}: missing key {e}; rebuild the engine") from None
        return cls(path=p, config=config, schedule=schedule, kernel=kernel, layout=layout)
