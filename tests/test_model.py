"""Architecture registry, built-in model configs, random weights and tiny checkpoints (checked against
HF transformers)."""
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from trtllm_mk.errors import ModelError
from trtllm_mk.graph.builder import check_model_supported
from trtllm_mk.model import list_models, load_checkpoint, random_weights, resolve_model, spec_from_hf_config
from trtllm_mk.model.registry import CONFIG_DIR_ENV
from trtllm_mk.model.rope import rope_inv_freq
from trtllm_mk.model.tiny import FAMILIES, main as tiny_main, tiny_config, write_tiny_checkpoint

# Published shapes: (family, hidden, layers, heads, kv heads, head_dim, intermediate, vocab, tied, rope_theta).
PUBLISHED = {
    "llama-3.2-1b": ("llama", 2048, 16, 32, 8, 64, 8192, 128256, True, 500000.0),
    "llama-3.1-8b": ("llama", 4096, 32, 32, 8, 128, 14336, 128256, False, 500000.0),
    "qwen3-0.6b": ("qwen3", 1024, 28, 16, 8, 128, 3072, 151936, True, 1e6),
    "qwen3-8b": ("qwen3", 4096, 36, 32, 8, 128, 12288, 151936, False, 1e6),
}
# Weight bytes of the first reference measurements, and Qwen's published non-embedding parameter counts.
ANCHOR_GB = {"llama-3.2-1b": 2.47, "llama-3.1-8b": 16.06, "qwen3-8b": 16.38}
NON_EMBEDDING_PARAMS = {"qwen3-0.6b": 0.44e9, "qwen3-8b": 6.95e9}


# ---------------------------------------------------------------- built-in architectures

def test_list_models_has_the_builtin_architectures():
    assert set(PUBLISHED) <= set(list_models())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_builtin_config_has_published_shapes(name):
    r = resolve_model(name)
    s = r.spec
    got = (s.family, s.hidden_size, s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim,
           s.intermediate_size, s.vocab_size, s.tie_word_embeddings, s.rope_theta)
    assert got == PUBLISHED[name]
    assert r.checkpoint_dir is None and r.source.startswith("builtin:") and s.name == name
    assert s.dtype == "bfloat16" and s.eos_token_ids
    check_model_supported(s)
    if name in ANCHOR_GB:
        assert s.weight_bytes() / 1e9 == pytest.approx(ANCHOR_GB[name], abs=0.01)
    if name in NON_EMBEDDING_PARAMS:
        embed = s.vocab_size * s.hidden_size * (1 if s.tie_word_embeddings else 2)
        assert s.num_params() - embed == pytest.approx(NON_EMBEDDING_PARAMS[name], rel=0.01)


def test_every_builtin_config_parses_and_fits_the_megakernel():
    # Covers files added to configs/models/ beyond the published four.
    for name in list_models():
        r = resolve_model(name)
        assert r.spec.name == name and r.source.startswith("builtin:")
        assert r.spec.num_params() > 0 and r.spec.eos_token_ids
        if r.spec.is_moe and len(r.spec.moe_layers) < r.spec.num_layers:   # the reference decoder's test model
            with pytest.raises(ModelError, match="dense MLP"):
                check_model_supported(r.spec)
        else:
            check_model_supported(r.spec)


def test_llama3_rope_scaling_and_eos_of_llama_3_2_1b():
    s = resolve_model("llama-3.2-1b").spec
    assert s.rope_scaling["rope_type"] == "llama3"
    assert (s.rope_scaling["factor"], s.rope_scaling["low_freq_factor"], s.rope_scaling["high_freq_factor"],
            s.rope_scaling["original_max_position_embeddings"]) == (32.0, 1.0, 4.0, 8192)
    assert s.max_position_embeddings == 131072
    assert s.eos_token_ids == (128001, 128008, 128009)
    assert resolve_model("llama-3.1-8b").spec.rope_scaling["factor"] == 8.0


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def test_rope_settings_in_either_form_and_conflicts_refused():
    spec = lambda **kw: spec_from_hf_config(tiny_config("llama", **kw), name="tiny")   # noqa: E731
    base = {k: v for k, v in tiny_config("llama").items() if not k.startswith("rope")}
    form = lambda **kw: spec_from_hf_config(base | kw, name="tiny")   # noqa: E731
    new = form(rope_parameters=dict(LLAMA3, rope_theta=5e5))   # transformers >= 5
    old = form(rope_theta=5e5, rope_scaling=LLAMA3)             # transformers 4
    assert new.rope_theta == old.rope_theta == 5e5 and new.rope_scaling["factor"] == old.rope_scaling["factor"] == 8.0
    # transformers 5 reads a legacy rope_scaling beside a default rope_parameters
    both = form(rope_parameters={"rope_type": "default", "rope_theta": 1e4}, rope_scaling=LLAMA3)
    assert both.rope_scaling["rope_type"] == "llama3" and both.rope_theta == 1e4
    assert form(rope_theta=1e4, rope_parameters={"rope_type": "default", "rope_theta": 1e4}).rope_theta == 1e4
    with pytest.raises(ModelError, match="rope_theta 500000 and rope_parameters.rope_theta 10000 disagree"):
        form(rope_theta=5e5, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    with pytest.raises(ModelError, match="describe different rope scaling"):
        form(rope_parameters=dict(LLAMA3, rope_theta=1e4), rope_scaling=dict(LLAMA3, factor=4.0))
    # every llama3 key is required (the rope tables would otherwise fail at run time, or guess)
    short = {k: v for k, v in LLAMA3.items() if k not in ("low_freq_factor", "original_max_position_embeddings")}
    with pytest.raises(ModelError, match="llama3 rope scaling needs low_freq_factor, original_max_position_embeddings"):
        form(rope_parameters=dict(short, rope_theta=1e4))
    with pytest.raises(ModelError, match="rope_scaling: rope type 'yarn' unsupported"):
        spec(rope_scaling={"rope_type": "yarn", "factor": 2.0})


def test_names_are_case_insensitive():
    assert resolve_model("Qwen3-8B").spec == resolve_model("qwen3-8b").spec


def test_unknown_name_suggests_the_closest_and_lists_known():
    with pytest.raises(ModelError, match=r"unknown architecture 'qwen3-8'; did you mean 'qwen3-8b'\?") as e:
        resolve_model("qwen3-8")
    assert all(n in str(e.value) for n in PUBLISHED) and "\n" not in str(e.value)
    with pytest.raises(ModelError, match="unknown architecture 'gpt-j'"):
        resolve_model("gpt-j")


def test_config_dir_env_adds_and_overrides(tmp_path, monkeypatch):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "env-only-llama.json").write_text(json.dumps(tiny_config("llama", hidden_size=192)))
    (tmp_path / "models" / "qwen3-8b.json").write_text(json.dumps(tiny_config("qwen3", num_hidden_layers=5)))
    assert "env-only-llama" not in list_models()
    monkeypatch.setenv(CONFIG_DIR_ENV, str(tmp_path))
    assert {"env-only-llama", "llama-3.1-8b"} <= set(list_models())
    assert resolve_model("ENV-ONLY-LLAMA").spec.hidden_size == 192
    assert resolve_model("qwen3-8b").spec.num_layers == 5
    monkeypatch.setenv(CONFIG_DIR_ENV, str(tmp_path / "models"))
    with pytest.raises(ModelError, match=f"{CONFIG_DIR_ENV}=.*no models/ directory"):
        list_models()


# ---------------------------------------------------------------- paths

def test_checkpoint_directory_and_config_file(tmp_path):
    d = write_tiny_checkpoint(tmp_path / "my-ckpt", family="qwen3")
    r = resolve_model(str(d))
    assert r.checkpoint_dir == d and r.spec.family == "qwen3" and r.spec.name == "my-ckpt"
    r = resolve_model(str(d / "config.json"))
    assert r.checkpoint_dir is None and r.spec.family == "qwen3"


def test_directory_without_config_or_weights(tmp_path):
    d = write_tiny_checkpoint(tmp_path / "c")
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelError, match=r"no \*\.safetensors weights"):
        resolve_model(str(d))
    (d / "config.json").unlink()
    with pytest.raises(ModelError, match="no config.json"):
        resolve_model(str(d))


def test_missing_path(tmp_path):
    with pytest.raises(ModelError, match="no such checkpoint directory"):
        resolve_model(str(tmp_path / "nope"))


def test_unsupported_architecture_is_named(tmp_path):
    d = write_tiny_checkpoint(tmp_path / "c")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="unsupported architecture 'GPT2LMHeadModel'"):
        resolve_model(str(d))


def test_an_architecture_that_is_no_causal_lm_is_refused_whatever_its_model_type(tmp_path):
    d = write_tiny_checkpoint(tmp_path / "c")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(architectures=["LlamaForSequenceClassification"])   # model_type stays "llama"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="unsupported architecture 'LlamaForSequenceClassification'"):
        resolve_model(str(d))


@pytest.mark.parametrize("family", FAMILIES)
def test_keys_a_config_leaves_out_take_the_transformers_defaults(family):
    # a config.json without the keys that have defaults decodes as transformers loads it: its config
    # class's defaults, which differ by family (Mixtral's rope theta and norm epsilon, Mistral's window,
    # Qwen3's head_dim, the KV heads)
    transformers = pytest.importorskip("transformers")
    full = tiny_config(family)
    keep = ("architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "vocab_size", "moe_intermediate_size", "num_experts", "num_local_experts",
            "num_experts_per_tok")
    # 32 heads of 128: every family's default KV heads (32, 8 or 4) divide them
    minimal = {k: full[k] for k in keep if k in full} | {"hidden_size": 4096, "num_attention_heads": 32}
    hf = transformers.AutoConfig.for_model(minimal["model_type"], **{k: v for k, v in minimal.items()
                                                                      if k not in ("architectures", "model_type")})
    spec = spec_from_hf_config(minimal)
    rope = getattr(hf, "rope_parameters", None) or {}
    want_head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert (spec.num_kv_heads, spec.head_dim, spec.rms_norm_eps, spec.rope_theta, spec.max_position_embeddings) == (
        hf.num_key_value_heads or hf.num_attention_heads, want_head_dim, hf.rms_norm_eps,
        rope.get("rope_theta", getattr(hf, "rope_theta", None)), hf.max_position_embeddings)
    if family in ("mistral", "mixtral"):
        assert spec.sliding_window == hf.sliding_window


def test_bad_json_is_named(tmp_path):
    d = write_tiny_checkpoint(tmp_path / "c")
    (d / "config.json").write_text('{"hidden_size": 128,')
    with pytest.raises(ModelError, match=r"config\.json: not valid JSON"):
        resolve_model(str(d))


# ---------------------------------------------------------------- random weights

def _tiny_spec(family, **overrides):
    return spec_from_hf_config(tiny_config(family, **overrides), name=f"tiny-{family}")


def test_random_weights_shapes_statistics_and_seed():
    spec = _tiny_spec("qwen2")
    w = random_weights(spec, seed=1, std=0.05)
    assert {n: tuple(t.shape) for n, t in w.items()} == spec.expected_tensors()
    assert all(t.dtype == torch.bfloat16 for t in w.values())

    def pooled(pred):
        return torch.cat([t.float().flatten() for n, t in w.items() if pred(n)])
    norms = pooled(lambda n: n.endswith("norm.weight"))
    biases = pooled(lambda n: n.endswith(".bias"))
    linears = pooled(lambda n: n.endswith("proj.weight"))
    # Norm gains scatter around 1 (so they matter), biases are visible, linears follow std.
    assert norms.mean() == pytest.approx(1.0, abs=0.02) and 0.05 < norms.std() < 0.2
    assert biases.abs().mean() > 0.03
    assert linears.mean() == pytest.approx(0.0, abs=0.005) and linears.std() == pytest.approx(0.05, rel=0.05)

    again, other = random_weights(spec, seed=1, std=0.05), random_weights(spec, seed=2, std=0.05)
    assert all(torch.equal(w[n], again[n]) for n in w)
    assert not torch.equal(w["model.layers.0.mlp.up_proj.weight"], other["model.layers.0.mlp.up_proj.weight"])


def test_random_weights_follow_tying_and_dtype():
    tied, untied = _tiny_spec("llama", tie_word_embeddings=True), _tiny_spec("llama", tie_word_embeddings=False)
    assert "lm_head.weight" not in random_weights(tied)
    w = random_weights(untied, dtype=torch.float16)
    assert w["lm_head.weight"].dtype == torch.float16
    assert not torch.equal(w["lm_head.weight"], w["model.embed_tokens.weight"])


@pytest.mark.gpu
def test_random_weights_of_an_8b_model_are_built_on_the_gpu():
    spec = resolve_model("llama-3.1-8b").spec
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    w = random_weights(spec, device="cuda", seed=0)
    assert all(t.is_cuda for t in w.values())
    # No fp32 copies or host staging: the peak is the weights themselves.
    assert torch.cuda.max_memory_allocated() - base <= spec.weight_bytes() * 1.01
    assert w["model.layers.31.mlp.down_proj.weight"].float().std().item() == pytest.approx(0.02, rel=0.05)


# ---------------------------------------------------------------- tiny checkpoints in transformers

@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {f: write_tiny_checkpoint(root / f, family=f, seed=11) for f in FAMILIES}


def test_tiny_defaults_fit_the_megakernel(tiny_dirs):
    for f, d in tiny_dirs.items():
        spec = resolve_model(str(d)).spec
        if len(spec.moe_layers) < spec.num_layers and spec.is_moe:   # a dense layer among sparse ones
            with pytest.raises(ModelError, match="dense MLP"):
                check_model_supported(spec)
        else:
            check_model_supported(spec)
        assert spec.family == f and spec.num_heads > spec.num_kv_heads  # GQA is exercised


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_checkpoint_loads_in_transformers(tiny_dirs, family, tmp_path):
    transformers = pytest.importorskip("transformers")
    d = tiny_dirs[family]
    spec = resolve_model(str(d)).spec
    ours = load_checkpoint(d, spec)
    hf = transformers.AutoModelForCausalLM.from_pretrained(d)
    sd = hf.state_dict()
    if spec.is_moe:   # HF holds the experts fused in memory; what it writes back is per expert, our names
        hf.save_pretrained(tmp_path)
        sd = load_file(str(tmp_path / "model.safetensors"))
    expected = dict(spec.expected_tensors())
    if spec.tie_word_embeddings:  # HF lists the tied head under its own name
        expected["lm_head.weight"] = (spec.vocab_size, spec.hidden_size)
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    assert {n: tuple(t.shape) for n, t in sd.items()} == expected
    assert all(torch.equal(sd[n], ours[n]) for n in ours)
    # HF reads rope base and llama3 scaling from our config.json exactly as rope.py does.
    torch.testing.assert_close(hf.model.rotary_emb.inv_freq.float(), rope_inv_freq(spec))
    logits = hf(torch.tensor([[1, 5, 9, 3]])).logits
    assert logits.shape == (1, 4, spec.vocab_size) and torch.isfinite(logits).all()


def test_tiny_overrides_and_unknown_family(tmp_path):
    d = write_tiny_checkpoint(tmp_path / "c", family="qwen3", num_hidden_layers=3, tie_word_embeddings=True)
    spec = resolve_model(str(d)).spec
    assert spec.num_layers == 3 and spec.tie_word_embeddings
    assert json.loads((d / "config.json").read_text())["max_window_layers"] == 3
    with pytest.raises(ModelError, match="unknown family 'gpt2'"):
        write_tiny_checkpoint(tmp_path / "x", family="gpt2")


def test_tiny_cli(tmp_path, capsys):
    assert tiny_main([str(tmp_path / "c"), "--family", "mistral", "--shards", "2",
                      "--set", "num_hidden_layers=3", "--set", "rope_theta=20000.0"]) == 0
    spec = resolve_model(str(tmp_path / "c")).spec
    assert (spec.family, spec.num_layers, spec.rope_theta) == ("mistral", 3, 20000.0)
    assert len(list((tmp_path / "c").glob("model-*-of-00002.safetensors"))) == 2


def test_tiny_cli_as_module_reports_errors_in_one_line(tmp_path):
    ok = subprocess.run([sys.executable, "-m", "trtllm_mk.model.tiny", str(tmp_path / "c"), "--family", "qwen2"],
                        capture_output=True, text=True)
    assert ok.returncode == 0 and (tmp_path / "c" / "model.safetensors").is_file()
    bad = subprocess.run([sys.executable, "-m", "trtllm_mk.model.tiny", str(tmp_path / "d"), "--set", "oops"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "--set 'oops'" in bad.stderr
