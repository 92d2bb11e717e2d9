"""Quantized checkpoints: the quantize command, each format's layout read back and dequantized, the
deployment's quantization section, and refusals.

Every dequantization is checked exactly against the format's formula written here in numpy straight
from the tensors on disk (independent of trtllm_mk.quant's unpacking), and within the round-to-nearest
error bound against the original weights. Checkpoints written by compressed-tensors itself are read
and compared with that library's own decompression, and ours are decompressed by it.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from trtllm_mk.config import load_config, parse_config
from trtllm_mk.errors import ConfigError, ModelError, UserError, run_cli
from trtllm_mk.model.checkpoint import load_checkpoint
from trtllm_mk.model.spec import load_spec
from trtllm_mk.model.tiny_tokenizer import write_tiny_tokenizer
from trtllm_mk.quant import Fp8Linear, IntLinear, load_dequantized, load_quantized, read_scheme
from trtllm_mk.quant import awq, compressed_tensors, gptq
from trtllm_mk.quant.packing import pack_last, unpack_last
from trtllm_mk.quant.rtn import quantize_int
from trtllm_mk.quant.scheme import PER_CHANNEL, QuantScheme
from trtllm_mk.quant.writer import MARK_FILE

ROOT = Path(__file__).resolve().parents[1]
_SHAPES = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=1024,
               bos_token_id=1, eos_token_id=2)


def _hf_checkpoint(d: Path, family: str = "llama", seed: int = 0) -> Path:
    """A tiny checkpoint written by transformers' save_pretrained (bf16), with a tokenizer."""
    import transformers
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[family]
    extra = {"tie_word_embeddings": False} if family == "llama" else {}
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cls(**_SHAPES, initializer_range=0.1, **extra),
                                                          dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():   # norms off 1 and biases off 0, so both matter
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(d)
    write_tiny_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return _hf_checkpoint(tmp_path_factory.mktemp("src") / "tiny-llama")


@pytest.fixture(scope="module")
def source_qwen2(tmp_path_factory):
    return _hf_checkpoint(tmp_path_factory.mktemp("src") / "tiny-qwen2", "qwen2", seed=1)


def _quantize(src: Path, out: Path, *args: str) -> Path:
    from trtllm_mk.cli.quantize import main
    assert main([*args, str(src), str(out)]) == 0
    return out


def _cli_error(capsys, main, argv) -> str:
    """The one stderr line of a command that must fail with exit code 2."""
    with pytest.raises(SystemExit) as e:
        run_cli(lambda: main(argv))
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


# ------------------------------------------------------------------- the formats' formulas, in numpy

def _fields(words: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Unsigned ``bits``-wide fields of int32 ``words``, unpacked along ``axis`` (lowest bits first)."""
    u = words.astype(np.int64) & 0xFFFFFFFF
    per = 32 // bits
    parts = [(u >> (bits * i)) & ((1 << bits) - 1) for i in range(per)]
    stacked = np.stack(parts, axis=axis + 1)            # [..., W, per, ...]
    shape = list(words.shape)
    shape[axis] *= per
    return stacked.reshape(shape)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.float64).numpy() if t.is_floating_point() else t.numpy()


def _gptq_formula(t: dict, prefix: str, bits: int, v1: bool = True) -> np.ndarray:
    codes = _fields(t[f"{prefix}.qweight"].numpy(), bits, 0)          # [in, out]
    zeros = _fields(t[f"{prefix}.qzeros"].numpy(), bits, 1) + (1 if v1 else 0)   # [G, out]
    g = t[f"{prefix}.g_idx"].numpy().astype(np.int64)
    return (_np(t[f"{prefix}.scales"])[g] * (codes - zeros[g])).T


def _awq_formula(t: dict, prefix: str, group_size: int) -> np.ndarray:
    order = [0, 2, 4, 6, 1, 3, 5, 7]          # field i of word c holds output 8c + order[i]

    def unpack(words):
        f = _fields(words, 4, 1).reshape(words.shape[0], -1, 8)
        out = np.empty_like(f)
        out[:, :, order] = f
        return out.reshape(words.shape[0], -1)
    codes, zeros = unpack(t[f"{prefix}.qweight"].numpy()), unpack(t[f"{prefix}.qzeros"].numpy())
    g = np.arange(codes.shape[0]) // group_size
    return (_np(t[f"{prefix}.scales"])[g] * (codes - zeros[g])).T


def _ct_int_formula(t: dict, prefix: str, bits: int) -> np.ndarray:
    out, k = (int(v) for v in t[f"{prefix}.weight_shape"])
    q = _fields(t[f"{prefix}.weight_packed"].numpy(), bits, 1)[:, :k] - (1 << (bits - 1))     # signed
    scale = _np(t[f"{prefix}.weight_scale"])
    zp = np.zeros_like(scale)
    if f"{prefix}.weight_zero_point" in t:
        zp = _fields(t[f"{prefix}.weight_zero_point"].numpy(), bits, 0)[:out] - (1 << (bits - 1))
    g = np.arange(k) // (k // scale.shape[1])
    return scale[:, g] * (q - zp[:, g])


def _e4m3(w: torch.Tensor) -> np.ndarray:
    """float8_e4m3fn bits decoded by hand: sign, 4 exponent bits (bias 7), 3 mantissa bits."""
    b = w.view(torch.uint8).numpy().astype(np.int64)
    e, m = (b >> 3) & 0xF, b & 7
    v = np.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (e - 7))
    return np.where(b >> 7, -v, v)


def _fp8_formula(t: dict, prefix: str) -> np.ndarray:
    s = _np(t[f"{prefix}.weight_scale"]).reshape(-1)
    w = _e4m3(t[f"{prefix}.weight"])
    return w * (s[:, None] if s.size > 1 else s[0])


# ------------------------------------------------------------------------ quantize -> read -> compare

# (quantize arguments, quant_algo, formula, relative bound in units of the stored scale or |w|)
CASES = {
    "gptq-int4-g128-sym": (["--format", "gptq"], "W4A16_GPTQ"),
    "gptq-int4-g32-zp": (["--format", "gptq", "--group-size", "32", "--zero-point"], "W4A16_GPTQ"),
    "gptq-int8-channel-zp": (["--format", "gptq", "--bits", "8", "--group-size", "-1", "--zero-point"], "W8A16"),
    "gptq-int8-g64-sym": (["--format", "gptq", "--bits", "8", "--group-size", "64"], "W8A16_GPTQ"),
    "awq-g64": (["--format", "awq", "--group-size", "64"], "W4A16_AWQ"),
    "awq-g128": (["--format", "awq"], "W4A16_AWQ"),
    "ct-int4-g128-sym": (["--format", "ct-w4a16"], "W4A16_GPTQ"),
    "ct-int4-g64-zp": (["--format", "ct-w4a16", "--group-size", "64", "--zero-point"], "W4A16_GPTQ"),
    "ct-int8-channel": (["--format", "ct-w4a16", "--bits", "8", "--group-size", "-1"], "W8A16"),
    "fp8-modelopt": (["--format", "fp8"], "FP8_PER_CHANNEL_PER_TOKEN"),
    "ct-fp8-channel": (["--format", "ct-fp8"], "FP8_PER_CHANNEL_PER_TOKEN"),
    "ct-fp8-tensor": (["--format", "ct-fp8", "--per-tensor"], "FP8"),
}


def _formula(scheme: QuantScheme, t: dict, prefix: str) -> np.ndarray:
    if scheme.weight_type == "fp8":
        return _fp8_formula(t, prefix)
    if scheme.method == "gptq":
        return _gptq_formula(t, prefix, scheme.bits)
    if scheme.method == "awq":
        return _awq_formula(t, prefix, scheme.group_size)
    return _ct_int_formula(t, prefix, scheme.bits)


@pytest.mark.parametrize("case", sorted(CASES))
def test_quantized_checkpoint_dequantizes_to_the_format_formula_within_the_error_bound(tmp_path, source, case):
    args, algo = CASES[case]
    out = _quantize(source, tmp_path / case, *args)
    scheme = read_scheme(out)
    assert scheme.quant_algo == algo
    spec = load_spec(source)
    original = load_checkpoint(source, spec)
    raw = load_file(str(out / "model.safetensors"))
    layers = load_quantized(out, spec, scheme)
    quantized = [n for n, v in layers.items() if isinstance(v, (IntLinear, Fp8Linear))]
    # every linear of the decoder blocks, nothing else: embedding, norms and LM head stay as they were
    assert sorted(quantized) == sorted(n for n, s in spec.expected_tensors().items()
                                       if len(s) == 2 and n.startswith("model.layers."))
    for name, v in layers.items():
        if name not in quantized:
            assert torch.equal(v, original[name]), name
            continue
        prefix = name[:-len(".weight")]
        got = v.dequantize()
        assert got.dtype == torch.float32 and tuple(got.shape) == spec.expected_tensors()[name]
        want = _formula(scheme, raw, prefix).astype(np.float32)
        assert np.array_equal(got.numpy(), want), f"{name}: differs from the {scheme.method} formula"
        err = (got - original[name].float()).abs()
        if isinstance(v, IntLinear):
            # half a step of the stored scale; the scale's own rounding (fp16 / bf16) can push the ends
            # of the range by up to 2**bits steps of its relative precision
            eps = torch.finfo(v.scales.dtype).eps
            step = v.scales.float()[:, v.group_of_input()]
            assert bool((err <= step * (0.5 + (1 << v.bits) * eps) + 1e-12).all()), name
        else:   # e4m3: 3 mantissa bits, relative half-ulp 2**-4; subnormals below 2**-6 scaled steps
            s = v.scale.float()[:, None] if v.per_channel else v.scale.float()
            bound = torch.maximum(original[name].float().abs() * 2.0 ** -4, s * 2.0 ** -10)
            assert bool((err <= bound * 1.001).all()), name
        assert float(err.max()) > 0   # it is quantized
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    assert json.loads((out / MARK_FILE).read_text())["quant_algo"] == algo
    # the bf16 load path used by the reference decoder and the CPU executor: the same values, rounded once
    deq = load_checkpoint(out, spec, dtype=torch.bfloat16)
    assert torch.equal(deq[quantized[0]], layers[quantized[0]].dequantize().to(torch.bfloat16))


def test_qwen2_biases_pass_through_unquantized(tmp_path, source_qwen2):
    out = _quantize(source_qwen2, tmp_path / "q", "--format", "awq")
    spec = load_spec(source_qwen2)
    layers, original = load_quantized(out, spec, read_scheme(out)), load_checkpoint(source_qwen2, spec)
    bias = "model.layers.1.self_attn.k_proj.bias"
    assert torch.equal(layers[bias], original[bias]) and float(original[bias].abs().max()) > 0.01
    assert isinstance(layers["model.layers.1.self_attn.k_proj.weight"], IntLinear)


@pytest.mark.parametrize("fmt", ["gptq", "ct-w4a16", "fp8"])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_mixture_of_experts_routers_stay_unquantized(tmp_path, family, fmt):
    from trtllm_mk.model.tiny import write_tiny_checkpoint
    src = write_tiny_checkpoint(tmp_path / family, family=family, seed=2)
    out = _quantize(src, tmp_path / "q", "--format", fmt, *(["--group-size", "32"] if fmt != "fp8" else []))
    spec = load_spec(src)
    router, experts = spec.moe_names(spec.moe_layers[0])
    layers, original = load_quantized(out, spec, read_scheme(out)), load_checkpoint(src, spec)
    assert torch.equal(layers[router], original[router])   # stored as it was, not as codes
    assert isinstance(layers[experts[0][0]], (IntLinear, Fp8Linear))
    on_disk = {n for f in out.glob("*.safetensors") for n in load_file(str(f))}
    assert router in on_disk and not any(n.startswith(router[:-len(".weight")] + ".") and n != router for n in on_disk)
    if fmt == "ct-w4a16":   # compressed-tensors lists every Linear it leaves alone
        import re
        ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
        module = router[:-len(".weight")]
        assert "lm_head" in ignore and any(p.startswith("re:") and re.match(p[3:], module) for p in ignore)


@pytest.mark.parametrize("bits", [4, 8])
def test_packing_is_little_end_first(bits):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (6, 64), generator=g, dtype=torch.int32)
    words = pack_last(codes, bits)
    assert words.dtype == torch.int32 and words.shape == (6, 64 * bits // 32)
    assert torch.equal(unpack_last(words, bits), codes)
    assert np.array_equal(_fields(words.numpy(), bits, 1), codes.numpy())


@pytest.mark.parametrize("module,scheme", [
    (gptq, QuantScheme("gptq", "int", 4, 32, True, variant="gptq")),
    (gptq, QuantScheme("gptq", "int", 8, PER_CHANNEL, True, variant="gptq_v2")),
    (awq, QuantScheme("awq", "int", 4, 64, True, variant="gemm")),
    (compressed_tensors, QuantScheme("compressed-tensors", "int", 4, 32, True, variant="pack-quantized")),
    (compressed_tensors, QuantScheme("compressed-tensors", "int", 8, 64, False, variant="pack-quantized")),
])
def test_each_layout_reads_back_the_packed_form_it_wrote(module, scheme):
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(3)) * 0.05
    scale_dtype = torch.float16 if module in (gptq, awq) else torch.bfloat16
    lin = quantize_int("p", w, scheme.bits, scheme.group_size, not scheme.has_zero_point, scale_dtype,
                       min_zero=1 if scheme.variant == "gptq" else 0)
    tensors = {f"p.{k}": v for k, v in module.write(lin, scheme).items()}
    back = module.read(tensors.get, "p", 64, 128, scheme, "test")
    assert torch.equal(back.qweight, lin.qweight) and torch.equal(back.scales, lin.scales)
    assert (back.zeros is None) == (lin.zeros is None)
    if lin.zeros is not None:
        assert torch.equal(back.zeros, lin.zeros)
    assert torch.equal(back.dequantize(), lin.dequantize())


# --------------------------------------------------------------------------- GPTQ activation order

def _rewrite(ckpt: Path, tensors: dict | None = None, qcfg: dict | None = None, drop_qcfg: bool = False) -> None:
    if tensors is not None:
        save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((ckpt / "config.json").read_text())
    if drop_qcfg:
        del cfg["quantization_config"]
    elif qcfg is not None:
        cfg["quantization_config"] = {**cfg["quantization_config"], **qcfg}
    (ckpt / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("case,message", [
    ("v2_labelled_v1", r"every zero point reads 9: a checkpoint_format gptq / gptq_v2 mix-up\?"),
    ("v1_labelled_v2", r"every zero point reads 7: a checkpoint_format gptq_v2 / gptq mix-up\?"),
    ("asymmetric_labelled_sym", r"zero points .*: an asymmetric checkpoint\?"),
])
def test_gptq_sym_is_checked_against_its_zero_points(tmp_path, source, case, message):
    args = ["--zero-point"] if case == "asymmetric_labelled_sym" else []
    out = _quantize(source, tmp_path / "g", "--format", "gptq", *args)
    t = load_file(str(out / "model.safetensors"))
    qcfg = {"sym": True}
    if case == "v2_labelled_v1":   # gptq_v2 stores the zero itself; read as v1 it is one more
        t = {k: (torch.full_like(v, 0x88888888 - (1 << 32)) if k.endswith("qzeros") else v) for k, v in t.items()}
    elif case == "v1_labelled_v2":
        qcfg["checkpoint_format"] = "gptq_v2"
    _rewrite(out, t, qcfg)
    with pytest.raises(ModelError, match=r"declares sym: true \(zero point 8\), but its qzeros do not \(" + message):
        load_quantized(out, load_spec(out), read_scheme(out))


def test_other_writers_spellings_of_the_same_config(tmp_path, source):
    """compressed-tensors FP8 saved naive-quantized (its default for FP8) and the older compression_config
    key read as float-quantized under quantization_config; GPTQModel's "format" as checkpoint_format."""
    ct = _quantize(source, tmp_path / "ct", "--format", "ct-fp8")
    want = load_dequantized(ct, load_spec(ct), read_scheme(ct))
    cfg = json.loads((ct / "config.json").read_text())
    for group in cfg["quantization_config"]["config_groups"].values():
        group["format"] = "naive-quantized"
    cfg["quantization_config"]["format"] = "naive-quantized"
    cfg["compression_config"] = cfg.pop("quantization_config")
    (ct / "config.json").write_text(json.dumps(cfg))
    scheme = read_scheme(ct)
    assert scheme.weight_type == "fp8" and scheme.variant == "float-quantized"
    got = load_dequantized(ct, load_spec(ct), scheme)
    assert all(torch.equal(got[k], want[k]) for k in want)
    for group in cfg["compression_config"]["config_groups"].values():
        group["weights"] |= {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 128}
    (ct / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="naive-quantized integer weights .* save them pack-quantized"):
        read_scheme(ct)
    gptq = _quantize(source, tmp_path / "g", "--format", "gptq")
    _rewrite(gptq, None, {"checkpoint_format": None, "format": "marlin"})
    with pytest.raises(ModelError, match="GPTQ checkpoint_format 'marlin' is not supported"):
        read_scheme(gptq)


def test_an_autogptq_native_checkpoint_reads_as_its_config_json_form(tmp_path, source):
    """AutoGPTQ's quantize_config.json (no quant_method, config.json without quantization_config) and its
    one weight file of another name."""
    g = _quantize(source, tmp_path / "g", "--format", "gptq", "--group-size", "64")
    want = load_dequantized(g, load_spec(g), read_scheme(g))
    cfg = json.loads((g / "config.json").read_text())
    q = cfg.pop("quantization_config")
    q.pop("quant_method")
    (g / "quantize_config.json").write_text(json.dumps(q))
    (g / "config.json").write_text(json.dumps(cfg))
    (g / "model.safetensors").rename(g / "gptq_model-4bit-64g.safetensors")
    scheme = read_scheme(g)
    assert (scheme.method, scheme.bits, scheme.group_size) == ("gptq", 4, 64)
    got = load_dequantized(g, load_spec(g), scheme)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_gptq_desc_act_follows_g_idx(tmp_path, source):
    out = _quantize(source, tmp_path / "g", "--format", "gptq", "--group-size", "32", "--zero-point")
    t = load_file(str(out / "model.safetensors"))
    prefix, k = "model.layers.0.mlp.down_proj", 256
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(0))
    t[f"{prefix}.g_idx"] = (perm // 32).to(torch.int32)     # input k belongs to group perm[k] // 32
    _rewrite(out, t, {"desc_act": True})
    scheme = read_scheme(out)
    assert scheme.desc_act and scheme.describe().endswith("act-order; gptq)")
    lin = load_quantized(out, load_spec(out), scheme)[f"{prefix}.weight"]
    assert lin.g_idx is not None
    assert np.array_equal(lin.dequantize().numpy(), _gptq_formula(t, prefix, 4).astype(np.float32))
    # the permutation that makes the groups contiguous: W[:, p] is a plain group-32 layer over x[p]
    p = lin.act_order_permutation()
    assert torch.equal(lin.g_idx.long()[p], torch.arange(k) // 32)
    plain = IntLinear("p", lin.out_features, k, 4, 32, pack_last(lin.codes()[:, p], 4), lin.scales, lin.zeros)
    assert torch.equal(plain.dequantize(), lin.dequantize()[:, p])
    # layers whose g_idx is the contiguous one need no permutation
    other = load_quantized(out, load_spec(out), scheme)["model.layers.1.mlp.down_proj.weight"]
    assert other.g_idx is None and other.act_order_permutation() is None
    del t[f"{prefix}.g_idx"]
    _rewrite(out, t)
    with pytest.raises(ModelError, match="g_idx, which GPTQ bits=4 group_size=32 requires"):
        load_quantized(out, load_spec(out), scheme)


# -------------------------------------------------------------------- compressed-tensors, independently

def _ct_library_checkpoint(d: Path, args_kw: dict, fmt: str) -> tuple[Path, dict]:
    """A checkpoint written by compressed-tensors itself: its scheme applied to a transformers model,
    its min-max qparams, its compressor, save_pretrained and its config update."""
    ct = pytest.importorskip("compressed_tensors")
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams
    torch.manual_seed(5)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**_SHAPES, initializer_range=0.1, tie_word_embeddings=False), dtype=torch.bfloat16)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    args = QuantizationArgs(**args_kw)
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)}, ignore=["lm_head"]))
    for _, m in model.named_modules():
        if getattr(m, "quantization_scheme", None) is not None and hasattr(m, "weight_scale"):
            w = m.weight.data
            gs = args.group_size if args.strategy == "group" else w.shape[1]
            g = w.reshape(w.shape[0], -1, gs) if args.strategy != "tensor" else w.reshape(1, 1, -1)
            scale, zp = calculate_qparams(g.amin(-1), g.amax(-1), args)
            m.weight_scale.data.copy_(scale.reshape(m.weight_scale.shape))
            if hasattr(m, "weight_zero_point"):
                m.weight_zero_point.data.copy_(zp.reshape(m.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(d)
    compressor.update_config(str(d))
    assert ct is not None
    return d, original


def _ct_decompress(ckpt: Path) -> dict[str, torch.Tensor]:
    """compressed-tensors' own decompression of every quantized module of ``ckpt``."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    qc = QuantizationConfig.model_validate(json.loads((ckpt / "config.json").read_text())["quantization_config"])
    scheme = qc.config_groups["group_0"]
    comp = BaseCompressor.get_value_from_registry(qc.format)
    t = load_file(str(ckpt / "model.safetensors"))
    out = {}
    for name in t:
        if name.endswith(".weight_scale"):
            prefix = name[:-len(".weight_scale")]
            local = {k[len(prefix) + 1:]: v for k, v in t.items() if k.startswith(prefix + ".")}
            out[prefix + ".weight"] = comp.decompress(local, scheme)["weight"]
    return out


CT_LIBRARY_CASES = {
    "int4-g64-asym": (dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=64),
                      "pack-quantized", "W4A16_GPTQ"),
    "int4-g128-sym": (dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=128),
                      "pack-quantized", "W4A16_GPTQ"),
    "int8-channel-sym": (dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
                         "pack-quantized", "W8A16"),
    "fp8-channel": (dict(num_bits=8, type="float", symmetric=True, strategy="channel"),
                    "float-quantized", "FP8_PER_CHANNEL_PER_TOKEN"),
    "fp8-tensor": (dict(num_bits=8, type="float", symmetric=True, strategy="tensor"),
                   "float-quantized", "FP8"),
}


@pytest.mark.parametrize("case", sorted(CT_LIBRARY_CASES))
def test_checkpoint_written_by_compressed_tensors_matches_its_decompression(tmp_path, case):
    args_kw, fmt, algo = CT_LIBRARY_CASES[case]
    ckpt, original = _ct_library_checkpoint(tmp_path / case, args_kw, fmt)
    scheme = read_scheme(ckpt)
    assert scheme.quant_algo == algo and scheme.method == "compressed-tensors"
    spec = load_spec(ckpt)
    ours = load_quantized(ckpt, spec, scheme)
    theirs = _ct_decompress(ckpt)
    assert len(theirs) == 14     # 7 linears in each of 2 layers
    for name, w in theirs.items():
        assert w.dtype == torch.bfloat16
        assert torch.equal(ours[name].dequantize(torch.bfloat16), w), name
        assert float((w.float() - original[name].float()).abs().max()) > 0
    # the unquantized LM head and embedding come through as saved
    assert torch.equal(ours["lm_head.weight"], original["lm_head.weight"])


@pytest.mark.parametrize("args", [["--format", "ct-w4a16", "--group-size", "64", "--zero-point"],
                                  ["--format", "ct-w4a16", "--bits", "8", "--group-size", "-1"],
                                  ["--format", "ct-fp8"], ["--format", "ct-fp8", "--per-tensor"]])
def test_our_compressed_tensors_checkpoints_decompress_in_compressed_tensors(tmp_path, source, args):
    pytest.importorskip("compressed_tensors")
    out = _quantize(source, tmp_path / "ct", *args)
    ours = load_quantized(out, load_spec(out), read_scheme(out))
    theirs = _ct_decompress(out)
    assert len(theirs) == 14
    for name, w in theirs.items():
        assert torch.equal(ours[name].dequantize(w.dtype), w), name


def test_packing_agrees_with_compressed_tensors():
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized import pack_to_int32, unpack_from_int32
    for bits in (4, 8):
        codes = torch.randint(0, 1 << bits, (16, 96), generator=torch.Generator().manual_seed(bits), dtype=torch.int32)
        signed = (codes - (1 << (bits - 1))).to(torch.int8)
        assert torch.equal(pack_last(codes, bits), pack_to_int32(signed, bits))
        assert torch.equal(pack_last(codes.T.contiguous(), bits).T, pack_to_int32(signed, bits, packed_dim=0))
        assert torch.equal(unpack_from_int32(pack_last(codes, bits), bits, codes.shape), signed)


# ------------------------------------------------------------------------------------------ refusals

@pytest.fixture(scope="module")
def gptq_ckpt(tmp_path_factory, source):
    return _quantize(source, tmp_path_factory.mktemp("g") / "gptq", "--format", "gptq")


@pytest.fixture(scope="module")
def ct_ckpt(tmp_path_factory, source):
    return _quantize(source, tmp_path_factory.mktemp("c") / "ct", "--format", "ct-w4a16")


def _variant(tmp_path: Path, ckpt: Path, **change) -> Path:
    d = tmp_path / "variant"
    shutil.copytree(ckpt, d)
    _rewrite(d, qcfg=change)
    return d


@pytest.mark.parametrize("which,change,message", [
    ("gptq", {"bits": 3}, "bits=3 is not supported"),
    ("gptq", {"bits": 2}, "bits=2 is not supported"),
    ("gptq", {"group_size": 256}, "group_size=256 is not supported"),
    ("gptq", {"checkpoint_format": "marlin"}, "GPTQ checkpoint_format 'marlin' is not supported"),
    ("gptq", {"quant_method": "awq", "version": "gemv"}, "AWQ version 'gemv' is not supported"),
    ("gptq", {"quant_method": "awq", "bits": 8}, "AWQ with 8 bits is not supported"),
    ("gptq", {"quant_method": "bitsandbytes"}, "quantization 'bitsandbytes' is not supported"),
    ("gptq", {"quant_method": "modelopt", "quant_algo": "FP8_BLOCK_SCALES"}, "'FP8_BLOCK_SCALES' is not supported"),
    ("ct", {"transform_config": {"config_groups": {"u": {}}}}, "transforms (rotations) are not supported"),
    ("ct", {"config_groups": None}, "quantization_config has no 'config_groups'"),
    ("ct", {"sparsity_config": {"format": "sparse-24-bitmask"}}, "compressed-tensors sparsity is not supported"),
    ("ct", {"quantization_status": "frozen"}, "quantization_status 'frozen' is not supported"),
])
def test_unsupported_schemes_are_refused_in_one_line(tmp_path, capsys, gptq_ckpt, ct_ckpt, which, change, message):
    d = _variant(tmp_path, gptq_ckpt if which == "gptq" else ct_ckpt, **change)
    with pytest.raises(ModelError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_scheme(d)
    yaml = tmp_path / "d.yaml"
    yaml.write_text(f"model: {d}\ngpu: H100-SXM\nmax_batch_size: 1\nmax_seq_len: 512\n")
    from trtllm_mk.cli.build import main
    assert message in _cli_error(capsys, main, ["--config", str(yaml), "--dry-run"])


def test_w4a8_compressed_tensors_is_refused(tmp_path, ct_ckpt):
    q = json.loads((ct_ckpt / "config.json").read_text())["quantization_config"]
    q["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int", "strategy": "token",
                                                          "dynamic": True, "symmetric": True}
    d = _variant(tmp_path, ct_ckpt, config_groups=q["config_groups"])
    with pytest.raises(ModelError, match=r"quantized input activations \(W4A8\) are not supported"):
        read_scheme(d)


def test_tensors_that_disagree_with_the_quantization_config_are_refused(tmp_path, gptq_ckpt):
    spec = load_spec(gptq_ckpt)
    d = _variant(tmp_path, gptq_ckpt, group_size=64)     # the tensors hold groups of 128
    with pytest.raises(ModelError, match=r"qzeros has shape \[1, 16\], expected \[2, 16\].*do not match the "
                                         "quantization_config"):
        load_checkpoint(d, spec)
    shutil.rmtree(d)
    d = _variant(tmp_path, gptq_ckpt, bits=8)
    with pytest.raises(ModelError, match="do not match the quantization_config"):
        load_checkpoint(d, spec)


def test_packed_tensors_without_a_quantization_config_say_so(tmp_path, gptq_ckpt):
    d = tmp_path / "noq"
    shutil.copytree(gptq_ckpt, d)
    _rewrite(d, drop_qcfg=True)
    assert read_scheme(d).method == "gptq"        # AutoGPTQ's quantize_config.json beside it still says so
    (d / "quantize_config.json").unlink()
    with pytest.raises(ModelError, match="holds packed quantized tensors .*qweight.* but its config.json has no "
                                         "quantization_config"):
        load_checkpoint(d, load_spec(d))


def test_a_quantized_checkpoint_on_a_bf16_engines_gpu_path_is_refused(gptq_ckpt):
    from trtllm_mk.runtime.hybrid import _load_weights
    with pytest.raises(UserError, match="but this engine was built for bf16 weights; build an engine from this "
                                        "checkpoint, or decode it dequantized"):
        _load_weights(load_spec(gptq_ckpt), gptq_ckpt, "cuda", 0)


# ------------------------------------------------------------------------------- the quantize command

def test_quantize_never_overwrites_a_folder_it_did_not_write(tmp_path, capsys, source, gptq_ckpt):
    from trtllm_mk.cli.quantize import main
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    err = _cli_error(capsys, main, ["--format", "gptq", str(source), str(foreign)])
    assert "was not written by quantize" in err and (foreign / "notes.txt").read_text() == "keep me"
    assert "overwrite the source" in _cli_error(capsys, main, ["--format", "gptq", str(source), str(source)])
    assert "is already quantized" in _cli_error(capsys, main, ["--format", "awq", str(gptq_ckpt), str(tmp_path / "x")])
    assert "AWQ's GEMM layout is 4-bit" in _cli_error(capsys, main, ["--format", "awq", "--bits", "8", str(source),
                                                                     str(tmp_path / "x")])
    assert "calibrated activation" in _cli_error(capsys, main, ["--format", "fp8", "--per-tensor", str(source),
                                                                str(tmp_path / "x")])
    assert "--group-size 96" in _cli_error(capsys, main, ["--format", "gptq", "--group-size", "96", str(source),
                                                          str(tmp_path / "x")])
    assert not (tmp_path / "x").exists()
    # an earlier output of the command is replaced, and nothing is left beside it
    out = _quantize(source, tmp_path / "q", "--format", "gptq")
    _quantize(source, out, "--format", "awq")
    assert read_scheme(out).method == "awq"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "q"]


def test_quantize_command_line(tmp_path, source):
    r = subprocess.run([sys.executable, "-m", "trtllm_mk", "quantize", "--format", "ct-w4a16", "--zero-point",
                        str(source), str(tmp_path / "q")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "W4A16_GPTQ (int4, group 128, zero points; compressed-tensors)" in r.stdout
    r = subprocess.run([sys.executable, "-m", "trtllm_mk", "quantize", "--format", "gptq", "--bits", "3",
                        str(source), str(tmp_path / "q3")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.strip() == "error: --bits 3: 4 or 8", r.stderr


# ---------------------------------------------------------------------------- the deployment section

def _yaml(tmp_path: Path, model: str, quant: str = "", name: str = "d.yaml") -> Path:
    p = tmp_path / name
    p.write_text(f"model: {model}\ngpu: H100-SXM\nmax_batch_size: 1\nmax_seq_len: 512\n{quant}")
    return p


def test_the_quantization_section_is_filled_from_the_checkpoint(tmp_path, gptq_ckpt, ct_ckpt):
    cfg = load_config(_yaml(tmp_path, gptq_ckpt))
    assert cfg.quantization == {"quant_algo": "W4A16_GPTQ", "group_size": 128, "has_zero_point": False,
                                "exclude_modules": ["lm_head"]}
    assert parse_config(cfg.to_dict(), source=cfg.source) == cfg
    given = load_config(_yaml(tmp_path, gptq_ckpt, "quantization:\n  quant_algo: W4A16_GPTQ\n  group_size: 128\n"))
    assert given.quantization == cfg.quantization
    assert load_config(_yaml(tmp_path, ct_ckpt)).quantization["quant_algo"] == "W4A16_GPTQ"
    from trtllm_mk.deployment import describe
    assert "W4A16_GPTQ (int4, group 128, symmetric; gptq)" in describe(cfg)
    # an unquantized deployment's resolved config has no section at all
    assert "quantization" not in load_config(ROOT / "configs" / "tiny_cpu.yaml").to_dict()


@pytest.mark.parametrize("quant,message", [
    ("quantization:\n  quant_algo: W4A16_AWQ\n", "quantization.quant_algo: 'W4A16_AWQ' disagrees with the checkpoint"),
    ("quantization:\n  group_size: 64\n", "quantization.group_size: 64 disagrees with the checkpoint"),
    ("quantization:\n  has_zero_point: true\n", "quantization.has_zero_point: True disagrees"),
    ("quantization:\n  exclude_modules: []\n", "quantization.exclude_modules: [] disagrees"),
    ("quantization:\n  quant_algo: INT4\n", "quantization.quant_algo: 'INT4' is not one of"),
    ("quantization:\n  qant_algo: W4A16_GPTQ\n", "(did you mean 'quant_algo'?)"),
])
def test_a_section_that_disagrees_with_the_checkpoint_is_refused(tmp_path, gptq_ckpt, quant, message):
    with pytest.raises(ConfigError) as e:
        load_config(_yaml(tmp_path, gptq_ckpt, quant))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_section_on_an_unquantized_checkpoint_or_shapes(tmp_path, source):
    with pytest.raises(ConfigError, match="holds unquantized weights; quantize it first"):
        load_config(_yaml(tmp_path, source, "quantization:\n  quant_algo: W4A16_GPTQ\n"))
    assert load_config(_yaml(tmp_path, source, "quantization:\n")).quantization is None
    cfg = load_config(_yaml(tmp_path, "llama-3.2-1b", "quantization:\n  quant_algo: W4A16_AWQ\n  group_size: 64\n"))
    assert cfg.quantization == {"quant_algo": "W4A16_AWQ", "group_size": 64, "has_zero_point": True,
                                "exclude_modules": ["lm_head"]}
    with pytest.raises(ConfigError, match="group_size: 128 is not a group size of W8A16"):
        load_config(_yaml(tmp_path, "llama-3.2-1b", "quantization:\n  quant_algo: W8A16\n  group_size: 128\n"))
    with pytest.raises(ConfigError, match="has_zero_point: false is not possible for W4A16_AWQ"):
        load_config(_yaml(tmp_path, "llama-3.2-1b",
                          "quantization:\n  quant_algo: W4A16_AWQ\n  has_zero_point: false\n"))
    with pytest.raises(ConfigError, match="quant_algo: required with group_size"):
        load_config(_yaml(tmp_path, "llama-3.2-1b", "quantization:\n  group_size: 64\n"))


@pytest.mark.parametrize("name,algo", [("l20_qwen3_8b_w4a16", "W4A16_GPTQ"), ("h100_llama8b_w4a16", "W4A16_GPTQ"),
                                       ("h100_qwen3_8b_fp8", "FP8"), ("h100_llama1b_w4a16", "W4A16_GPTQ")])
def test_shipped_quantized_configs_load_and_dry_run(capsys, name, algo):
    cfg = load_config(name)
    assert cfg.quantization["quant_algo"] == algo
    from trtllm_mk.cli.build import main
    if algo == "FP8":
        from trtllm_mk.quant.kernel_layout import tile_cols
        assert main(["--config", name, "--dry-run"]) == 0
        assert "FP8 (e4m3, per-channel scales)" in capsys.readouterr().out
        assert (cfg.model_spec.weight_bits, cfg.model_spec.weight_group) == (8, tile_cols(cfg.model_spec)) == (8, 512)
    else:
        assert main(["--config", name, "--dry-run"]) == 0
        assert "W4A16 (group 128)" in capsys.readouterr().out
        assert (cfg.model_spec.weight_bits, cfg.model_spec.weight_group) == (4, 128)


def test_an_8bit_checkpoint_build_is_refused_before_the_search(tmp_path, source):
    from trtllm_mk.build import build_engine
    w8 = _quantize(source, tmp_path / "w8", "--format", "gptq", "--bits", "8")
    with pytest.raises(ConfigError, match=r"8-bit integer weights \(W8A16\) are not implemented in the megakernel"):
        build_engine(load_config(_yaml(tmp_path, w8)), tmp_path / "engine", show_progress=False)
    assert not (tmp_path / "engine").exists()


# ------------------------------------------------------------------- decoding the dequantized weights

def test_cpu_executor_decodes_a_quantized_checkpoint_as_the_reference_does(tmp_path_factory, source):
    """An engine built from the bf16 checkpoint decodes the AWQ copy (same model) with --simulate:
    greedy tokens equal the reference decoder's on the same dequantized weights."""
    from serve_helpers import tiny_engine
    from trtllm_mk.kv_cache import PagedKVCache
    from trtllm_mk.reference import ReferenceDecoder
    from trtllm_mk.runtime.hybrid import HybridEngine
    out = _quantize(source, tmp_path_factory.mktemp("awq") / "awq", "--format", "awq", "--group-size", "32")
    engine = tiny_engine(tmp_path_factory.mktemp("e") / "tiny", source, batch=1)
    eng = HybridEngine(engine, weights=out, simulate=True)
    try:
        prompt = [3, 141, 59, 26, 5, 358, 97]
        got = eng.generate([prompt], 8, eos_ids=()).tokens[0]
        spec = load_spec(out)
        weights = {k: v.float() for k, v in load_checkpoint(out, spec, dtype=torch.bfloat16).items()}
        ref = ReferenceDecoder(spec, weights, compute_dtype=torch.float32)
        cache = PagedKVCache.allocate(spec, 1, 256, 32, dtype=torch.float32)
        assert got == ref.generate([prompt], 8, cache=cache, eos_ids=())[0]
        bf16 = {k: v.float() for k, v in load_checkpoint(source, spec).items()}
        base = ReferenceDecoder(spec, bf16, compute_dtype=torch.float32)
        cache = PagedKVCache.allocate(spec, 1, 256, 32, dtype=torch.float32)
        # the engine really ran the quantized weights: their logits differ from the bf16 model's
        assert not torch.equal(ref.prefill([prompt], PagedKVCache.allocate(spec, 1, 256, 32, dtype=torch.float32)),
                               base.prefill([prompt], cache))
    finally:
        eng.close()


@pytest.mark.parametrize("group_size", ["32", "128"])
def test_our_awq_checkpoint_through_compressed_tensors_autoawq_converter(tmp_path, source, group_size):
    """compressed-tensors' AutoAWQ converter reads our AWQ layout (interleaved nibbles, zero points) into
    its own pack-quantized form; its decompression equals ours."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter
    out = _quantize(source, tmp_path / "awq", "--format", "awq", "--group-size", group_size)
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    conv = AutoAWQConverter.from_autoawq_config(qcfg)
    scheme = conv._build_quant_config().config_groups["config_group_0"]
    converted = conv.process(load_file(str(out / "model.safetensors")))
    ours = load_quantized(out, load_spec(out), read_scheme(out))
    comp = BaseCompressor.get_value_from_registry("pack-quantized")
    n = 0
    for name in converted:
        if name.endswith(".weight_packed"):
            prefix = name[:-len(".weight_packed")]
            local = {k[len(prefix) + 1:]: v for k, v in converted.items() if k.startswith(prefix + ".")}
            theirs = comp.decompress(local, scheme)["weight"]
            assert torch.equal(ours[prefix + ".weight"].dequantize(theirs.dtype), theirs), prefix
            n += 1
    assert n == 14


def test_modelopt_fp8_export_with_only_hf_quant_config(tmp_path, source):
    """NVIDIA's FP8 exports: per-tensor fp32 scalar scales, static input scales and KV-cache scales,
    the scheme in hf_quant_config.json and none in config.json."""
    from trtllm_mk.quant.rtn import quantize_fp8
    spec = load_spec(source)
    t = dict(load_checkpoint(source, spec))
    for name, shape in spec.expected_tensors().items():
        if len(shape) == 2 and name.startswith("model.layers."):
            prefix = name[:-len(".weight")]
            lin = quantize_fp8(prefix, t[name], group_size=0)
            t[name], t[f"{prefix}.weight_scale"] = lin.weight, lin.scale
            t[f"{prefix}.input_scale"] = torch.tensor(0.02)
            if name.endswith("o_proj.weight"):
                attn = prefix[:-len(".o_proj")]
                t[f"{attn}.k_proj.k_scale"], t[f"{attn}.v_proj.v_scale"] = torch.tensor(1.0), torch.tensor(1.0)
    d = tmp_path / "modelopt"
    d.mkdir()
    shutil.copy(source / "config.json", d / "config.json")
    save_file(t, str(d / "model.safetensors"))
    (d / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": {
        "quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]}}))
    scheme = read_scheme(d)
    assert scheme.quant_algo == "FP8" and scheme.method == "modelopt"
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # the format's scale tensors are no unknown extras
        layers = load_quantized(d, spec, scheme)
    raw = load_file(str(d / "model.safetensors"))
    lin = layers["model.layers.1.mlp.up_proj.weight"]
    assert isinstance(lin, Fp8Linear) and not lin.per_channel and float(lin.input_scale) == pytest.approx(0.02)
    assert np.array_equal(lin.dequantize().numpy(),
                          _fp8_formula(raw, "model.layers.1.mlp.up_proj").astype(np.float32))
    cfg = load_config(_yaml(tmp_path, d))
    assert cfg.quantization == {"quant_algo": "FP8", "group_size": 0, "has_zero_point": False,
                                "exclude_modules": ["lm_head"]}


def test_a_quantized_lm_head_is_read_and_a_quantized_embedding_refused(tmp_path, gptq_ckpt):
    d = tmp_path / "head"
    shutil.copytree(gptq_ckpt, d)
    t = load_file(str(d / "model.safetensors"))
    head = t.pop("lm_head.weight")
    scheme = read_scheme(d)
    lin = quantize_int("lm_head", head, 4, 128, True, torch.float16, min_zero=1)
    t.update({f"lm_head.{k}": v for k, v in gptq.write(lin, scheme).items()})
    _rewrite(d, t, {"lm_head": True})
    assert read_scheme(d).exclude_modules == ()
    got = load_quantized(d, load_spec(d), read_scheme(d))["lm_head.weight"]
    assert isinstance(got, IntLinear) and torch.equal(got.dequantize(), lin.dequantize())
    emb = t.pop("model.embed_tokens.weight")
    elin = quantize_int("model.embed_tokens", emb, 4, 128, True, torch.float16, min_zero=1)
    t.update({f"model.embed_tokens.{k}": v for k, v in gptq.write(elin, scheme).items()})
    _rewrite(d, t)
    with pytest.raises(ModelError, match="quantized embeddings are not supported"):
        load_quantized(d, load_spec(d), read_scheme(d))


def test_quantized_bytes_give_the_memory_budget_and_the_decode_floor():
    """Llama-3.1-8B W4A16 group 128 with a bf16 LM head: about 4.7 GB read per token (issue 23's floor)."""
    from trtllm_mk.quant.scheme import quantized_weight_bytes
    cfg = load_config("h100_llama8b_w4a16")
    H, I, KV, L, V = 4096, 14336, 1024, 32, 128256
    params = L * (2 * H * H + 2 * KV * H + 3 * I * H)           # the decoder blocks' linear layers
    norms = (2 * L + 1) * H * 2
    want = params // 2 + params // 128 * 2 + V * H * 2 + norms  # int4 codes, fp16 group scales, bf16 head
    assert quantized_weight_bytes(cfg.model_spec, cfg.quant_scheme, decode=True) == want
    assert cfg.memory_budget().weights == want + V * H * 2      # plus the embedding table
    fp8 = load_config("h100_qwen3_8b_fp8")
    assert fp8.quant_scheme.matrix_bytes(4096, 12288) == 4096 * 12288 + 4


def test_sharded_source_and_sharded_output(tmp_path):
    from trtllm_mk.model.tiny import write_tiny_checkpoint
    from trtllm_mk.quant.writer import make_scheme, quantize_checkpoint
    src = write_tiny_checkpoint(tmp_path / "src", "qwen3", shards=3)
    scheme = make_scheme("gptq", 8, 64, zero_point=True)
    one = quantize_checkpoint(src, tmp_path / "one", scheme, show_progress=False)
    many = quantize_checkpoint(src, tmp_path / "many", scheme, max_shard_bytes=100_000, show_progress=False)
    assert len(list(many.glob("model-*.safetensors"))) > 2 and (many / "model.safetensors.index.json").is_file()
    assert (one / "quantize_config.json").is_file() and not (one / "model.safetensors.index.json").exists()
    spec = load_spec(src)
    a, b = load_checkpoint(one, spec), load_checkpoint(many, spec)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_transformers_reads_our_compressed_tensors_checkpoint_as_we_do(tmp_path, source):
    """HF transformers loads our pack-quantized checkpoint through its compressed-tensors integration:
    its decompressed weights are ours, and its logits the reference decoder's on our dequantized weights."""
    pytest.importorskip("compressed_tensors")
    import transformers
    from trtllm_mk.kv_cache import PagedKVCache
    from trtllm_mk.reference import ReferenceDecoder
    out = _quantize(source, tmp_path / "ct", "--format", "ct-w4a16", "--group-size", "64")
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = [3, 141, 59, 26, 5, 358]
    with torch.no_grad():
        hf = model(torch.tensor([ids])).logits[0]
    spec = load_spec(out)
    layers = load_quantized(out, spec, read_scheme(out))
    w = {k: v.dequantize() if isinstance(v, IntLinear) else v.float() for k, v in layers.items()}
    sd = model.state_dict()
    for name, v in layers.items():
        if isinstance(v, IntLinear):
            assert torch.equal(sd[name], w[name]), name
    ref = ReferenceDecoder(spec, w, compute_dtype=torch.float32)
    ours = ref.prefill([ids], PagedKVCache.allocate(spec, 1, 64, 8, dtype=torch.float32))[0]
    assert torch.allclose(ours, hf[-1], atol=1e-4, rtol=0), float((ours - hf[-1]).abs().max())


def test_fbgemm_fp8_checkpoint(tmp_path, source):
    """transformers' fbgemm_fp8 layout: per-channel fp32 scales [out, 1] and an activation bound."""
    out = _quantize(source, tmp_path / "fb", "--format", "fp8")
    t = load_file(str(out / "model.safetensors"))
    for name in [n for n in t if n.endswith(".weight_scale")]:
        t[name] = t[name][:, None]
        t[name.replace(".weight_scale", ".input_scale_ub")] = torch.tensor([1200.0])
    (out / "hf_quant_config.json").unlink()
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                                  "modules_to_not_convert": ["lm_head"]}
    (out / "config.json").write_text(json.dumps(cfg))
    save_file(t, str(out / "model.safetensors"))
    scheme = read_scheme(out)
    assert (scheme.method, scheme.quant_algo) == ("fbgemm_fp8", "FP8_PER_CHANNEL_PER_TOKEN")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lin = load_quantized(out, load_spec(out), scheme)["model.layers.0.mlp.down_proj.weight"]
    assert lin.per_channel
    assert np.array_equal(lin.dequantize().numpy(), _fp8_formula(t, "model.layers.0.mlp.down_proj").astype(np.float32))


@pytest.mark.gpu
def test_packed_layers_load_and_dequantize_on_the_gpu(tmp_path, source):
    """The packed objects the device kernels consume, loaded straight onto the GPU, hold and dequantize
    to what the CPU holds."""
    for args in (["--format", "gptq", "--zero-point"], ["--format", "awq"], ["--format", "ct-fp8"]):
        out = _quantize(source, tmp_path / args[1], *args)
        spec, scheme = load_spec(out), read_scheme(out)
        cpu, gpu = load_quantized(out, spec, scheme), load_quantized(out, spec, scheme, device="cuda")
        for name, v in cpu.items():
            g = gpu[name]
            if isinstance(v, torch.Tensor):
                assert g.is_cuda and torch.equal(g.cpu(), v)
            else:
                assert g.dequantize().is_cuda and torch.equal(g.dequantize().cpu(), v.dequantize()), name
