"""Builds never destroy what they did not make, engines never decode with the wrong weights silently,
and an engine whose files disagree is refused: each case of the kind a user met once, as a test."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trtllm_mk.build import build_engine
from trtllm_mk.config import load_config, with_overrides
from trtllm_mk.engine import EngineDir, write_manifest
from trtllm_mk.engine_target import EngineTarget, is_engine_dir
from trtllm_mk.errors import EngineError, ModelError, UserError
from trtllm_mk.model.tiny import write_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_cpu.yaml"


def _cfg(**mk):
    return with_overrides(load_config(TINY), {"megakernel": {"search_budget_s": 1.0, **mk}})


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("built") / "tiny"
    build_engine(_cfg(), out, show_progress=False)
    return out


def _snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------ safe engine directories
def test_a_folder_of_user_files_is_refused_and_kept(tmp_path):
    user = tmp_path / "my_project"
    user.mkdir()
    (user / "notes.txt").write_text("precious")
    with pytest.raises(EngineError, match="not an engine"):
        build_engine(_cfg(), user, show_progress=False)
    assert (user / "notes.txt").read_text() == "precious" and sorted(os.listdir(tmp_path)) == ["my_project"]


def test_a_folder_of_engines_is_refused(tmp_path, built):
    engines = tmp_path / "engines"
    shutil.copytree(built, engines / "a")
    shutil.copytree(built, engines / "b")
    before = _snapshot(engines)
    with pytest.raises(EngineError, match="not an engine"):
        build_engine(_cfg(), engines, show_progress=False)
    assert _snapshot(engines) == before


def test_the_current_folder_and_its_parents_are_refused(tmp_path, monkeypatch):
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    (tmp_path / "a" / "keep.txt").write_text("x")
    monkeypatch.chdir(work)
    for target in (".", "..", str(tmp_path)):
        with pytest.raises(EngineError, match="current folder|not an engine"):
            build_engine(_cfg(), target, show_progress=False)
    assert (tmp_path / "a" / "keep.txt").read_text() == "x"


def test_dry_run_makes_the_checks_a_build_makes_before_its_search(tmp_path):
    from trtllm_mk.cli.build import main
    f = tmp_path / "engine"
    f.write_text("not a folder")
    with pytest.raises(EngineError, match="is a file"):
        main(["--config", str(TINY), "--output-dir", str(f), "--dry-run"])
    assert main(["--config", str(TINY), "--output-dir", str(tmp_path / "new"), "--dry-run"]) == 0
    assert sorted(os.listdir(tmp_path)) == ["engine"]


def test_a_file_as_output_is_refused(tmp_path):
    f = tmp_path / "engine"
    f.write_text("not a folder")
    with pytest.raises(EngineError, match="is a file"):
        build_engine(_cfg(), f, show_progress=False)
    assert f.read_text() == "not a folder"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_parent_is_refused_before_the_search(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(EngineError, match="not writable"):
            build_engine(_cfg(), ro / "engine", show_progress=False)
    finally:
        ro.chmod(0o755)


def test_an_engine_is_replaced_whole_and_nothing_is_left_beside_it(tmp_path, built):
    out = tmp_path / "eng"
    shutil.copytree(built, out)
    (out / "stale.txt").write_text("from an older build")
    assert is_engine_dir(out)
    build_engine(_cfg(seed=3), out, show_progress=False)
    assert not (out / "stale.txt").exists()
    assert json.loads((out / "config.json").read_text())["megakernel"]["seed"] == 3
    assert os.listdir(tmp_path) == ["eng"]          # no temporary folder, no lock file
    EngineDir.open(out)


def test_an_engine_folder_takes_the_users_umask_and_an_impossible_place_is_one_line(tmp_path):
    old = os.umask(0o022)
    try:
        with EngineTarget(tmp_path / "eng") as t:
            assert (t.tmp.stat().st_mode & 0o777) == 0o755    # mkdtemp alone would leave 0700
    finally:
        os.umask(old)
    if Path("/proc").is_dir():
        with pytest.raises(EngineError, match=r"the engine directory cannot be created there"):
            with EngineTarget("/proc/no-engine-here"):
                pass


def test_a_second_build_into_the_same_folder_refuses(tmp_path):
    out = tmp_path / "eng"
    with EngineTarget(out):
        with pytest.raises(EngineError, match="another build is writing"):
            build_engine(_cfg(), out, show_progress=False)
    assert not out.exists()


def test_a_killed_builds_folder_is_cleaned_by_the_next_build(tmp_path):
    from trtllm_mk.engine_target import BUILDING_MARK
    stale = tmp_path / ".eng.building-abc"
    stale.mkdir()
    (stale / "half.cu").write_text("//")
    (stale / BUILDING_MARK).write_text("")
    lookalike = tmp_path / ".eng.building-mine"       # a user's folder with a matching name survives
    lookalike.mkdir()
    (lookalike / "notes.txt").write_text("keep")
    build_engine(_cfg(), tmp_path / "eng", show_progress=False)
    assert sorted(os.listdir(tmp_path)) == [".eng.building-mine", "eng"]
    assert (lookalike / "notes.txt").read_text() == "keep"


def test_sigterm_during_compilation_stops_the_compiler_and_cleans_up(tmp_path):
    """The compiler is stood in by a launcher that records its pid and sleeps; SIGTERM to the build
    must end the build (exit 2 or 130, no traceback), the sleeper, the temporary folder and the lock."""
    pidfile = tmp_path / "compiler.pid"
    launcher = tmp_path / "slow_nvcc.py"
    tmpfile = tmp_path / "compiler.tmpdir"
    launcher.write_text("import os, sys, time\n"
                        f"open({str(tmpfile)!r}, 'w').write(os.environ['TMPDIR'])\n"
                        "open(os.path.join(os.environ['TMPDIR'], 'tmpxft_scratch.cpp'), 'w').write('//')\n"
                        f"open({str(pidfile)!r}, 'w').write(str(os.getpid()))\n"
                        "time.sleep(120)\n")
    env = {**os.environ, "TRTLLM_MK_NVCC_LAUNCHER": f"{sys.executable} {launcher}",
           "TRTLLM_MK_CACHE": str(tmp_path / "cache")}
    out = tmp_path / "out" / "eng"
    proc = subprocess.Popen([sys.executable, "-m", "trtllm_mk", "build", "--config", str(TINY), "--output-dir",
                             str(out), "--budget", "0.5"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not pidfile.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert pidfile.exists(), proc.communicate()[1]
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode in (2, 130) and "Traceback" not in err, err
    pid = int(pidfile.read_text())
    time.sleep(0.2)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert os.listdir(tmp_path / "out") == []
    # the compiler's own scratch files (nvcc's tmpxft_*) went to a folder the build removed
    assert not Path(tmpfile.read_text()).exists()


# ------------------------------------------------------------------ engine and checkpoint agree
@pytest.fixture(scope="module")
def from_checkpoint(tmp_path_factory):
    base = tmp_path_factory.mktemp("fromckpt")
    ckpt = write_tiny_checkpoint(base / "ckpt", family="llama", seed=1)
    cfg_path = base / "cfg.yaml"
    cfg_path.write_text(TINY.read_text().replace("model: tiny-llama", f"model: {ckpt}"))
    cfg = with_overrides(load_config(cfg_path), {"megakernel": {"search_budget_s": 1.0}})
    out = build_engine(cfg, base / "eng", show_progress=False)[0]
    return out, ckpt


def test_an_engine_decodes_with_its_own_checkpoint_by_default(from_checkpoint):
    from trtllm_mk.runtime.hybrid import HybridEngine, resolve_weights
    eng, ckpt = from_checkpoint
    record = EngineDir.open(eng).checkpoint
    assert record["path"] == str(ckpt.resolve())
    assert resolve_weights(EngineDir.open(eng), None) == str(ckpt.resolve())
    he = HybridEngine(eng, simulate=True)
    assert he.weights_source == str(ckpt.resolve())


def test_a_changed_checkpoint_is_refused(from_checkpoint, tmp_path):
    from trtllm_mk.runtime.hybrid import resolve_weights
    eng, ckpt = from_checkpoint
    moved = tmp_path / "ckpt"
    shutil.copytree(ckpt, moved)
    e = EngineDir.open(eng)
    e.checkpoint = {**e.checkpoint, "path": str(moved)}
    cfg = json.loads((moved / "config.json").read_text())
    (moved / "config.json").write_text(json.dumps({**cfg, "rope_theta": 1234.0}))
    with pytest.raises(ModelError, match="config.json changed since the engine was built"):
        resolve_weights(e, None)


@pytest.mark.parametrize("change,needle", [
    (dict(tie_word_embeddings=False), "tie_word_embeddings"),
    (dict(rope_theta=10000.0), "rope_theta"),
    (dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3"), "family"),
    (dict(num_hidden_layers=3), "num_layers"),
])
def test_a_checkpoint_of_another_model_is_refused_naming_the_difference(from_checkpoint, tmp_path, change, needle):
    from trtllm_mk.runtime.hybrid import resolve_weights
    eng, _ = from_checkpoint
    other = write_tiny_checkpoint(tmp_path / "other", family="llama", seed=2, **change)
    with pytest.raises(ModelError, match=needle):
        resolve_weights(EngineDir.open(eng), other)


def _config_of(ckpt, tmp_path):
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(TINY.read_text().replace("model: tiny-llama", f"model: {ckpt}"))
    return with_overrides(load_config(cfg_path), {"megakernel": {"search_budget_s": 1.0}})


def test_a_checkpoint_without_a_tensor_is_refused_before_the_search(tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt", family="llama", seed=1)
    tensors = load_file(str(ckpt / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    cfg = _config_of(ckpt, tmp_path)
    import trtllm_mk.build as build
    monkeypatch.setattr(build, "search_candidates", lambda *a, **k: pytest.fail("searched a broken checkpoint"))
    with pytest.raises(ModelError, match=r"lacks 1 tensor\(s\) the config requires: model.layers.1.mlp.up_proj"):
        build_engine(cfg, tmp_path / "eng", show_progress=False)
    assert not (tmp_path / "eng").exists()


def test_an_fp32_checkpoint_builds_a_bf16_engine_that_takes_its_bf16_twin(tmp_path):
    from safetensors.torch import load_file, save_file
    from trtllm_mk.runtime.hybrid import HybridEngine
    fp32 = write_tiny_checkpoint(tmp_path / "fp32", family="llama", seed=1)
    cfg = json.loads((fp32 / "config.json").read_text())
    (fp32 / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "float32"}))
    save_file({k: v.float() for k, v in load_file(str(fp32 / "model.safetensors")).items()},
              str(fp32 / "model.safetensors"), metadata={"format": "pt"})
    dep = _config_of(fp32, tmp_path)
    assert dep.model_spec.dtype == "bfloat16"   # the kernel streams (and the search prices) 2-byte weights
    eng = build_engine(dep, tmp_path / "eng", show_progress=False)[0]
    bf16 = write_tiny_checkpoint(tmp_path / "bf16", family="llama", seed=1)
    a = HybridEngine(eng, simulate=True).generate([[1, 2, 3]], 6, eos_ids=()).tokens
    b = HybridEngine(eng, weights=bf16, simulate=True).generate([[1, 2, 3]], 6, eos_ids=()).tokens
    assert a == b


def test_an_architecture_only_engine_needs_weights_named(built):
    from trtllm_mk.runtime.hybrid import resolve_weights
    with pytest.raises(UserError, match="--weights random"):
        resolve_weights(EngineDir.open(built), None)
    assert resolve_weights(EngineDir.open(built), "random") == "random"


# ------------------------------------------------------------------ one deployment in the engine's files
def test_a_foreign_cubin_is_refused_even_with_a_resigned_manifest(built, tmp_path):
    from trtllm_mk.codegen import compile_cubin
    eng = tmp_path / "eng"
    shutil.copytree(built, eng)
    cubin, _ = compile_cubin('extern "C" __global__ void mk_decode_step(float* p) { p[threadIdx.x] = 1.f; }', "sm_89")
    shutil.copyfile(cubin, eng / "megakernel.cubin")
    write_manifest(eng)
    with pytest.raises(EngineError, match="machine code for sm_89"):
        EngineDir.open(eng)


def test_a_config_naming_another_gpu_is_refused_even_with_a_resigned_manifest(built, tmp_path):
    eng = tmp_path / "eng"
    shutil.copytree(built, eng)
    cfg = json.loads((eng / "config.json").read_text())
    (eng / "config.json").write_text(json.dumps({**cfg, "gpu": "L20"}))
    write_manifest(eng)
    with pytest.raises(EngineError, match="names GPU L20"):
        EngineDir.open(eng)
