"""The engine directory: what the builder writes and what the runtime opens.

    config.json      resolved deployment config
    schedule.json    searched per-SM schedule (versioned, checksummed; holds the model spec)
    megakernel.cu    generated, self-contained CUDA source
    megakernel.cubin compiled for the config's GPU target
    kernel.json      launch layout for the host runtime and the TensorRT plugin; "resources": registers,
                     stack frame and spill bytes per function, as ptxas reported them
    ptxas.txt        ptxas's report itself (registers / shared memory / spills of the compiled kernel)
    report.json, report.md, gantt.png   predicted latency, smem, naive vs searched, search statistics
    checkpoint.json  the checkpoint the engine was built from (path and fingerprint), or none
    manifest.json    sha256 of every file above (checked by `verify` and on open)
"""
from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

from . import seam
from .codegen import KERNEL_NAME, KernelLayout, arch_sm, compile_cubin, cubin_sm, generate_source
from .codegen.ptxas import PtxasReport, parse_ptxas
from .errors import EngineError, UserError, read_json_object
from .gpus import get_gpu
from .model.spec import ModelSpec
from .schedule import Schedule

# schedule.meta of a tensor-parallel engine: the whole model's spec (the schedule's is one rank's share)
TP_MODEL_KEY = "tensor_parallel_model"

MANIFEST_FILES = ["config.json", "schedule.json", "megakernel.cu", "megakernel.cubin", "kernel.json", "checkpoint.json"]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def kernel_json(schedule: Schedule, layout: KernelLayout, target: str, resources: dict | None = None) -> dict:
    """Launch layout + dimensions: everything a host (Python runtime, TensorRT plugin) needs, and the
    kernel's registers and spills (``resources``, KernelBuild.resources)."""
    g = schedule.graph()
    d = g.dims
    return {
        "kernel": KERNEL_NAME, "grid": layout.grid, "block": layout.block, "smem_bytes": layout.smem_bytes,
        "num_counters": layout.num_counters, "n_lm_tiles": layout.n_lm_tiles, "history_len": layout.history_len,
        "tokens_per_block": layout.tokens_per_block, "trace_tasks": layout.trace_tasks, "batch": schedule.batch,
        "attn_splits": schedule.plan.attn_splits,
        "event_offsets": layout.event_offsets, "target": target,
        "qk_norm": schedule.spec.qk_norm, "qkv_bias": schedule.spec.qkv_bias,
        "weight_bits": schedule.spec.weight_bits, "weight_group": schedule.spec.weight_group,
        **({"tensor_parallel": layout.tensor_parallel} if layout.tensor_parallel > 1 else {}),
        **({"experts": d.experts, "experts_per_token": d.experts_per_token} if d.experts else {}),
        "dims": seam.kernel_dims_json(d),   # keys: seam.KERNEL_DIMS (the TensorRT plugin reads them)
        "params": seam.params_layout_json(),
        **({"resources": resources} if resources is not None else {}),
    }


def layout_from_kernel_json(k: dict) -> KernelLayout:
    return KernelLayout(grid=k["grid"], block=k["block"], smem_bytes=k["smem_bytes"],
                        event_offsets=dict(k["event_offsets"]), num_counters=k["num_counters"],
                        n_lm_tiles=k["n_lm_tiles"], history_len=k["history_len"],
                        tokens_per_block=k["tokens_per_block"], trace_tasks=k.get("trace_tasks", 0),
                        tensor_parallel=k.get("tensor_parallel", 1))


_KIND_TEMPLATE = re.compile(r"^(run_task|prefetch_next_step)<(\d+)>$")


def kernel_function_name(readable: str) -> str:
    """The megakernel's functions templated on a task kind, named by the kind: ``run_task<3>`` ->
    ``run_task<COMBINE>`` (the template argument is the kind's number, kinds/__init__.py)."""
    from .graph.tasks import Kind
    m = _KIND_TEMPLATE.match(readable)
    if m is None:
        return readable
    try:
        return f"{m.group(1)}<{Kind(int(m.group(2))).name}>"
    except ValueError:
        return readable


@dataclass
class KernelBuild:
    """The compiled megakernel of one schedule: its source, launch layout, cached cubin and ptxas's
    report (parsed in ``ptxas``)."""
    source: str
    layout: KernelLayout
    cubin: Path
    ptxas_text: str
    target: str

    @property
    def ptxas(self) -> PtxasReport:
        return parse_ptxas(self.ptxas_text)

    @property
    def spills(self) -> bool:
        return bool(self.ptxas.spilling)

    def describe_spills(self) -> str:
        return self.ptxas.describe_spills(kernel_function_name)

    @property
    def resources(self) -> dict:
        return self.ptxas.to_dict(kernel_function_name)


def compile_kernel(schedule: Schedule, tokens_per_block: int, max_seq_len: int, target: str,
                   use_bulk_copy: bool) -> KernelBuild:
    """Generate and compile (cached) the megakernel of ``schedule``."""
    src, layout = generate_source(schedule, tokens_per_block, max_seq_len, use_bulk_copy)
    cubin, ptxas = compile_cubin(src, target)
    return KernelBuild(source=src, layout=layout, cubin=cubin, ptxas_text=ptxas, target=target)


def write_kernel(engine_dir: Path, schedule: Schedule, kernel: KernelBuild) -> KernelLayout:
    """Write the compiled megakernel of ``schedule`` (source, cubin, ptxas report, launch layout)
    into ``engine_dir``."""
    (engine_dir / "megakernel.cu").write_text(kernel.source)
    (engine_dir / "megakernel.cubin").write_bytes(kernel.cubin.read_bytes())
    (engine_dir / "ptxas.txt").write_text(kernel.ptxas_text)
    (engine_dir / "kernel.json").write_text(
        json.dumps(kernel_json(schedule, kernel.layout, kernel.target, kernel.resources), indent=1) + "\n")
    return kernel.layout


def checkpoint_record(checkpoint_dir: Path | None) -> dict | None:
    """The checkpoint's path and fingerprint, or None when the model was named by architecture only
    (then the runtime needs --weights)."""
    from .model.consistency import fingerprint
    return fingerprint(checkpoint_dir) if checkpoint_dir is not None else None


def write_checkpoint_record(engine_dir: Path, record: dict | None) -> None:
    """checkpoint.json: ``checkpoint_record``'s, taken when the build began."""
    (engine_dir / "checkpoint.json").write_text(json.dumps({"checkpoint": record}, indent=1) + "\n")


def write_manifest(engine_dir: Path) -> None:
    from .engine_target import ENGINE_FORMAT
    files = {f: _sha256(engine_dir / f) for f in MANIFEST_FILES if (engine_dir / f).exists()}
    (engine_dir / "manifest.json").write_text(json.dumps({"format": ENGINE_FORMAT,
                                                          "built": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                                          "files": files}, indent=1) + "\n")


def _check_consistency(eng: "EngineDir") -> None:
    """The config, the schedule and the cubin describe one deployment: the same GPU, model and batch,
    and machine code for that GPU (a re-signed manifest does not make a foreign cubin pass)."""
    cfg, sched = eng.config, eng.schedule
    try:
        gpu = get_gpu(str(cfg["gpu"]))
        batch = int(cfg["max_batch_size"])
    except (KeyError, TypeError, ValueError, UserError):
        raise EngineError(f"{eng.path / 'config.json'}: no valid gpu / max_batch_size; rebuild the engine") from None
    if gpu.name != sched.gpu:
        raise EngineError(f"{eng.path}: config.json names GPU {gpu.name} but the schedule was searched for "
                          f"{sched.gpu}; rebuild the engine")
    if batch != sched.batch:
        raise EngineError(f"{eng.path}: config.json has max_batch_size {batch} but the schedule decodes batch "
                          f"{sched.batch}; rebuild the engine")
    tp = cfg.get("tensor_parallel_size", 1)
    if tp != sched.spec.tensor_parallel or (tp > 1 and TP_MODEL_KEY not in sched.meta):
        raise EngineError(f"{eng.path}: config.json has tensor_parallel_size {tp} but the schedule is one rank's of "
                          f"{sched.spec.tensor_parallel}; rebuild the engine")
    if eng.target != gpu.nvcc_arch:
        raise EngineError(f"{eng.path}: kernel.json targets {eng.target} but {gpu.name} needs {gpu.nvcc_arch}; "
                          "rebuild the engine")
    sm = cubin_sm(eng.cubin)
    if sm != arch_sm(gpu.nvcc_arch):
        raise EngineError(f"{eng.cubin}: machine code for sm_{sm}, but the engine's GPU {gpu.name} is "
                          f"{gpu.nvcc_arch}; rebuild the engine")



@dataclass
class EngineDir:
    """An opened, integrity-checked engine directory."""
    path: Path
    config: dict
    schedule: Schedule
    kernel: dict
    layout: KernelLayout
    checkpoint: dict | None = None     # checkpoint.json's record: {path, config_sha256, tensors_sha256}

    @property
    def cubin(self) -> Path:
        return self.path / "megakernel.cubin"

    @property
    def model_spec(self) -> ModelSpec:
        """The whole model. The schedule's spec is one rank's share of it when the engine is
        tensor-parallel (every rank runs the same schedule and kernel on its own shard)."""
        if self.schedule.spec.tensor_parallel == 1:
            return self.schedule.spec
        return ModelSpec.from_dict(self.schedule.meta[TP_MODEL_KEY])

    @property
    def target(self) -> str:
        return self.kernel["target"]

    @classmethod
    def open(cls, path: str | Path, check_hashes: bool = True) -> "EngineDir":
        p = Path(path)
        if not p.is_dir():
            raise EngineError(f"{p}: no such engine directory; build one with "
                              "python build_scripts/build_engine.py --config <config.yaml>")
        if not (p / "schedule.json").exists() and (p / "config.json").is_file() and any(p.glob("*.safetensors*")):
            raise EngineError(f"{p}: is a model checkpoint, not an engine; build an engine from it with "
                              "python -m trtllm_mk build --config <config.yaml> (model: this folder)")
        for f in MANIFEST_FILES + ["manifest.json"]:
            if not (p / f).is_file():
                raise EngineError(f"{p}: missing {f} (or not a file); the engine is incomplete, rebuild it")
        manifest, config, kernel, record = (read_json_object(p / f, EngineError, "rebuild the engine")
                                            for f in ("manifest.json", "config.json", "kernel.json", "checkpoint.json"))
        checkpoint = record.get("checkpoint")
        if checkpoint is not None and not (isinstance(checkpoint, dict) and all(
                isinstance(checkpoint.get(k), str) for k in ("path", "config_sha256", "tensors_sha256"))):
            raise EngineError(f"{p / 'checkpoint.json'}: malformed checkpoint record; rebuild the engine")
        if not isinstance(manifest.get("files"), dict):
            raise EngineError(f"{p / 'manifest.json'}: no file list (corrupted); rebuild the engine")
        for f in MANIFEST_FILES:
            digest = manifest["files"].get(f)
            if not isinstance(digest, str):
                raise EngineError(f"{p / 'manifest.json'}: does not cover {f} (corrupted); rebuild the engine")
            try:
                actual = _sha256(p / f) if check_hashes else digest
            except OSError as e:
                raise EngineError(f"{p / f}: cannot be read ({e.strerror}); rebuild the engine") from None
            if actual != digest:
                raise EngineError(f"{p / f}: corrupted (checksum differs from manifest.json); rebuild the engine")
        schedule = Schedule.load(p / "schedule.json")
        try:
            layout = layout_from_kernel_json(kernel)
        except KeyError as e:
            raise EngineError(f"{p / 'kernel.json'}: missing key {e}; rebuild the engine") from None
        except (TypeError, ValueError, AttributeError):
            raise EngineError(f"{p / 'kernel.json'}: malformed launch layout; rebuild the engine") from None
        eng = cls(path=p, config=config, schedule=schedule, kernel=kernel, layout=layout, checkpoint=checkpoint)
        _check_consistency(eng)
        return eng
