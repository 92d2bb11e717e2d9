"""The regression gate on synthetic predicted and measured reports."""
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # benchmarks/ is a top-level directory, not part of the installed package

from benchmarks import regress  # noqa: E402

SHIPPED = {"llama-3.2-1b/b1/ctx512": 900.0, "llama-3.1-8b/b1/ctx512": 5600.0, "qwen3-8b/b4/ctx2048": 6100.0}


def _write(path: Path, obj) -> Path:
    path.write_text(json.dumps(obj))
    return path


def _cli(*args) -> int:
    """Run the CLI as a user would: exit code via run_cli."""
    with pytest.raises(SystemExit) as e:
        regress.run_cli(lambda: regress.main([str(a) for a in args]))
    return e.value.code


@pytest.fixture
def baseline(tmp_path):
    """A predicted baseline for H100-SXM recorded through the 'update' command."""
    rep = _write(tmp_path / "base_report.json", regress.predicted_report(SHIPPED, "H100-SXM"))
    path = tmp_path / "H100-SXM.json"
    assert _cli("update", rep, "--baseline", path) == 0
    return path


def _predicted(tmp_path, changes: dict[str, float], drop=()) -> Path:
    vals = {k: v * (1 + changes.get(k, 0.0)) for k, v in SHIPPED.items() if k not in drop}
    return _write(tmp_path / "new.json", regress.predicted_report(vals, "H100-SXM"))


def test_unchanged_and_within_tolerance_pass(tmp_path, baseline, capsys):
    assert _cli("check", _predicted(tmp_path, {}), "--baseline", baseline) == 0
    assert _cli("check", _predicted(tmp_path, {"qwen3-8b/b4/ctx2048": 0.049}), "--baseline", baseline) == 0
    assert "3 metrics compared" in capsys.readouterr().out


def test_regression_is_named_with_its_size(tmp_path, baseline, capsys):
    new = _predicted(tmp_path, {"llama-3.1-8b/b1/ctx512": 0.10, "llama-3.2-1b/b1/ctx512": -0.20})
    assert _cli("check", new, "--baseline", baseline) == 1
    out = capsys.readouterr().out
    assert "REGRESSED  llama-3.1-8b/b1/ctx512 predicted_step_us: 5600 -> 6160 (+10.0%)" in out
    assert "improved   llama-3.2-1b/b1/ctx512" in out and "1 regressed, 1 improved" in out
    # the same change passes under a looser tolerance
    assert _cli("check", new, "--baseline", baseline, "--tolerance", "0.15") == 0


def test_missing_config_fails_unless_allowed(tmp_path, baseline, capsys):
    new = _predicted(tmp_path, {}, drop=["qwen3-8b/b4/ctx2048"])
    assert _cli("check", new, "--baseline", baseline) == 1
    assert "MISSING    qwen3-8b/b4/ctx2048" in capsys.readouterr().out
    assert _cli("check", new, "--baseline", baseline, "--allow-missing") == 0


def test_baseline_is_found_by_gpu_name(tmp_path, monkeypatch):
    monkeypatch.setattr(regress, "BASELINE_DIR", tmp_path / "baselines")
    rep = _write(tmp_path / "r.json", regress.predicted_report(SHIPPED, "L20"))
    assert _cli("update", rep) == 0
    assert (tmp_path / "baselines" / "L20.json").is_file()
    assert _cli("check", rep) == 0


def test_predicted_report_from_engine_reports(tmp_path, capsys):
    for i, (model, batch, ctx, us) in enumerate([("llama-3.2-1b", 1, 512, 812.5), ("qwen3-8b", 4, 2048, 6000.0)]):
        d = tmp_path / f"engine{i}"
        d.mkdir()
        _write(d / "report.json", {"model": model, "batch": batch, "context_len": ctx, "gpu": "L20",
                                   "predicted_step_us": us, "floor_us": 1.0})
    out = tmp_path / "predicted.json"
    assert _cli("predicted", tmp_path / "engine0", tmp_path / "engine1", "-o", out) == 0
    rep = json.loads(out.read_text())
    assert rep["gpu"] == "L20" and rep["configs"] == {"llama-3.2-1b/b1/ctx512": {"predicted_step_us": 812.5},
                                                      "qwen3-8b/b4/ctx2048": {"predicted_step_us": 6000.0}}
    # engines of two GPUs cannot share a predicted report
    _write(tmp_path / "engine1" / "report.json", {"model": "qwen3-8b", "batch": 4, "context_len": 2048,
                                                  "gpu": "H200", "predicted_step_us": 1.0})
    assert _cli("predicted", tmp_path / "engine0", tmp_path / "engine1", "-o", out) == 2
    assert "several GPUs" in capsys.readouterr().err


def test_predicted_report_rejects_duplicates():
    eng = {"model": "m", "batch": 1, "context_len": 8, "predicted_step_us": 1.0}
    with pytest.raises(regress.RegressInputError, match="twice"):
        regress.predicted_report([eng, eng], "H100-SXM")


def _measured(p50: dict[str, float | None], ttft=50.0) -> dict:
    systems = {name: ({"status": "ok", "tpot_ms": {"p50": v, "p90": v * 1.1}} if v is not None
                      else {"status": "error", "error": "RuntimeError: boom"}) for name, v in p50.items()}
    return {"schema": regress.MEASURED_SCHEMA, "gpu": "H100-SXM", "configs": [
        {"name": "llama-3.2-1b/b1/ctx512", "ttft_ms": ttft, "systems": systems}]}


def test_measured_report_metrics_and_failed_system(tmp_path, capsys):
    kind, gpu, m = regress.metrics_of(_measured({"torch.compile": 1.41, "trtllm_mk megakernel": 0.9}))
    assert (kind, gpu) == ("measured", "H100-SXM")
    assert m == {"llama-3.2-1b/b1/ctx512": {"ttft_ms": 50.0, "torch.compile.tpot_p50_ms": 1.41,
                                            "trtllm_mk megakernel.tpot_p50_ms": 0.9}}
    base = tmp_path / "H100-SXM.json"
    assert _cli("update", _write(tmp_path / "m0.json", _measured({"trtllm_mk megakernel": 0.9})),
                "--baseline", base) == 0
    slower = _write(tmp_path / "m1.json", _measured({"trtllm_mk megakernel": 0.99}))
    assert _cli("check", slower, "--baseline", base) == 1
    assert "trtllm_mk megakernel.tpot_p50_ms: 0.9 -> 0.99 (+10.0%)" in capsys.readouterr().out
    failed = _write(tmp_path / "m2.json", _measured({"trtllm_mk megakernel": None}))  # the system errored
    assert _cli("check", failed, "--baseline", base) == 1
    # the predicted section of the same file is untouched by measured updates, and vice versa
    assert _cli("update", _predicted(tmp_path, {}), "--baseline", base) == 0
    b = json.loads(base.read_text())
    assert set(b) == {"schema", "gpu", "measured", "predicted"}


@pytest.mark.parametrize("problem", ["no report", "corrupt report", "unknown schema", "no baseline",
                                     "corrupt baseline", "other gpu", "no section"])
def test_bad_inputs_exit_2_with_one_line(tmp_path, baseline, capsys, problem):
    report = _predicted(tmp_path, {})
    base = baseline
    if problem == "no report":
        report = tmp_path / "absent.json"
    elif problem == "corrupt report":
        report.write_text('{"schema": ')
    elif problem == "unknown schema":
        _write(report, {"schema": "something/9", "gpu": "H100-SXM"})
    elif problem == "no baseline":
        base = tmp_path / "absent_baseline.json"
    elif problem == "corrupt baseline":
        base.write_text("[1, 2")
    elif problem == "other gpu":
        _write(report, regress.predicted_report(SHIPPED, "H200"))
    elif problem == "no section":
        report = _write(tmp_path / "m.json", _measured({"torch.compile": 1.0}))
    assert _cli("check", report, "--baseline", base) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
