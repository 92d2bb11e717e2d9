"""Mixture-of-experts models on the CPU: the qwen3_moe and mixtral families (spec, checkpoints, random
weights, tiny writer), routing with its tie-break rule, the reference decoder and the torch prefill
against transformers on tiny checkpoints that transformers itself writes, the active-expert byte
counts, and deployments (configs load; building stops in one line).

HF's eager modules define the truth, as in tests/test_reference.py: the checkpoints are written by
``save_pretrained`` (per-expert tensors, HF's names) and read by our loader; prefill logits and the
K/V in the paged cache, greedy generations token for token at batch 1 and 4, and the logits of every
teacher-forced decode step. Prefill runs the grouped evaluation of the experts (tokens x k > E) and
decode the gathered one, so both are checked.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

from trtllm_mk.backends.torch_prefill import TorchPrefill
from trtllm_mk.config import load_config
from trtllm_mk.deployment import decode_floor_s, describe
from trtllm_mk.errors import ConfigError, ModelError
from trtllm_mk.graph import build_step_graph
from trtllm_mk.graph.tasks import TilePlan
from trtllm_mk.kv_cache import PagedKVCache
from trtllm_mk.model.checkpoint import load_checkpoint
from trtllm_mk.model.decoder_block import share_fused_storage
from trtllm_mk.model.moe import MoeMlp, route
from trtllm_mk.model.random_weights import random_weights
from trtllm_mk.model.registry import resolve_model
from trtllm_mk.model.spec import ModelSpec, load_spec, spec_from_hf_config
from trtllm_mk.model.tiny import tiny_config, write_tiny_checkpoint
from trtllm_mk.reference import ReferenceDecoder

ROOT = Path(__file__).resolve().parents[1]
TPB = 8
MAX_SEQ = 48
NEW_TOKENS = 16

_COMMON = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=512,
               # std 0.1 spreads the logits (and the router's), so neither greedy choices nor routing are near-ties
               initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None)

# qwen3_moe: renormalised, layer 1 dense (mlp_only_layers); qwen3_moe_sparse2: not renormalised, every
# second layer sparse (decoder_sparse_step); mixtral: every layer sparse, w1/w3/w2 names, fp32 scaling.
CASES = ("qwen3_moe", "qwen3_moe_sparse2", "mixtral")


def _hf_config(case: str):
    if case == "qwen3_moe":
        return Qwen3MoeConfig(**_COMMON, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                              norm_topk_prob=True, mlp_only_layers=[1], rms_norm_eps=1e-6, rope_theta=1e6)
    if case == "qwen3_moe_sparse2":
        return Qwen3MoeConfig(**{**_COMMON, "num_hidden_layers": 4}, moe_intermediate_size=64, num_experts=8,
                              num_experts_per_tok=3, norm_topk_prob=False, decoder_sparse_step=2,
                              rms_norm_eps=1e-6, rope_theta=1e6)
    return MixtralConfig(**{**_COMMON, "intermediate_size": 64}, num_local_experts=8, num_experts_per_tok=2,
                         rms_norm_eps=1e-5, rope_theta=1e6)


@functools.cache
def _checkpoint(case: str, dtype: torch.dtype, root: str) -> tuple[object, Path]:
    """(HF eager model, the directory it saved itself to); the bf16 model holds the fp32 model's weights
    rounded. Norm gains are moved off 1 so that they matter."""
    if dtype == torch.float32:
        torch.manual_seed(CASES.index(case))
        model = AutoModelForCausalLM.from_config(_hf_config(case), attn_implementation="eager",
                                                 experts_implementation="eager", dtype=dtype)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(1.0, 0.2)
    else:
        fp32, _ = _checkpoint(case, torch.float32, root)
        model = AutoModelForCausalLM.from_config(_hf_config(case), attn_implementation="eager",
                                                 experts_implementation="eager", dtype=dtype)
        model.load_state_dict(fp32.state_dict())
    d = Path(root) / f"{case}-{str(dtype).split('.')[-1]}"
    model.eval().save_pretrained(d)
    return model, d


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("moe_ckpts"))


def _setup(case, dtype, root):
    model, d = _checkpoint(case, dtype, root)
    spec = load_spec(d)
    return model, spec, load_checkpoint(d, spec)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(100 + seed)
    return [torch.randint(0, 512, (length,), generator=g).tolist() for length in (5, 19, 30, 11)[:n]]


def _cache(spec, batch, dtype=torch.float32, seed=0):
    return PagedKVCache.allocate(spec, batch, MAX_SEQ, TPB, dtype=dtype, shuffle_blocks=True, seed=seed, fill=1e4)


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@torch.no_grad()
def _decode_errors(model, ref, prompts, cache, steps):
    """Relative error of the prefill and every teacher-forced decode step against HF's logits at the
    same positions of the whole sequence."""
    g = torch.Generator().manual_seed(7)
    cont = torch.randint(0, 512, (len(prompts), steps + 1), generator=g)
    ours = [ref.prefill(prompts, cache)]
    pos = torch.tensor([len(p) for p in prompts])
    for t in range(steps):
        ours.append(ref.decode(cont[:, t], pos + t, cache))
    errs = []
    for b, p in enumerate(prompts):
        hf = model(torch.tensor([p + cont[b, :steps].tolist()])).logits[0, len(p) - 1:].float()
        errs += [_rel(ours[t][b], hf[t]) for t in range(steps + 1)]
    return errs


# ---- the spec ----------------------------------------------------------------------------------

def test_spec_of_what_transformers_writes(ckpt_root):
    _, d = _checkpoint("qwen3_moe", torch.float32, ckpt_root)
    cfg = json.loads((d / "config.json").read_text())
    assert "num_local_experts" in cfg and "num_experts" not in cfg   # transformers' own spelling
    s = load_spec(d)
    assert (s.family, s.num_experts, s.num_experts_per_tok, s.moe_intermediate_size, s.norm_topk_prob) == \
        ("qwen3_moe", 8, 2, 64, True)
    assert s.moe_layers == (0, 2) and s.qk_norm
    _, d2 = _checkpoint("qwen3_moe_sparse2", torch.float32, ckpt_root)
    assert load_spec(d2).moe_layers == (1, 3) and not load_spec(d2).norm_topk_prob
    _, d3 = _checkpoint("mixtral", torch.float32, ckpt_root)
    m = load_spec(d3)
    assert (m.family, m.moe_layers, m.moe_intermediate_size, m.norm_topk_prob) == ("mixtral", (0, 1, 2), 64, True)
    assert "model.layers.0.block_sparse_moe.experts.7.w3.weight" in m.expected_tensors()


def test_qwen3_30b_a3b_architecture_file():
    s = resolve_model("qwen3-30b-a3b").spec
    assert (s.family, s.num_layers, s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim, s.num_experts,
            s.num_experts_per_tok, s.moe_intermediate_size, s.vocab_size, s.rope_theta, s.norm_topk_prob,
            s.tie_word_embeddings) == ("qwen3_moe", 48, 2048, 32, 4, 128, 128, 8, 768, 151936, 1e6, True, False)
    assert s.moe_layers == tuple(range(48))
    assert s.num_params() / 1e9 == pytest.approx(30.53, abs=0.01)       # "30.5B total"
    # transformers' config class reads the file to the same model, and its defaults are this shape
    raw = json.loads((ROOT / "configs" / "models" / "qwen3-30b-a3b.json").read_text())
    via_hf = spec_from_hf_config(Qwen3MoeConfig(**raw).to_dict(), name="qwen3-30b-a3b")
    assert dataclasses.replace(via_hf, eos_token_ids=s.eos_token_ids) == s
    d = Qwen3MoeConfig()
    assert (d.hidden_size, d.num_attention_heads, d.num_key_value_heads, d.num_experts, d.num_experts_per_tok,
            d.moe_intermediate_size, d.vocab_size) == (2048, 32, 4, 128, 8, 768, 151936)


def test_active_bytes_of_qwen3_30b_a3b():
    s = resolve_model("qwen3-30b-a3b").spec
    E, k, L = 128, 8, 48
    per_expert = 3 * 2048 * 768 * 2
    assert s.expert_bytes() == per_expert
    dense = s.weight_bytes() - L * E * per_expert - s.vocab_size * s.hidden_size * 2   # embedding: looked up
    assert s.decode_weight_bytes() == dense + L * k * per_expert
    assert s.decode_weight_bytes() / 1e9 == pytest.approx(6.08, abs=0.01)
    assert s.decode_weight_bytes(4, worst_case=True) == dense + L * 32 * per_expert
    assert s.decode_weight_bytes(64, worst_case=True) == dense + L * E * per_expert   # min(E, b*k)
    assert s.decode_weight_bytes(1) < s.decode_weight_bytes(4) < s.decode_weight_bytes(4, worst_case=True)


def test_expected_distinct_experts_matches_sampling():
    s = resolve_model("qwen3-30b-a3b").spec
    assert s.active_experts(1) == 8 and s.active_experts(1, worst_case=True) == 8
    g = torch.Generator().manual_seed(0)
    for batch in (2, 4, 16):
        trials = 4000
        picks = torch.rand(trials, batch, 128, generator=g).argsort(-1)[..., :8]   # k distinct per row
        hit = torch.zeros(trials, 128, dtype=torch.bool)
        hit.scatter_(1, picks.reshape(trials, -1), True)
        assert s.active_experts(batch) == pytest.approx(hit.sum(1).float().mean().item(), rel=0.01)
        assert s.active_experts(batch, worst_case=True) == min(128, 8 * batch)


def test_dense_spec_dict_is_unchanged_and_moe_dict_round_trips():
    dense = resolve_model("qwen3-8b").spec
    assert not dense.is_moe and dense.moe_layers == () and dense.decode_weight_bytes(4) == dense.decode_weight_bytes()
    assert "num_experts" not in dense.to_dict() and ModelSpec.from_dict(dense.to_dict()) == dense
    moe = resolve_model("tiny-qwen3-moe").spec
    d = json.loads(json.dumps(moe.to_dict()))   # as a schedule stores it
    assert d["mlp_only_layers"] == [1] and ModelSpec.from_dict(d) == moe


@pytest.mark.parametrize("change, match", [
    ({"num_experts_per_tok": 9}, "exceeds the 8 experts"),
    ({"num_experts": 6}, "disagree"),
    ({"mlp_only_layers": [3]}, "mlp_only_layers"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob"),
    ({"shared_expert_intermediate_size": 128}, "shared experts are not implemented"),
    ({"scoring_func": "sigmoid"}, "scoring_func 'sigmoid' is not implemented"),
    ({"num_local_experts": None}, "no 'num_experts'"),
])
def test_bad_moe_configs_are_refused_in_one_line(change, match):
    cfg = tiny_config("qwen3_moe")
    cfg["num_local_experts"] = cfg.pop("num_experts")
    cfg.update(change)
    with pytest.raises(ModelError, match=match) as e:
        spec_from_hf_config(cfg)
    assert "\n" not in str(e.value)


# ---- routing -----------------------------------------------------------------------------------

def _rule(logits: torch.Tensor, k: int) -> list[list[int]]:
    """The tie-break rule written out: expert e's rank is the number of experts more probable than it,
    plus the number of equally probable ones with a lower index; the k lowest ranks win."""
    probs = torch.softmax(logits, -1, dtype=torch.float32)
    out = []
    for p in probs:
        rank = [int((p > p[e]).sum()) + int((p[:e] == p[e]).sum()) for e in range(len(p))]
        out.append(sorted(e for e in range(len(p)) if rank[e] < k))
    return out


def test_route_breaks_ties_towards_the_lowest_expert_index():
    w, e = route(torch.zeros(1, 8), 3, normalize=False)
    assert e.tolist() == [[0, 1, 2]] and torch.allclose(w, torch.full((1, 3), 1 / 8))
    w, e = route(torch.tensor([[0.0, 2.0, 1.0, 2.0, 1.0, 1.0]]), 3, normalize=True)
    assert e.tolist() == [[1, 2, 3]]                      # 2.0 twice, then the first of the 1.0s
    assert w.sum().item() == pytest.approx(1.0) and w[0, 0] == w[0, 2] > w[0, 1]
    g = torch.Generator().manual_seed(3)
    logits = torch.randint(0, 4, (200, 16), generator=g).float()      # ties everywhere
    for k in (1, 2, 5):
        assert route(logits, k, normalize=False)[1].tolist() == _rule(logits, k)


def test_route_weights_without_ties_are_torch_topk():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(64, 128, generator=g)
    probs = torch.softmax(logits, -1)
    for normalize in (False, True):
        w, e = route(logits, 8, normalize)
        top_w, top_e = probs.topk(8, -1)
        order = top_e.argsort(-1)
        assert torch.equal(e, top_e.gather(-1, order))
        want = top_w / top_w.sum(-1, keepdim=True) if normalize else top_w
        torch.testing.assert_close(w, want.gather(-1, order))
        assert bool((e[:, 1:] > e[:, :-1]).all())        # ascending index: the summation order


def test_gathered_and_grouped_experts_agree():
    spec = resolve_model("tiny-qwen3-moe").spec
    w = random_weights(spec, dtype=torch.float32, seed=1, std=0.1)
    mlp = MoeMlp(spec, w, 0, torch.float32)
    x = torch.randn(3, spec.hidden_size, generator=torch.Generator().manual_seed(5))
    _, experts = route(torch.nn.functional.linear(x, mlp.router), 2, True)
    torch.testing.assert_close(mlp._gathered(x, experts, None), mlp._grouped(x, experts, None))


# ---- the reference against transformers -----------------------------------------------------------

@pytest.mark.parametrize("case", CASES)
def test_prefill_logits_and_cache_match_hf(case, ckpt_root):
    model, spec, w = _setup(case, torch.float32, ckpt_root)
    prompts = _prompts(4)
    cache = _cache(spec, 4)
    logits = ReferenceDecoder(spec, w).prefill(prompts, cache)
    for b, p in enumerate(prompts):
        with torch.no_grad():
            out = model(torch.tensor([p]), use_cache=True)
        assert _rel(logits[b], out.logits[0, -1]) < 1e-4
        for i, layer in enumerate(out.past_key_values.layers):
            k, v = cache.read(i, b, len(p))
            assert _rel(k, layer.keys[0].transpose(0, 1)) < 1e-5
            assert _rel(v, layer.values[0].transpose(0, 1)) < 1e-5


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("case", CASES)
def test_greedy_generation_equals_hf_generate(case, batch, ckpt_root):
    model, spec, w = _setup(case, torch.float32, ckpt_root)
    prompts = _prompts(batch, seed=1)
    ours = ReferenceDecoder(spec, w).generate(prompts, NEW_TOKENS, cache=_cache(spec, batch, seed=1))
    for p, got in zip(prompts, ours):
        with torch.no_grad():
            hf = model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(p):]
        assert got == hf.tolist()
        assert len(set(got)) >= 4, "degenerate generation: the comparison would prove little"


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("case", CASES)
def test_decode_logits_match_hf_every_step(case, batch, ckpt_root):
    model, spec, w = _setup(case, torch.float32, ckpt_root)
    errs = _decode_errors(model, ReferenceDecoder(spec, w), _prompts(batch, seed=2), _cache(spec, batch, seed=2),
                          steps=12)
    assert max(errs) < 1e-4


@pytest.mark.parametrize("case", CASES)
def test_bf16_rounds_like_hf_bf16(case, ckpt_root):
    """In bf16 the reference rounds where HF's eager bf16 modules round, the experts' weighted sum
    included (its order and, for Mixtral, scaling in fp32). A single misplaced rounding point (the
    routing weights rounded, or not, before they scale) costs ~1e-2 on every step; here most steps
    are exact (on x86 CPUs: bitwise equal). Not all: HF runs each expert's GEMM over the tokens that
    chose it, and a CPU bf16 GEMM rounds differently for different row counts, so HF on the whole
    sequence differs from HF on its prefix, by bf16 noise, at a few positions."""
    model, spec, w = _setup(case, torch.bfloat16, ckpt_root)
    ref = ReferenceDecoder(spec, w)
    assert ref.dtype == torch.bfloat16
    errs = _decode_errors(model, ref, _prompts(4, seed=3), _cache(spec, 4, torch.bfloat16, seed=3), steps=6)
    assert statistics.median(errs) < 1e-3 and max(errs) < 2e-2


def test_torch_prefill_runs_moe_like_the_reference(ckpt_root):
    model, spec, w = _setup("qwen3_moe", torch.float32, ckpt_root)
    prompts = _prompts(4, seed=4)
    caches = [_cache(spec, 4, seed=4), _cache(spec, 4, seed=4)]
    got = TorchPrefill(spec, w).prefill(prompts, caches[0])
    want = ReferenceDecoder(spec, w).prefill(prompts, caches[1])
    assert _rel(got, want) < 1e-4
    for b, p in enumerate(prompts):
        for layer in range(spec.num_layers):
            assert _rel(caches[0].read(layer, b, len(p))[0], caches[1].read(layer, b, len(p))[0]) < 1e-5


def test_shared_storage_stacks_the_experts_without_a_copy():
    spec = resolve_model("tiny-qwen3-moe").spec
    w = share_fused_storage(spec, random_weights(spec, dtype=torch.float32, seed=2))
    mlp = MoeMlp(spec, w, 0, torch.float32)
    _, experts = spec.moe_names(0)
    assert mlp.w_gate_up.data_ptr() == w[experts[0][0]].data_ptr()
    assert mlp.w_down.data_ptr() == w[experts[0][2]].data_ptr()
    assert torch.equal(mlp.w_gate_up[3, 64:], w[experts[3][1]]) and torch.equal(mlp.w_down[5], w[experts[5][2]])


# ---- checkpoints and random weights ----------------------------------------------------------------

@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_tiny_writer_checkpoint_is_what_transformers_reads(family, tmp_path):
    """Our tiny writer's checkpoint (sharded) loads in transformers to the model our reference computes."""
    write_tiny_checkpoint(tmp_path, family=family, seed=3, shards=3)
    spec = load_spec(tmp_path)
    assert spec.family == family and spec.is_moe
    w = {k: v.float() for k, v in load_checkpoint(tmp_path, spec).items()}
    assert list(w) == list(spec.expected_tensors())
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager",
                                                 experts_implementation="eager", dtype=torch.float32)
    prompts = _prompts(2, seed=5)
    logits = ReferenceDecoder(spec, w).prefill(prompts, _cache(spec, 2))
    for b, p in enumerate(prompts):
        with torch.no_grad():
            assert _rel(logits[b], model(torch.tensor([p])).logits[0, -1]) < 1e-4


def test_random_weights_have_the_moe_shapes():
    spec = resolve_model("qwen3-30b-a3b").spec
    small = dataclasses.replace(spec, num_layers=2, vocab_size=512, num_experts=4)
    w = random_weights(small, dtype=torch.bfloat16, seed=0)
    assert {k: tuple(v.shape) for k, v in w.items()} == small.expected_tensors()
    assert w["model.layers.1.mlp.gate.weight"].shape == (4, 2048)
    assert w["model.layers.0.mlp.experts.3.down_proj.weight"].shape == (2048, 768)
    assert "model.layers.0.mlp.gate_proj.weight" not in w


def test_missing_expert_is_named(tmp_path):
    from safetensors.torch import load_file, save_file
    write_tiny_checkpoint(tmp_path, family="qwen3_moe")
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelError, match=r"lacks 1 tensor.*layers\.2\.mlp\.experts\.5\.up_proj"):
        load_checkpoint(tmp_path, load_spec(tmp_path))


# ---- deployments -----------------------------------------------------------------------------------

def test_tiny_moe_config_loads_with_active_floors():
    cfg = load_config(ROOT / "configs" / "tiny_moe_cpu.yaml")
    spec, gpu = cfg.model_spec, cfg.gpu_spec
    assert spec.is_moe and cfg.max_batch_size == 4
    mem = cfg.memory_budget()
    assert mem.fits and mem.weights == spec.weight_bytes()              # every expert is resident
    assert decode_floor_s(spec, gpu) < decode_floor_s(spec, gpu, 4) < decode_floor_s(spec, gpu, 4, worst_case=True)
    assert decode_floor_s(spec, gpu) == spec.decode_weight_bytes() / gpu.read_bandwidth
    text = describe(cfg)
    assert "2 of 8 experts per layer" in text and "decode floor, batch 4, worst case" in text
    assert "sparse layers" in text and "3 of 3" in text


@pytest.mark.parametrize("name, batch", [("h100_qwen3_30b_a3b_bs1", 1), ("h100_qwen3_30b_a3b_bs4", 4)])
def test_qwen3_30b_a3b_deployments_fit_an_h100(name, batch):
    cfg = load_config(name)
    assert (cfg.model_spec.name, cfg.gpu, cfg.max_batch_size) == ("qwen3-30b-a3b", "H100-SXM", batch)
    assert cfg.memory_budget().fits


def _mixed_config(tmp_path):
    """tiny_moe_cpu.yaml with the tiny Qwen3-MoE whose middle layer is dense."""
    text = (ROOT / "configs" / "tiny_moe_cpu.yaml").read_text().replace("model: tiny-qwen3-moe-sparse",
                                                                       "model: tiny-qwen3-moe")
    path = tmp_path / "mixed.yaml"
    path.write_text(text)
    return path


def test_building_dense_and_sparse_layers_stops_before_the_search_in_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "trtllm_mk", "build", "--config", str(_mixed_config(tmp_path)),
                        "--output-dir", str(tmp_path / "e")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "mixture-of-experts" in err[0] and "dense MLP layers [1]" in err[0], r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "e").exists()


def test_no_step_is_lowered_for_dense_and_sparse_layers(tmp_path):
    spec = resolve_model("tiny-qwen3-moe").spec
    with pytest.raises(ModelError, match="dense MLP"):
        build_step_graph(spec, 1, TilePlan())
    from trtllm_mk.build import check_buildable
    with pytest.raises(ConfigError, match="dense MLP"):
        check_buildable(load_config(_mixed_config(tmp_path)))


def test_fused_expert_checkpoint_is_refused_in_one_line(tmp_path):
    from safetensors.torch import load_file, save_file
    write_tiny_checkpoint(tmp_path, family="qwen3_moe")
    spec = load_spec(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    _, experts = spec.moe_names(0)
    tensors["model.layers.0.mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([tensors.pop(g), tensors.pop(u)]) for g, u, _ in experts])
    tensors["model.layers.0.mlp.experts.down_proj"] = torch.stack([tensors.pop(d) for _, _, d in experts])
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelError, match="experts fused into 3-D tensors") as e:
        load_checkpoint(tmp_path, spec)
    assert "\n" not in str(e.value)


def test_a_checkpoint_routed_differently_is_not_the_engine_model(tmp_path):
    from trtllm_mk.model.consistency import check_matches
    write_tiny_checkpoint(tmp_path / "a", family="qwen3_moe")
    write_tiny_checkpoint(tmp_path / "b", family="qwen3_moe", num_experts_per_tok=3)
    check_matches(load_spec(tmp_path / "a"), tmp_path / "a")
    with pytest.raises(ModelError, match="num_experts_per_tok is 3 in the checkpoint but 2 in the engine"):
        check_matches(load_spec(tmp_path / "a"), tmp_path / "b")
