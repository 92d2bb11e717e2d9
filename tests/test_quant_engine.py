"""Quantized checkpoints as engines: a tiny Llama written by transformers, quantized by our own quantize
command (GPTQ, AWQ, compressed-tensors W4A16; ModelOpt and compressed-tensors FP8), built by the build
command (search, nvcc) into a W4A16 or FP8 engine whose report counts the quantized bytes, and decoded
on the CPU executor (``run --simulate``) exactly as the reference decoder decodes the weights the
kernel computes with. What the kernel does not implement (8-bit
integers, FP8 block scales, activation order, layouts it cannot take) is refused in one line, before
any work."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trtllm_mk.config import load_config
from trtllm_mk.errors import ConfigError, UserError, run_cli
from trtllm_mk.kv_cache import PagedKVCache
from trtllm_mk.model.spec import load_spec
from trtllm_mk.quant import Fp8Linear, IntLinear, load_quantized, read_scheme
from trtllm_mk.quant.kernel_layout import dequantize, is_layer_linear, kernel_dequantize, layout_of
from trtllm_mk.quant.kernel_support import UnsupportedQuantization, kernel_group, quantized_spec
from trtllm_mk.reference import ReferenceDecoder

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [3, 141, 59, 26, 5, 358, 97]
_SHAPES = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
               num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=1024,
               bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)

# (quantize arguments, the engine's weight bits and group, its weight format in reports)
FORMATS = {
    "gptq": (["--format", "gptq"], 4, 128, "W4A16 (group 128)"),
    "awq": (["--format", "awq", "--group-size", "64"], 4, 64, "W4A16 (group 64)"),
    "ct-per-channel": (["--format", "ct-w4a16", "--zero-point", "--group-size", "-1"], 4, 128, "W4A16 (group 128)"),
}
# FP8 checkpoints: one scale word per row and 256-column tile (tile_cols of this model)
FP8_FORMATS = {
    "fp8": (["--format", "fp8"], 8, 256, "FP8 (e4m3, per-channel scales)"),
    "ct-fp8": (["--format", "ct-fp8"], 8, 256, "FP8 (e4m3, per-channel scales)"),
    "ct-fp8-per-tensor": (["--format", "ct-fp8", "--per-tensor"], 8, 256, "FP8 (e4m3, per-channel scales)"),
}
ALL_FORMATS = {**FORMATS, **FP8_FORMATS}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A tiny bf16 Llama written by transformers' save_pretrained (no tokenizer: run takes and prints ids)."""
    import transformers
    d = tmp_path_factory.mktemp("src") / "tiny-llama"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**_SHAPES, initializer_range=0.1), dtype=torch.bfloat16)
    model.save_pretrained(d)
    return d


def _quantize(src: Path, out: Path, *args: str) -> Path:
    from trtllm_mk.cli.quantize import main
    assert main([*args, str(src), str(out)]) == 0
    return out


def _yaml(d: Path, model, extra: str = "", gpu: str = "H100-SXM") -> Path:
    p = d / "deploy.yaml"
    p.write_text(f"model: {model}\ngpu: {gpu}\nmax_batch_size: 1\nmax_seq_len: 256\nmax_input_len: 128\n"
                 f"prefill:\n  backend: torch\nmegakernel:\n  search_budget_s: 0.5\n  context_len: 128\n{extra}")
    return p


def _cli_error(capsys, main, argv) -> str:
    with pytest.raises(SystemExit) as e:
        run_cli(lambda: main(argv))
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


@pytest.fixture(scope="module", params=list(ALL_FORMATS))
def built(request, tmp_path_factory, source):
    """(format, checkpoint, engine dir, build stdout) of a 4-bit or FP8 engine built by the build command."""
    from trtllm_mk.cli.build import main
    args = ALL_FORMATS[request.param][0]
    d = tmp_path_factory.mktemp(request.param)
    ckpt = _quantize(source, d / "ckpt", *args)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["--config", str(_yaml(d, ckpt)), "--output-dir", str(d / "engine")]) == 0
    return request.param, ckpt, d / "engine", buf.getvalue()


def _kernel_weights_of(ckpt: Path) -> dict[str, torch.Tensor]:
    """The checkpoint as the kernel computes with it, fp32: quantized layers through kernel_dequantize
    (``kernel_dequantize_fp8`` for FP8 ones)."""
    spec = load_spec(ckpt)
    return {k: (kernel_dequantize(v) if isinstance(v, (IntLinear, Fp8Linear)) else v).float()
            for k, v in load_quantized(ckpt, spec, read_scheme(ckpt)).items()}


def _reference_tokens(spec, weights: dict, n: int) -> list[int]:
    ref = ReferenceDecoder(spec, weights, compute_dtype=torch.float32)
    cache = PagedKVCache.allocate(spec, 1, 256, 32, dtype=torch.float32)
    return ref.generate([PROMPT], n, cache=cache, eos_ids=())[0]


def test_the_build_reports_the_quantized_bytes(built):
    fmt, ckpt, engine, out = built
    _, bits, group, wf = ALL_FORMATS[fmt]
    rep = json.loads((engine / "report.json").read_text())
    assert rep["weight_format"] == wf
    assert f"| decoder layer weights | {wf} |" in (engine / "report.md").read_text()
    assert re.search(rf"weights streamed +\S+ MB per step, {re.escape(wf)}", out), out
    assert wf in out.split("searching")[0]          # the deployment summary names it too
    sched = json.loads((engine / "schedule.json").read_text())
    assert (sched["spec"]["weight_bits"], sched["spec"]["weight_group"]) == (bits, group)
    kj = json.loads((engine / "kernel.json").read_text())
    assert (kj["weight_bits"], kj["weight_group"]) == (bits, group)
    # the step streams each layer linear as codes + scale words instead of bf16: the bf16 graph's
    # bytes minus exactly that saving
    from trtllm_mk.engine import EngineDir
    from trtllm_mk.graph import build_step_graph
    spec = EngineDir.open(engine).schedule.spec
    bf16 = dataclasses.replace(spec, weight_bits=16, weight_group=0)
    plan = EngineDir.open(engine).schedule.plan
    saving = sum(2 * s[0] * s[1] - layout_of(spec, s).nbytes
                 for n, s in spec.expected_tensors().items() if is_layer_linear(n, s))
    assert rep["weight_bytes_per_step"] == build_step_graph(bf16, 1, plan).weight_bytes() - saving
    assert rep["floor_us"] > 0


def test_run_simulate_decodes_as_the_reference_on_the_kernels_weights(built, capsys):
    fmt, ckpt, engine, _ = built
    from trtllm_mk.cli.run import main
    assert main(["--engine", str(engine), "--prompt", " ".join(map(str, PROMPT)), "--max-new-tokens", "8",
                 "--simulate", "--ignore-eos"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[0]"))
    got = [int(t) for t in line.split()[1:]]
    spec = load_spec(ckpt)
    assert got == _reference_tokens(spec, _kernel_weights_of(ckpt), 8)


def test_the_engine_binds_the_kernel_layout_and_prefills_on_its_weights(built):
    fmt, ckpt, engine, _ = built
    from trtllm_mk.runtime.hybrid import HybridEngine
    bits, group = ALL_FORMATS[fmt][1:3]
    eng = HybridEngine(engine, simulate=True)
    try:
        want = _kernel_weights_of(ckpt)
        layers = load_quantized(ckpt, load_spec(ckpt), read_scheme(ckpt))
        n = 0
        for name, shape in eng.spec.expected_tensors().items():
            assert torch.equal(eng.weights[name], want[name]), name
            if is_layer_linear(name, shape):
                packed, sz = eng.decode_weights[name], eng.decode_weights[name + "_sz"]
                assert packed.dtype == torch.uint8 and sz.dtype == torch.int32
                assert torch.equal(dequantize(packed, sz, group, bits=bits).float(), eng.weights[name]), name
                n += 1
        assert n == 14
        # fp16 / fp32 scales (GPTQ, AWQ, ModelOpt FP8) are rounded to bf16 first, as the kernel does, which
        # changes some weights against the checkpoint's own value rounded once; bf16 scales
        # (compressed-tensors, stored bf16 by our quantize) change nothing
        lin = layers["model.layers.0.mlp.down_proj.weight"]
        scales = lin.scale if isinstance(lin, Fp8Linear) else lin.scales
        kernel = kernel_dequantize(lin)   # 4-bit: exact in fp32; FP8: rounded once to bf16
        same = torch.equal(kernel, lin.dequantize(kernel.dtype))
        assert same == torch.equal(scales.to(torch.bfloat16).to(scales.dtype), scales), scales.dtype
    finally:
        eng.close()


def test_random_weights_for_a_quantized_shapes_only_engine(tmp_path):
    """A shapes-only model with a quantization section builds a 4-bit engine; --weights random
    quantizes random weights (round to nearest) and decodes them as the reference does."""
    from trtllm_mk.build import build_engine
    from trtllm_mk.model.random_weights import random_weights
    from trtllm_mk.quant.kernel_layout import kernel_weights, quantize_model
    from trtllm_mk.runtime.hybrid import HybridEngine
    cfg = load_config(_yaml(tmp_path, "tiny-llama", "quantization:\n  quant_algo: W4A16_GPTQ\n  group_size: 32\n"))
    assert (cfg.model_spec.weight_bits, cfg.model_spec.weight_group) == (4, 32)
    build_engine(cfg, tmp_path / "engine", show_progress=False)
    eng = HybridEngine(tmp_path / "engine", weights="random", seed=5, simulate=True)
    try:
        got = eng.generate([PROMPT], 6, eos_ids=()).tokens[0]
    finally:
        eng.close()
    spec = cfg.model_spec
    _, dense = kernel_weights(spec, quantize_model(spec, random_weights(spec, seed=5)))
    assert got == _reference_tokens(spec, {k: v.float() for k, v in dense.items()}, 6)


# ------------------------------------------------------------------------------------------ refusals

def _rewritten(tmp_path: Path, ckpt: Path, name: str, qcfg: dict | None = None, tensors=None) -> Path:
    """A copy of ``ckpt`` with ``qcfg`` merged into its quantization_config and ``tensors(t)`` applied to
    its tensors."""
    from safetensors.torch import load_file, save_file
    d = tmp_path / name
    shutil.copytree(ckpt, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"].update(qcfg or {})
    (d / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        t = load_file(str(d / "model.safetensors"))
        tensors(t)
        save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


def _permute_g_idx(t):
    prefix = "model.layers.0.mlp.down_proj"
    k = t[f"{prefix}.g_idx"].numel()
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(0))
    t[f"{prefix}.g_idx"] = (perm // 32).to(torch.int32)


def _dense_down(t):
    """layer 1's down projection left in bf16 (GPTQModel's dynamic skip), its packed tensors dropped"""
    from trtllm_mk.quant.gptq import read
    from trtllm_mk.quant.scheme import QuantScheme
    prefix = "model.layers.1.mlp.down_proj"
    out, k = t[f"{prefix}.qweight"].shape[1], t[f"{prefix}.g_idx"].numel()
    lin = read(t.get, prefix, out, k, QuantScheme("gptq", "int", 4, 32, False, variant="gptq"), "ckpt")
    for suffix in ("qweight", "qzeros", "scales", "g_idx"):
        t.pop(f"{prefix}.{suffix}", None)
    t[f"{prefix}.weight"] = lin.dequantize(torch.bfloat16)


@pytest.mark.parametrize("case,message", [
    ("w8", r"quantization: cannot be built into an engine: .*8-bit integer weights \(W8A16\) are not implemented "
           r"in the megakernel .*requantize with --bits 4"),
    # decided by the tensors at build, not by the flags (the engine would refuse them when it loads)
    ("act_order", r"cannot be laid out for this engine's W4A16 \(group 32\) kernel: model.layers.0.mlp.down_proj: "
                  r"activation-order groups \(g_idx\) cannot be laid out .*requantize with desc_act false"),
    ("permuted_without_desc_act", r"activation-order groups \(g_idx\) cannot be laid out"),
    ("dense_layer", r"cannot be laid out for this engine's W4A16 \(group 32\) kernel: model.layers.1.mlp.down_proj.weight "
                    r"is not quantized"),
])
def test_what_the_kernel_does_not_implement_is_refused_in_one_line(tmp_path, capsys, source, case, message):
    from trtllm_mk.cli.build import main
    ckpt = _quantize(source, tmp_path / case, "--format", "gptq", *(["--bits", "8"] if case == "w8" else
                                                                      ["--group-size", "32"]))
    if case == "act_order":
        ckpt = _rewritten(tmp_path, ckpt, "x", {"desc_act": True}, _permute_g_idx)
    elif case == "permuted_without_desc_act":   # a g_idx out of column order under desc_act false
        ckpt = _rewritten(tmp_path, ckpt, "x", None, _permute_g_idx)
    elif case == "dense_layer":
        ckpt = _rewritten(tmp_path, ckpt, "x", None, _dense_down)
    capsys.readouterr()                   # the quantize command's progress bar
    err = _cli_error(capsys, main, ["--config", str(_yaml(tmp_path, ckpt)), "--output-dir", str(tmp_path / "engine")])
    assert re.search(message, err) and "\n" not in err.strip(), err
    assert not (tmp_path / "engine").exists()


def test_flags_the_tensors_make_moot_do_not_refuse(tmp_path, source):
    """desc_act with groups in column order (per-channel scales, static groups), and an exclusion list
    naming modules outside the decoder layers, stream as any 4-bit checkpoint."""
    from trtllm_mk.build import check_buildable, check_weights
    gptq = _quantize(source, tmp_path / "g", "--format", "gptq", "--group-size", "32")
    awq = _quantize(source, tmp_path / "a", "--format", "awq", "--group-size", "32")
    for name, ckpt, qcfg in (("desc_act", gptq, {"desc_act": True}),
                             ("outside", awq, {"modules_to_not_convert": ["visual"]})):
        cfg = load_config(_yaml(tmp_path, _rewritten(tmp_path, ckpt, name, qcfg)))
        assert cfg.model_spec.weight_bits == 4
        check_buildable(cfg)
        check_weights(cfg, log=lambda *_: None)


def test_the_build_command_exits_2(tmp_path, source):
    ckpt = _quantize(source, tmp_path / "w8", "--format", "gptq", "--bits", "8")
    r = subprocess.run([sys.executable, "-m", "trtllm_mk", "build", "--config", str(_yaml(tmp_path, ckpt)),
                        "--output-dir", str(tmp_path / "engine")], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "(W8A16) are not implemented in the megakernel" in r.stderr and not (tmp_path / "engine").exists()


def test_layouts_the_kernel_cannot_take(tmp_path):
    from trtllm_mk.build import check_buildable
    from trtllm_mk.quant.scheme import PER_CHANNEL, QuantScheme
    cfg = load_config(_yaml(tmp_path, "tiny-llama", "quantization:\n  quant_algo: W4A16_GPTQ\n  group_size: 128\n"))
    odd = dataclasses.replace(cfg.model_spec, weight_bits=16, weight_group=0, hidden_size=96, num_heads=3,
                              num_kv_heads=1)
    with pytest.raises(ConfigError, match=r"hidden 96, q 96 and intermediate 256 sizes are not multiples of 128 "
                                          r"columns, which the quantized weight layouts need") as e:
        check_buildable(dataclasses.replace(cfg, model_spec=odd))
    assert "\n" not in str(e.value)
    wide = dataclasses.replace(cfg.model_spec, weight_bits=16, weight_group=0, hidden_size=512, num_heads=16)
    with pytest.raises(ConfigError, match=r"model.layers.0.self_attn.q_proj.weight \[512, 512\] cannot be laid out "
                                          r"for the megakernel: 512 input channels are not a multiple of the group "
                                          r"size 1024"):
        check_buildable(dataclasses.replace(cfg, model_spec=wide, quant_scheme=dataclasses.replace(
            cfg.quant_scheme, group_size=1024)))
    # per-channel scales take the largest of 128/64/32 dividing every layer's input channels
    per_channel = QuantScheme("gptq", "int", 4, PER_CHANNEL, False)
    assert kernel_group(cfg.model_spec, per_channel) == 128
    assert kernel_group(dataclasses.replace(odd, hidden_size=192, num_heads=6, num_kv_heads=2), per_channel) == 64
    with pytest.raises(UnsupportedQuantization, match="not multiples of 128 columns"):
        quantized_spec(odd, per_channel)


def test_engine_open_refuses_weights_the_engine_cannot_bind(tmp_path, source):
    """A 4-bit engine given a bf16 checkpoint, or a 4-bit one with other groups; a bf16 engine given a
    4-bit checkpoint on the GPU: one line each, naming what to do."""
    from trtllm_mk.runtime.hybrid import _load_engine_weights
    spec = dataclasses.replace(load_spec(source), weight_bits=4, weight_group=128)
    with pytest.raises(UserError, match="holds unquantized weights, but this engine streams W4A16 \\(group 128\\)"):
        _load_engine_weights(spec, source, "cpu", 0)
    awq = _quantize(source, tmp_path / "awq", "--format", "awq", "--group-size", "64")
    with pytest.raises(UserError, match="cannot be laid out for this engine's W4A16 \\(group 128\\) kernel: .*group "
                                        "size 64 cannot be laid out as 128"):
        _load_engine_weights(spec, awq, "cpu", 0)
    w8 = _quantize(source, tmp_path / "w8", "--format", "gptq", "--bits", "8")
    with pytest.raises(UserError, match=r"\(W8A16\) are not implemented in the megakernel"):
        _load_engine_weights(spec, w8, "cpu", 0)
    with pytest.raises(UserError, match="but this engine was built for bf16 weights"):
        _load_engine_weights(load_spec(source), awq, "cuda", 0)


def test_describe_counts_the_kernels_bytes():
    from trtllm_mk.deployment import describe
    cfg = load_config("h100_llama1b_w4a16")
    spec = cfg.model_spec
    out = describe(cfg)
    assert re.search(r"weights +\S+ GB W4A16 \(group 128\)", out), out
    floor = re.search(r"decode floor +(\S+) ms per token +\((\S+) GB of weights", out)
    assert float(floor.group(2)) == pytest.approx(spec.decode_weight_bytes() / 1e9, abs=0.006)
    assert spec.decode_weight_bytes() < dataclasses.replace(spec, weight_bits=16, weight_group=0).decode_weight_bytes() / 2


# --------------------------------------------------------------------------------------------- FP8

@pytest.mark.parametrize("fmt", list(FP8_FORMATS))
def test_fp8_checkpoints_configure_an_fp8_engine(tmp_path, source, capsys, fmt):
    """ModelOpt and compressed-tensors FP8 checkpoints (per-channel, per-tensor) give a spec with
    weight_bits 8 and the tile as group; the deployment summary names the format and counts its bytes
    (the built engines: the ``built`` fixture's tests)."""
    from trtllm_mk.cli.build import main
    from trtllm_mk.quant.kernel_layout import Fp8Layout, kernel_tensors, tile_cols
    from trtllm_mk.quant.kernel_support import weight_format
    args, bits, group, wf = FP8_FORMATS[fmt]
    ckpt = _quantize(source, tmp_path / "ckpt", *args)
    cfg = load_config(_yaml(tmp_path, ckpt))
    spec = cfg.model_spec
    assert (spec.weight_bits, spec.weight_group) == (bits, group) == (8, tile_cols(spec))
    assert cfg.quant_scheme.weight_type == "fp8" and weight_format(spec) == wf
    lin_bytes = 0
    for name, (shape, dtype) in kernel_tensors(spec).items():
        if name.endswith("_sz"):
            w = load_spec(ckpt).expected_tensors()[name[:-3]]
            assert shape == Fp8Layout(w[0], w[1], group).sz_shape and dtype == torch.int32
            assert kernel_tensors(spec)[name[:-3]] == (Fp8Layout(w[0], w[1], group).packed_shape, torch.uint8)
            lin_bytes += Fp8Layout(w[0], w[1], group).nbytes
    assert lin_bytes == sum(w[0] * w[1] + 4 * w[0] * (w[1] // group)
                            for n, w in spec.expected_tensors().items() if is_layer_linear(n, w))
    capsys.readouterr()
    assert main(["--config", str(_yaml(tmp_path, ckpt)), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"weights +\S+ MB {re.escape(wf)}", out), out
    assert not (tmp_path / "engine").exists()


@pytest.mark.parametrize("fmt", ["fp8", "ct-fp8-per-tensor"])
def test_an_fp8_engine_loads_its_checkpoint_in_the_kernel_layout(tmp_path, source, fmt):
    """What an FP8 engine binds is the checkpoint in the FP8 layout, and what its prefill and CPU
    executor compute with is kernel_dequantize_fp8 of the checkpoint's layers, bit for bit; on the GPU
    path the prefill gets PackedFp8Linear modules over the bound tensors."""
    from trtllm_mk.quant.kernel_layout import dequantize_fp8, kernel_dequantize_fp8, kernel_tensors
    from trtllm_mk.quant.packed_linear import PackedFp8Linear
    from trtllm_mk.runtime.hybrid import _dense_from_bound, _load_engine_weights
    ckpt = _quantize(source, tmp_path / "ckpt", *FP8_FORMATS[fmt][0])
    spec = load_config(_yaml(tmp_path, ckpt)).model_spec
    dense, bound = _load_engine_weights(spec, ckpt, "cpu", 0)
    layers = load_quantized(ckpt, load_spec(ckpt), read_scheme(ckpt))
    assert {k: (tuple(v.shape), v.dtype) for k, v in bound.items()} == kernel_tensors(spec)
    n = 0
    for name, shape in spec.expected_tensors().items():
        if is_layer_linear(name, shape):
            lin = layers[name]
            assert isinstance(lin, Fp8Linear) and lin.per_channel == (fmt == "fp8")
            assert torch.equal(dense[name], kernel_dequantize_fp8(lin)), name
            assert torch.equal(dequantize_fp8(bound[name], bound[name + "_sz"]), dense[name]), name
            n += 1
        else:
            assert torch.equal(dense[name], layers[name]), name
    assert n == 14
    mods = _dense_from_bound(spec, bound, packed=True)
    name = "model.layers.1.self_attn.o_proj.weight"
    assert isinstance(mods[name], PackedFp8Linear) and torch.equal(mods[name].weight(), dense[name])
    assert torch.equal(_dense_from_bound(spec, bound)[name], dense[name])
    # the CPU executor decodes these weights as the reference decoder does
    from test_verify import round_robin_schedule
    from trtllm_mk.executor import CpuExecutor
    from trtllm_mk.graph import TilePlan
    ref_tokens = _reference_tokens(spec, _kernel_weights_of(ckpt), 4)
    cache = PagedKVCache.allocate(spec, 1, 256, 32, dtype=torch.float32)
    ref = ReferenceDecoder(spec, _kernel_weights_of(ckpt), compute_dtype=torch.float32)
    logits = ref.prefill([PROMPT], cache)
    ex = CpuExecutor(spec, {k: v.float() for k, v in dense.items()}, round_robin_schedule(spec, TilePlan(), 4), cache)
    tok, got = int(logits.argmax(-1)[0]), []
    for t in range(3):
        got.append(tok)
        _, toks = ex.step(torch.tensor([tok]), torch.tensor([len(PROMPT) + t]))
        tok = int(toks[0])
    assert got + [tok] == ref_tokens


def test_random_fp8_weights_for_a_shapes_only_model(tmp_path):
    """A shapes-only model with an FP8 quantization section builds an FP8 engine; --weights random
    quantizes random weights to FP8 with per-channel scales, in the kernel layout, and decodes them as
    the reference does."""
    from trtllm_mk.model.random_weights import random_weights
    from trtllm_mk.quant.kernel_layout import kernel_weights, quantize_model
    from trtllm_mk.runtime.hybrid import _load_engine_weights
    cfg = load_config(_yaml(tmp_path, "tiny-llama", "quantization:\n  quant_algo: FP8_PER_CHANNEL_PER_TOKEN\n"
                                                    "  group_size: -1\n"))
    spec = cfg.model_spec
    from trtllm_mk.quant.kernel_layout import tile_cols
    assert (spec.weight_bits, spec.weight_group) == (8, tile_cols(spec))
    dense, bound = _load_engine_weights(spec, "random", "cpu", 5)
    want_bind, want = kernel_weights(spec, quantize_model(spec, random_weights(spec, seed=5)))
    assert bound.keys() == want_bind.keys() and all(torch.equal(bound[k], want_bind[k]) for k in bound)
    assert all(torch.equal(dense[k], want[k]) for k in want)
    assert bound["model.layers.0.mlp.up_proj.weight"].dtype == torch.uint8
    # built and decoded on the CPU executor: the reference's tokens on those weights
    from trtllm_mk.build import build_engine
    from trtllm_mk.runtime.hybrid import HybridEngine
    build_engine(cfg, tmp_path / "engine", show_progress=False)
    eng = HybridEngine(tmp_path / "engine", weights="random", seed=5, simulate=True)
    try:
        got = eng.generate([PROMPT], 6, eos_ids=()).tokens[0]
    finally:
        eng.close()
    assert got == _reference_tokens(spec, {k: v.float() for k, v in want.items()}, 6)


def test_fp8_block_scales_and_mismatched_checkpoints_are_refused(tmp_path, source, capsys):
    """Block-scaled FP8 is refused in one line (by the loader reading the checkpoint, by the kernel
    support check for a scheme); an FP8 checkpoint does not load into a 4-bit engine, nor a 4-bit one
    into an FP8 engine."""
    from trtllm_mk.cli.build import main
    from trtllm_mk.quant.kernel_support import unsupported_reason
    from trtllm_mk.quant.scheme import QuantScheme
    from trtllm_mk.runtime.hybrid import _load_engine_weights
    ckpt = _quantize(source, tmp_path / "ct", "--format", "ct-fp8")
    block = tmp_path / "block"
    shutil.copytree(ckpt, block)
    cfg = json.loads((block / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = "block"
    (block / "config.json").write_text(json.dumps(cfg))
    capsys.readouterr()
    err = _cli_error(capsys, main, ["--config", str(_yaml(tmp_path, block)), "--output-dir", str(tmp_path / "engine")])
    assert "block scales are not" in err, err
    assert not (tmp_path / "engine").exists()
    blocked = QuantScheme("modelopt", "fp8", 8, 128, False, variant="FP8_BLOCK_SCALES", exclude_modules=("lm_head",))
    assert "FP8 weights with block scales (group size 128) are not implemented in the megakernel" in \
        unsupported_reason(blocked)
    with pytest.raises(UnsupportedQuantization, match="block scales"):
        quantized_spec(load_spec(source), blocked)

    spec4 = dataclasses.replace(load_spec(source), weight_bits=4, weight_group=128)
    with pytest.raises(UserError, match=r"cannot be laid out for this engine's W4A16 \(group 128\) kernel: .*FP8 "
                                        r"weights are not the kernel's 4-bit integer layout"):
        _load_engine_weights(spec4, ckpt, "cpu", 0)
    spec8 = dataclasses.replace(load_spec(source), weight_bits=8, weight_group=256)
    gptq = _quantize(source, tmp_path / "gptq", "--format", "gptq")
    with pytest.raises(UserError, match=r"cannot be laid out for this engine's FP8 \(e4m3, per-channel scales\) "
                                        r"kernel: .*4-bit integer weights are not the kernel's FP8 layout"):
        _load_engine_weights(spec8, gptq, "cpu", 0)
    with pytest.raises(UserError, match=r"holds unquantized weights, but this engine streams FP8 \(e4m3"):
        _load_engine_weights(spec8, source, "cpu", 0)


# --------------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["gptq", "awq", "fp8", "ct-fp8"])
def test_a_quantized_checkpoint_decodes_on_the_megakernel_as_the_reference_does(tmp_path, source, fmt):
    """The megakernel streams the packed layers: its greedy tokens, teacher-forced over its own KV
    history, are the reference decoder's on the kernel's weights (bf16 rounding may flip a rare near
    tie, as in test_hybrid_gpu.py)."""
    from trtllm_mk.build import build_engine
    from trtllm_mk.runtime.hybrid import HybridEngine
    new = 64
    ckpt = _quantize(source, tmp_path / "ckpt", *ALL_FORMATS[fmt][0])
    out, _ = build_engine(load_config(_yaml(tmp_path, ckpt, gpu="auto")), tmp_path / "engine", show_progress=False)
    eng = HybridEngine(out)
    try:
        assert eng.decode_weights["model.layers.0.mlp.up_proj.weight"].dtype == torch.uint8
        res = eng.generate([PROMPT], new, eos_ids=())
        w = {k: v.cuda() for k, v in _kernel_weights_of(ckpt).items()}
        ref = ReferenceDecoder(eng.spec, w, torch.float32, gemv_input_dtype=torch.bfloat16)
        first = ref.prefill([PROMPT], PagedKVCache.allocate(eng.spec, 1, 256, eng.tokens_per_block, device="cuda"))
        assert int(first.argmax(-1)[0]) == res.tokens[0][0]
        cache = PagedKVCache(eng.cache.pool.clone(), eng.cache.block_table.clone(), eng.cache.tokens_per_block)
        flips = 0
        for t in range(new - 1):
            cache.pool.copy_(eng.cache.pool)   # each reference step starts from the engine's own state
            tok = torch.tensor([res.tokens[0][t]], device="cuda")
            want = int(ref.decode(tok, torch.tensor([len(PROMPT) + t], device="cuda"), cache).argmax(-1)[0])
            flips += int(want != res.tokens[0][t + 1])
        assert flips <= 1, f"{flips} tokens differ from the reference"
    finally:
        eng.close()


@pytest.mark.parametrize("fmt", ["gptq", "fp8"])
def test_a_quantized_mixture_of_experts_is_refused_naming_the_experts(tmp_path, fmt):
    # whatever the layout would say about an expert's width, the cause is that the expert kinds stream
    # bf16 weights
    from trtllm_mk.build import check_buildable
    from trtllm_mk.model.tiny import write_tiny_checkpoint
    src = write_tiny_checkpoint(tmp_path / "moe", family="qwen3_moe", seed=2, mlp_only_layers=[])   # every layer sparse
    ckpt = _quantize(src, tmp_path / "q", "--format", fmt, *(["--group-size", "32"] if fmt == "gptq" else []))
    with pytest.raises(ConfigError, match=r"quantization: cannot be built into an engine: a mixture-of-experts "
                                          r"model with .* weights; the megakernel streams bf16 experts") as e:
        check_buildable(load_config(_yaml(tmp_path, ckpt)))
    assert "\n" not in str(e.value)
