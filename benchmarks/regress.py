"""Regression gate: compare a report with the stored baselines of its GPU.

    python -m benchmarks.regress check REPORT [--baseline FILE] [--tolerance 0.05] [--allow-missing]
    python -m benchmarks.regress update REPORT [--baseline FILE]      # record REPORT as the baseline
    python -m benchmarks.regress predicted ENGINE_DIR... -o predicted.json [--gpu NAME]

Exit codes of ``check``: 0 no regression, 1 regression (each named, with how much it grew),
2 a missing or corrupt file (one line).

Two kinds of report, both reduced to ``{config name: {metric: value}}`` (all metrics: lower is better):
  predicted  ``{"schema": PREDICTED_SCHEMA, "kind": "predicted", "gpu": ..., "configs":
             {name: {"predicted_step_us": x}}}``, made by ``predicted_report`` from engine reports
             (deterministic from the search: the CI gate for every shipped config, GPU or not);
  measured   decode_latency's report.json: per config ``ttft_ms`` and ``<system>.tpot_p50_ms``.
Config names are ``<model>/b<batch>/ctx<context_len>`` (``config_name``).

Baselines live in ``benchmarks/baselines/<gpu>.json``, one file per GPU catalog name, with one
section per kind: ``{"schema": BASELINE_SCHEMA, "gpu": ..., "predicted": {...}, "measured": {...}}``.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from trtllm_mk.errors import UserError, run_cli

BASELINE_SCHEMA = "trtllm_mk.baseline/1"
PREDICTED_SCHEMA = "trtllm_mk.predicted/1"
MEASURED_SCHEMA = "trtllm_mk.decode_latency/1"
BASELINE_DIR = Path(__file__).resolve().parent / "baselines"
DEFAULT_TOLERANCE = 0.05

Metrics = dict[str, dict[str, float]]  # config name -> metric -> value


class RegressInputError(UserError):
    """A report or baseline file that is missing, unreadable or not of the expected shape."""


def config_name(model: str, batch: int, context_len: int) -> str:
    return f"{model}/b{batch}/ctx{context_len}"


# ---------------------------------------------------------------------------------------------
# Predicted reports (from the engine builder)
# ---------------------------------------------------------------------------------------------


def predicted_entry(engine_report: Mapping[str, Any]) -> tuple[str, float]:
    """(config name, predicted_step_us) of one engine report.json (model, batch, context_len,
    predicted_step_us as written by trtllm_mk.report)."""
    try:
        name = config_name(engine_report["model"], int(engine_report["batch"]), int(engine_report["context_len"]))
        return name, float(engine_report["predicted_step_us"])
    except (KeyError, TypeError, ValueError) as e:
        raise RegressInputError(f"engine report lacks model/batch/context_len/predicted_step_us ({e})") from None


def predicted_report(entries: Mapping[str, float] | Iterable[Mapping[str, Any]], gpu: str) -> dict[str, Any]:
    """A predicted report for ``gpu`` from either {config name: predicted_step_us} or engine reports."""
    pairs = entries.items() if isinstance(entries, Mapping) else (predicted_entry(r) for r in entries)
    configs: dict[str, dict[str, float]] = {}
    for name, us in pairs:
        if name in configs:
            raise RegressInputError(f"predicted report: config '{name}' appears twice")
        configs[name] = {"predicted_step_us": float(us)}
    return {"schema": PREDICTED_SCHEMA, "kind": "predicted", "gpu": gpu, "configs": dict(sorted(configs.items()))}


def predicted_report_from_engines(engine_dirs: Iterable[str | Path], gpu: str | None = None) -> dict[str, Any]:
    """Read ``report.json`` of each engine directory; all must be for one GPU (``gpu`` if given)."""
    reports = [load_json(Path(d) / "report.json") for d in engine_dirs]
    gpus = {r.get("gpu") for r in reports}
    if gpu is None:
        if len(gpus) != 1:
            raise RegressInputError(f"engines are for several GPUs ({', '.join(map(str, gpus))}); "
                                    "make one predicted report per GPU")
        gpu = gpus.pop()
    elif gpus - {gpu}:
        raise RegressInputError(f"--gpu {gpu}: some engines are for {', '.join(map(str, gpus - {gpu}))}")
    return predicted_report(reports, str(gpu))


# ---------------------------------------------------------------------------------------------
# Reading reports and baselines
# ---------------------------------------------------------------------------------------------


def load_json(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise RegressInputError(f"{p}: no such file")
    try:
        d = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RegressInputError(f"{p}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise RegressInputError(f"{p}: expected a JSON object")
    return d


def metrics_of(report: Mapping[str, Any], where: str = "report") -> tuple[str, str, Metrics]:
    """(kind, gpu, metrics) of a predicted or measured report."""
    schema, gpu = report.get("schema"), report.get("gpu")
    if not isinstance(gpu, str) or not gpu:
        raise RegressInputError(f"{where}: no 'gpu' name")
    try:
        if schema == PREDICTED_SCHEMA:
            return "predicted", gpu, {n: {"predicted_step_us": float(m["predicted_step_us"])}
                                      for n, m in report["configs"].items()}
        if schema == MEASURED_SCHEMA:
            out: Metrics = {}
            for c in report["configs"]:
                m = out.setdefault(c["name"], {})
                if c.get("ttft_ms") is not None:
                    m["ttft_ms"] = float(c["ttft_ms"])
                for system, r in c["systems"].items():
                    if r.get("status") == "ok":
                        m[f"{system}.tpot_p50_ms"] = float(r["tpot_ms"]["p50"])
            return "measured", gpu, out
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise RegressInputError(f"{where}: malformed {schema} report ({type(e).__name__}: {e})") from None
    raise RegressInputError(f"{where}: unknown schema {schema!r} (expected {PREDICTED_SCHEMA} or {MEASURED_SCHEMA})")


def baseline_path(gpu: str, directory: Path | None = None) -> Path:
    return (directory or BASELINE_DIR) / f"{gpu}.json"


def load_baseline(path: Path, kind: str, gpu: str) -> Metrics:
    b = load_json(path)
    if b.get("schema") != BASELINE_SCHEMA:
        raise RegressInputError(f"{path}: not a baseline file (schema {b.get('schema')!r}, expected {BASELINE_SCHEMA})")
    if b.get("gpu") != gpu:
        raise RegressInputError(f"{path}: baselines for GPU {b.get('gpu')!r}, but the report is for {gpu!r}")
    section = b.get(kind)
    if not isinstance(section, dict) or not section:
        raise RegressInputError(f"{path}: no {kind} baselines; record some with "
                                f"'python -m benchmarks.regress update REPORT'")
    try:
        return {n: {k: float(v) for k, v in m.items()} for n, m in section.items()}
    except (AttributeError, TypeError, ValueError) as e:
        raise RegressInputError(f"{path}: malformed {kind} section ({e})") from None


def update_baseline(path: Path, kind: str, gpu: str, metrics: Metrics) -> None:
    """Merge ``metrics`` into the ``kind`` section of the baseline file (created if absent)."""
    b = load_json(path) if path.exists() else {"schema": BASELINE_SCHEMA, "gpu": gpu}
    if b.get("schema") != BASELINE_SCHEMA or b.get("gpu") != gpu:
        raise RegressInputError(f"{path}: not the baseline file of GPU {gpu}; refusing to overwrite it")
    section = b.setdefault(kind, {})
    for name, m in metrics.items():
        section.setdefault(name, {}).update(m)
    b[kind] = dict(sorted(section.items()))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(b, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------------------------


@dataclass
class Comparison:
    tolerance: float
    regressions: list[str] = field(default_factory=list)
    improvements: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)   # in the baseline, absent from the report
    compared: int = 0

    def failed(self, allow_missing: bool = False) -> bool:
        return bool(self.regressions or (self.missing and not allow_missing))


def compare(baseline: Metrics, current: Metrics, tolerance: float = DEFAULT_TOLERANCE) -> Comparison:
    """Every baseline metric against the report: worse than ``baseline * (1 + tolerance)`` regresses.
    Metrics only in the report are new and pass."""
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0 (got {tolerance})")
    c = Comparison(tolerance)
    for name in sorted(baseline):
        for metric, base in sorted(baseline[name].items()):
            new = current.get(name, {}).get(metric)
            if new is None:
                c.missing.append(f"{name} {metric}: in the baseline ({base:g}) but not in the report")
                continue
            c.compared += 1
            change = (new - base) / base if base > 0 else (0.0 if new == base else float("inf"))
            line = f"{name} {metric}: {base:g} -> {new:g} ({change:+.1%})"
            if change > tolerance:
                c.regressions.append(line)
            elif change < -tolerance:
                c.improvements.append(line)
    return c


def check(report_path: Path, baseline: Path | None = None, tolerance: float = DEFAULT_TOLERANCE,
          allow_missing: bool = False, out=print) -> int:
    kind, gpu, current = metrics_of(load_json(report_path), str(report_path))
    path = baseline or baseline_path(gpu)
    if not path.exists():
        raise RegressInputError(f"{path}: no baselines for GPU {gpu}; record them with "
                                f"'python -m benchmarks.regress update {report_path}'")
    c = compare(load_baseline(path, kind, gpu), current, tolerance)
    for line in c.improvements:
        out(f"improved   {line}")
    for line in c.missing:
        out(f"{'skipped' if allow_missing else 'MISSING':<10} {line}")
    for line in c.regressions:
        out(f"REGRESSED  {line}")
    verdict = "FAIL" if c.failed(allow_missing) else "ok"
    out(f"{verdict}: {kind} {gpu}: {c.compared} metrics compared with {path} (tolerance {tolerance:.0%}): "
        f"{len(c.regressions)} regressed, {len(c.improvements)} improved, {len(c.missing)} missing")
    return 1 if c.failed(allow_missing) else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.regress", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    pc = sub.add_parser("check", help="compare REPORT with its GPU's baselines")
    pc.add_argument("report", type=Path)
    pc.add_argument("--baseline", type=Path, help="baseline file (default: benchmarks/baselines/<gpu>.json)")
    pc.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE, help="allowed relative increase")
    pc.add_argument("--allow-missing", action="store_true",
                    help="only compare what the report has (e.g. a measured run over a subset of configs)")
    pu = sub.add_parser("update", help="record REPORT's numbers as the baseline of its GPU")
    pu.add_argument("report", type=Path)
    pu.add_argument("--baseline", type=Path)
    pp = sub.add_parser("predicted", help="make a predicted report from engine directories")
    pp.add_argument("engines", nargs="+", type=Path)
    pp.add_argument("-o", "--out", type=Path, required=True)
    pp.add_argument("--gpu", help="GPU the engines were built for (default: from their reports)")
    a = ap.parse_args(argv)
    if a.cmd == "check":
        if a.tolerance < 0:
            raise UserError(f"--tolerance {a.tolerance}: must be >= 0")
        return check(a.report, a.baseline, a.tolerance, a.allow_missing)
    if a.cmd == "update":
        kind, gpu, metrics = metrics_of(load_json(a.report), str(a.report))
        path = a.baseline or baseline_path(gpu)
        update_baseline(path, kind, gpu, metrics)
        print(f"recorded {sum(map(len, metrics.values()))} {kind} metrics of {len(metrics)} configs in {path}")
        return 0
    rep = predicted_report_from_engines(a.engines, a.gpu)
    a.out.write_text(json.dumps(rep, indent=2) + "\n")
    print(f"wrote {a.out} ({len(rep['configs'])} configs, {rep['gpu']})")
    return 0


if __name__ == "__main__":
    run_cli(main)
