"""Property-based tests of the command line: generated deployment YAMLs, model config.json files,
damaged engine folders and damaged checkpoints go through the CLI's entry points, and every time the
answer is exit 0, or exit 2 with one line on stderr and no traceback, and nothing outside the output
folder changes. More than 1,000 generated inputs in all (see EXAMPLES)."""
from __future__ import annotations

import contextlib
import io
import json
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trtllm_mk.build import build_engine
from trtllm_mk.config import load_config, with_overrides
from trtllm_mk.model.tiny import write_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
TINY_YAML = ROOT / "configs" / "tiny_cpu.yaml"
TINY_MODEL = json.loads((ROOT / "configs" / "models" / "tiny-llama.json").read_text())
EXAMPLES = {"yaml": 450, "model": 400, "engine": 120, "checkpoint": 60}   # 1,030 inputs
FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
                derandomize=True)


def cli(*argv: str) -> tuple[int, str]:
    """``python -m trtllm_mk ARGV`` in this process: (exit code, stderr)."""
    from trtllm_mk.__main__ import main
    err = io.StringIO()
    old = sys.argv
    sys.argv = ["trtllm_mk", *argv]
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                main()
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv = old
    return code, err.getvalue()


def assert_clean(code: int, err: str, what: str) -> None:
    assert "Traceback" not in err, f"{what}: traceback\n{err}"
    assert code in (0, 2), f"{what}: exit {code}\n{err}"
    if code == 2:
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), f"{what}: not one error line\n{err}"


def snapshot(d: Path, skip: Path | None = None) -> dict[str, bytes]:
    out = {}
    for p in sorted(d.rglob("*")):
        if skip is not None and (p == skip or skip in p.parents):
            continue
        out[str(p.relative_to(d))] = p.read_bytes() if p.is_file() else b"<dir>"
    return out


# ------------------------------------------------------------------ values a user might type
junk = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**7), st.floats(allow_nan=True, allow_infinity=True),
                 st.text(max_size=12), st.lists(st.integers(-1, 5), max_size=3),
                 st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
BASE = yaml.safe_load(TINY_YAML.read_text())
TOP_KEYS = list(BASE) + ["max_num_tokens", "dtype", "name", "cuda_graph_config", "bogus_key"]
SECTION_KEYS = {"kv_cache_config": ["tokens_per_block", "dtype", "free_gpu_memory_fraction", "typo"],
                "megakernel": ["search_budget_s", "context_len", "seed", "mode", "output_dir"],
                "prefill": ["backend"]}


@st.composite
def deployment(draw) -> dict:
    cfg = json.loads(json.dumps(BASE))
    for _ in range(draw(st.integers(1, 4))):
        key = draw(st.sampled_from(TOP_KEYS + list(SECTION_KEYS)))
        if key in SECTION_KEYS and draw(st.booleans()):
            sec = cfg.setdefault(key, {}) if isinstance(cfg.get(key), dict) else {}
            cfg[key] = sec
            sec[draw(st.sampled_from(SECTION_KEYS[key]))] = draw(junk)
        elif draw(st.integers(0, 9)) == 0:
            cfg.pop(key, None)
        else:
            cfg[key] = draw(st.one_of(junk, st.sampled_from(["tiny-llama", "H100-SXM", "L20", "auto", "llama-3.1-8b"])))
    return cfg


@given(cfg=deployment(), raw=st.booleans())
@settings(FUZZ, max_examples=EXAMPLES["yaml"])
def test_generated_deployment_yamls(tmp_path_factory, cfg, raw):
    d = tmp_path_factory.mktemp("yaml")
    path = d / "cfg.yaml"
    if raw:   # also text that is not a mapping, or not YAML at all
        path.write_bytes(yaml.safe_dump(cfg).encode()[: len(yaml.safe_dump(cfg)) // 2] + b"\xff: [")
    else:
        path.write_text(yaml.safe_dump(cfg))
    before = snapshot(d)
    code, err = cli("build", "--config", str(path), "--dry-run")
    assert_clean(code, err, f"build --dry-run {cfg}")
    assert snapshot(d) == before


MODEL_KEYS = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "vocab_size", "rms_norm_eps", "rope_theta", "max_position_embeddings", "tie_word_embeddings",
              "rope_scaling", "hidden_act", "architectures", "torch_dtype", "eos_token_id", "attention_bias",
              "mlp_bias", "partial_rotary_factor", "model_type"]


@st.composite
def model_config(draw) -> dict:
    cfg = json.loads(json.dumps(TINY_MODEL))
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(MODEL_KEYS))
        if draw(st.integers(0, 5)) == 0:
            cfg.pop(key, None)
        else:
            names = st.sampled_from(["silu", "gelu", "llama3", "Qwen3ForCausalLM"])
            cfg[key] = draw(st.one_of(junk, st.integers(0, 4096), names))
    return cfg


@given(cfg=model_config())
@settings(FUZZ, max_examples=EXAMPLES["model"])
def test_generated_model_configs(tmp_path_factory, cfg):
    d = tmp_path_factory.mktemp("model")
    (d / "m").mkdir()
    (d / "m" / "config.json").write_text(json.dumps(cfg))
    (d / "cfg.yaml").write_text(TINY_YAML.read_text().replace("model: tiny-llama", f"model: {d / 'm'}"))
    before = snapshot(d)
    code, err = cli("build", "--config", str(d / "cfg.yaml"), "--dry-run")
    assert_clean(code, err, f"config.json {cfg}")
    assert snapshot(d) == before


# ------------------------------------------------------------------ damaged engines and checkpoints
@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fuzz_engine") / "tiny"
    cfg = with_overrides(load_config(TINY_YAML), {"megakernel": {"search_budget_s": 1.0}})
    build_engine(cfg, out, show_progress=False)
    return out


ENGINE_FILES = ["config.json", "schedule.json", "kernel.json", "manifest.json", "checkpoint.json", "megakernel.cubin",
                "megakernel.cu"]


@st.composite
def damage(draw):
    return (draw(st.sampled_from(ENGINE_FILES)),
            draw(st.sampled_from(["truncate", "flip", "delete", "json", "binary", "dir", "empty"])),
            draw(st.integers(0, 10**6)), draw(junk))


def _damage(path: Path, how: str, at: int, value) -> None:
    if how == "delete":
        path.unlink()
    elif how == "dir":
        path.unlink()
        path.mkdir()
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "binary":
        path.write_bytes(b"\xff\xfe\x00garbage\x80")
    elif how == "json":
        path.write_text(json.dumps(value))
    else:
        data = bytearray(path.read_bytes())
        i = at % max(1, len(data))
        if how == "truncate":
            del data[i:]
        else:
            data[i] ^= 0x55
        path.write_bytes(bytes(data))


@given(hit=st.lists(damage(), min_size=1, max_size=2), resign=st.booleans(), run=st.integers(0, 5))
@settings(FUZZ, max_examples=EXAMPLES["engine"])
def test_damaged_engine_folders(tmp_path_factory, engine, hit, resign, run):
    from trtllm_mk.engine import write_manifest
    d = tmp_path_factory.mktemp("dmg")
    eng = d / "eng"
    shutil.copytree(engine, eng)
    for name, how, at, value in hit:
        if (eng / name).is_file():
            _damage(eng / name, how, at, value)
    if resign and (eng / "manifest.json").is_file():
        with contextlib.suppress(OSError):
            write_manifest(eng)   # a re-signed manifest must not make damage pass
    code, err = cli("verify", "--engine", str(eng))
    assert_clean(code, err, f"verify after {hit}")
    if run == 0:   # one in six also decodes (slower): open, bind random weights, two steps
        code, err = cli("run", "--engine", str(eng), "--weights", "random", "--prompt", "1 2 3",
                        "--max-new-tokens", "2", "--simulate")
        assert_clean(code, err, f"run after {hit}")


@pytest.fixture(scope="module")
def checkpoint_engine(tmp_path_factory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("fuzz_ckpt")
    ckpt = write_tiny_checkpoint(base / "ckpt", family="llama", seed=3, shards=2)
    (base / "cfg.yaml").write_text(TINY_YAML.read_text().replace("model: tiny-llama", f"model: {ckpt}"))
    cfg = with_overrides(load_config(base / "cfg.yaml"), {"megakernel": {"search_budget_s": 1.0}})
    return build_engine(cfg, base / "eng", show_progress=False)[0], ckpt


CKPT_FILES = ["config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
              "model-00002-of-00002.safetensors"]


@given(name=st.sampled_from(CKPT_FILES), how=st.sampled_from(["truncate", "flip", "delete", "json", "binary", "empty"]),
       at=st.integers(0, 10**6), value=junk)
@settings(FUZZ, max_examples=EXAMPLES["checkpoint"])
def test_damaged_checkpoints(tmp_path_factory, checkpoint_engine, name, how, at, value):
    eng, ckpt = checkpoint_engine
    d = tmp_path_factory.mktemp("ck")
    bad = d / "ckpt"
    shutil.copytree(ckpt, bad)
    _damage(bad / name, how, at, value)
    before = snapshot(d)
    code, err = cli("run", "--engine", str(eng), "--weights", str(bad), "--prompt", "1 2 3", "--max-new-tokens", "2",
                    "--simulate")
    assert_clean(code, err, f"{how} {name}")
    assert snapshot(d) == before


@given(kind=st.sampled_from(["user_files", "file", "engine", "fresh", "nested_under_file"]))
@settings(FUZZ, max_examples=10)
def test_builds_change_nothing_outside_their_output(tmp_path_factory, engine, kind):
    d = tmp_path_factory.mktemp("out")
    (d / "keep.txt").write_text("keep")
    out = d / "target"
    if kind == "user_files":
        out.mkdir()
        (out / "thesis.tex").write_text("mine")
    elif kind == "file":
        out.write_text("a file")
    elif kind == "engine":
        shutil.copytree(engine, out)
    elif kind == "nested_under_file":
        (d / "f").write_text("x")
        out = d / "f" / "target"
    before = snapshot(d)
    code, err = cli("build", "--config", str(TINY_YAML), "--output-dir", str(out), "--budget", "0.5")
    assert_clean(code, err, kind)
    if code == 2:     # refused: nothing changed at all
        assert snapshot(d) == before
    else:             # built: only the output folder changed
        assert snapshot(d, skip=out) == {k: v for k, v in before.items()
                                         if not (d / k == out or out in (d / k).parents)}
    assert code == (2 if kind in ("user_files", "file", "nested_under_file") else 0), err
