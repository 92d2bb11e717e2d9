"""Deployment config: shipped YAMLs, defaults, resolution, TensorRT-LLM kwargs, and one clear
ConfigError (file + dotted key + fix) for every class of bad input."""
import json
import re
from pathlib import Path

import pytest
import torch
import yaml

from trtllm_mk.config import DEFAULT_CONFIG, load_config, parse_config, with_overrides
from trtllm_mk.deployment import decode_floor_s, memory_budget
from trtllm_mk.errors import ConfigError
from trtllm_mk.gpus import CATALOG, GB
from trtllm_mk.model.tiny import tiny_config, write_tiny_checkpoint

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
SHIPPED = sorted(CONFIGS.glob("*.yaml"))

BASE = {"model": "tiny-llama", "gpu": "H100-SXM", "max_batch_size": 1, "max_seq_len": 1024, "max_input_len": 512}


def write_yaml(path: Path, data) -> Path:
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def config_error(path: Path) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


# ------------------------------------------------------------------------------ shipped configs

def test_the_shipped_configs_are_there():
    assert {p.name for p in SHIPPED} >= {"l20_bs1.yaml", "h100_bs1.yaml", "h100_llama8b_bs1.yaml",
                                         "h100_qwen3_8b_bs1.yaml", "h200_bs4.yaml", "tiny_cpu.yaml"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert cfg.name == path.stem
    assert cfg.gpu in CATALOG and cfg.gpu_spec is CATALOG[cfg.gpu]
    assert cfg.memory_budget().fits
    assert cfg.megakernel.output_dir == Path("engines") / path.stem
    assert parse_config(cfg.to_dict()) == cfg  # the engine dir's config.json reads back identically


@pytest.mark.parametrize("name, model, gpu, batch", [
    ("l20_bs1", "qwen3-8b", "L20", 1), ("h100_bs1", "llama-3.2-1b", "H100-SXM", 1),
    ("h100_llama8b_bs1", "llama-3.1-8b", "H100-SXM", 1), ("h100_qwen3_8b_bs1", "qwen3-8b", "H100-SXM", 1),
    ("h200_bs4", "llama-3.1-8b", "H200", 4), ("tiny_cpu", "tiny-llama", "H100-SXM", 1)])
def test_shipped_configs_deploy_what_their_names_say(name, model, gpu, batch):
    cfg = load_config(CONFIGS / f"{name}.yaml")
    assert (cfg.model_spec.name, cfg.gpu, cfg.max_batch_size) == (model, gpu, batch)


def test_default_config_is_qwen3_8b_on_l20():
    cfg = load_config(DEFAULT_CONFIG)
    assert DEFAULT_CONFIG.name == "l20_bs1.yaml"
    assert (cfg.model_spec.family, cfg.gpu, cfg.max_batch_size, cfg.max_seq_len, cfg.max_input_len) == \
        ("qwen3", "L20", 1, 4096, 2048)


def test_tiny_llama_architecture_file():
    s = load_config(CONFIGS / "tiny_cpu.yaml").model_spec
    assert (s.hidden_size, s.intermediate_size, s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim,
            s.vocab_size, s.tie_word_embeddings) == (128, 256, 2, 4, 2, 32, 512, True)


# ------------------------------------------------------------------------------ defaults, resolution

def test_defaults(tmp_path):
    cfg = load_config(write_yaml(tmp_path / "mine.yaml", BASE))
    assert cfg.name == "mine" and cfg.dtype == "bfloat16"
    assert cfg.max_num_tokens == 1 * 512
    assert (cfg.kv_cache_config.tokens_per_block, cfg.kv_cache_config.dtype,
            cfg.kv_cache_config.free_gpu_memory_fraction) == (32, "bfloat16", 0.9)
    assert cfg.prefill.backend == "auto" and cfg.cuda_graph_config == {}
    mk = cfg.megakernel
    assert (mk.mode, mk.search_budget_s, mk.seed, mk.output_dir, mk.context_len) == \
        ("static", 60.0, 0, Path("engines/mine"), 512)


def test_defaults_follow_max_seq_len(tmp_path):
    cfg = load_config(write_yaml(tmp_path / "x.yaml", {**BASE, "max_seq_len": 256, "max_input_len": None}))
    assert cfg.max_input_len == 256 and cfg.megakernel.context_len == 256  # min(1024 / 512, max_seq_len)


def test_gpu_alias_resolves_to_the_catalog_name(tmp_path):
    cfg = load_config(write_yaml(tmp_path / "x.yaml", {**BASE, "gpu": "nvidia h200"}))
    assert cfg.gpu == "H200" and cfg.to_dict()["gpu"] == "H200"


def test_relative_checkpoint_path_is_relative_to_the_yaml(tmp_path, monkeypatch):
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt", family="qwen3")
    (tmp_path / "cfgs").mkdir()
    path = write_yaml(tmp_path / "cfgs" / "x.yaml", {**BASE, "model": "../ckpt"})
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # relative to the YAML, not to the current directory
    cfg = load_config(path)
    assert cfg.checkpoint_dir == ckpt.resolve() and cfg.model == str(ckpt.resolve())
    assert cfg.model_spec.family == "qwen3"


def test_config_json_path_gives_shapes_without_weights(tmp_path):
    (tmp_path / "arch.json").write_text(json.dumps(tiny_config("qwen2")))
    cfg = load_config(write_yaml(tmp_path / "x.yaml", {**BASE, "model": "arch.json"}))
    assert cfg.model_spec.family == "qwen2" and cfg.checkpoint_dir is None


def test_parse_config_from_a_dict_needs_a_name():
    assert parse_config({**BASE, "name": "d"}).name == "d"
    with pytest.raises(ConfigError, match=r"^<config>: name: required"):
        parse_config(BASE)


def test_overrides_are_applied_and_validated(tmp_path):
    cfg = load_config(write_yaml(tmp_path / "x.yaml", BASE))
    new = with_overrides(cfg, {"megakernel": {"seed": 7, "search_budget_s": 2, "output_dir": "out/e"}})
    assert (new.megakernel.seed, new.megakernel.search_budget_s, new.megakernel.output_dir) == (7, 2.0, Path("out/e"))
    assert new.megakernel.context_len == cfg.megakernel.context_len and new.model_spec == cfg.model_spec
    with pytest.raises(ConfigError, match=r"^command line: megakernel\.seed: -1 must be >= 0"):
        with_overrides(cfg, {"megakernel": {"seed": -1}})


# ------------------------------------------------------------------------------ TensorRT-LLM kwargs

def test_trtllm_kwargs_carry_only_tensorrt_llm_keys(tmp_path):
    cfg = load_config(write_yaml(tmp_path / "x.yaml", {**BASE, "max_num_tokens": 4096,
                                                       "kv_cache_config": {"free_gpu_memory_fraction": 0.5}}))
    kw = cfg.trtllm_llm_kwargs()
    assert kw == {"dtype": "bfloat16", "max_batch_size": 1, "max_seq_len": 1024, "max_input_len": 512,
                  "max_num_tokens": 4096,
                  "kv_cache_config": {"tokens_per_block": 32, "dtype": "auto", "free_gpu_memory_fraction": 0.5}}
    assert not set(kw) & {"megakernel", "prefill", "name", "gpu", "model"}


@pytest.mark.parametrize("given, passed", [({"max_batch_size": 1}, {"max_batch_size": 1}), (None, None)])
def test_trtllm_kwargs_pass_cuda_graph_config_untouched(tmp_path, given, passed):
    cfg = load_config(write_yaml(tmp_path / "x.yaml", {**BASE, "cuda_graph_config": given}))
    assert cfg.trtllm_llm_kwargs()["cuda_graph_config"] == passed  # null: TensorRT-LLM turns graphs off


# ------------------------------------------------------------------------------ memory budget

def test_memory_budget_counts_weights_kv_and_activations():
    cfg = load_config(DEFAULT_CONFIG)
    spec = cfg.model_spec
    mem = cfg.memory_budget()
    assert spec.kv_bytes_per_token() == 2 * 36 * 8 * 128 * 2
    assert mem.kv_cache == 4096 * spec.kv_bytes_per_token()
    assert mem.weights == spec.weight_bytes()
    # TensorRT-LLM's meaning: the share of the memory left free after weights and activations
    assert mem.available == int((48 * GB - mem.weights - mem.activations) * 0.9)
    assert mem.headroom == mem.available - mem.kv_cache
    assert 0 < mem.activations < 1 * GB
    assert mem.total == mem.weights + mem.kv_cache + mem.activations


def test_kv_pool_rounds_sequences_up_to_whole_blocks():
    spec = load_config(DEFAULT_CONFIG).model_spec
    mem = memory_budget(spec, CATALOG["L20"], max_batch_size=3, max_seq_len=100, max_num_tokens=100,
                        tokens_per_block=32, free_gpu_memory_fraction=0.9)
    assert mem.kv_tokens == 3 * 128


def test_decode_floor_matches_the_measured_anchor():
    # Llama-3.2-1B, 2.47 GB of weights at 3.08 TB/s -> 0.80 ms per token on H100 SXM (measured read bandwidth).
    cfg = load_config(CONFIGS / "h100_bs1.yaml")
    assert decode_floor_s(cfg.model_spec, cfg.gpu_spec) * 1e3 == pytest.approx(0.80, abs=0.005)


# ------------------------------------------------------------------------------ bad input

def mk(**changes):
    """BASE with top-level keys replaced (None removes a key) and sections given as dicts."""
    data = {**BASE, **changes}
    return {k: v for k, v in data.items() if v is not None}


BAD = [
    # (config, dotted key, regex of the rest of the message)
    (mk(max_batch_szie=1), "max_batch_szie", r"unknown key \(did you mean 'max_batch_size'\?\)"),
    (mk(kv_cache_config={"token_per_block": 32}), "kv_cache_config.token_per_block",
     r"did you mean 'tokens_per_block'"),
    (mk(tokens_per_block=32), "tokens_per_block", r"did you mean 'kv_cache_config.tokens_per_block'"),
    (mk(megakernel={"sead": 1}), "megakernel.sead", r"did you mean 'seed'.*allowed here: mode, search_budget_s"),
    (mk(max_seq_len="1024"), "max_seq_len", r"expected an integer, got a string \('1024'\)"),
    (mk(max_seq_len=1024.5), "max_seq_len", r"expected an integer, got float 1024.5"),
    (mk(max_batch_size=True), "max_batch_size", r"expected an integer, got a boolean \(true\)"),
    (mk(max_batch_size=0), "max_batch_size", r"0 must be >= 1"),
    (mk(max_batch_size=-2), "max_batch_size", r"-2 must be >= 1"),
    (mk(model=None), "model", r"required"),
    (mk(max_input_len=2048), "max_input_len", r"2048 exceeds max_seq_len 1024"),
    (mk(max_num_tokens=100), "max_num_tokens", r"below max_input_len 512.*at least 512"),
    (mk(dtype="float16"), "dtype", r"'float16' is not supported.*use dtype: bfloat16"),
    (mk(kv_cache_config=32), "kv_cache_config", r"expected a mapping"),
    (mk(kv_cache_config={"free_gpu_memory_fraction": 0}), "kv_cache_config.free_gpu_memory_fraction",
     r"must be in \(0, 1\]"),
    (mk(kv_cache_config={"free_gpu_memory_fraction": 1.5}), "kv_cache_config.free_gpu_memory_fraction",
     r"must be in \(0, 1\]"),
    (mk(kv_cache_config={"dtype": "fp8"}), "kv_cache_config.dtype", r"'fp8' is not one of bfloat16, auto"),
    (mk(cuda_graph_config=[1]), "cuda_graph_config", r"expected a mapping.*or null"),
    (mk(prefill={"backend": "tensorrt-llm"}), "prefill.backend", r"did you mean 'tensorrt_llm'"),
    (mk(megakernel={"mode": "dynamic"}), "megakernel.mode", r"not implemented yet; only static is"),
    (mk(megakernel={"search_budget_s": 0}), "megakernel.search_budget_s", r"must be > 0"),
    (mk(megakernel={"seed": 1.5}), "megakernel.seed", r"expected an integer"),
    (mk(megakernel={"context_len": 2048}), "megakernel.context_len", r"exceeds max_seq_len 1024"),
    (mk(name="a/b"), "name", r"names the engine directory"),
    (mk(max_seq_len=4096, max_input_len=512), "max_seq_len", r"max_position_embeddings 2048.*at most 2048"),
    (mk(model="qwen3-9b"), "model", r"unknown architecture 'qwen3-9b'; did you mean 'qwen3-8b'"),
    (mk(model="./no/such/ckpt"), "model", r"no such checkpoint directory"),
    (mk(gpu="H300"), "gpu", r"unknown GPU 'H300'; known: L20, L40S"),
]


@pytest.mark.parametrize("data, key, rest", BAD, ids=[b[1] + "-" + str(i) for i, b in enumerate(BAD)])
def test_bad_config_names_file_and_key(tmp_path, data, key, rest):
    path = write_yaml(tmp_path / "bad.yaml", data)
    msg = config_error(path)
    assert msg.startswith(f"{path}: {key}: "), msg
    assert re.search(rest, msg), msg


def test_tokens_per_block_message_is_exact(tmp_path):
    path = write_yaml(tmp_path / "x.yaml", mk(kv_cache_config={"tokens_per_block": 24}))
    assert config_error(path) == \
        f"{path}: kv_cache_config.tokens_per_block: 24 is not a power of two (use 16, 32 or 64)"


def test_kv_cache_that_does_not_fit_says_how_much_and_what_fits(tmp_path):
    data = {"model": "llama-3.1-8b", "gpu": "L20", "max_batch_size": 8, "max_seq_len": 131072,
            "max_input_len": 1024}
    msg = config_error(write_yaml(tmp_path / "big.yaml", data))
    assert msg.startswith(f"{tmp_path / 'big.yaml'}: max_seq_len: weights 16.06 GB + activations ")
    assert "(8 x 131072 tokens)" in msg and "of L20's 48 GB, of which the KV cache may take" in msg
    assert "(free_gpu_memory_fraction 0.9)" in msg
    suggested = int(re.search(r"lower max_seq_len to at most (\d+)", msg).group(1))
    assert load_config(write_yaml(tmp_path / "fits.yaml", {**data, "max_seq_len": suggested})).memory_budget().fits
    msg = config_error(write_yaml(tmp_path / "over.yaml", {**data, "max_seq_len": suggested + 32}))
    assert "max_seq_len:" in msg


def test_batch_whose_prompts_cannot_fit_asks_for_a_smaller_batch(tmp_path):
    data = {"model": "llama-3.1-8b", "gpu": "L20", "max_batch_size": 256, "max_seq_len": 4096,
            "max_input_len": 2048, "max_num_tokens": 2048}
    msg = config_error(write_yaml(tmp_path / "x.yaml", data))
    assert msg.startswith(f"{tmp_path / 'x.yaml'}: max_batch_size: ") and "lower max_batch_size" in msg


def test_weights_that_do_not_fit_point_at_a_bigger_gpu(tmp_path):
    # a Llama of about 35 B parameters (70 GB in bf16): too big for L20's 48 GB, not for 80 GB GPUs
    arch = tiny_config("llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=40,
                       num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                       max_position_embeddings=8192)
    (tmp_path / "big.json").write_text(json.dumps(arch))
    data = {"model": str(tmp_path / "big.json"), "gpu": "L20", "max_batch_size": 1, "max_seq_len": 4096}
    msg = config_error(write_yaml(tmp_path / "x.yaml", data))
    assert msg.startswith(f"{tmp_path / 'x.yaml'}: model: ") and "alone do not fit" in msg
    assert "(A100-80GB, H100-SXM, H200)" in msg


def test_free_gpu_memory_fraction_is_a_share_of_the_memory_left_after_weights(tmp_path):
    # 8B on L20: 48 GB - 16.4 GB of weights leaves ~31 GB; a fraction of 0.2 gives the KV cache ~6 GB,
    # enough for 4 x 8192 tokens (4.3 GB) but not 8 x 8192 (8.6 GB). Read as a share of all memory
    # (9.6 GB), not even the weights would fit.
    base = {"model": "llama-3.1-8b", "gpu": "L20", "max_seq_len": 8192,
            "kv_cache_config": {"free_gpu_memory_fraction": 0.2}}
    assert load_config(write_yaml(tmp_path / "a.yaml", {**base, "max_batch_size": 4})).memory_budget().fits
    msg = config_error(write_yaml(tmp_path / "b.yaml", {**base, "max_batch_size": 8}))
    assert "free_gpu_memory_fraction 0.2" in msg


def test_mistral_sliding_window_must_cover_max_seq_len(tmp_path):
    (tmp_path / "mistral.json").write_text(json.dumps(tiny_config("mistral", sliding_window=512)))
    path = write_yaml(tmp_path / "x.yaml", mk(model="mistral.json", max_seq_len=1024))
    assert config_error(path).startswith(f"{path}: max_seq_len: 1024 exceeds the model's sliding_window 512")


def test_model_the_megakernel_cannot_run_is_a_model_error_of_the_config(tmp_path):
    arch = tiny_config("llama", hidden_size=96, num_attention_heads=3, num_key_value_heads=1)
    (tmp_path / "odd.json").write_text(json.dumps(arch))
    path = write_yaml(tmp_path / "x.yaml", mk(model="odd.json"))
    msg = config_error(path)
    assert msg.startswith(f"{path}: model: ") and "hidden_size=96 must be a multiple of 64" in msg


def test_head_width_the_kernel_cannot_split_across_a_warp_is_refused_before_the_search(tmp_path):
    # head_dim 80 (a multiple of 16, so the spec and the reference take it) leaves a warp's lanes uneven
    arch = tiny_config("mistral", hidden_size=320, num_attention_heads=4, num_key_value_heads=2, head_dim=80)
    (tmp_path / "hd80.json").write_text(json.dumps(arch))
    path = write_yaml(tmp_path / "x.yaml", mk(model="hd80.json"))
    msg = config_error(path)
    assert msg.startswith(f"{path}: model: ") and "head_dim=80 must be a multiple of 32" in msg


def test_gpu_auto_without_a_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    path = write_yaml(tmp_path / "x.yaml", mk(gpu="auto"))
    msg = config_error(path)
    assert msg.startswith(f"{path}: gpu: auto found no CUDA GPU") and "H100-SXM" in msg


def test_bad_yaml_syntax_gives_the_line(tmp_path):
    path = write_yaml(tmp_path / "x.yaml", "model: tiny-llama\ngpu: H100-SXM\nmax_batch_size: [1\nmax_seq_len: 8\n")
    msg = config_error(path)
    assert msg.startswith(f"{path}: line ") and "invalid YAML" in msg


def test_duplicate_key_gives_the_line(tmp_path):
    path = write_yaml(tmp_path / "x.yaml", "model: tiny-llama\ngpu: H100-SXM\ngpu: L20\n")
    assert config_error(path) == f"{path}: line 3: key 'gpu' is given twice; keep one"


@pytest.mark.parametrize("text, rest", [("", "the config is empty"), ("- 1\n- 2\n", "config: expected a mapping")])
def test_empty_or_non_mapping_file(tmp_path, text, rest):
    path = write_yaml(tmp_path / "x.yaml", text)
    assert config_error(path).startswith(f"{path}: {rest}")


def test_missing_file(tmp_path):
    msg = config_error(tmp_path / "nope.yaml")
    assert msg.startswith(f"{tmp_path / 'nope.yaml'}: no such config file")
