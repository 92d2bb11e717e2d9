"""Tensor parallelism on the CPU: rank layouts (GQA-aware, KV heads replicated below one per rank),
weight shards and their inverse, the all-reduce and cross-rank argmax, the emulated TP decoder against
TP=1 and the reference decoder, and the deployment key ``tensor_parallel_size`` with its per-GPU
memory budget."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from trtllm_mk.build import check_buildable
from trtllm_mk.config import load_config, parse_config
from trtllm_mk.deployment import describe
from trtllm_mk.errors import ConfigError, ModelError
from trtllm_mk.kinds.argmax import NonFiniteLogits
from trtllm_mk.kv_cache import PagedKVCache
from trtllm_mk.model.decoder_block import check_weights
from trtllm_mk.model.random_weights import random_weights
from trtllm_mk.model.registry import resolve_model
from trtllm_mk.model.spec import spec_from_hf_config
from trtllm_mk.model.tiny import tiny_config
from trtllm_mk.parallel import allreduce_cost as arc
from trtllm_mk.parallel import check_tensor_parallel, rank_layout, rank_spec, shard_all, shard_weights, unshard_weights
from trtllm_mk.parallel.emulate import TensorParallelDecoder, all_reduce, cross_rank_argmax
from trtllm_mk.reference import ReferenceDecoder

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [[5, 6, 7, 8], [1, 2, 3], [400, 9], [33, 44, 55, 66, 77]]
NEW = 10


def tiny_spec(family="llama", **overrides):
    """A tiny model with 8 query heads on 2 KV heads: TP 4 and 8 replicate the KV heads."""
    cfg = tiny_config(family, **{"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16, **overrides})
    return spec_from_hf_config(cfg, name=f"tiny-{family}")


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def model(request):
    spec = tiny_spec(request.param)
    return spec, random_weights(spec, dtype=torch.bfloat16, seed=3)


# ------------------------------------------------------------------------------------ layouts

@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_llama70b_splits_evenly(tp):
    spec = resolve_model("llama-3.1-70b").spec
    share = rank_spec(spec, tp)
    assert (share.num_heads, share.num_kv_heads, share.intermediate_size, share.vocab_size) == (
        64 // tp, 8 // tp, 28672 // tp, 128256 // tp)
    assert (share.hidden_size, share.head_dim, share.num_layers) == (8192, 128, 80)
    lays = [rank_layout(spec, tp, r) for r in range(tp)]
    for axis, total in (("heads", 64), ("kv_heads", 8), ("intermediate", 28672), ("vocab", 128256)):
        ranges = [getattr(lay, axis) for lay in lays]
        assert ranges[0][0] == 0 and ranges[-1][1] == total
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))   # consecutive, disjoint, covering


@pytest.mark.parametrize("nh, nkv, tp", [(8, 2, 4), (8, 2, 8), (8, 1, 8), (16, 4, 8), (8, 8, 8), (8, 2, 2)])
def test_every_query_head_of_a_rank_reads_a_kv_head_of_that_rank(nh, nkv, tp):
    spec = tiny_spec(num_attention_heads=nh, num_key_value_heads=nkv)
    group = nh // nkv
    holders = {}
    for r in range(tp):
        lay = rank_layout(spec, tp, r)
        kv = range(*lay.kv_heads)
        assert all(h // group in kv for h in range(*lay.heads))           # HF's repeat_kv mapping
        assert len(kv) == max(1, nkv // tp)
        for k in kv:
            holders.setdefault(k, []).append(r)
    if nkv < tp:   # TensorRT-LLM: KV head k on the tp/nkv consecutive ranks k*tp/nkv ...
        assert holders == {k: list(range(k * tp // nkv, (k + 1) * tp // nkv)) for k in range(nkv)}
        assert rank_layout(spec, tp, 0).kv_replicas == tp // nkv
    else:
        assert all(len(r) == 1 for r in holders.values()) and len(holders) == nkv


@pytest.mark.parametrize("overrides, tp, fragment", [
    ({"num_attention_heads": 6, "num_key_value_heads": 2}, 4, "num_attention_heads=6 does not divide"),
    ({"num_attention_heads": 6, "num_key_value_heads": 3}, 2, "num_key_value_heads=3 does not divide"),
    ({"num_attention_heads": 12, "num_key_value_heads": 3}, 4, "cannot be replicated evenly"),
    ({"intermediate_size": 204}, 8, "intermediate_size=204 does not divide"),
    ({"vocab_size": 500}, 8, "vocab_size=500 does not divide"),
    ({}, 3, "is not one of 1, 2, 4, 8"),
])
def test_splits_that_do_not_divide_are_refused(overrides, tp, fragment):
    with pytest.raises(ModelError, match=fragment):
        check_tensor_parallel(tiny_spec(**overrides), tp)


# ------------------------------------------------------------------------------------ shards

@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_shards_are_what_the_rank_binds_and_join_back_exactly(model, tp):
    spec, w = model
    shards = shard_all(spec, w, tp)
    share = rank_spec(spec, tp)
    for shard in shards:
        check_weights(share, shard)                      # the names and shapes one rank's engine binds
        assert set(shard) == set(share.expected_tensors())
        assert all(t.is_contiguous() for t in shard.values())
    back = unshard_weights(spec, shards)
    assert set(back) == set(w) and all(torch.equal(back[n], w[n]) for n in w)


def test_shards_hold_the_documented_rows_and_columns():
    spec = tiny_spec("qwen2")                            # q/k/v biases
    w = random_weights(spec, dtype=torch.bfloat16, seed=1)
    d, a, m = spec.head_dim, "model.layers.1.self_attn.", "model.layers.1.mlp."
    s = shard_weights(spec, w, 8, 5)                     # query head 5, KV head 5 // 4 = 1, I/8 and V/8 ranges
    assert torch.equal(s[a + "q_proj.weight"], w[a + "q_proj.weight"][5 * d:6 * d])
    assert torch.equal(s[a + "q_proj.bias"], w[a + "q_proj.bias"][5 * d:6 * d])
    assert torch.equal(s[a + "k_proj.weight"], w[a + "k_proj.weight"][1 * d:2 * d])
    assert torch.equal(s[a + "v_proj.bias"], w[a + "v_proj.bias"][1 * d:2 * d])
    assert torch.equal(s[a + "o_proj.weight"], w[a + "o_proj.weight"][:, 5 * d:6 * d])
    i = spec.intermediate_size // 8
    assert torch.equal(s[m + "up_proj.weight"], w[m + "up_proj.weight"][5 * i:6 * i])
    assert torch.equal(s[m + "down_proj.weight"], w[m + "down_proj.weight"][:, 5 * i:6 * i])
    v = spec.vocab_size // 8
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(s[name], w[name][5 * v:6 * v])
    assert s["model.norm.weight"] is w["model.norm.weight"]


def test_a_tied_model_stays_tied_on_every_rank():
    spec = tiny_spec("llama")
    assert spec.tie_word_embeddings
    for shard in shard_all(spec, random_weights(spec, dtype=torch.bfloat16, seed=0), 4):
        assert "lm_head.weight" not in shard and shard["model.embed_tokens.weight"].shape[0] == spec.vocab_size // 4


def test_unsharding_refuses_replicas_that_differ():
    spec = tiny_spec("llama")
    shards = shard_all(spec, random_weights(spec, dtype=torch.bfloat16, seed=0), 4)
    name = "model.layers.0.self_attn.k_proj.weight"         # KV head 0 on ranks 0 and 1
    shards[1][name] = shards[1][name].clone()
    shards[1][name][0, 0] += 1
    with pytest.raises(ValueError, match="rank 1: 'model.layers.0.self_attn.k_proj.weight' differs"):
        unshard_weights(spec, shards)
    shards = shard_all(spec, random_weights(spec, dtype=torch.bfloat16, seed=0), 2)
    shards[1]["model.norm.weight"] = shards[1]["model.norm.weight"] + 1
    with pytest.raises(ValueError, match="replicated 'model.norm.weight' differs"):
        unshard_weights(spec, shards)


# ------------------------------------------------------------------------------------ communication

def test_ordered_all_reduce_adds_in_rank_order():
    p = [torch.tensor([1e8]), torch.tensor([1.0]), torch.tensor([-1e8]), torch.tensor([1.0])]
    assert all_reduce(p).item() == 1.0        # ((1e8 + 1) - 1e8) + 1 in fp32: 1e8 + 1 rounds to 1e8
    assert all_reduce([p[0], p[2], p[1], p[3]]).item() == 2.0          # another order, other bits
    # bf16 steps by 2^-7 at 1: adding 2^-8 twice in bf16 would stay at 1; accumulated in fp32 it does not
    bf = [torch.tensor([v], dtype=torch.bfloat16) for v in (1.0, 2 ** -8, 2 ** -8)]
    assert all_reduce(bf).dtype == torch.bfloat16 and all_reduce(bf).item() == 1.0 + 2 ** -7


def test_fixed_point_all_reduce_is_the_same_in_any_order():
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(4, 64, generator=g) * 10 ** k for k in range(-3, 5)]
    ref = all_reduce(parts, "fixed")
    for seed in range(5):
        perm = torch.randperm(len(parts), generator=torch.Generator().manual_seed(seed)).tolist()
        assert torch.equal(all_reduce([parts[i] for i in perm], "fixed"), ref)
    assert torch.allclose(ref, torch.stack(parts).double().sum(0).float(), rtol=1e-6, atol=1e-6)
    assert all_reduce(parts[:1], "fixed") is parts[0]


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_cross_rank_argmax_is_the_first_global_argmax(tp):
    g = torch.Generator().manual_seed(tp)
    logits = torch.randint(-3, 4, (64, 64), generator=g).float()    # many ties, across ranks too
    logits[0] = 1.0                                                     # all tied: token 0
    logits[1, 40:] = float("nan")                                      # NaN is never chosen
    want = torch.nan_to_num(logits, nan=-1e9).argmax(-1)              # torch: the first maximum
    got = cross_rank_argmax(list(logits.chunk(tp, dim=-1)))
    assert torch.equal(got, want) and got[0] == 0


def test_cross_rank_argmax_refuses_rows_without_a_finite_logit():
    shards = [torch.full((2, 8), float("-inf")), torch.full((2, 8), float("nan"))]
    shards[0][0, 3] = 0.0
    with pytest.raises(NonFiniteLogits, match="batch row 1"):
        cross_rank_argmax(shards)


# ------------------------------------------------------------------------------------ emulated decoding

def reference_run(spec, w, batch, compute, stage, kv_dtype):
    ref = ReferenceDecoder(spec, w, compute, stage)
    cache = PagedKVCache.allocate(spec, batch, 32, dtype=kv_dtype)
    toks = ref.generate(PROMPTS[:batch], NEW, cache)
    last = ref.decode(torch.tensor([t[-1] for t in toks]), torch.tensor([len(p) + NEW for p in PROMPTS[:batch]]), cache)
    return toks, last, cache


def tp_run(spec, w, tp, batch, compute, stage, kv_dtype, reduction="ordered"):
    dec = TensorParallelDecoder(spec, w, tp, compute, stage, reduction)
    caches = dec.allocate_caches(batch, 32, dtype=kv_dtype)
    toks = dec.generate(PROMPTS[:batch], NEW, caches)
    last = dec.decode(torch.tensor([t[-1] for t in toks]), torch.tensor([len(p) + NEW for p in PROMPTS[:batch]]),
                      caches)
    return toks, last, caches


@pytest.mark.parametrize("compute", [torch.float32, None], ids=["fp32", "bf16"])
def test_tp1_emulation_is_the_reference_decoder(model, compute):
    spec, w = model
    toks, last, _ = reference_run(spec, w, 4, compute, None, torch.bfloat16)
    toks1, last1, _ = tp_run(spec, w, 1, 4, compute, None, torch.bfloat16)
    assert toks1 == toks and torch.equal(last1, last)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tensor_parallel_decodes_the_tokens_of_tp1(model, tp, batch):
    spec, w = model
    # fp32 compute and cache: the logits differ from TP=1 only by the order of fp32 sums
    toks, last, ref_cache = reference_run(spec, w, batch, torch.float32, None, torch.float32)
    toks_tp, last_tp, caches = tp_run(spec, w, tp, batch, torch.float32, None, torch.float32)
    assert toks_tp == toks
    assert len(toks[0]) == NEW
    scale = last.abs().max().item()
    assert (last_tp - last).abs().max().item() <= 64 * torch.finfo(torch.float32).eps * scale
    # each rank's cache holds its KV heads, the same values as TP=1's cache holds for them
    for lay, cache in zip(rank_layout_all(spec, tp), caches):
        assert cache.pool.shape[3] == lay.kv_heads[1] - lay.kv_heads[0]
        assert torch.allclose(cache.pool, ref_cache.pool[:, :, :, slice(*lay.kv_heads)], rtol=1e-5, atol=1e-6)
    # the kernel's numerics: bf16 GEMV inputs and a bf16 KV cache; both reductions
    toks_bf, _, _ = reference_run(spec, w, batch, torch.float32, torch.bfloat16, torch.bfloat16)
    for reduction in ("ordered", "fixed"):
        assert tp_run(spec, w, tp, batch, torch.float32, torch.bfloat16, torch.bfloat16, reduction)[0] == toks_bf


def rank_layout_all(spec, tp):
    return [rank_layout(spec, tp, r) for r in range(tp)]


def test_the_emulation_refuses_a_cache_per_rank_missing():
    spec = tiny_spec()
    dec = TensorParallelDecoder(spec, random_weights(spec, dtype=torch.bfloat16, seed=0), 2)
    with pytest.raises(ValueError, match="1 KV caches for 2 ranks"):
        dec.prefill([[1, 2]], dec.allocate_caches(1, 8)[:1])


# ------------------------------------------------------------------------------------ deployment config

BASE = {"name": "tp", "gpu": "H200", "max_batch_size": 1, "max_seq_len": 4096}


def model_file(tmp_path, **overrides) -> str:
    """A tiny model's config.json (max_position_embeddings 4096, as BASE's max_seq_len needs)."""
    p = tmp_path / "config.json"
    p.write_text(json.dumps(tiny_config("llama", **{"max_position_embeddings": 4096, **overrides})))
    return str(p)


def one_line_error(data) -> str:
    with pytest.raises(ConfigError) as e:
        parse_config(data, where="tp.yaml")
    assert "\n" not in str(e.value)
    return str(e.value)


def test_tensor_parallel_size_defaults_to_one_and_reads_back():
    cfg = parse_config({**BASE, "model": "llama-3.1-8b"})
    assert cfg.tensor_parallel_size == 1 and "tensor_parallel_size" not in cfg.to_dict()
    assert "tensor_parallel_size" not in cfg.trtllm_llm_kwargs()
    cfg4 = parse_config({**BASE, "model": "llama-3.1-70b", "tensor_parallel_size": 4})
    assert cfg4.tensor_parallel_size == 4 and parse_config(cfg4.to_dict()) == cfg4
    assert cfg4.trtllm_llm_kwargs()["tensor_parallel_size"] == 4


@pytest.mark.parametrize("value, fragment", [(3, "3 is not one of 1, 2, 4, 8"), (16, "16 is not one of"),
                                              ("2", "expected an integer"), (True, "expected an integer"),
                                              (0, "must be >= 1")])
def test_bad_tensor_parallel_sizes_get_one_line(value, fragment):
    msg = one_line_error({**BASE, "model": "llama-3.1-8b", "tensor_parallel_size": value})
    assert msg.startswith("tp.yaml: tensor_parallel_size: ") and fragment in msg


def test_models_that_do_not_split_are_refused(tmp_path):
    msg = one_line_error({**BASE, "model": "tiny-llama", "tensor_parallel_size": 8})
    assert "tensor_parallel_size: tiny-llama: num_attention_heads=4 does not divide by tensor_parallel_size 8" in msg
    msg = one_line_error({**BASE, "model": "tiny-llama", "tensor_parallel_size": 4})   # 1 head of 32: q_size 32
    assert "each GPU a share the megakernel cannot compute" in msg and "num_heads*head_dim=32" in msg
    msg = one_line_error({**BASE, "model": model_file(tmp_path, num_key_value_heads=4, num_attention_heads=12,
                                                      head_dim=64, hidden_size=256), "tensor_parallel_size": 8})
    assert "num_attention_heads=12 does not divide" in msg


def test_the_memory_budget_is_per_gpu():
    one = resolve_model("llama-3.1-70b").spec
    msg = one_line_error({**BASE, "model": "llama-3.1-70b"})        # 141 GB of weights on a 141 GB H200
    assert "alone do not fit" in msg and "tensor_parallel_size: 2 fits" in msg
    norms = (2 * one.num_layers + 1) * one.hidden_size * one.dtype_bytes   # replicated on every GPU
    kv1 = None
    for tp in (2, 4, 8):
        cfg = parse_config({**BASE, "model": "llama-3.1-70b", "tensor_parallel_size": tp})
        mem = cfg.memory_budget()
        assert mem.fits and mem.weights == (one.weight_bytes() - norms) // tp + norms
        kv1 = kv1 or mem.kv_cache * tp
        assert mem.kv_cache * tp == kv1                                  # 8 KV heads split evenly


def test_replicated_kv_heads_are_counted_on_every_gpu(tmp_path):
    model = model_file(tmp_path, num_attention_heads=8, num_key_value_heads=2, head_dim=64, hidden_size=512,
                       intermediate_size=1024)
    kv = {tp: parse_config({**BASE, "model": model, "tensor_parallel_size": tp}).memory_budget().kv_cache
          for tp in (1, 2, 4, 8)}
    assert kv[2] * 2 == kv[1] and kv[4] == kv[2] == kv[8]                # one KV head per GPU from TP 2 on


def test_describe_shows_the_split_and_the_per_gpu_budget():
    out = describe(parse_config({**BASE, "model": "llama-3.1-70b", "tensor_parallel_size": 4}))
    assert re.search(r"tensor parallel +4 GPUs, each with 16 heads, 2 KV heads, intermediate 7168, vocab 32064\n", out)
    assert "Memory budget per GPU (of 4)" in out and "of weights per GPU" in out
    assert "tensor parallel" not in describe(parse_config({**BASE, "model": "llama-3.1-8b"}))


def test_quantized_tensor_parallel_deployments_stop_with_one_line(tmp_path):
    path = tmp_path / "tp2q.yaml"
    path.write_text(yaml.safe_dump({**BASE, "model": "llama-3.1-8b", "tensor_parallel_size": 2,
                                    "quantization": {"quant_algo": "W4A16_GPTQ", "group_size": 128}}))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([sys.executable, "-m", "trtllm_mk", "build", "--config", str(path), "--dry-run",
                        "--output-dir", str(tmp_path / "engine")], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "tensor-parallel engine streams bf16 weights only" in err[0], r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "engine").exists()


# ------------------------------------------------------------------------------------ all-reduce cost model

LINK = arc.LinkModel(sync_us=2.0, link_bandwidth=300e9, reduce_bandwidth=2e12)


@pytest.mark.parametrize("link", [arc.UNMEASURED, LINK], ids=["defaults", "other"])
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_all_reduce_costs_grow_with_the_message_and_cross_over_once(link, tp):
    sizes = [0] + [2 ** k for k in range(4, 28)]
    for f in (arc.one_shot_us, arc.two_shot_us):
        costs = [f(n, tp, link) for n in sizes]
        assert all(a < b for a, b in zip(costs, costs[1:]))
    assert arc.one_shot_us(0, tp, link) == link.sync_us and arc.two_shot_us(0, tp, link) == 2 * link.sync_us
    x = arc.crossover_bytes(tp, link)
    assert x is not None and arc.one_shot_us(x, tp, link) == pytest.approx(arc.two_shot_us(x, tp, link))
    assert arc.choose(x / 2, tp, link)[0] == arc.ONE_SHOT and arc.choose(2 * x, tp, link)[0] == arc.TWO_SHOT
    winners = [arc.choose(n, tp, link)[0] for n in sizes]
    assert winners == sorted(winners, key=[arc.ONE_SHOT, arc.TWO_SHOT].index)   # one switch, never back


def test_more_ranks_move_the_crossover_down_and_one_rank_costs_nothing():
    xs = [arc.crossover_bytes(tp, LINK) for tp in (2, 4, 8)]
    assert xs[0] > xs[1] > xs[2]
    assert arc.crossover_bytes(1, LINK) is None and arc.choose(1 << 20, 1, LINK)[1] == 0.0
    # a slower link makes the bytes dearer, so two-shot pays off at smaller messages
    slow = arc.LinkModel(sync_us=LINK.sync_us, link_bandwidth=LINK.link_bandwidth / 4,
                         reduce_bandwidth=LINK.reduce_bandwidth)
    assert arc.crossover_bytes(8, slow) < arc.crossover_bytes(8, LINK)
    with pytest.raises(ValueError):
        arc.LinkModel(sync_us=1.0, link_bandwidth=0.0, reduce_bandwidth=1e12)


def test_the_defaults_are_marked_unmeasured_and_a_fit_recovers_a_link():
    assert arc.UNMEASURED.measured is False
    sizes = [1 << k for k in range(10, 24, 2)]
    fitted = arc.fit_one_shot([(n, arc.one_shot_us(n, 4, LINK)) for n in sizes], 4,
                              reduce_bandwidth=LINK.reduce_bandwidth)
    assert fitted.measured
    assert fitted.sync_us == pytest.approx(LINK.sync_us) and fitted.link_bandwidth == pytest.approx(LINK.link_bandwidth)
    with pytest.raises(ValueError, match="two message sizes"):
        arc.fit_one_shot([(1024, 3.0), (1024, 3.1)], 4)
    with pytest.raises(ValueError, match="do not fit"):
        arc.fit_one_shot([(1024, 9.0), (1 << 20, 3.0)], 4)            # larger messages faster


def test_decode_step_communication_adds_up():
    spec = resolve_model("llama-3.1-70b").spec
    for tp in (2, 4, 8):
        parts = arc.decode_step_comm_us(spec, 1, tp, LINK)
        msg = spec.hidden_size * 4
        assert parts["layers"] == pytest.approx(2 * spec.num_layers * arc.choose(msg, tp, LINK)[1])
        assert parts["total"] == pytest.approx(parts["layers"] + parts["embedding"] + parts["argmax"])
        assert arc.decode_step_comm_us(spec, 8, tp, LINK)["total"] > parts["total"]
    assert arc.decode_step_comm_us(spec, 1, 1, LINK)["total"] == 0.0


# ------------------------------------------------------------------------------------ the kernel's task graph

def _rank_schedule(spec, tp, batch):
    from trtllm_mk.gpus import get_gpu
    from trtllm_mk.search import search
    sch, _ = search(rank_spec(spec, tp), batch, get_gpu("H100-SXM"), context_len=64, budget_s=1.0, seed=0)
    return sch


def kernel_spec(family="llama"):
    """A tiny model whose shares at TP 2 and 4 still meet the megakernel's shape constraints."""
    cfg = tiny_config(family, **{"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8,
                                 "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512})
    return spec_from_hf_config(cfg, name=f"tiny-{family}")


def test_cross_rank_events_are_exactly_those_that_order_cross_rank_writes():
    from trtllm_mk.graph import build_step_graph
    from trtllm_mk.graph.builder import CROSS_RANK_EVENTS
    from trtllm_mk.graph.tasks import Kind
    spec = kernel_spec()
    one = _rank_schedule(spec, 1, 2)
    assert not any(ev.cross_rank for ev in one.graph().events.values())
    for tp in (2, 4):
        sch = _rank_schedule(spec, tp, 2)
        g = build_step_graph(sch.spec, 2, sch.plan)
        assert g.dims.tensor_parallel == tp and sch.spec.tensor_parallel == tp
        assert {n for n, ev in g.events.items() if ev.cross_rank} == CROSS_RANK_EVENTS
        for t in g.layer:
            if t.kind == Kind.OPROJ:   # a peer's adds must wait until this rank's QKV tiles read x
                assert any(r.event == "qkv_all" for r in t.waits)
            if t.kind in (Kind.OPROJ, Kind.DOWN):   # other ranks add too: never a plain store
                assert all(a.add for a in t.writes if a.buf == "x")
                assert not any(a.buf == "x" for a in t.reads)


def test_the_kernel_source_counts_every_ranks_signals_on_cross_rank_counters():
    from trtllm_mk.codegen import generate_source
    from trtllm_mk.codegen.source import _event_layout
    sch = _rank_schedule(kernel_spec(), 2, 2)
    g = sch.graph()
    src, layout = generate_source(sch, 16, 64, use_bulk_copy=True)
    offsets, counts, cross = _event_layout(g)
    assert layout.tensor_parallel == 2 and "constexpr int TP = 2;" in src
    assert f"constexpr int LM_TILES_ALL = {2 * g.dims.n_lm_tiles};" in src
    for name, ev in g.events.items():
        i = offsets[name]
        assert cross[i] == int(ev.cross_rank)
        assert counts[i] == ev.counts[0][0] * (2 if ev.cross_rank else 1)
    assert "EV_CROSS[" in src
    # one GPU: nothing is cross-rank and the kernel is the single-GPU one
    src1, layout1 = generate_source(_rank_schedule(kernel_spec(), 1, 2), 16, 64, use_bulk_copy=True)
    assert layout1.tensor_parallel == 1 and "constexpr int TP = 1;" in src1


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2"])
@pytest.mark.parametrize("tp", [2, 4])
def test_rank_schedules_on_the_cpu_decode_the_tokens_of_one_gpu(family, tp):
    """Every rank's schedule run by the CPU executor, with the kernel's cross-rank writes (shared x,
    lm_val, lm_idx): the tokens of the single-GPU schedule, and logits within the bf16 staging noise
    of the emulated tensor-parallel decoder."""
    from trtllm_mk.executor import CpuExecutor
    from trtllm_mk.parallel.cpu_executor import TensorParallelCpuExecutor
    spec = kernel_spec(family)
    w = random_weights(spec, dtype=torch.bfloat16, seed=3)
    B, steps = 2, 6
    prompts = PROMPTS[:B]
    emu = TensorParallelDecoder(spec, w, tp, torch.float32, torch.bfloat16)
    caches = [PagedKVCache.allocate(rank_spec(spec, tp), B, 64, 16, dtype=torch.bfloat16, seed=1) for _ in range(tp)]
    ref = ReferenceDecoder(spec, w, torch.float32, torch.bfloat16)
    cache1 = PagedKVCache.allocate(spec, B, 64, 16, dtype=torch.bfloat16, seed=1)
    first = cross_rank_argmax(emu.prefill_shards(prompts, caches))
    assert torch.equal(first, ref.prefill(prompts, cache1).argmax(-1))
    ex_tp = TensorParallelCpuExecutor(spec, w, tp, _rank_schedule(spec, tp, B), caches)
    ex_1 = CpuExecutor(spec, w, _rank_schedule(spec, 1, B), cache1)
    pos = torch.tensor([len(p) for p in prompts])
    tok_tp = tok_1 = first
    for t in range(steps):
        emu_caches = [PagedKVCache(c.pool.clone(), c.block_table.clone(), c.tokens_per_block) for c in caches]
        want = emu.decode(tok_tp, pos + t, emu_caches)
        logits, tok_tp = ex_tp.step(tok_tp, pos + t, interleave="random", seed=t)
        _, tok_1 = ex_1.step(tok_1, pos + t)
        assert torch.equal(tok_tp, tok_1), f"step {t}"
        assert logits.shape == want.shape
        assert ((logits - want).norm(dim=-1) / want.norm(dim=-1)).max() < 2e-2
        for c, e in zip(caches, emu_caches):   # each rank cached its own KV heads of the new token
            assert torch.allclose(c.pool.float(), e.pool.float(), rtol=2e-2, atol=2e-2)


def test_a_rank_refuses_sampling():
    from trtllm_mk.parallel.cpu_executor import TensorParallelCpuExecutor
    from trtllm_mk.sampling import SamplingParams
    spec = kernel_spec()
    w = random_weights(spec, dtype=torch.bfloat16, seed=3)
    caches = [PagedKVCache.allocate(rank_spec(spec, 2), 1, 64, 16, seed=1) for _ in range(2)]
    ex = TensorParallelCpuExecutor(spec, w, 2, _rank_schedule(spec, 2, 1), caches)
    ex.set_sampling(0, None)
    with pytest.raises(ModelError, match="decodes greedily"):
        ex.set_sampling(0, SamplingParams(temperature=0.7))


# ------------------------------------------------------------------------------------ engines and launch

@pytest.fixture(scope="module")
def tp_engines(tmp_path_factory):
    """(TP=1 engine, TP=2 engine) of the tiny Llama: the shipped tiny_cpu configs."""
    from trtllm_mk.build import build_engine
    from trtllm_mk.config import with_overrides
    out = tmp_path_factory.mktemp("tp_engines")
    engines = []
    for name in ("tiny_cpu", "tiny_cpu_tp2"):
        cfg = with_overrides(load_config(ROOT / "configs" / f"{name}.yaml"), {"megakernel": {"search_budget_s": 2.0}})
        build_engine(cfg, out / name, show_progress=False)
        engines.append(out / name)
    return engines


def cli(*args, env_extra=None, cwd=None):
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(ROOT)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "trtllm_mk", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=600)


def test_a_tensor_parallel_engine_is_one_ranks_kernel_and_the_whole_model(tp_engines):
    from trtllm_mk.engine import EngineDir
    one, two = (EngineDir.open(e) for e in tp_engines)
    assert two.schedule.spec.tensor_parallel == 2 and two.layout.tensor_parallel == 2
    assert two.model_spec == one.model_spec == one.schedule.spec
    assert two.schedule.spec == rank_spec(one.model_spec, 2)
    assert json.loads((tp_engines[1] / "kernel.json").read_text())["tensor_parallel"] == 2
    assert "constexpr int TP = 2;" in (tp_engines[1] / "megakernel.cu").read_text()


def test_run_simulate_of_the_tp2_engine_gives_the_tokens_of_tp1(tp_engines):
    """Both ranks in one process on the CPU executor, prefilled by the emulation: the tokens of the
    single-GPU engine on the same random weights (a rounding-level difference could flip a near tie;
    these prompts have none)."""
    outs = []
    for eng in tp_engines:
        r = cli("run", "--engine", str(eng), "--weights", "random", "--seed", "3", "--prompt", "3 141 59 26 5 358 97",
                "--max-new-tokens", "16", "--ignore-eos", "--simulate")
        assert r.returncode == 0, r.stderr
        outs.append(r.stdout.splitlines()[0])
    assert outs[0] == outs[1] and len(outs[0].split()) == 17, outs
    assert "tensor parallel" in r.stdout


@pytest.mark.parametrize("env, fragment", [
    ({}, "launch it with torchrun --nproc-per-node 2"),
    ({"WORLD_SIZE": "4", "RANK": "0"}, "but torchrun started 4 processes"),
])
def test_a_tp_engine_launched_wrongly_gets_one_line(tp_engines, env, fragment):
    r = cli("run", "--engine", str(tp_engines[1]), "--weights", "random", "--prompt", "1 2 3", env_extra=env)
    assert r.returncode == 2
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and fragment in err[0] and "Traceback" not in r.stderr, r.stderr


def test_tp_engines_refuse_sampling_and_serving_in_one_line(tp_engines):
    r = cli("run", "--engine", str(tp_engines[1]), "--weights", "random", "--prompt", "1 2 3", "--simulate",
            "--temperature", "0.7")
    assert r.returncode == 2 and "decodes greedily" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = cli("serve", "--engine", str(tp_engines[1]), "--weights", "random", "--simulate")
    assert r.returncode == 2 and "not served yet" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def spawn_ranks(body, tp, out) -> None:
    """``body(rank, group, tp, spec, shard)`` in ``tp`` gloo processes (the tiny Qwen3 of kernel_spec, its
    fp32 random weights sharded); what each returns is saved as ``out/rank<r>.pt``."""
    import socket

    import torch.multiprocessing as mp
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_rank_worker, args=(tp, port, str(out), body), nprocs=tp, join=True)


def _rank_worker(rank, tp, port, out, body):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(tp),
                      LOCAL_RANK=str(rank))
    import torch.distributed as dist

    from trtllm_mk.parallel.distributed import join_ranks
    r, group = join_ranks(tp, "the test", backend="gloo")
    spec = kernel_spec("qwen3")
    shard = shard_weights(spec, random_weights(spec, dtype=torch.float32, seed=3), tp, r)
    torch.save(body(r, group, tp, spec, shard), Path(out) / f"rank{r}.pt")
    # every rank done before any tears its connections down: a gloo rank whose peer closed them while
    # its own last collective was still in flight aborts ("terminate called without an active exception")
    dist.barrier()
    dist.destroy_process_group()


def _rank_prefill(r, group, tp, spec, shard):
    from trtllm_mk.parallel.distributed import RankPrefill
    cache = PagedKVCache.allocate(rank_spec(spec, tp), 2, 64, 16, dtype=torch.float32, seed=1)
    pre = RankPrefill(spec, shard, tp, r, group)
    logits = pre.prefill(PROMPTS[:2], cache)
    first = pre.first_tokens(PROMPTS[2:4], cache)
    return {"logits": logits, "first": first, "pool": cache.pool}


@pytest.mark.parametrize("tp", [2, 4])
def test_the_prefill_over_torch_distributed_is_the_emulations(tmp_path, tp):
    """One process per rank (gloo on the CPU): each rank's KV cache and the gathered logits are the
    emulation's, and every rank finds the same first tokens."""
    spawn_ranks(_rank_prefill, tp, tmp_path)
    spec = kernel_spec("qwen3")
    emu = TensorParallelDecoder(spec, random_weights(spec, dtype=torch.float32, seed=3), tp)
    caches = [PagedKVCache.allocate(rank_spec(spec, tp), 2, 64, 16, dtype=torch.float32, seed=1) for _ in range(tp)]
    want = emu.prefill(PROMPTS[:2], caches)
    want_first = cross_rank_argmax(emu.prefill_shards(PROMPTS[2:4], caches))
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(tp)]
    for r, g in enumerate(got):
        assert torch.allclose(g["logits"], want, rtol=1e-5, atol=1e-5), r
        assert torch.equal(g["first"], want_first)
        assert torch.allclose(g["pool"], caches[r].pool, rtol=1e-5, atol=1e-6)


def _tp_baseline_rank(r, group, tp, spec, shard):
    from benchmarks.tp_baseline import TensorParallelStaticDecoder
    dec = TensorParallelStaticDecoder(spec, shard, tp, r, group, max_batch=2, max_seq=64)
    first = dec.prefill(torch.tensor([PROMPTS[0][:3], PROMPTS[1][:3]]))
    nxt = dec.decode_step(first.argmax(-1), torch.tensor([3, 3]))
    return {"first": first, "next": nxt}


def test_the_tensor_parallel_baseline_is_the_emulation(tmp_path):
    """The benchmark's gpt-fast-style tensor-parallel decoder (benchmarks/tp_baseline.py), two gloo ranks
    on the CPU: prefill and one decode step give the emulated tensor-parallel decoder's logits."""
    spawn_ranks(_tp_baseline_rank, 2, tmp_path)
    spec = kernel_spec("qwen3")
    emu = TensorParallelDecoder(spec, random_weights(spec, dtype=torch.float32, seed=3), 2)
    caches = emu.allocate_caches(2, 64)
    prompts = [PROMPTS[0][:3], PROMPTS[1][:3]]
    first = emu.prefill(prompts, caches)
    nxt = emu.decode(first.argmax(-1), torch.tensor([3, 3]), caches)
    for r in range(2):
        got = torch.load(tmp_path / f"rank{r}.pt")
        assert torch.allclose(got["first"], first, rtol=1e-4, atol=1e-4)
        assert torch.allclose(got["next"], nxt, rtol=1e-4, atol=1e-4)
