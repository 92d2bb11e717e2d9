"""The W4A16 decode benchmark on the CPU: its weights, the int4 (tinygemm) baseline through torch's CPU
tinygemm ops against the dequantized weights, the system choice, the floor, and --cpu-smoke."""
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import decode_latency  # noqa: E402
from benchmarks.baselines import SYSTEMS, StaticCacheDecoder, random_prompt, register_system  # noqa: E402
from benchmarks.int4_baseline import TinygemmLinear, compile_int4_system, int4_decoder, tinygemm_ops  # noqa: E402
from benchmarks.w4a16_weights import W4A16Weights, w4a16_spec, w4a16_weights  # noqa: E402
from trtllm_mk.errors import UserError  # noqa: E402
from trtllm_mk.model.spec import spec_from_hf_config  # noqa: E402
from trtllm_mk.model.tiny import tiny_config  # noqa: E402
from trtllm_mk.quant.kernel_layout import kernel_dequantize  # noqa: E402
from trtllm_mk.quant.rtn import quantize_int  # noqa: E402
from trtllm_mk.seam import SCALE_SUFFIX  # noqa: E402

CPU = torch.device("cpu")


def _spec(family="llama"):
    return spec_from_hf_config(tiny_config(family), name=f"tiny-{family}")


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("group", [32, 128])
def test_tinygemm_linear_applies_the_quantized_weights(group):
    """Asymmetric codes whose zero points span the whole range: tinygemm's (scale, offset) pairs must
    reproduce scale * (code - zero) (an offset of 0, i.e. zero points ignored, is far off)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 256, generator=gen) + 3 * torch.rand(48, 256 // group, 1, generator=gen).repeat_interleave(
        group, 1).view(48, 256) - 1.5
    parts = [quantize_int(f"p{i}", w[16 * i:16 * (i + 1)], 4, group, False, torch.bfloat16) for i in range(3)]
    assert len({int(z) for p in parts for z in p.zeros.flatten()}) > 8
    lin = TinygemmLinear(parts, CPU)
    x = torch.randn(5, 256, generator=gen).to(torch.bfloat16)
    want = x.float() @ torch.cat([kernel_dequantize(p).float() for p in parts]).t()
    got = lin(x)
    assert got.shape == (5, 48) and got.dtype == torch.bfloat16
    assert _rel(got, want) < 1e-2
    lin.scales_and_zeros[..., 1] = 0
    assert _rel(lin(x), want) > 0.1


@pytest.mark.parametrize("family,group,symmetric", [("llama", 128, True), ("qwen2", 32, False), ("qwen3", 64, True)])
def test_int4_decoder_matches_the_dequantized_decoder(family, group, symmetric):
    """The int4 baseline decodes the model the megakernel binds: its logits (tinygemm's CPU ops) agree
    with the static-cache decoder on the dequantized weights, prefill and decode (Qwen2: q/k/v biases)."""
    spec = w4a16_spec(_spec(family), group)
    w = w4a16_weights(spec, CPU, torch.bfloat16, seed=2, symmetric=symmetric)
    dense = StaticCacheDecoder(spec, w, 2, 32)
    dec, tok, pos = int4_decoder(spec, w, 2, 20, CPU)
    assert all(isinstance(b.wqkv, TinygemmLinear) and isinstance(b.w_down, TinygemmLinear) for b in dec.decoder.layers)
    prompt = random_prompt(spec, 2, 20, CPU)
    with torch.no_grad():
        dense.prefill(prompt)
        assert _rel(dec.decode_step(tok, pos), dense.decode_step(tok, pos)) < 3e-2


def test_w4a16_weights_forms_agree():
    spec = w4a16_spec(_spec(), 64)
    w = w4a16_weights(spec, CPU)
    assert isinstance(w, W4A16Weights) and w.group == 64 and w.symmetric
    name = "model.layers.1.self_attn.k_proj.weight"
    assert torch.equal(w[name], kernel_dequantize(w.linears[name], torch.bfloat16))   # the kernel's, rounded once
    assert w.kernel[name].dtype == torch.uint8 and w.kernel[name + SCALE_SUFFIX].dtype == torch.int32
    assert w.kernel["model.norm.weight"] is w["model.norm.weight"]
    assert set(w) == set(spec.expected_tensors())
    with pytest.raises(ValueError, match="not a quantized spec"):
        w4a16_weights(_spec(), CPU)


def test_fp8_weights_forms_agree():
    from benchmarks.w4a16_weights import fp8_spec
    from trtllm_mk.quant.kernel_layout import dequantize_fp8, tile_cols
    from trtllm_mk.quant.linear import Fp8Linear
    spec = fp8_spec(_spec())
    assert (spec.weight_bits, spec.weight_group) == (8, tile_cols(spec))
    w = w4a16_weights(spec, CPU)
    name = "model.layers.1.mlp.gate_proj.weight"
    assert isinstance(w.linears[name], Fp8Linear) and torch.equal(w[name], kernel_dequantize(w.linears[name]))
    assert torch.equal(dequantize_fp8(w.kernel[name], w.kernel[name + SCALE_SUFFIX]), w[name])
    assert sum(t.numel() * t.element_size() for t in w.kernel.values()) == spec.weight_bytes()
    import dataclasses
    with pytest.raises(UserError, match="--weights fp8: odd: .*not multiples of 128 columns"):
        fp8_spec(dataclasses.replace(_spec(), name="odd", hidden_size=96, num_heads=3, num_kv_heads=1))


def test_w4a16_spec_names_the_matrix_a_group_does_not_fit():
    with pytest.raises(UserError, match=r"--group 96: tiny-llama's model\.layers\.0\.self_attn\.q_proj\.weight"):
        w4a16_spec(_spec(), 96)
    assert w4a16_spec(_spec(), 32).weight_group == 32


def test_int4_baseline_reports_what_is_missing():
    with pytest.raises(RuntimeError, match="has no aten._weight_int4pack_mm_for_cpu"):
        tinygemm_ops(CPU, SimpleNamespace(_convert_weight_to_int4pack_for_cpu=object()))
    with pytest.raises(RuntimeError, match="has no aten._convert_weight_to_int4pack "):
        tinygemm_ops(torch.device("cuda"), SimpleNamespace())
    spec = w4a16_spec(_spec(), 128)
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        compile_int4_system(spec, w4a16_weights(spec, CPU), 1, 16, CPU)
    with pytest.raises(ValueError, match="--weights w4a16"):
        int4_decoder(spec, {}, 1, 16, CPU)


def test_default_systems_by_weight_format():
    builtin = list(SYSTEMS)   # the int4 systems included: this module imported int4_baseline
    assert decode_latency.default_systems("bf16", builtin) == list(SYSTEMS)
    assert decode_latency.default_systems("w4a16", builtin) == ["torch.compile int4", "torch.compile"]
    register_system("plugin-x", lambda *a: None)
    try:
        assert decode_latency.default_systems("w4a16", builtin) == ["torch.compile int4", "torch.compile", "plugin-x"]
    finally:
        del SYSTEMS["plugin-x"]


def _run(args, tmp_path):
    env = {"PYTHONPATH": f"{REPO}:{tmp_path}", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    return subprocess.run([sys.executable, "-m", "benchmarks.decode_latency", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


PLUGIN = """
from benchmarks.baselines import SystemRun, register_system

def fake(spec, weights, batch, context_len, device):
    kernel = weights.kernel
    return SystemRun(step=lambda: None, info={"packed": str(kernel["model.layers.0.mlp.down_proj.weight"].dtype)})

register_system("fake-mk", fake)
"""


def test_cpu_smoke_w4a16_floor_and_systems(tmp_path):
    (tmp_path / "mk_plugin.py").write_text(PLUGIN)
    out = tmp_path / "out"
    r = _run(["--cpu-smoke", "--out", str(out), "--weights", "w4a16", "--group", "64", "--plugin", "mk_plugin"],
             tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads((out / "report.json").read_text())
    assert rep["systems"] == ["torch.compile int4", "torch.compile", "fake-mk"]
    assert rep["weights"]["format"] == "w4a16" and rep["weights"]["group"] == 64
    spec = w4a16_spec(spec_from_hf_config(tiny_config("llama")), 64)
    names = [f"tiny-llama:w4a16-g64/b{b}/ctx{c}" for b in (1, 2) for c in (16, 32)]
    assert [c["name"] for c in rep["configs"]] == names
    for c in rep["configs"]:
        # the floor reads the 4-bit codes and scale words, not the dequantized bf16 dict the systems get
        assert c["weight_bytes"] == spec.decode_weight_bytes(c["batch"]) < spec.num_params()   # < half of bf16
        kv = c["batch"] * c["context_len"] * spec.kv_bytes_per_token(4)
        assert c["kv_bytes"] == kv
        assert c["floor_ms"] == pytest.approx((c["weight_bytes"] + kv) / rep["read_bandwidth"]["bytes_per_s"] * 1e3)
        assert c["systems"]["fake-mk"]["info"] == {"packed": "torch.uint8"}
        assert "CUDA" in c["systems"]["torch.compile int4"]["error"]
    md = (out / "report.md").read_text()
    assert "Weights: w4a16, group 64" in md and "| tiny-llama:w4a16-g64 | 2 | 32 | fake-mk |" in md


def test_cpu_smoke_times_the_eager_int4_decoder(tmp_path):
    out = tmp_path / "out"
    r = _run(["--cpu-smoke", "--out", str(out), "--weights", "w4a16", "--systems", "eager int4"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads((out / "report.json").read_text())
    for c in rep["configs"]:
        res = c["systems"]["eager int4"]
        assert res["status"] == "ok", res
        assert res["fraction_of_floor"] == pytest.approx(c["floor_ms"] / res["tpot_ms"]["p50"])


@pytest.mark.parametrize("args,msg", [(["--group", "64"], "--group applies to 4-bit quantized weights"),
                                      (["--weights", "fp8", "--group", "64"], "--group applies to 4-bit"),
                                      (["--weights", "w4a16", "--group", "96"], "--group 96: tiny-llama's")])
def test_w4a16_argument_mistakes_are_one_line(tmp_path, args, msg):
    r = _run(["--cpu-smoke", "--out", str(tmp_path / "out"), *args], tmp_path)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and msg in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_int4_decode_step_traces_as_one_graph():
    """The int4 step under fullgraph=True (what the torch.compile int4 system compiles): the tinygemm
    linears and the decoder's weight dispatch trace without a graph break."""
    spec = w4a16_spec(_spec("qwen2"), 64)
    w = w4a16_weights(spec, CPU, torch.bfloat16, seed=1)
    with torch.no_grad():
        dec, tok, pos = int4_decoder(spec, w, 2, 20, CPU)
        want = dec.decode_step(tok, pos).clone()
        got = torch.compile(dec.decode_step, backend="eager", fullgraph=True, dynamic=False)(tok, pos)
    torch.testing.assert_close(got, want)


# ------------------------------------------------------------------------------------ FP8

def test_fp8_linear_applies_the_codes_and_their_row_scales():
    from benchmarks.fp8_baseline import Fp8WeightOnlyLinear
    from benchmarks.w4a16_weights import fp8_spec
    spec = fp8_spec(_spec("llama"))
    w = w4a16_weights(spec, CPU, torch.bfloat16, seed=2)
    name = "model.layers.0.mlp.gate_proj.weight"
    lin = Fp8WeightOnlyLinear([w.linears[name], w.linears[name.replace("gate", "up")]], CPU)
    x = torch.randn(3, spec.hidden_size).to(torch.bfloat16)
    want = x.float() @ torch.cat([w[name], w[name.replace("gate", "up")]]).float().t()
    assert _rel(lin(x), want) < 2e-2
    lin.scale.fill_(1.0)   # without the row scales the product is far off
    assert _rel(lin(x), want) > 0.5


def test_cpu_smoke_times_the_eager_fp8_decoder(tmp_path):
    out = tmp_path / "out"
    r = _run(["--cpu-smoke", "--out", str(out), "--weights", "fp8", "--systems", "eager fp8", "torch.compile fp8"],
             tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads((out / "report.json").read_text())
    assert rep["weights"]["format"] == "fp8"
    from benchmarks.w4a16_weights import fp8_spec
    spec = fp8_spec(spec_from_hf_config(tiny_config("llama")))
    for c in rep["configs"]:
        assert c["name"].startswith("tiny-llama:fp8/")
        assert c["weight_bytes"] == spec.decode_weight_bytes(c["batch"])
        assert c["systems"]["eager fp8"]["status"] == "ok"
        assert "CUDA" in c["systems"]["torch.compile fp8"]["error"]
    assert "Weights: fp8 (e4m3" in (out / "report.md").read_text()
