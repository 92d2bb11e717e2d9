"""End to end on the CPU: build an engine for the tiny config, decode with `run --simulate` (the
CPU task-graph executor over the searched schedule) and compare with the reference decoder; then
every user mistake around engines ends as one stderr line and exit code 2."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trtllm_mk.config import load_config, with_overrides
from trtllm_mk.kv_cache import PagedKVCache
from trtllm_mk.model.checkpoint import load_checkpoint
from trtllm_mk.model.tiny import write_tiny_checkpoint
from trtllm_mk.reference import ReferenceDecoder

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from trtllm_mk.build import build_engine
    out = tmp_path_factory.mktemp("eng") / "tiny"
    cfg = with_overrides(load_config(ROOT / "configs" / "tiny_cpu.yaml"), {"megakernel": {"search_budget_s": 2.0}})
    build_engine(cfg, out, show_progress=False)
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    write_tiny_checkpoint(d, family="llama", seed=7)
    return d


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "trtllm_mk", *args], capture_output=True, text=True, cwd=cwd)


def test_run_simulate_matches_reference_decoder(engine, checkpoint):
    prompt = [3, 141, 59, 26, 5, 358, 97, 93, 238, 46]
    r = cli("run", "--engine", str(engine), "--weights", str(checkpoint), "--prompt", " ".join(map(str, prompt)),
            "--max-new-tokens", "12", "--simulate")
    assert r.returncode == 0, r.stderr
    got = [int(t) for t in r.stdout.splitlines()[0].split("] ", 1)[1].split()]
    spec = json.loads((engine / "schedule.json").read_text())["spec"]
    from trtllm_mk.model.spec import ModelSpec
    spec = ModelSpec.from_dict(spec)
    w = {k: v.float() for k, v in load_checkpoint(checkpoint, spec).items()}
    ref = ReferenceDecoder(spec, w, compute_dtype=torch.float32)
    cache = PagedKVCache.allocate(spec, 1, 128, 32, dtype=torch.float32)
    want = ref.generate([prompt], 12, cache=cache, eos_ids=())[0]
    assert got == want
    assert "TTFT" in r.stdout and "TPOT" in r.stdout


def test_verify_accepts_a_fresh_engine(engine):
    r = cli("verify", "--engine", str(engine))
    assert r.returncode == 0, r.stderr
    assert "schedule valid" in r.stdout


def _one_line_error(r, *needles):
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_missing_engine_directory(tmp_path):
    _one_line_error(cli("verify", "--engine", str(tmp_path / "nope")), "no such engine directory")


@pytest.mark.parametrize("victim", ["schedule.json", "megakernel.cubin"])
def test_corrupted_engine_files_are_refused(engine, tmp_path, victim):
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(engine, bad)
    data = bytearray((bad / victim).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (bad / victim).write_bytes(bytes(data))
    _one_line_error(cli("verify", "--engine", str(bad)), victim, "corrupted")
    _one_line_error(cli("run", "--engine", str(bad), "--prompt", "1 2", "--simulate"), victim)


def test_prompt_longer_than_max_input_len(engine):
    cfg = json.loads((engine / "config.json").read_text())
    too_long = " ".join(["1"] * (cfg["max_input_len"] + 1))
    r = cli("run", "--engine", str(engine), "--weights", "random", "--prompt", too_long, "--simulate")
    _one_line_error(r, "max_input_len")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without a GPU")
def test_gpu_run_without_gpu_says_simulate(engine):
    _one_line_error(cli("run", "--engine", str(engine), "--weights", "random", "--prompt", "1 2"), "--simulate")


def test_unknown_command():
    r = cli("frobnicate")
    assert r.returncode == 2 and "unknown command" in r.stderr
