"""load_checkpoint: round trips of tiny checkpoints (single file and sharded) and every error path."""
import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from trtllm_mk.errors import ModelError
from trtllm_mk.model import load_checkpoint, load_spec
from trtllm_mk.model.checkpoint import INDEX_FILE, SINGLE_FILE, check_checkpoint
from trtllm_mk.model.tiny import FAMILIES, write_tiny_checkpoint


def _rewrite(ckpt, edit):
    """Apply ``edit`` to the tensors of a single-file checkpoint and save them back."""
    path = ckpt / SINGLE_FILE
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_checkpoint_round_trips(tmp_path, family):
    ckpt = write_tiny_checkpoint(tmp_path / family, family=family, seed=3)
    spec = load_spec(ckpt)
    loaded = load_checkpoint(ckpt, spec)
    on_disk = load_file(str(ckpt / SINGLE_FILE))
    assert list(loaded) == list(spec.expected_tensors())
    for name, shape in spec.expected_tensors().items():
        assert loaded[name].shape == shape and loaded[name].dtype == torch.bfloat16
        assert torch.equal(loaded[name], on_disk[name]), name


def test_dtype_argument_casts(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "c", family="qwen3")
    spec = load_spec(ckpt)
    bf16 = load_checkpoint(ckpt, spec)
    fp32 = load_checkpoint(ckpt, spec, dtype=torch.float32)
    assert all(t.dtype == torch.float32 for t in fp32.values())
    assert all(torch.equal(fp32[n], bf16[n].float()) for n in bf16)


def test_sharded_checkpoint_loads_like_single_file(tmp_path):
    single = write_tiny_checkpoint(tmp_path / "one", family="qwen2", seed=7)
    sharded = write_tiny_checkpoint(tmp_path / "three", family="qwen2", seed=7, shards=3)
    index = json.loads((sharded / INDEX_FILE).read_text())
    shard_files = sorted(set(index["weight_map"].values()))
    assert len(shard_files) == 3 and not (sharded / SINGLE_FILE).exists()
    assert all((sharded / f).is_file() for f in shard_files)
    spec = load_spec(single)
    a, b = load_checkpoint(single, spec), load_checkpoint(sharded, spec)
    assert list(a) == list(b)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_rewriting_with_fewer_shards_removes_stale_shards(tmp_path):
    d = write_tiny_checkpoint(tmp_path / "c", family="llama", shards=2)
    write_tiny_checkpoint(d, family="llama", seed=1)
    assert not (d / INDEX_FILE).exists() and not list(d.glob("model-*-of-*.safetensors"))
    load_checkpoint(d, load_spec(d))


def test_tied_lm_head_and_inv_freq_are_ignored_silently(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "c", family="llama", tie_word_embeddings=True)

    def add(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(16)
    _rewrite(ckpt, add)
    spec = load_spec(ckpt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = load_checkpoint(ckpt, spec)
    assert "lm_head.weight" not in loaded and set(loaded) == set(spec.expected_tensors())


def test_a_tied_configs_lm_head_that_is_no_copy_is_refused(tmp_path):
    # transformers unties a saved lm_head that differs from the embedding and decodes with it; the
    # engine reads the embedding, so it refuses the checkpoint naming the fix (check and load alike)
    ckpt = write_tiny_checkpoint(tmp_path / "c", family="llama", tie_word_embeddings=True)

    def add(t):
        head = t["model.embed_tokens.weight"].clone()
        head[-1, 3] += 1.0   # the last block of rows, one element
        t["lm_head.weight"] = head
    _rewrite(ckpt, add)
    spec = load_spec(ckpt)
    for read in (check_checkpoint, load_checkpoint):
        with pytest.raises(ModelError, match="lm_head.weight differs from model.embed_tokens.weight.*"
                                             "tie_word_embeddings to false"):
            read(ckpt, spec)


def test_unknown_extra_tensor_is_skipped_with_a_warning(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "c", family="llama")
    _rewrite(ckpt, lambda t: t.__setitem__("model.layers.0.self_attn.q_proj.bias", torch.zeros(128)))
    spec = load_spec(ckpt)
    with pytest.warns(UserWarning, match=r"q_proj\.bias"):
        loaded = load_checkpoint(ckpt, spec)
    assert "model.layers.0.self_attn.q_proj.bias" not in loaded


# ---------------------------------------------------------------- error paths

def test_missing_directory(tmp_path):
    spec = load_spec(write_tiny_checkpoint(tmp_path / "c"))
    with pytest.raises(ModelError, match="checkpoint directory not found"):
        load_checkpoint(tmp_path / "nowhere", spec)


def test_missing_weight_file_names_what_was_expected(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "c")
    spec = load_spec(ckpt)
    (ckpt / SINGLE_FILE).rename(ckpt / "pytorch_model.bin")
    with pytest.raises(ModelError, match=rf"no {SINGLE_FILE} or {INDEX_FILE} \(found: pytorch_model.bin\)"):
        load_checkpoint(ckpt, spec)


def test_missing_tensor_is_named(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "c", family="qwen3")
    _rewrite(ckpt, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(ModelError, match=r"lacks 1 tensor.*model\.layers\.1\.self_attn\.k_norm\.weight"):
        load_checkpoint(ckpt, load_spec(ckpt))


def test_untied_config_requires_lm_head(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "c", family="llama", tie_word_embeddings=True)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match=r"lm_head\.weight"):
        load_checkpoint(ckpt, load_spec(ckpt))


def test_misshaped_tensor_reports_expected_and_actual(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "c", family="llama")
    name = "model.layers.0.mlp.up_proj.weight"
    _rewrite(ckpt, lambda t: t.__setitem__(name, t[name][:192].contiguous()))
    with pytest.raises(ModelError, match=rf"{name} shape \[192, 128\] \(expected \[256, 128\]\)"):
        load_checkpoint(ckpt, load_spec(ckpt))


def test_mixed_float_dtypes_load_cast_to_the_model_dtype(tmp_path):
    # fp32 norms beside bf16 matrices, as some exporters write them (transformers loads them too)
    ckpt = write_tiny_checkpoint(tmp_path / "c", family="mistral")
    name = "model.norm.weight"
    _rewrite(ckpt, lambda t: t.__setitem__(name, t[name].float()))
    spec = load_spec(ckpt)
    assert check_checkpoint(ckpt, spec) == {"BF16", "F32"}
    loaded = load_checkpoint(ckpt, spec)
    assert {t.dtype for t in loaded.values()} == {torch.bfloat16}
    assert torch.equal(loaded[name], load_file(str(ckpt / SINGLE_FILE))[name].bfloat16())


def test_non_float_dtype_is_reported(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "c", family="mistral")
    name = "model.norm.weight"
    _rewrite(ckpt, lambda t: t.__setitem__(name, t[name].to(torch.int16)))
    with pytest.raises(ModelError, match=rf"{name} dtype I16 \(expected one of BF16, F16, F32\)"):
        check_checkpoint(ckpt, load_spec(ckpt))


@pytest.mark.parametrize("keep", [0.5, 0.999, 6])
def test_truncated_file_is_named(tmp_path, keep):
    ckpt = write_tiny_checkpoint(tmp_path / "c")
    path = ckpt / SINGLE_FILE
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep) if keep < 1 else keep])
    with pytest.raises(ModelError, match=rf"{path}: unreadable safetensors file"):
        load_checkpoint(ckpt, load_spec(ckpt))


def test_corrupt_header_is_named(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "c")
    path = ckpt / SINGLE_FILE
    data = bytearray(path.read_bytes())
    data[8:24] = b"#" * 16  # the JSON header starts at byte 8, after its little-endian length
    path.write_bytes(bytes(data))
    with pytest.raises(ModelError, match=rf"{path}: unreadable safetensors file"):
        load_checkpoint(ckpt, load_spec(ckpt))


def test_truncated_shard_is_named(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "c", shards=2)
    shard = ckpt / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ModelError, match="model-00002-of-00002.safetensors: unreadable"):
        load_checkpoint(ckpt, load_spec(ckpt))


def test_missing_shard_is_named(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "c", shards=2)
    (ckpt / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(ModelError, match="missing: model-00001-of-00002.safetensors"):
        load_checkpoint(ckpt, load_spec(ckpt))


def test_bad_index_json(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "c", shards=2)
    (ckpt / INDEX_FILE).write_text('{"weight_map": {')
    with pytest.raises(ModelError, match=rf"{INDEX_FILE}: not valid JSON"):
        load_checkpoint(ckpt, load_spec(ckpt))
    (ckpt / INDEX_FILE).write_text('{"metadata": {}}')
    with pytest.raises(ModelError, match="no 'weight_map'"):
        load_checkpoint(ckpt, load_spec(ckpt))


def test_index_pointing_at_the_wrong_shard(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "c", shards=2)
    index = json.loads((ckpt / INDEX_FILE).read_text())
    moved = next(n for n, f in index["weight_map"].items() if f == "model-00002-of-00002.safetensors")
    index["weight_map"][moved] = "model-00001-of-00002.safetensors"
    (ckpt / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ModelError, match=rf"model-00001-of-00002\.safetensors: .*places {moved}"):
        load_checkpoint(ckpt, load_spec(ckpt))


@pytest.mark.gpu
def test_loads_straight_onto_the_gpu(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "c", family="qwen3", shards=2)
    spec = load_spec(ckpt)
    on_gpu = load_checkpoint(ckpt, spec, device="cuda")
    on_cpu = load_checkpoint(ckpt, spec)
    assert all(t.is_cuda and t.dtype == torch.bfloat16 for t in on_gpu.values())
    assert all(torch.equal(on_gpu[n].cpu(), on_cpu[n]) for n in on_cpu)
