"""The seam description (trtllm_mk/seam.py) against what is built from it: the C++ declarations (a
host compiler checks the Params layout the Python packer assumes), the runtime's packing, kernel.json."""
from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from trtllm_mk import seam
from trtllm_mk.codegen.source import device_source_dir
from trtllm_mk.graph import Kind


def test_params_layout_is_natural_alignment():
    layout, size = seam.params_layout()
    assert [f.name for f, _, _ in layout] == [f.name for f in seam.PARAMS]
    end = 0
    for f, off, n in layout:
        assert off >= end and off % seam.ctype_info(f.ctype)[1] == 0
        end = off + n
    assert size >= end and size % 8 == 0


def test_pack_params_places_every_field_at_its_offset():
    values = {f.name: 0x1000 + 8 * i for i, f in enumerate(seam.PARAMS)}
    raw = seam.pack_params(values)
    layout, size = seam.params_layout()
    assert len(raw) == size
    for f, off, n in layout:
        fmt = "<" + seam.ctype_info(f.ctype)[2]
        assert struct.unpack_from(fmt, raw, off)[0] == values[f.name]
    with pytest.raises(ValueError, match="missing"):
        seam.pack_params({k: v for k, v in values.items() if k != "trace"})


def test_emitted_kind_enum_is_the_graph_kind_and_the_only_one():
    text = seam.emit_cuda()
    for k in Kind:
        assert f"{k.name} = {int(k)}" in text
    for path in device_source_dir().glob("*.cuh"):
        assert "enum Kind" not in path.read_text(), f"{path.name} declares its own enum Kind"


def test_event_ref_word_refuses_what_does_not_fit():
    assert seam.event_ref_word(3, 0) == 3 and seam.event_ref_word(3, 2) == 3 + (2 << seam.EVENT_INDEX_BITS)
    for index, stride in ((1 << seam.EVENT_INDEX_BITS, 0), (-1, 0), (0, 1 << (31 - seam.EVENT_INDEX_BITS))):
        with pytest.raises(ValueError, match="does not fit"):
            seam.event_ref_word(index, stride)


def test_task_args_initializer_follows_the_declaration():
    vals = {a.name: (["1", "2", "3", "4"] if a.count else str(i)) for i, a in enumerate(seam.TASK_ARGS)}
    init = seam.task_args_init(vals)
    assert init.startswith("mk::TaskArgs{0, 1, 2,") and init.count("{1, 2, 3, 4}") == 2


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a host C++ compiler")
def test_host_compiler_proves_the_params_layout(tmp_path):
    """The emitted static_asserts (sizeof and every offsetof) hold for a host compiler: the bytes the
    Python runtime packs are the struct the kernel reads."""
    src = tmp_path / "seam_check.cpp"
    # the event references the code generator writes decode, on the device, to counter + layer x stride
    refs = [(0, 0, 5), (37, 8, 0), (1601, 8, 79), (1000, 0, -1), ((1 << seam.EVENT_INDEX_BITS) - 1, 2047, 3)]
    checks = "".join(f"static_assert(mk::event_counter({seam.event_ref_word(i, s)}, {l}) == {i + l * s}, \"ref\");\n"
                     for i, s, l in refs)
    src.write_text("#include <stdint.h>\n#define __device__\n#define __forceinline__ inline\n"
                   "struct bf16 { uint16_t x; };\nnamespace mk { struct ErrorInfo { int w[8]; }; }\n"
                   "namespace cfg { constexpr int MAX_REFS = 4; }\n" + seam.emit_cuda() + checks + "int main() { return 0; }\n")
    proc = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", str(src)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_runtime_packs_from_the_seam():
    from trtllm_mk.runtime import megakernel
    assert megakernel.PARAM_FIELDS == [f.name for f in seam.PARAMS]
    assert [f for f, _ in megakernel.LAYER_FIELDS] == list(seam.LAYER_FIELD_NAMES)


def test_trace_words_are_the_seams():
    from trtllm_mk.runtime import trace
    assert trace.TRACE_WORDS == len(seam.TRACE_WORD_NAMES)
    assert f"constexpr int TRACE_WORDS = {trace.TRACE_WORDS};" in seam.emit_cuda()


def test_generated_source_carries_the_smem_layout():
    """The device reads its shared-memory offsets from the generated constants, which are the layout
    the host allocates (KernelLayout.smem_bytes)."""
    from trtllm_mk.codegen import generate_source
    from trtllm_mk.codegen.source import kernel_smem_layout
    from trtllm_mk.graph import TilePlan
    from trtllm_mk.model.spec import load_spec
    from trtllm_mk.schedule import Schedule, SMProgram

    spec = load_spec(Path(__file__).resolve().parents[1] / "configs" / "models" / "tiny-llama.json")
    plan = TilePlan(qkv_rows=32, o_rows=32, gateup_rows=32, down_rows=32, lm_rows=64, stages=3, slot_bytes=4096,
                    o_ksplit=1, down_ksplit=2, attn_splits=2)
    sched = Schedule(spec, 2, plan, 1, "test", [SMProgram()])
    src, layout = generate_source(sched, 16, 128, True)
    smem = kernel_smem_layout(sched.graph())
    assert layout.smem_bytes == smem.total and f"constexpr size_t SMEM_TOTAL = {smem.total};" in src
    for r in smem.regions:
        assert f"constexpr size_t SMEM_{r.name.upper()}_AT = {r.offset}, SMEM_{r.name.upper()} = {r.size};" in src


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_kernel_dims_and_layer_weight_shapes_are_the_checkpoints(family):
    """kernel.json's dims (seam.KERNEL_DIMS, read by the TensorRT plugin) and the layer weight shapes the
    plugin checks its inputs against (seam.LAYER_WEIGHT_SHAPES) are the checkpoint's tensors' shapes."""
    from dataclasses import fields

    from trtllm_mk.graph import Dims, TilePlan, build_step_graph
    from trtllm_mk.model.spec import ModelSpec

    assert list(seam.LAYER_WEIGHT_SHAPES) == list(seam.LAYER_FIELD_NAMES)
    assert {a for _, a, _ in seam.KERNEL_DIMS} <= {f.name for f in fields(Dims)}
    spec = ModelSpec(name="tiny", family=family, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=32, vocab_size=80, rms_norm_eps=1e-5, rope_theta=10000.0,
                     max_position_embeddings=256, tie_word_embeddings=False)
    plan = TilePlan(qkv_rows=48, o_rows=32, gateup_rows=32, down_rows=32, lm_rows=32, embed_rows=32,
                    attn_splits=2, down_ksplit=2)
    dims = seam.kernel_dims_json(build_step_graph(spec, 1, plan).dims)
    assert tuple(dims) == seam.KERNEL_DIM_KEYS
    assert dims["NH"] == dims["NKV"] * dims["G"] and dims["QKVR"] == dims["NKV"] * (dims["G"] + 2) * dims["D"]
    tensors = spec.expected_tensors()
    for w in seam.LAYER_WEIGHTS:
        name = "model.layers.1." + w.hf_suffix
        if name in tensors:
            assert seam.layer_weight_shape(w.field, dims) == tensors[name], w.field
        else:
            assert w.optional, f"{w.field}: required but {family} has no {name}"


def test_plugin_header_is_emitted_once_and_written_only_on_change(tmp_path):
    text = seam.emit_plugin_header()
    assert text == seam.emit_plugin_header() and f"namespace {seam.PLUGIN_HEADER_NAMESPACE} {{" in text
    out = tmp_path / "gen" / seam.PLUGIN_HEADER_NAME
    assert seam.main(["--plugin-header", str(out)]) == 0 and out.read_text() == text
    assert seam.write_plugin_header(out) is False   # unchanged: left alone, so nothing recompiles
    out.write_text("stale")
    assert seam.write_plugin_header(out) is True and out.read_text() == text


def test_wait_timeout_report_names_the_event_and_the_task():
    from types import SimpleNamespace

    import torch

    from trtllm_mk.runtime.megakernel import MegakernelDecoder
    words = dict(code=seam.ERROR_CODES["WAIT_TIMEOUT"], sm=3, event_index=21, target=8, seen=7, layer=2,
                 task=41, pad=0)
    err = torch.tensor([words[n] for n, _ in seam.ERROR_FIELDS], dtype=torch.int32)
    dec = SimpleNamespace(buf=SimpleNamespace(error=err),
                          layout=SimpleNamespace(event_offsets={"attn_done": 0, "qkv_done": 16}))
    text = MegakernelDecoder.error_report(dec)
    assert "SM 3 timed out waiting on event qkv_done[+5] (counter 21)" in text and "task #41 of that SM" in text
