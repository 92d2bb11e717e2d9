"""TensorRT / TensorRT-LLM integration, tested without either (neither can be installed here).

What runs everywhere: the import guards (absence simulated by ``sys.modules[name] = None``, which makes
``import name`` raise ImportError), the CMake configure failure without TensorRT headers, the
kernel.json reader of the plugin (compiled with g++ into plugin_src/trt/kernel_json_check.cpp), and
the TensorRT-LLM handover logic that is plain torch (block copy, request tracking) on the CPU.
What needs TensorRT's public headers (env TRTLLM_MK_TRT_INCLUDE=<dir with NvInferRuntime.h>, e.g.
the include/ of github.com/NVIDIA/TensorRT): compiling and linking the plugin library, and running
its build-phase checks through plugin_src/trt/plugin_check.cpp. Nothing here runs TensorRT itself.
"""
from __future__ import annotations

import ctypes.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trtllm_mk.errors import UserError
from trtllm_mk.kv_cache import PagedKVCache
from trtllm_mk.model.spec import ModelSpec

REPO = Path(__file__).resolve().parents[1]
TRT_SRC = REPO / "plugin_src" / "trt"
CMAKE_DIR = REPO / "build_scripts"


def tiny_spec(layers: int = 2, kv_heads: int = 2, head_dim: int = 32) -> ModelSpec:
    return ModelSpec(name="tiny", family="llama", hidden_size=64, intermediate_size=128, num_layers=layers,
                     num_heads=4, num_kv_heads=kv_heads, head_dim=head_dim, vocab_size=64, rms_norm_eps=1e-5,
                     rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def real_kernel_json() -> dict:
    """kernel.json exactly as the engine builder writes it, for a tiny model (no nvcc needed)."""
    from trtllm_mk.codegen import generate_source
    from trtllm_mk.engine import kernel_json
    from trtllm_mk.graph import TilePlan, build_step_graph
    from trtllm_mk.schedule import Schedule, SMProgram

    spec = tiny_spec()
    plan = TilePlan(qkv_rows=48, o_rows=32, gateup_rows=64, down_rows=32, lm_rows=32, embed_rows=32,
                    attn_splits=2, down_ksplit=2)
    batch, sms = 2, 4
    g = build_step_graph(spec, batch, plan)
    progs = [SMProgram() for _ in range(sms)]
    for phase, tasks in (("head", g.head), ("layer", g.layer), ("tail", g.tail)):
        for i in range(len(tasks)):
            getattr(progs[i % sms], phase).append(i)
    sched = Schedule(spec, batch, plan, sms, "test", progs)
    _, layout = generate_source(sched, 16, 128, False)
    return kernel_json(sched, layout, "sm_90a")


# ------------------------------------------------------------------------------------ import guards

def test_tensorrt_absent_gives_one_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    from trtllm_mk.backends import tensorrt_plugin as tp

    calls = [lambda: tp.load_plugin_library("libtrtllm_mk_trt_plugin.so"),
             lambda: tp.add_decode_step(None, "engine", None, None, None, None, None, None, None, None, []),
             lambda: tp.get_creator()]
    for call in calls:
        with pytest.raises(tp.TensorRTNotInstalled) as info:
            call()
        msg = str(info.value)
        assert msg.startswith("TensorRT is not installed"), msg
        assert "pip install tensorrt" in msg and "cmake -S build_scripts" in msg
        assert "\n" not in msg
        assert isinstance(info.value, UserError)  # the CLI prints it as one line, no traceback


def test_tensorrt_llm_absent_gives_one_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)
    from trtllm_mk.backends import resolve_backend
    from trtllm_mk.backends import tensorrt_llm_backend as tb

    assert tb.is_available() is False
    assert resolve_backend("auto") == "torch"
    with pytest.raises(tb.TensorRTLLMNotInstalled) as info:
        tb.TensorRTLLMPrefill(None, "engines/x", "checkpoints/x")
    assert str(info.value).startswith("TensorRT-LLM is not installed; use prefill.backend: torch")
    assert isinstance(info.value, UserError)
    # TensorRT-LLM looks the connector classes up by name; without it that is the same clear error.
    with pytest.raises(tb.TensorRTLLMNotInstalled, match="^TensorRT-LLM is not installed; use prefill.backend: torch"):
        getattr(tb, tb.WORKER_CLASS)
    with pytest.raises(AttributeError):
        getattr(tb, "NoSuchThing")


# ------------------------------------------------------------------- TensorRT-LLM handover (plain torch)

def test_request_tracker_hands_over_each_prompt_once():
    from trtllm_mk.backends.tensorrt_llm_backend import RequestTracker

    t = RequestTracker()
    # Whole prompt in one pass (new request).
    assert t.update(7, [5, 6, 7], [3], 0, 3) == ((5, 6, 7), [3])
    # Its generation pass afterwards is not a handover.
    assert t.update(7, [9], [], 3, 1) is None
    # Chunked context: complete only after the second chunk; blocks accumulate.
    assert t.update(8, list(range(10)), [0, 4], 0, 6) is None
    assert t.update(8, [], [1], 6, 4) == (tuple(range(10)), [0, 4, 1])
    # Older TensorRT-LLM without num_scheduled_tokens: the context is computed in one pass.
    assert t.update(9, [1, 2], [5], 0, None) == ((1, 2), [5])
    t.finish(9)
    assert t.update(9, [1, 2], [6], 0, None) == ((1, 2), [6])  # a reused id is a new request


def _trtllm_pool(spec: ModelSpec, num_blocks: int, tpb: int, seed: int = 0) -> torch.Tensor:
    """A pool in TensorRT-LLM's layout [num_blocks, layers, 2, kv_heads * tpb * head_dim], random bf16."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, spec.num_layers, 2, spec.num_kv_heads * tpb * spec.head_dim)
    return torch.randn(shape, generator=g).to(torch.bfloat16)


def test_handover_copies_prompt_blocks_into_our_layout():
    from trtllm_mk.backends.tensorrt_llm_backend import KVHandover

    spec, tpb = tiny_spec(layers=3, kv_heads=2, head_dim=8), 4
    pool = _trtllm_pool(spec, num_blocks=12, tpb=tpb)
    h = KVHandover(spec.num_layers, spec.num_kv_heads, tpb, spec.head_dim)
    h.register_pool(pool)
    cache = PagedKVCache.allocate(spec, batch=3, max_seq_len=16, tokens_per_block=tpb, fill=1e4)
    prompts = [[1, 2, 3, 4, 5], [7, 8], [1, 2, 3, 4, 5]]
    distinct = h.begin(cache, prompts)
    assert distinct == [(1, 2, 3, 4, 5), (7, 8)]
    trt_blocks = {(1, 2, 3, 4, 5): [6, 2], (7, 8): [9]}
    orders = [((1, 2, 3, 4, 5), [6, 2]), ((42, 43), [0]), ((7, 8), [9, 11])]  # (42, 43): not ours, skipped
    h.copy_out(orders, stream=None)
    copied = h.end()
    assert copied == {0: [6, 2], 2: [6, 2], 1: [9]}

    view = pool.view(-1, spec.num_layers, 2, spec.num_kv_heads, tpb, spec.head_dim)
    for b, p in enumerate(prompts):
        blocks = trt_blocks[tuple(p)]
        for layer in range(spec.num_layers):
            k, v = cache.read(layer, b, len(p))
            for t in range(len(p)):
                blk, off = blocks[t // tpb], t % tpb
                assert torch.equal(k[t], view[blk, layer, 0, :, off])
                assert torch.equal(v[t], view[blk, layer, 1, :, off])


def test_handover_reports_what_it_could_not_do():
    from trtllm_mk.backends.tensorrt_llm_backend import KVHandover
    from trtllm_mk.errors import EngineError

    spec, tpb = tiny_spec(layers=2, kv_heads=2, head_dim=8), 4
    h = KVHandover(spec.num_layers, spec.num_kv_heads, tpb, spec.head_dim)
    with pytest.raises(EngineError, match="bfloat16"):
        h.register_pool(_trtllm_pool(spec, 4, tpb).to(torch.float16))
    with pytest.raises(EngineError, match="lays its cache out differently"):
        h.register_pool(torch.zeros(4, 3, 2, spec.num_kv_heads * tpb * spec.head_dim, dtype=torch.bfloat16))
    h.register_pool(_trtllm_pool(spec, 4, tpb))
    cache = PagedKVCache.allocate(spec, batch=2, max_seq_len=8, tokens_per_block=tpb)
    h.begin(cache, [[1, 2, 3], [4]])
    h.copy_out([((1, 2, 3), [2])], stream=None)
    with pytest.raises(EngineError, match=r"batch slot\(s\) \[1\]"):
        h.end()
    h.begin(cache, [[1, 2, 3, 4, 5]])
    with pytest.raises(EngineError, match="2 are needed"):
        h.copy_out([((1, 2, 3, 4, 5), [2])], stream=None)


# ------------------------------------------------------------------------------------------ CMake

def _cmake_env() -> dict:
    env = dict(os.environ)
    env.pop("TENSORRT_ROOT", None)
    return env


@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")
def test_cmake_configure_without_tensorrt_fails_helpfully(tmp_path):
    empty = tmp_path / "no_tensorrt"
    empty.mkdir()
    proc = subprocess.run(["cmake", "-S", str(CMAKE_DIR), "-B", str(tmp_path / "build"), f"-DTENSORRT_ROOT={empty}"],
                          capture_output=True, text=True, env=_cmake_env(), timeout=300)
    out = proc.stdout + proc.stderr
    if proc.returncode == 0:
        pytest.skip("this machine has TensorRT headers in a system include directory")
    assert "TensorRT headers not found" in out, out
    assert "-DTENSORRT_ROOT=" in out and "TENSORRT_INCLUDE_DIR" in out
    assert "no TensorRT library is linked" in out


# ------------------------------------------------------------------------------- kernel.json reader

@pytest.fixture(scope="module")
def kernel_json_check(tmp_path_factory) -> Path:
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler (g++) to build the kernel.json reader")
    exe = tmp_path_factory.mktemp("kjc") / "kernel_json_check"
    subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", f"-I{TRT_SRC}",
                    str(TRT_SRC / "kernel_json.cpp"), str(TRT_SRC / "kernel_json_check.cpp"), "-o", str(exe)],
                   check=True, capture_output=True, timeout=300)
    return exe


def _check(exe: Path, tmp_path: Path, text: str) -> subprocess.CompletedProcess:
    path = tmp_path / "kernel.json"
    path.write_bytes(text.encode())
    return subprocess.run([str(exe), str(path)], capture_output=True, text=True, timeout=60)


def test_kernel_json_reader_accepts_the_builders_file(kernel_json_check, real_kernel_json, tmp_path):
    proc = _check(kernel_json_check, tmp_path, json.dumps(real_kernel_json, indent=1) + "\n")
    assert proc.returncode == 0, proc.stderr
    k, d = real_kernel_json, real_kernel_json["dims"]
    for key in ("grid", "block", "smem_bytes", "num_counters", "n_lm_tiles", "history_len", "tokens_per_block",
                "batch", "attn_splits"):
        assert f" {key}={k[key]} " in proc.stdout
    for key in ("L", "H", "I", "V", "NH", "NKV", "D", "G", "QKVR"):
        assert f" {key}={d[key]} " in proc.stdout
    assert f"events={len(k['event_offsets'])}" in proc.stdout
    # the Params layout the plugin packs from is the seam's, field by field
    from trtllm_mk import seam
    layout, size = seam.params_layout()
    assert f" params_size={size} " in proc.stdout and f" layer_fields={len(seam.LAYER_WEIGHTS)}" in proc.stdout
    assert [ln for ln in proc.stdout.splitlines() if ln.startswith("param ")] == [
        f"param {f.name} {off} {n}" for f, off, n in layout]
    # Keys it does not know (the builder may add some first) are skipped, whatever JSON they hold.
    extra = dict(real_kernel_json, future={"list": [1, 2.5e3, None, True, "\u00e9\U0001F600"]})
    assert _check(kernel_json_check, tmp_path, json.dumps(extra)).returncode == 0


def _edit(base: dict, **changes) -> str:
    d = json.loads(json.dumps(base))
    for key, value in changes.items():
        if "." in key:
            outer, inner = key.split(".")
            if value is None:
                del d[outer][inner]
            else:
                d[outer][inner] = value
        elif value is None:
            del d[key]
        else:
            d[key] = value
    return json.dumps(d)


MALFORMED = [
    ("empty file", lambda k: "", "unexpected end of file"),
    ("truncated", lambda k: json.dumps(k)[:60], "truncated?"),
    ("trailing data", lambda k: json.dumps(k) + " x", "unexpected data after the top-level value"),
    ("top-level array", lambda k: "[1, 2]", "the top level must be an object"),
    ("duplicate key", lambda k: json.dumps(k)[:-1] + ', "grid": 8}', 'key "grid" appears twice'),
    ("missing key", lambda k: _edit(k, n_lm_tiles=None), 'missing required key "n_lm_tiles"'),
    ("missing dim", lambda k: _edit(k, **{"dims.QKVR": None}), 'missing required key "dims.QKVR"'),
    ("float for an integer", lambda k: _edit(k, grid=4.0), '"grid" must be an integer, got a non-integer number'),
    ("string for an integer", lambda k: _edit(k, block="288"), '"block" must be an integer, got a string'),
    ("zero grid", lambda k: _edit(k, grid=0), '"grid" = 0 is out of range'),
    ("integer overflow", lambda k: json.dumps(k).replace('"grid": 4', '"grid": 99999999999999999999'),
     "integer out of range"),
    ("leading zero", lambda k: json.dumps(k).replace('"grid": 4', '"grid": 04'), "leading zero"),
    ("NaN", lambda k: json.dumps(k).replace('"grid": 4', '"grid": NaN'), "unexpected character 'N'"),
    ("block not whole warps", lambda k: _edit(k, block=100), "multiple of 32"),
    ("tokens_per_block not a power of two", lambda k: _edit(k, tokens_per_block=24), "power of two"),
    ("inconsistent heads", lambda k: _edit(k, **{"dims.NH": k["dims"]["NH"] + 1}), "NH != NKV * G"),
    ("inconsistent QKVR", lambda k: _edit(k, **{"dims.QKVR": k["dims"]["QKVR"] - 1}), "QKVR != NKV * (G + 2) * D"),
    ("dims not an object", lambda k: _edit(k, dims=[1, 2]), '"dims" must be an object'),
    ("empty kernel name", lambda k: _edit(k, kernel=""), '"kernel" must not be empty'),
    ("bad escape", lambda k: json.dumps(k).replace('"sm_90a"', '"sm_\\q90a"'), "unknown escape sequence"),
    ("raw control character", lambda k: json.dumps(k).replace('"sm_90a"', '"sm_\t90a"'), "control character"),
    ("lone surrogate", lambda k: json.dumps(k).replace('"sm_90a"', '"\\ud800"'), "unpaired UTF-16 surrogate"),
    ("qk_norm not a boolean", lambda k: _edit(k, qk_norm=1), '"qk_norm" must be true or false'),
    ("weight_bits 8", lambda k: _edit(k, weight_bits=8), '"weight_bits" = 8 must be 16 (bf16) or 4 (W4A16)'),
    ("event offset beyond the counters", lambda k: _edit(k, event_offsets={"qkv_done": 10 ** 6}),
     "beyond num_counters"),
    ("missing params", lambda k: _edit(k, params=None), 'missing required key "params"'),
    ("params field beyond the struct", lambda k: _edit(k, params=dict(k["params"], size=16)), "beyond params.size"),
    ("params fields overlap", lambda k: _edit(k, params=dict(k["params"], fields=[
        dict(f, offset=0) for f in k["params"]["fields"]])), "overlaps the previous field"),
    ("params field of odd size", lambda k: _edit(k, params=dict(k["params"], fields=[
        dict(k["params"]["fields"][0], size=2)])), "must be 4 or 8"),
    ("layer field not a string", lambda k: _edit(k, params=dict(k["params"], layer_fields=[1])), "non-empty string"),
    ("nesting too deep", lambda k: json.dumps(dict(k, deep=json.loads("[" * 20 + "]" * 20))), "deeper than 16"),
]


@pytest.mark.parametrize("text_of,expected", [pytest.param(f, e, id=n) for n, f, e in MALFORMED])
def test_kernel_json_reader_rejects_malformed(kernel_json_check, real_kernel_json, tmp_path, text_of, expected):
    proc = _check(kernel_json_check, tmp_path, text_of(real_kernel_json))
    assert proc.returncode == 1, proc.stdout
    assert expected in proc.stderr, proc.stderr
    assert proc.stderr.startswith("error: " + str(tmp_path / "kernel.json"))  # names the file


def test_kernel_json_reader_reads_the_weight_format(kernel_json_check, real_kernel_json, tmp_path):
    assert real_kernel_json["weight_bits"] == 16
    assert " weight_bits=16 " in _check(kernel_json_check, tmp_path, json.dumps(real_kernel_json)).stdout
    assert " weight_bits=4 " in _check(kernel_json_check, tmp_path, _edit(real_kernel_json, weight_bits=4)).stdout
    # an engine written before the key existed streams bf16 weights
    assert " weight_bits=16 " in _check(kernel_json_check, tmp_path, _edit(real_kernel_json, weight_bits=None)).stdout


def test_python_side_refuses_a_4bit_engine_in_one_line(real_kernel_json):
    from trtllm_mk.backends.tensorrt_plugin import check_bf16_engine
    check_bf16_engine(real_kernel_json, "eng")
    with pytest.raises(UserError) as e:
        check_bf16_engine(dict(real_kernel_json, weight_bits=4, weight_group=128), "eng")
    assert "eng: the engine streams 4-bit weights (W4A16 group 128); the TensorRT plugin binds bf16 weights only" \
        in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UserError, match="eng: a tensor-parallel engine \\(2 GPUs\\); the TensorRT plugin runs one GPU"):
        check_bf16_engine(dict(real_kernel_json, tensor_parallel=2), "eng")
    with pytest.raises(UserError, match="eng: a mixture-of-experts engine \\(128 experts\\)"):
        check_bf16_engine(dict(real_kernel_json, experts=128), "eng")


# ------------------------------------------------------------- the plugin against TensorRT's headers

TRT_INCLUDE = os.environ.get("TRTLLM_MK_TRT_INCLUDE")


def _have_libcuda() -> bool:
    return ctypes.util.find_library("cuda") is not None


@pytest.fixture(scope="module")
def plugin_build(tmp_path_factory) -> Path:
    if not TRT_INCLUDE:
        pytest.skip("set TRTLLM_MK_TRT_INCLUDE to a TensorRT include directory (e.g. the include/ of "
                    "github.com/NVIDIA/TensorRT) to compile the plugin; CI has no TensorRT headers")
    if not (Path(TRT_INCLUDE) / "NvInferRuntime.h").is_file():
        pytest.fail(f"TRTLLM_MK_TRT_INCLUDE={TRT_INCLUDE} has no NvInferRuntime.h")
    if shutil.which("cmake") is None:
        pytest.skip("cmake is not installed")
    build = tmp_path_factory.mktemp("trt_plugin")
    cfg = ["cmake", "-S", str(CMAKE_DIR), "-B", str(build), f"-DTENSORRT_INCLUDE_DIR={TRT_INCLUDE}"]
    if not _have_libcuda():  # no CUDA driver here: link against the generated link-only stub
        cfg.append("-DTRTLLM_MK_LINK_STUB_LIBCUDA=ON")
    for cmd in (cfg, ["cmake", "--build", str(build), "-j2"]):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=_cmake_env(), timeout=900)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return build


@pytest.mark.slow
def test_plugin_compiles_and_links_without_libnvinfer(plugin_build):
    lib = plugin_build / "libtrtllm_mk_trt_plugin.so"
    assert lib.is_file()
    if shutil.which("readelf"):
        dyn = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True, check=True).stdout
        needed = [line.split("[")[1].rstrip("]") for line in dyn.splitlines() if "(NEEDED)" in line]
        assert "libcuda.so.1" in needed
        assert not [n for n in needed if "nvinfer" in n or "cudart" in n], needed
        if not _have_libcuda():  # linked against the stub: no path to it may be recorded
            assert "RPATH" not in dyn and "RUNPATH" not in dyn, dyn
    if shutil.which("nm"):
        syms = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True,
                              check=True).stdout.split()
        assert "getCreators" in syms and "setLoggerFinder" in syms


@pytest.mark.slow
def test_plugin_build_phase_checks(plugin_build, real_kernel_json, tmp_path):
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "kernel.json").write_text(json.dumps(real_kernel_json, indent=1) + "\n")
    # The build phase only checks that the cubin exists; it is loaded when an execution context is
    # created, which needs a GPU, so a placeholder file stands in for it here.
    (engine / "megakernel.cubin").write_bytes(b"placeholder: never loaded in the build phase")
    env = dict(os.environ)
    paths = [str(plugin_build)] + ([] if _have_libcuda() else [str(plugin_build / "libcuda_link_stub")])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(paths + [env.get("LD_LIBRARY_PATH", "")])
    proc = subprocess.run([str(plugin_build / "trt_plugin_check"), str(engine)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all checks passed" in proc.stdout
    assert "FAIL" not in proc.stdout


@pytest.mark.slow
def test_plugin_refuses_a_params_field_it_cannot_fill(plugin_build, real_kernel_json, tmp_path):
    """The plugin packs mk::Params from kernel.json; a field it does not know would reach the kernel
    as garbage, so createPlugin refuses the engine."""
    engine = tmp_path / "engine"
    engine.mkdir()
    k = json.loads(json.dumps(real_kernel_json))
    end = k["params"]["size"]
    k["params"]["fields"].append({"name": "future", "ctype": "int64_t", "role": "scalar", "offset": end, "size": 8})
    k["params"]["size"] = end + 8
    (engine / "kernel.json").write_text(json.dumps(k))
    (engine / "megakernel.cubin").write_bytes(b"placeholder: never loaded in the build phase")
    env = dict(os.environ)
    paths = [str(plugin_build)] + ([] if _have_libcuda() else [str(plugin_build / "libcuda_link_stub")])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(paths + [env.get("LD_LIBRARY_PATH", "")])
    proc = subprocess.run([str(plugin_build / "trt_plugin_check"), str(engine)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode != 0
    assert 'Params field "future" is unknown to this plugin' in proc.stdout + proc.stderr


@pytest.mark.slow
def test_plugin_refuses_a_4bit_engine(plugin_build, real_kernel_json, tmp_path):
    """A 4-bit kernel reads scale words through mk::Params.layer_scales, which the plugin leaves null:
    createPlugin refuses such an engine and says where it runs."""
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "kernel.json").write_text(json.dumps(dict(real_kernel_json, weight_bits=4, weight_group=128)))
    (engine / "megakernel.cubin").write_bytes(b"placeholder: never loaded in the build phase")
    env = dict(os.environ)
    paths = [str(plugin_build)] + ([] if _have_libcuda() else [str(plugin_build / "libcuda_link_stub")])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(paths + [env.get("LD_LIBRARY_PATH", "")])
    proc = subprocess.run([str(plugin_build / "trt_plugin_check"), str(engine)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode != 0
    assert "the engine streams 4-bit weights (W4A16); the TensorRT plugin binds bf16 weights only, so quantized " \
           "engines run through the PyTorch runtime" in proc.stdout + proc.stderr
