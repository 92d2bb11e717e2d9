"""CPU executor: decode steps run task by task on the event machine must compute the model.

Checked against the PyTorch prefill backend (the logits of the last token of the whole sequence equal
the decode step's logits) and, where it exists, the reference decoder; and across schedules and
interleavings, which must not change the result, bit for bit: K-chunks add into the fixed-point
residual, where the order of the adds cannot show."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from test_verify import random_legal_schedule, round_robin_schedule
from trtllm_mk.backends.torch_prefill import TorchPrefill
from trtllm_mk.executor import CpuExecutor, EventMachine, NonFiniteLogits
from trtllm_mk.graph import Kind, TilePlan, build_step_graph
from trtllm_mk.kv_cache import PagedKVCache
from trtllm_mk.model.random_weights import random_weights
from trtllm_mk.model.spec import spec_from_hf_config
from trtllm_mk.model.tiny import tiny_config
from trtllm_mk.schedule import Schedule, SMProgram
from trtllm_mk.verify import ScheduleError

# tiny.py shapes: H=128, I=256, 4 q heads on 2 KV heads of 32, V=512, 2 layers
PLAN = TilePlan(qkv_rows=48, o_rows=64, gateup_rows=64, down_rows=64, lm_rows=128, embed_rows=64, attn_splits=3)
KSPLIT = dataclasses.replace(PLAN, down_ksplit=2, attn_splits=2)
PROMPTS = [[5, 17, 300, 42, 7], [1, 99, 12]]


def _spec(family: str):
    return spec_from_hf_config(tiny_config(family), name=f"tiny-{family}")


def _weights(spec, seed: int = 0) -> dict[str, torch.Tensor]:
    # std 0.1 instead of 0.02 so that the logits spread and greedy tokens are not near-ties
    return random_weights(spec, seed=seed, std=0.1)


def _cache(spec, batch: int, dtype: torch.dtype = torch.bfloat16) -> PagedKVCache:
    # every slot poisoned: a read beyond a sequence's length would show up in the logits
    return PagedKVCache.allocate(spec, batch, 64, tokens_per_block=8, fill=1e4, dtype=dtype)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


class _Oracle:
    """Full-sequence prefill in fp32 on the bf16 weights: its last-token logits are what the decode
    step at that position must produce, up to the executor's bf16 activation rounding."""

    def __init__(self, spec, weights):
        self.spec = spec
        self.prefill = TorchPrefill(spec, {k: v.float() for k, v in weights.items()})

    def logits(self, seqs: list[list[int]]) -> torch.Tensor:
        cache = PagedKVCache.allocate(self.spec, len(seqs), 64, tokens_per_block=8, dtype=torch.float32)
        return self.prefill.prefill(seqs, cache)


def _decode(spec, weights, sched: Schedule, prompts, steps: int, interleaves, exact: bool = False):
    """Prefill with the torch backend, then ``steps`` executor steps; returns the per-step logits,
    tokens, the sequences and the executor. ``exact``: fp32 prefill, fp32 cache, no bf16 rounding."""
    cache = _cache(spec, len(prompts), torch.float32 if exact else torch.bfloat16)
    pre_w = {k: v.float() for k, v in weights.items()} if exact else weights
    first = TorchPrefill(spec, pre_w).prefill(prompts, cache)
    ex = CpuExecutor(spec, weights, sched, cache, round_activations=not exact)
    tok = first.argmax(-1).to(torch.int32)
    pos = torch.tensor([len(p) for p in prompts], dtype=torch.int32)
    seqs = [p + [int(t)] for p, t in zip(prompts, tok)]
    out = []
    for i in range(steps):
        mode = interleaves[i % len(interleaves)]
        logits, nxt = ex.step(tok, pos, interleave=mode, seed=i)
        out.append((logits, nxt, [list(s) for s in seqs]))
        assert torch.equal(ex.pos, pos + 1)
        tok, pos = nxt, ex.pos.clone()
        seqs = [s + [int(t)] for s, t in zip(seqs, tok)]
    return out, ex


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_exact_mode_matches_full_sequence_prefill(family):
    """Without bf16 rounding, every task's semantics (grouped QKV rows, bias, QK-norm, RoPE, split-KV
    softmax and combine, K-split residual adds, tiled LM head) must reproduce the dense fp32 model."""
    spec = _spec(family)
    w = _weights(spec)
    oracle = _Oracle(spec, w)
    sched = round_robin_schedule(spec, KSPLIT, 5, batch=2)
    out, _ = _decode(spec, w, sched, PROMPTS, 3, ["round_robin", "random", "sequential"], exact=True)
    for logits, nxt, seqs in out:
        ref = oracle.logits(seqs)
        assert _rel(logits, ref) < 1e-5
        assert torch.equal(nxt, ref.argmax(-1).to(torch.int32))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_oproj_merge_exact_and_equal_to_combine(family):
    """TilePlan.o_merge: OPROJ merges the split partials of its K-chunk's heads itself (no COMBINE
    tasks). It must reproduce the dense fp32 model (with one K-chunk per KV group), and with the
    same OPROJ tiling it computes COMBINE's arithmetic on the same partials: equal logits bit for bit."""
    spec = _spec(family)
    w = _weights(spec)
    oracle = _Oracle(spec, w)
    merged = dataclasses.replace(KSPLIT, o_merge=True, o_ksplit=spec.num_kv_heads)
    g = build_step_graph(spec, 2, merged)
    assert not any(t.kind == Kind.COMBINE for t in g.layer) and "combine_done" not in g.events
    assert g.events["attn_done"].counts[0] == (merged.attn_splits,) * spec.num_kv_heads
    out, _ = _decode(spec, w, round_robin_schedule(spec, merged, 5, batch=2), PROMPTS, 3,
                     ["round_robin", "random", "sequential"], exact=True)
    for logits, nxt, seqs in out:
        ref = oracle.logits(seqs)
        assert _rel(logits, ref) < 1e-5
        assert torch.equal(nxt, ref.argmax(-1).to(torch.int32))
    runs = []
    for o_merge in (False, True):   # one OPROJ K-chunk: x gets one add per element, in any order
        plan = dataclasses.replace(PLAN, o_merge=o_merge)
        runs.append(_decode(spec, w, round_robin_schedule(spec, plan, 5, batch=2), PROMPTS, 3, ["random"])[0])
    for (l0, n0, _), (l1, n1, _) in zip(*runs):
        assert torch.equal(l0, l1) and torch.equal(n0, n1)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_attention_row_tiles_exact_and_equal_to_one_task_per_split(family):
    """TilePlan.attn_rows: ATTN tasks over part of the batch rows (here 2 + 1 of 3, and one each) write
    the same partials as one task over all rows: equal logits bit for bit, and the dense fp32 model
    without rounding. The race checker sees the tiles' row ranges as disjoint (Access.rows)."""
    spec = _spec(family)
    w = _weights(spec)
    prompts = PROMPTS + [[5, 6, 7, 8, 9, 10, 11]]
    runs = []
    for rows in (0, 2, 1):
        plan = dataclasses.replace(PLAN, attn_rows=rows)
        g = build_step_graph(spec, 3, plan)
        tiles = {(t.r0, t.r1) for t in g.layer if t.kind == Kind.ATTN}
        assert tiles == ({(0, 3)} if rows == 0 else {(0, 2), (2, 3)} if rows == 2 else {(0, 1), (1, 2), (2, 3)})
        runs.append(_decode(spec, w, round_robin_schedule(spec, plan, 5, batch=3), prompts, 3, ["random", "sequential"])[0])
    for (l0, n0, _), (l1, n1, _), (l2, n2, _) in zip(*runs):
        assert torch.equal(l0, l1) and torch.equal(l0, l2) and torch.equal(n0, n1) and torch.equal(n0, n2)
    oracle = _Oracle(spec, w)
    out, _ = _decode(spec, w, round_robin_schedule(spec, dataclasses.replace(KSPLIT, attn_rows=1), 5, batch=3), prompts, 3,
                     ["round_robin", "random"], exact=True)
    for logits, nxt, seqs in out:
        assert _rel(logits, oracle.logits(seqs)) < 1e-5


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_bf16_mode_close_to_full_sequence_prefill(family):
    """With the GPU's rounding points the error is bf16 noise (about 1e-2 at these weight scales)."""
    spec = _spec(family)
    w = _weights(spec)
    oracle = _Oracle(spec, w)
    sched = round_robin_schedule(spec, PLAN, 5, batch=2)
    out, _ = _decode(spec, w, sched, PROMPTS, 3, ["round_robin", "random", "sequential"])
    for logits, nxt, seqs in out:
        ref = oracle.logits(seqs)
        assert _rel(logits, ref) < 2e-2
        assert torch.equal(nxt, ref.argmax(-1).to(torch.int32))


def test_matches_reference_decoder():
    ref_mod = pytest.importorskip("trtllm_mk.reference", reason="reference decoder not written yet")
    spec = _spec("qwen3")
    w = _weights(spec, seed=3)
    ref = ref_mod.ReferenceDecoder(spec, w, torch.float32)
    cache_ref = _cache(spec, 2)
    first = ref.prefill(PROMPTS, cache_ref)
    scheds = [round_robin_schedule(spec, KSPLIT, 4, batch=2),
              random_legal_schedule(spec, KSPLIT, 7, random.Random(1), batch=2)]
    # each executor continues from its own copy of the prefilled cache
    exs = [CpuExecutor(spec, w, s, dataclasses.replace(cache_ref, pool=cache_ref.pool.clone())) for s in scheds]
    tok = first.argmax(-1).to(torch.int32)
    pos = torch.tensor([len(p) for p in PROMPTS], dtype=torch.int32)
    for i in range(4):
        want = ref.decode(tok, pos, cache_ref)
        for ex, mode in zip(exs, ("round_robin", "random")):
            logits, nxt = ex.step(tok, pos, interleave=mode, seed=i)
            assert _rel(logits, want) < 2e-2
            assert torch.equal(nxt, want.argmax(-1).to(torch.int32))
        tok, pos = nxt, pos + 1


def test_schedules_and_interleavings_agree_bitwise():
    """Without K-split every x element gets one update per phase, so the arithmetic is the same in
    any legal order: logits, tokens and the written cache must be identical."""
    spec = _spec("qwen2")
    w = _weights(spec, seed=1)
    scheds = [round_robin_schedule(spec, PLAN, 3, batch=2),
              random_legal_schedule(spec, PLAN, 6, random.Random(5), batch=2)]
    results = []
    for sched in scheds:
        for mode in ("round_robin", "random", "sequential"):
            out, ex = _decode(spec, w, sched, PROMPTS, 2, [mode])
            results.append((out, ex.cache.pool, ex.history))
    base_out, base_pool, base_hist = results[0]
    for out, pool, hist in results[1:]:
        for (l0, t0, _), (l1, t1, _) in zip(base_out, out):
            assert torch.equal(l0, l1) and torch.equal(t0, t1)
        assert torch.equal(pool, base_pool) and torch.equal(hist, base_hist)


def test_ksplit_interleavings_agree_bitwise():
    """K-split OPROJ and DOWN chunks add into x in a different order under each schedule and
    interleaving; the residual is fixed point (trtllm_mk/residual.py), so the results are identical."""
    spec = _spec("llama")
    w = _weights(spec, seed=2)
    a, _ = _decode(spec, w, round_robin_schedule(spec, KSPLIT, 4, batch=2), PROMPTS, 2, ["sequential"])
    b, _ = _decode(spec, w, random_legal_schedule(spec, KSPLIT, 5, random.Random(2), batch=2), PROMPTS, 2,
                   ["random"])
    for (l0, t0, _), (l1, t1, _) in zip(a, b):
        assert torch.equal(l1, l0) and torch.equal(t0, t1)


def test_first_token_with_empty_splits_and_history():
    """pos 0 with 3 splits: two splits see no token (m = -inf, l = 0) and the combine must skip them."""
    spec = _spec("mistral")
    w = _weights(spec, seed=4)
    cache = _cache(spec, 2)
    ex = CpuExecutor(spec, w, round_robin_schedule(spec, PLAN, 4, batch=2), cache)
    logits, nxt = ex.step(torch.tensor([11, 250]), torch.tensor([0, 0]))
    ref = _Oracle(spec, w).logits([[11], [250]])
    assert _rel(logits, ref) < 1e-2
    assert torch.equal(nxt, logits.argmax(-1).to(torch.int32))       # first argmax of its own logits
    assert ex.history[:, 1].tolist() == nxt.tolist() and (ex.history[:, 2:] == -1).all()
    assert torch.equal(ex.pos, torch.tensor([1, 1], dtype=torch.int32))
    assert torch.isfinite(ex.part_ml[:, :, 1:, :, 1]).all() and (ex.part_ml[:, :, 1:, :, 1] == 0).all()


def test_argmax_ties_pick_first_index():
    """Rows 7, 130 and 300 of the LM head (three different tiles) identical, all others zero: the
    maximum is shared by several indices, and the lowest one must win, as on the GPU."""
    spec = _spec("mistral")                           # untied LM head
    w = _weights(spec)
    lm = torch.zeros_like(w["lm_head.weight"])
    v = torch.where(torch.arange(spec.hidden_size) % 3 == 0, -1.0, 1.0).to(lm.dtype)
    lm[7] = lm[130] = lm[300] = v
    w = {**w, "lm_head.weight": lm}
    ex = CpuExecutor(spec, w, round_robin_schedule(spec, PLAN, 3, batch=2), _cache(spec, 2))
    logits, nxt = ex.step(torch.tensor([7, 8]), torch.tensor([0, 0]))
    for b in range(2):
        tied = (logits[b] == logits[b].max()).nonzero().flatten().tolist()
        assert len(tied) >= 3 and tied[0] in (0, 7)   # 7/130/300 if positive, else every zero row
        assert int(nxt[b]) == tied[0]


def test_nan_logits_never_win_and_an_all_nan_row_is_an_error():
    """NaN logits are skipped by the argmax (as on the GPU), never turned into an index; a row with
    no logit above -inf stops the step with a clear error instead of an out-of-range token."""
    spec = _spec("mistral")
    w = _weights(spec)
    lm = w["lm_head.weight"].clone()
    lm[::2] = float("nan")                             # every even row of the LM head, in every tile
    ex = CpuExecutor(spec, {**w, "lm_head.weight": lm}, round_robin_schedule(spec, PLAN, 3, batch=2), _cache(spec, 2))
    logits, nxt = ex.step(torch.tensor([7, 8]), torch.tensor([0, 0]))
    for b in range(2):
        finite = torch.where(logits[b].isnan(), -torch.inf, logits[b])
        assert int(nxt[b]) == int(finite.argmax()) and int(nxt[b]) % 2 == 1
    lm[:] = float("nan")
    ex = CpuExecutor(spec, {**w, "lm_head.weight": lm}, round_robin_schedule(spec, PLAN, 3, batch=2), _cache(spec, 2))
    with pytest.raises(NonFiniteLogits, match="all NaN or -inf"):
        ex.step(torch.tensor([7, 8]), torch.tensor([0, 0]))


def test_counters_are_monotonic_across_steps():
    spec = _spec("llama")
    sched = round_robin_schedule(spec, KSPLIT, 3)
    g = sched.graph()
    m = EventMachine(sched, g)
    for _ in range(3):
        m.run(None, "random", 0)
    assert m.steps_done == 3 and m.counters == [3 * c for c in m.counts] and any(m.counts)


def test_deadlocking_schedule_raises():
    spec = _spec("llama")
    good = round_robin_schedule(spec, PLAN, 1)
    bad = Schedule(spec, 1, PLAN, 1, "test",
                   [SMProgram(good.programs[0].head, good.programs[0].layer[::-1], good.programs[0].tail)])
    w = _weights(spec)
    with pytest.raises(ScheduleError, match="deadlock"):
        CpuExecutor(spec, w, bad, _cache(spec, 1))               # rejected by the validator
    ex = CpuExecutor(spec, w, bad, _cache(spec, 1), validate=False)
    with pytest.raises(ScheduleError, match=r"deadlock at step 0: SM 0 task \d+ \(layer 0 DOWN"):
        ex.step(torch.tensor([3]), torch.tensor([0]))


def test_rejects_mismatched_inputs():
    spec = _spec("llama")
    sched = round_robin_schedule(spec, PLAN, 2, batch=2)
    w = _weights(spec)
    with pytest.raises(ScheduleError, match="built for model"):
        CpuExecutor(_spec("qwen3"), _weights(_spec("qwen3")), sched, _cache(spec, 2))
    ex = CpuExecutor(spec, w, sched, _cache(spec, 2))
    with pytest.raises(ValueError, match="2 entries"):
        ex.step(torch.tensor([1]), torch.tensor([0]))
    with pytest.raises(ValueError, match="outside the KV cache"):
        ex.step(torch.tensor([1, 2]), torch.tensor([0, 64]))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_kernel_numerics_reference_models_the_rounding_points(family):
    """The reference decoder with bf16-staged GEMV inputs models the task graph's rounding points:
    the first step agrees to fp32 summation order; later steps only drift by the rare bf16 ulp that
    summation order flips at a rounding boundary (and which then sits in the KV cache). The GPU tests
    compare greedy tokens against this reference."""
    from trtllm_mk.reference import ReferenceDecoder
    spec = _spec(family)
    w = _weights(spec, seed=5)
    ref = ReferenceDecoder(spec, w, torch.float32, gemv_input_dtype=torch.bfloat16)
    plain = ReferenceDecoder(spec, w, torch.float32)
    cache = _cache(spec, 2)
    first = ref.prefill(PROMPTS, cache)
    ex = CpuExecutor(spec, w, round_robin_schedule(spec, PLAN, 5, batch=2),
                     dataclasses.replace(cache, pool=cache.pool.clone()))
    plain_cache = dataclasses.replace(cache, pool=cache.pool.clone())
    tok = first.argmax(-1).to(torch.int32)
    pos = torch.tensor([len(p) for p in PROMPTS], dtype=torch.int32)
    close, loose = [], []
    for i in range(4):
        want = ref.decode(tok, pos, cache)
        other = plain.decode(tok, pos, plain_cache)
        logits, nxt = ex.step(tok, pos, interleave="random", seed=i)
        close.append(_rel(logits, want))
        loose.append(_rel(logits, other))
        tok, pos = nxt, pos + 1
    assert close[0] < 1e-6                      # same rounding points, same inputs
    assert max(close) < 5e-3
    # the rounding really is modelled: every step nearer the bf16-staged reference than the plain
    # one, and overall well below it (a single ulp flip with QK-norm can cost a step ~half its margin)
    assert all(c < l for c, l in zip(close, loose))
    assert sum(close) < 0.5 * sum(loose)


def test_argmax_samples_each_row_as_its_params_say():
    """ARGMAX's CPU semantics choose per row (trtllm_mk.sampling, as the kernel does in place): a greedy
    row keeps the first argmax, a sampled row repeats with its seed, and draws from one fixed state
    with many seeds follow the reference distribution (Pearson's chi-square)."""
    from scipy.stats import chisquare

    from trtllm_mk.sampling import SamplingParams, reference_probs, sample
    spec = _spec("llama")
    w = _weights(spec)
    ex = CpuExecutor(spec, w, round_robin_schedule(spec, PLAN, 3, batch=2), _cache(spec, 2))
    tok, pos = torch.tensor([7, 8]), torch.tensor([3, 5])
    params = SamplingParams(temperature=1.0, top_k=6, seed=0, logprobs=2)
    counts = torch.zeros(spec.vocab_size, dtype=torch.long)
    draws = 400
    for i in range(draws):
        p = dataclasses.replace(params, seed=i)
        ex.set_sampling(1, p)
        logits, nxt = ex.step(tok, pos)
        assert int(nxt[0]) == int(logits[0].argmax())              # row 0: greedy, untouched
        want = sample(logits[1], p, int(pos[1]) + 1)
        assert int(nxt[1]) == want.token and ex.history[1, int(pos[1]) + 1] == want.token
        assert abs(float(ex.logprobs[1, 0]) - want.logprob) < 1e-6
        assert [int(t) for t in ex.top_ids[1, :2]] == [i for i, _ in want.top_logprobs]
        counts[int(nxt[1])] += 1
    probs = reference_probs(logits[1], params)
    kept = probs > 0
    assert counts[~kept].sum() == 0
    e, o = (probs[kept] * draws).double(), counts[kept].double()
    order = torch.argsort(e)
    e, o = e[order], o[order]
    cut = int((torch.cumsum(e, 0) < 5).sum())   # pool the rarest cells until each expects >= 5 draws
    if cut:
        e = torch.cat([e[:cut + 1].sum().reshape(1), e[cut + 1:]])
        o = torch.cat([o[:cut + 1].sum().reshape(1), o[cut + 1:]])
    assert chisquare(o.numpy(), e.numpy()).pvalue > 1e-3
