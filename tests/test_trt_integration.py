"""TensorRT / TensorRT-LLM integration, tested without either (neither can be installed here).

What runs everywhere: the import guards (absence simulated by ``sys.modules[name] = None``, which makes
``import name`` raise ImportError), the CMake configure failure without TensorRT headers, the
kernel.json reader of the plugin (compiled with g++ into trtllm_mk/plugin/trt/kernel_json_check.cpp),
the header the plugin's build generates from trtllm_mk/seam.py (compiled with g++ and checked against
seam.py), and the TensorRT-LLM handover logic that is plain torch (block copy, request tracking) on the CPU.
What needs TensorRT's public headers (env TRTLLM_MK_TRT_INCLUDE=<dir with NvInferRuntime.h>, e.g.
the include/ of github.com/NVIDIA/TensorRT): compiling and linking the plugin library, and running
its build-phase checks through trtllm_mk/plugin/trt/plugin_check.cpp. Nothing here runs TensorRT itself.
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
CMAKE_DIR = REPO / "trtllm_mk" / "plugin"   # the plugin's CMake project, shipped in the package
TRT_SRC = CMAKE_DIR / "trt"
SEAM_PY = REPO / "trtllm_mk" / "seam.py"


def generate_seam_header(out_dir: Path) -> Path:
    """seam_generated.h in ``out_dir``, by the command the plugin's CMake build runs."""
    from trtllm_mk import seam
    header = out_dir / seam.PLUGIN_HEADER_NAME
    subprocess.run([sys.executable, "-I", str(SEAM_PY), "--plugin-header", str(header)], check=True,
                   capture_output=True, timeout=60)
    return header


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
        assert "pip install tensorrt" in msg and f"cmake -S {tp.PLUGIN_SOURCE_DIR} " in msg
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
    assert str(info.value).startswith("TensorRT-LLM is not installed: pip install '.[tensorrt-llm]' --extra-index-url "
                                      "https://pypi.nvidia.com")
    assert "or use prefill.backend: torch" in str(info.value)
    assert isinstance(info.value, UserError)
    # TensorRT-LLM looks the connector classes up by name; without it that is the same clear error.
    with pytest.raises(tb.TensorRTLLMNotInstalled, match="^TensorRT-LLM is not installed: pip install"):
        getattr(tb, tb.WORKER_CLASS)
    with pytest.raises(AttributeError):
        getattr(tb, "NoSuchThing")
    # a name that is no backend is named as such, not as TensorRT-LLM missing
    with pytest.raises(UserError, match="prefill backend 'foo' is not one of auto, torch, tensorrt_llm"):
        resolve_backend("foo")


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
    gen = generate_seam_header(exe.parent).parent
    subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", f"-I{TRT_SRC}", f"-I{gen}",
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
    from trtllm_mk import seam
    assert tuple(d) == seam.KERNEL_DIM_KEYS
    for key in seam.KERNEL_DIM_KEYS:
        assert f" {key}={d[key]} " in proc.stdout
    assert f"events={len(k['event_offsets'])}" in proc.stdout
    # the Params layout the plugin packs from is the seam's, field by field
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


# ----------------------------------------------------------- seam_generated.h (from trtllm_mk/seam.py)

def _cstr(s: str) -> str:
    return json.dumps(s)   # the seam's names are plain ASCII


def _header_program(seam, dims: dict[str, int]) -> str:
    """A C++ program that static_asserts the generated header's constants against seam.py's values
    (written here from Python) and prints what only runs at run time (the shape function, names)."""
    layout, size = seam.params_layout()
    sa = []
    sa += [f"static_assert(streq(s::kPluginName, {_cstr(seam.TRT_PLUGIN_NAME)}), \"plugin name\");",
           f"static_assert(streq(s::kPluginVersion, {_cstr(seam.TRT_PLUGIN_VERSION)}), \"plugin version\");",
           f"static_assert(streq(s::kPluginNamespace, {_cstr(seam.TRT_PLUGIN_NAMESPACE)}), \"plugin namespace\");",
           f"static_assert(s::kNumFixedInputs == {len(seam.TRT_PLUGIN_FIXED_INPUTS)}, \"fixed inputs\");",
           f"static_assert(s::kNumOutputs == {len(seam.TRT_PLUGIN_OUTPUTS)}, \"outputs\");",
           f"static_assert(s::kNumKernelDims == {len(seam.KERNEL_DIM_KEYS)}, \"dims\");",
           f"static_assert(s::kNumLayerFields == {len(seam.LAYER_WEIGHTS)}, \"layer fields\");",
           f"static_assert(s::kNumOptionalLayerFields == {len(seam.OPTIONAL_LAYER_FIELDS)}, \"optional\");",
           f"static_assert(s::kNumParams == {len(seam.PARAMS)}, \"params\");",
           f"static_assert(s::kParamsSize == {size}, \"sizeof(Params)\");",
           f"static_assert(s::kNumErrorFields == {len(seam.ERROR_FIELDS)}, \"error fields\");",
           f"static_assert(s::kNumErrorCodes == {len(seam.ERROR_CODES)}, \"error codes\");"]
    for i, n in enumerate(seam.TRT_PLUGIN_FIXED_INPUTS):
        camel = "k" + "".join(p.capitalize() for p in n.split("_"))
        sa.append(f"static_assert(s::{camel} == {i} && streq(s::kFixedInputNames[{i}], {_cstr(n)}), \"{n}\");")
    for i, n in enumerate(seam.TRT_PLUGIN_OUTPUTS):
        camel = "k" + "".join(p.capitalize() for p in n.split("_"))
        sa.append(f"static_assert(s::{camel} == {i} && streq(s::kOutputNames[{i}], {_cstr(n)}), \"{n}\");")
    for i, k in enumerate(seam.KERNEL_DIM_KEYS):
        sa.append(f"static_assert(s::index_of(s::KernelDim::{k}) == {i} && streq(s::kKernelDimNames[{i}], "
                  f"{_cstr(k)}), \"dim {k}\");")
    for i, w in enumerate(seam.LAYER_WEIGHTS):
        sa.append(f"static_assert(s::index_of(s::LayerField::{w.field}) == {i} && "
                  f"streq(s::name(s::LayerField::{w.field}), {_cstr(w.field)}) && "
                  f"streq(s::kLayerFieldHfSuffixes[{i}], {_cstr(w.hf_suffix)}) && "
                  f"s::kLayerFieldOptional[{i}] == {str(w.optional).lower()}, \"layer field {w.field}\");")
    for i, (f, off, n) in enumerate(layout):
        sa.append(f"static_assert(s::index_of(s::Param::{f.name}) == {i} && streq(s::kParams[{i}].name, "
                  f"{_cstr(f.name)}) && streq(s::kParamNames[{i}], {_cstr(f.name)}) && "
                  f"streq(s::kParams[{i}].ctype, {_cstr(f.ctype)}) && streq(s::kParams[{i}].role, {_cstr(f.role)}) && "
                  f"s::kParams[{i}].offset == {off} && s::kParams[{i}].size == {n}, \"param {f.name}\");")
    for i, (f, _) in enumerate(seam.ERROR_FIELDS):
        sa.append(f"static_assert(s::index_of(s::ErrorField::{f}) == {i} && streq(s::kErrorFieldNames[{i}], "
                  f"{_cstr(f)}), \"error field {f}\");")
    for name, code in seam.ERROR_CODES.items():
        sa.append(f"static_assert(static_cast<uint32_t>(s::ErrorCode::{name}) == {code} && "
                  f"streq(s::name(s::ErrorCode::{name}), {_cstr(name)}), \"error code {name}\");")
    members = " ".join(f"int64_t {k} = {v};" for k, v in dims.items())
    return "\n".join([
        "#include <cstdio>", "#include <cstdint>", "", '#include "seam_generated.h"', "",
        "namespace s = trtllm_mk_seam;",
        "constexpr bool streq(const char* a, const char* b) { return *a == *b && (*a == 0 || streq(a + 1, b + 1)); }",
        *sa, "",
        f"struct Dims {{ {members} }};",
        "#define PRINT_DIM_KEY(key) std::printf(\"dimkey %s\\n\", #key);",
        "int main() {",
        "  TRTLLM_MK_SEAM_KERNEL_DIMS(PRINT_DIM_KEY)",
        "  const auto shapes = s::layer_weight_shapes(Dims{});",
        "  for (int f = 0; f < s::kNumLayerFields; ++f) {",
        "    std::printf(\"shape %s\", s::kLayerFieldNames[f]);",
        "    for (int64_t n : shapes[f]) std::printf(\" %lld\", static_cast<long long>(n));",
        "    std::printf(\"\\n\");",
        "  }",
        "  for (const auto& p : s::kParams) std::printf(\"param %s %lld %lld\\n\", p.name,",
        "                                             static_cast<long long>(p.offset), static_cast<long long>(p.size));",
        "  return 0;",
        "}", ""])


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a host C++ compiler")
def test_generated_plugin_header_compiles_and_matches_the_seam(tmp_path):
    """The plugin takes its names, counts, offsets and shapes from seam_generated.h; g++ proves the header
    holds exactly seam.py's values (static_asserts written from Python), and the program prints the rest."""
    from trtllm_mk import seam
    header = generate_seam_header(tmp_path)
    assert header.read_text() == seam.emit_plugin_header()
    primes = [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31]
    dims = dict(zip(seam.KERNEL_DIM_KEYS, primes))   # distinct primes: a product names its factors
    src = tmp_path / "check.cpp"
    src.write_text(_header_program(seam, dims))
    exe = tmp_path / "check"
    proc = subprocess.run(["g++", "-std=c++17", "-Wall", "-Wextra", "-Wpedantic", "-Werror", f"-I{tmp_path}",
                           str(src), "-o", str(exe)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True, timeout=60).stdout.splitlines()
    assert [ln.split()[1] for ln in out if ln.startswith("dimkey ")] == list(seam.KERNEL_DIM_KEYS)
    assert [ln for ln in out if ln.startswith("shape ")] == [
        "shape " + " ".join([w.field, *map(str, seam.layer_weight_shape(w.field, dims))]) for w in seam.LAYER_WEIGHTS]
    layout, _ = seam.params_layout()
    assert [ln for ln in out if ln.startswith("param ")] == [f"param {f.name} {off} {n}" for f, off, n in layout]
    # a value the header does not hold fails to compile (the static_asserts do check something)
    src.write_text(src.read_text().replace(f"s::kParamsSize == {seam.params_layout()[1]}",
                                           f"s::kParamsSize == {seam.params_layout()[1] + 8}"))
    bad = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", f"-I{tmp_path}", str(src)], capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode != 0 and "sizeof(Params)" in bad.stderr


def test_generated_plugin_header_is_not_committed():
    """seam_generated.h exists only in build directories: the plugin sources hold no copy to drift."""
    from trtllm_mk import seam
    copies = [p for p in (REPO / "trtllm_mk").rglob(seam.PLUGIN_HEADER_NAME)]
    assert copies == [], copies
    for src in [*TRT_SRC.glob("*.h"), *TRT_SRC.glob("*.cpp")]:
        text = src.read_text()
        for hand in ("kLayerInputFields", "kParamsFilled", "kFirstOptionalField", '"q_proj"', 'dims, "L"'):
            assert hand not in text, f"{src.name} mirrors the seam by hand ({hand})"
    cmake = (CMAKE_DIR / "CMakeLists.txt").read_text()
    assert '-I "${SEAM_PY}" --plugin-header "${SEAM_HEADER}"' in cmake   # the command generate_seam_header runs


def test_plugin_library_path_is_explicit_env_or_cwd(tmp_path, monkeypatch):
    from trtllm_mk.backends import tensorrt_plugin as tp
    from trtllm_mk.errors import EngineError
    monkeypatch.delenv(tp.LIBRARY_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(EngineError) as info:
        tp.find_plugin_library()
    msg = str(info.value)
    assert msg.startswith(f"{tmp_path / 'build' / 'trt_plugin' / tp.LIBRARY_NAME}: no TensorRT plugin library")
    assert f"cmake -S {tp.PLUGIN_SOURCE_DIR} -B build/trt_plugin" in msg and tp.LIBRARY_ENV in msg
    assert "\n" not in msg
    assert (tp.PLUGIN_SOURCE_DIR / "CMakeLists.txt").is_file()   # the command names a real CMake project
    lib = tmp_path / "build" / "trt_plugin" / tp.LIBRARY_NAME
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"")
    assert tp.find_plugin_library() == lib.resolve()                   # ./build/trt_plugin
    other = tmp_path / "elsewhere.so"
    other.write_bytes(b"")
    monkeypatch.setenv(tp.LIBRARY_ENV, str(other))
    assert tp.find_plugin_library() == other.resolve()                 # the environment variable
    assert tp.find_plugin_library(lib) == lib.resolve()                # an explicit path wins
    with pytest.raises(EngineError, match="no TensorRT plugin library"):
        tp.find_plugin_library(tmp_path / "missing.so")


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
    cfg = ["cmake", "-S", str(CMAKE_DIR), "-B", str(build), f"-DTENSORRT_INCLUDE_DIR={TRT_INCLUDE}",
           f"-DPython3_EXECUTABLE={sys.executable}"]
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
    # the build generated the plugin's seam header from seam.py
    from trtllm_mk import seam
    assert (plugin_build / "generated" / seam.PLUGIN_HEADER_NAME).read_text() == seam.emit_plugin_header()
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
