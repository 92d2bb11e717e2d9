"""Schedule: the searched, per-SM, layer-periodic program of one decode step, as versioned JSON.

Each SM runs ``head`` (indices into graph.head), then ``layer`` (indices into the per-layer template)
once per layer, then ``tail``. Everything the code generator needs to rebuild the task graph (model
spec, batch, tile plan, context length) is stored beside the programs, so schedule.json alone
determines the kernel. Loading rejects another version or a corrupted file with a clear message.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from .errors import EngineError
from .graph import HEAD, LAYER, TAIL, StepGraph, Task, TilePlan, build_step_graph
from .model.spec import ModelSpec

SCHEDULE_VERSION = 1


@dataclass
class SMProgram:
    head: list[int] = field(default_factory=list)
    layer: list[int] = field(default_factory=list)
    tail: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"head": list(self.head), "layer": list(self.layer), "tail": list(self.tail)}


@dataclass
class Schedule:
    spec: ModelSpec
    batch: int
    plan: TilePlan
    num_sms: int
    gpu: str
    programs: list[SMProgram]
    context_len: int = 512
    mode: str = "static"
    predicted_step_us: float = 0.0
    meta: dict = field(default_factory=dict)   # search statistics, seed, naive baseline, ...

    def graph(self) -> StepGraph:
        return build_step_graph(self.spec, self.batch, self.plan, self.context_len)

    def unrolled(self, sm: int, graph: StepGraph) -> Iterator[tuple[Task, int]]:
        """(task, layer) in the order SM ``sm`` executes them; layer is -1 outside LAYER."""
        prog = self.programs[sm]
        for i in prog.head:
            yield graph.head[i], -1
        for l in range(graph.num_layers):
            for i in prog.layer:
                yield graph.layer[i], l
        for i in prog.tail:
            yield graph.tail[i], -1

    # ---------------------------------------------------------------- serialization
    def to_json(self) -> str:
        body = {
            "version": SCHEDULE_VERSION,
            "spec": self.spec.to_dict(),
            "batch": self.batch,
            "plan": self.plan.to_dict(),
            "num_sms": self.num_sms,
            "gpu": self.gpu,
            "context_len": self.context_len,
            "mode": self.mode,
            "predicted_step_us": round(self.predicted_step_us, 3),
            "meta": self.meta,
            "programs": [p.to_dict() for p in self.programs],
        }
        digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
        body["sha256"] = digest
        return json.dumps(body, indent=1, sort_keys=True) + "\n"

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def from_json(cls, text: str, where: str = "schedule.json") -> "Schedule":
        try:
            body = json.loads(text)
        except json.JSONDecodeError as e:
            raise EngineError(f"{where}: corrupted (not valid JSON: {e.msg} at line {e.lineno}); rebuild the engine")
        if not isinstance(body, dict) or "version" not in body:
            raise EngineError(f"{where}: not a trtllm_mk schedule; rebuild the engine")
        if body["version"] != SCHEDULE_VERSION:
            raise EngineError(f"{where}: schedule version {body['version']} but this trtllm_mk reads version "
                              f"{SCHEDULE_VERSION}; rebuild the engine with this version")
        digest = body.pop("sha256", None)
        if digest != hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest():
            raise EngineError(f"{where}: corrupted (checksum mismatch); rebuild the engine")
        try:
            return cls(spec=ModelSpec.from_dict(body["spec"]), batch=int(body["batch"]),
                       plan=TilePlan.from_dict(body["plan"]), num_sms=int(body["num_sms"]), gpu=body["gpu"],
                       programs=[SMProgram(**p) for p in body["programs"]],
                       context_len=int(body["context_len"]), mode=body["mode"],
                       predicted_step_us=float(body["predicted_step_us"]), meta=body.get("meta", {}))
        except (KeyError, TypeError, ValueError) as e:
            raise EngineError(f"{where}: corrupted ({type(e).__name__}: {e}); rebuild the engine") from None

    @classmethod
    def load(cls, path: str | Path) -> "Schedule":
        p = Path(path)
        if not p.exists():
            raise EngineError(f"{p}: no such file; build the engine first (python build_scripts/build_engine.py --config <config.yaml>)")
        try:
            text = p.read_text()
        except UnicodeDecodeError:
            raise EngineError(f"{p}: corrupted (not UTF-8 text); rebuild the engine") from None
        except OSError as e:
            raise EngineError(f"{p}: cannot be read ({e.strerror}); rebuild the engine") from None
        return cls.from_json(text, where=str(p))
