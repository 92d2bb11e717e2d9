"""build_scripts/build_engine.py: summary of a valid config, overrides, and one-line errors (exit 2)."""
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trtllm_mk.config import load_config
from trtllm_mk.deployment import describe, resolve_prefill_backend
from trtllm_mk.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "build_scripts" / "build_engine.py"
TINY = ROOT / "configs" / "tiny_cpu.yaml"


def load_script():
    spec = importlib.util.spec_from_file_location("build_engine", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def build_engine():
    return load_script()


def run_script(*args, cwd):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def test_summary_of_the_default_config(build_engine, capsys):
    assert build_engine.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Deployment l20_bs1")
    for fact in (r"qwen3 \(QK-norm\)", r"GPU L20", r"sm_89", r"cp\.async \(no TMA\)", r"max_input_len +2048",
                 r"KV cache +0\.60 GB  \(4096 tokens x 147456 B\)", r"KV cache may take +28\.25 GB",
                 r"decode floor +19\.47 ms per token"):
        assert re.search(fact, out), fact


def test_overrides_reach_the_config(build_engine, capsys, tmp_path):
    argv = ["--config", str(TINY), "--output-dir", str(tmp_path / "e"), "--seed", "5", "--budget", "2.5"]
    args = build_engine.parse_args(argv)
    cfg = build_engine.config_from_args(args)
    assert (cfg.megakernel.output_dir, cfg.megakernel.seed, cfg.megakernel.search_budget_s) == (tmp_path / "e", 5, 2.5)
    assert build_engine.main(argv) == 0
    assert "search budget 2.5 s, seed 5" in capsys.readouterr().out


def test_bad_override_names_the_key(build_engine):
    with pytest.raises(ConfigError, match=r"with command-line overrides: megakernel\.search_budget_s: 0 must be > 0"):
        build_engine.main(["--config", str(TINY), "--budget", "0"])


def test_describe_reports_tied_lm_head_and_tma():
    out = describe(load_config(TINY))
    assert "512 (tied to the embedding)" in out and "TMA bulk copies" in out and "sm_90a" in out
    assert re.search(r"prefill backend +torch  \(as configured\)", out)


def test_auto_prefill_resolves_to_tensorrt_llm_only_where_installed(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "tensorrt_llm" else real(n, *a))
    assert resolve_prefill_backend("auto")[0] == "torch"
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "tensorrt_llm" else real(n, *a))
    assert resolve_prefill_backend("auto")[0] == "tensorrt_llm"
    assert resolve_prefill_backend("torch") == ("torch", "as configured")


def test_script_runs_from_any_directory(tmp_path):
    r = run_script("--config", str(TINY), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Deployment tiny_cpu") and "decode floor" in r.stdout


def test_bad_config_exits_2_with_one_stderr_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(TINY.read_text().replace("tokens_per_block: 32", "tokens_per_block: 24"))
    r = run_script("--config", "bad.yaml", cwd=tmp_path)
    assert r.returncode == 2
    assert r.stdout == ""
    assert r.stderr == ("error: bad.yaml: kv_cache_config.tokens_per_block: 24 is not a power of two "
                        "(use 16, 32 or 64)\n")
