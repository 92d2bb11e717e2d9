"""The megakernel's expert kinds on the CPU (kinds/router.py, route.py, egateup.py, edown.py, emlp.py): the
task graph of a mixture-of-experts step (expert slots, the events that carry the routing), the CPU
executor's decode against the reference decoder (model/moe.py, itself checked against transformers in
tests/test_moe.py), an engine built and run with ``--simulate``, and the layouts it refuses.

The GPU side runs in tests/test_moe_gpu.py."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trtllm_mk.errors import ModelError
from trtllm_mk.executor import CpuExecutor
from trtllm_mk.gpus import get_gpu
from trtllm_mk.graph import build_step_graph
from trtllm_mk.graph.builder import MAX_EXPERTS, check_moe_supported
from trtllm_mk.graph.tasks import EventRef, Kind, TilePlan
from trtllm_mk.kinds.route import slots_of
from trtllm_mk.kv_cache import PagedKVCache
from trtllm_mk.model.decoder_block import share_fused_storage
from trtllm_mk.model.moe import route
from trtllm_mk.model.random_weights import random_weights
from trtllm_mk.model.registry import resolve_model
from trtllm_mk.model.spec import spec_from_hf_config
from trtllm_mk.model.tiny import tiny_config
from trtllm_mk.reference import ReferenceDecoder
from trtllm_mk.search import search

ROOT = Path(__file__).resolve().parents[1]


def sparse_spec(family: str):
    """The tiny model of ``family`` with every layer sparse (the layouts the megakernel runs)."""
    spec = spec_from_hf_config(tiny_config(family), name=f"tiny-{family}")
    return dataclasses.replace(spec, mlp_only_layers=())


def _schedule(spec, batch):
    sch, _ = search(spec, batch, get_gpu("H100-SXM"), context_len=64, budget_s=1.0, seed=0)
    return sch


@pytest.mark.parametrize("batch, slots", [(1, 2), (3, 6), (4, 8), (8, 8)])
def test_a_moe_step_has_min_e_bk_expert_slots(batch, slots):
    spec = sparse_spec("qwen3_moe")   # 8 experts, 2 per token
    g = build_step_graph(spec, batch, TilePlan(gateup_rows=32, down_rows=64))
    kinds = {t.kind for t in g.layer}
    assert kinds >= {Kind.ROUTER, Kind.ROUTE, Kind.EGATEUP, Kind.EDOWN} and not kinds & {Kind.GATEUP, Kind.DOWN}
    assert g.dims.expert_slots == slots and g.dims.intermediate == spec.moe_intermediate_size
    eg = [t for t in g.layer if t.kind == Kind.EGATEUP]
    ed = [t for t in g.layer if t.kind == Kind.EDOWN]
    assert sorted({t.slot for t in eg}) == sorted({t.slot for t in ed}) == list(range(slots))
    assert len(eg) == slots * (spec.moe_intermediate_size // 32)
    # the loaders of the expert kinds wait only for their first event: the router's logits, which they
    # route themselves; EGATEUP waits for nothing else, EDOWN also for ROUTE's routing weights
    assert all(t.waits[0].event == "router_done" for t in eg + ed)
    assert all(len(t.waits) == 1 for t in eg) and all(EventRef("route_done", 0, 0) in t.waits for t in ed)
    # EDOWN of a slot waits for that slot's EGATEUP tiles only: no EGATEUP task reads x (they stage the
    # normed rows the ROUTER tasks publish, which partition the columns between them)
    assert all([w for w in t.waits if w.event == "egateup_done"] == [EventRef("egateup_done", 0, t.slot)] for t in ed)
    assert g.events["egateup_done"].counts[0] == (spec.moe_intermediate_size // 32,) * slots
    assert not any(a.buf == "x" for t in eg for a in t.reads)
    shares = sorted((a.lo, a.hi) for t in g.layer if t.kind == Kind.ROUTER for a in t.writes if a.buf == "moe_xn")
    assert shares[0][0] == 0 and shares[-1][1] == spec.hidden_size
    assert all(a[1] == b[0] for a, b in zip(shares, shares[1:]))
    # streamed bytes: every slot's expert (the worst case the static schedule allows: an idle slot streams
    # nothing, but the SMs of the busy slots set the step's time)
    per_expert = 3 * spec.moe_intermediate_size * spec.hidden_size * 2
    assert sum(t.weight_bytes for t in eg + ed) == slots * per_expert


def test_expert_streams_take_their_own_in_flight_cap():
    """TilePlan.expert_inflight reaches the kernel (the expert kinds' loader cap): by default the whole
    ring, else the plan's value, at most the ring."""
    from trtllm_mk.codegen import generate_source
    sch = _schedule(sparse_spec("qwen3_moe"), 1)
    for cap, want in ((0, sch.plan.stages), (1, 1)):
        src, _ = generate_source(dataclasses.replace(sch, plan=dataclasses.replace(sch.plan, expert_inflight=cap)),
                                 32, 512, use_bulk_copy=True)
        assert f"constexpr int INFLIGHT_EXPERT = {want};" in src
    with pytest.raises(ValueError, match="expert_inflight"):
        build_step_graph(sch.spec, 1, dataclasses.replace(sch.plan, expert_inflight=sch.plan.stages + 1))


def test_route_lays_the_rows_choices_out_as_slots():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, -1.0], [2.0, 0.0, 5.0, 0.0, 0.0], [0.0, 3.0, 1.0, 3.0, -1.0]])
    weights, experts = route(logits, 2, normalize=True)
    assert experts.tolist() == [[1, 3], [0, 2], [1, 3]]          # equal logits: the lower index ranks first
    slot, w = slots_of(weights, experts, 6)
    assert slot.tolist() == [0, 1, 2, 3, -1, -1]
    assert torch.equal(w[:, 0], torch.tensor([0.0, weights[0, 0], 0.0, weights[0, 1], 0.0, 0.0]))
    assert torch.equal(w[:, 1], torch.tensor([weights[1, 0], 0.0, weights[1, 1], 0.0, 0.0, 0.0]))
    assert torch.allclose(w.sum(0), torch.ones(3))


def _fused_schedule(spec, batch):
    """The searched plan with fused expert tiles (EMLP), list-scheduled."""
    from trtllm_mk.search import schedule_plan
    plan = _schedule(spec, batch).plan
    plan = dataclasses.replace(plan, expert_fused=True, gateup_rows=-(-plan.gateup_rows // 16) * 16)
    return schedule_plan(spec, batch, get_gpu("H100-SXM"), plan, context_len=64)


def test_fused_expert_tiles_replace_route_egateup_and_edown():
    """Under TilePlan.expert_fused a slot's tiles are EMLP tasks: each waits for OPROJ only (its loader and
    consumers route the rows from the logits the chain summed), adds into all of the layer's expert_sum
    (beside x) and streams its rows of gate, up and down; ROUTE, EGATEUP and EDOWN and their events are
    gone. ROUTER runs at the layer's start and every OPROJ task waits for it (kinds/router.py)."""
    spec = sparse_spec("qwen3_moe")
    I, H = spec.moe_intermediate_size, spec.hidden_size
    g = build_step_graph(spec, 3, TilePlan(gateup_rows=32, expert_fused=True))
    kinds = {t.kind for t in g.layer}
    assert Kind.EMLP in kinds and not kinds & {Kind.ROUTE, Kind.EGATEUP, Kind.EDOWN}
    em = [t for t in g.layer if t.kind == Kind.EMLP]
    assert sorted({t.slot for t in em}) == list(range(g.dims.expert_slots)) and len(em) == 6 * (I // 32)
    assert all(t.waits == (EventRef("oproj_done", 0, 0),) and t.signals == (EventRef("resid_ready", 1, 0),) for t in em)
    assert all(any(a.buf == "expert_sum" and a.add and a.layer == 1 and (a.lo, a.hi) == (0, H) for a in t.writes)
               for t in em)
    assert not any(a.buf == "x" for t in em for a in t.writes)
    router = [t for t in g.layer if t.kind == Kind.ROUTER]
    assert router and all(t.waits == (EventRef("resid_ready", 0, 0),) for t in router)
    assert all(EventRef("router_done", 0, 0) in t.waits for t in g.layer if t.kind == Kind.OPROJ)
    assert {(a.buf, a.layer) for t in g.tail for a in t.reads} >= {("x", -1), ("expert_sum", spec.num_layers)}
    assert not {"route_done", "egateup_done"} & set(g.events)
    assert g.events["resid_ready"].counts[1] == (len(em),)
    assert sum(t.weight_bytes for t in em) == 6 * 3 * I * H * 2


@pytest.mark.parametrize("plan, batch, fragment", [
    (TilePlan(gateup_rows=24, expert_fused=True), 1, "multiple of 16"),
    (TilePlan(gateup_rows=32, expert_fused=True), 64, "scratch"),
])
def test_plans_the_fused_expert_tiles_cannot_run_are_refused(plan, batch, fragment):
    with pytest.raises(ValueError, match=fragment):
        build_step_graph(sparse_spec("qwen3_moe"), batch, plan)
    with pytest.raises(ValueError, match="dense model"):
        build_step_graph(spec_from_hf_config(tiny_config("llama"), name="tiny-llama"), 1, TilePlan(expert_fused=True))


def test_the_fused_kernel_carries_emlp_only():
    """The kernel of a fused plan inlines EMLP's device file with its constants and none of EGATEUP's or
    EDOWN's; a split plan's kernel the reverse."""
    from trtllm_mk.codegen import generate_source
    from trtllm_mk.kinds.emlp import down_cols
    spec = sparse_spec("qwen3_moe")
    fused = _fused_schedule(spec, 1)
    src, _ = generate_source(fused, 32, 512, use_bulk_copy=True)
    dkc = down_cols(spec.hidden_size, fused.plan.slot_bytes, fused.plan.consumer_warps)
    assert f"constexpr int EMLP_DKC = {dkc};" in src and f"constexpr int EMLP_ROWS = {fused.plan.gateup_rows};" in src
    assert "===== emlp.cuh =====" in src and "===== egateup.cuh =====" not in src and "===== edown.cuh =====" not in src
    split, _ = generate_source(_schedule(spec, 1), 32, 512, use_bulk_copy=True)
    assert "===== emlp.cuh =====" not in split and "EMLP_DKC" not in split and "===== edown.cuh =====" in split


def test_down_cols_fill_a_slot_and_divide_the_width():
    from trtllm_mk.kinds.emlp import down_cols
    assert down_cols(2048, 32768, 8) == 1024 and down_cols(4096, 32768, 8) == 1024
    assert down_cols(128, 32768, 8) == 128 and down_cols(2048, 16384, 8) == 512 and down_cols(2048, 32768, 4) == 512
    assert down_cols(192, 4096, 8) == 96   # the widest multiple of 16 that divides 192 within 16 rows of 4 KB


@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused"])
def test_the_decoder_binds_each_expert_down_in_the_layout_its_plan_streams(fused):
    """MegakernelDecoder._expert_down: storage in the plan's layout (row-major for the split kinds, the
    transposed [I, H] rows for EMLP) is bound as it is; the other layout is copied once, and decoders
    bound to the same tensor share the copy."""
    from types import SimpleNamespace
    from trtllm_mk.runtime.megakernel import MegakernelDecoder
    dec = object.__new__(MegakernelDecoder)
    dec.schedule = SimpleNamespace(plan=TilePlan(expert_fused=fused))
    row_major = torch.randn(6, 4)
    transposed = torch.randn(4, 6).t()
    want = (lambda t: t.t()) if fused else (lambda t: t)
    for t in (row_major, transposed):
        got = dec._expert_down(t)
        assert got.is_contiguous() and torch.equal(got, want(t))
        in_layout = t.t().is_contiguous() if fused else t.is_contiguous()
        assert (got.data_ptr() == t.data_ptr()) == in_layout
        assert dec._expert_down(t) is got or in_layout


def test_transposed_down_storage_is_read_by_the_reference_mlp_without_a_copy():
    """share_fused_storage(transposed_down=True) stores a sparse layer's down matrices as one [E, I, H]
    tensor (the rows EMLP streams) and names each expert's [H, I] as a view of it; MoeMlp reads that
    storage as it is and computes what it computes from the plain tensors."""
    from trtllm_mk.model.decoder_block import share_fused_storage
    from trtllm_mk.model.moe import MoeMlp
    spec = sparse_spec("qwen3_moe")
    w = random_weights(spec, dtype=torch.float32, seed=5)
    t = share_fused_storage(spec, w, transposed_down=True)
    _, experts = spec.moe_names(0)
    downs = [t[d] for _, _, d in experts]
    assert all(torch.equal(a, w[d]) and not a.is_contiguous() and a.t().is_contiguous()
               for a, (_, _, d) in zip(downs, experts))
    base = downs[0].t().data_ptr()
    assert [a.t().data_ptr() - base for a in downs] == [e * a.numel() * 4 for e, a in enumerate(downs)]
    plain, trans = MoeMlp(spec, w, 0, torch.float32), MoeMlp(spec, t, 0, torch.float32)
    assert trans.w_down.data_ptr() == base
    x = torch.randn(5, spec.hidden_size)
    assert torch.allclose(plain(x), trans(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused"])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_the_cpu_executor_decodes_as_the_reference(family, batch, fused):
    """The expert kinds on the task graph, any legal interleaving: the reference decoder's logits (fp32
    with the kernel's bf16 GEMV inputs) and tokens, step after step. The executor's fp32 sums run in
    another order than the reference's (its fixed-point residual, per-tile GEMVs). The fused plan sums
    the router's logits along the chain (kinds/router.py), as its reference does (router_through_o)."""
    from trtllm_mk.kinds.route import route_slots, route_slots_fixed
    spec = sparse_spec(family)
    w = random_weights(spec, dtype=torch.bfloat16, seed=3)
    ref = ReferenceDecoder(spec, w, compute_dtype=torch.float32, gemv_input_dtype=torch.bfloat16,
                           router_through_o=fused)
    cache = PagedKVCache.allocate(spec, batch, 64, 16, dtype=torch.bfloat16, seed=1)
    prompts = [[5 + b, 6, 7 + 3 * b, 8][: 2 + b % 3] for b in range(batch)]
    tok = ref.prefill(prompts, cache).argmax(-1)
    # a fused engine stores the experts' down matrices transposed (runtime/hybrid.py): the executor
    # runs on that storage
    bound = share_fused_storage(spec, w, transposed_down=True) if fused else w
    ex = CpuExecutor(spec, bound, _fused_schedule(spec, batch) if fused else _schedule(spec, batch), cache)
    pos = torch.tensor([len(p) for p in prompts])
    used = set()
    for t in range(5):
        mirror = PagedKVCache(cache.pool.clone(), cache.block_table.clone(), cache.tokens_per_block)
        want = ref.decode(tok, pos + t, mirror)
        # poisoned: an idle slot's activation is neither computed nor read (nor is any row's that did
        # not choose the slot's expert), so no NaN reaches the logits
        ex.moe_act.fill_(float("nan"))
        got, nxt = ex.step(tok, pos + t, interleave="random", seed=t)
        err = (got - want).norm(dim=-1) / want.norm(dim=-1)
        # fp32 summation order only, except where it moves a staged activation across a bf16 rounding
        # boundary (a rounding event: ~1e-4 in these random models)
        assert err.median() < 1e-5 and err.max() < 3e-3, (t, err)
        assert torch.equal(nxt, want.argmax(-1).to(nxt.dtype)), t
        used |= set((route_slots_fixed(ex, spec.num_layers - 1) if fused else route_slots(ex))[0].tolist())
        tok = nxt
    if batch > 1:   # rows chose different experts: the slots hold their union
        assert len(used - {-1}) > spec.num_experts_per_tok
    if batch == 3:   # 6 slots, about 4.6 distinct experts: some steps leave slots idle
        assert -1 in used


def test_the_tiny_moe_engine_runs_simulated_as_the_reference(tmp_path):
    from trtllm_mk.build import build_engine
    from trtllm_mk.config import load_config, with_overrides
    cfg = with_overrides(load_config(ROOT / "configs" / "tiny_moe_cpu.yaml"), {"megakernel": {"search_budget_s": 2.0}})
    build_engine(cfg, tmp_path / "e", show_progress=False)
    prompt = [3, 141, 59, 26, 5]
    r = subprocess.run([sys.executable, "-m", "trtllm_mk", "run", "--engine", str(tmp_path / "e"), "--weights", "random",
                        "--seed", "4", "--prompt", " ".join(map(str, prompt)), "--max-new-tokens", "8", "--ignore-eos",
                        "--simulate"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    got = [int(t) for t in r.stdout.splitlines()[0].split("] ", 1)[1].split()]
    spec = cfg.model_spec
    w = {k: v.float() for k, v in random_weights(spec, seed=4).items()}
    want = ReferenceDecoder(spec, w, compute_dtype=torch.float32).generate(
        [prompt], 8, PagedKVCache.allocate(spec, 1, 64, 16, dtype=torch.float32), eos_ids=())[0]
    assert got == want


@pytest.mark.parametrize("change, fragment", [
    (dict(mlp_only_layers=(1,)), "dense MLP layers [1]"),
    (dict(decoder_sparse_step=2), "dense MLP layers"),
    (dict(num_experts=MAX_EXPERTS + 8), f"at most {MAX_EXPERTS} experts"),
    (dict(num_experts_per_tok=9), "8 per token"),
    (dict(weight_bits=4, weight_group=64), "quantized expert weights"),
])
def test_layouts_the_expert_kinds_do_not_run_are_refused(change, fragment):
    spec = dataclasses.replace(sparse_spec("qwen3_moe"), **change)
    with pytest.raises(ModelError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        check_moe_supported(spec)


def test_qwen3_30b_a3b_is_one_the_kernel_runs():
    spec = resolve_model("qwen3-30b-a3b").spec
    check_moe_supported(spec)
    g = build_step_graph(spec, 1, TilePlan(gateup_rows=64, down_rows=64))
    # batch 1: the 8 selected experts of 128, read as 8 slots
    assert g.dims.expert_slots == 8 and g.weight_bytes() < spec.decode_weight_bytes() * 1.01


def test_the_fused_layer_runs_router_before_oproj_and_prices_it_off_the_ring():
    """Under TilePlan.expert_fused OPROJ waits for ROUTER, so ROUTER moves ahead of OPROJ in the layer's task
    list (a topological order, which the list scheduler keeps on every SM); its tasks read their weights
    themselves, so the cost model prices them as a non-ring task. The split plan keeps the family's order."""
    from trtllm_mk.search.calibration import load_calibration
    from trtllm_mk.search.cost import cost_table
    spec = sparse_spec("qwen3_moe")
    gpu = get_gpu("H100-SXM")

    def kinds(g):
        return list(dict.fromkeys(t.kind for t in g.layer))
    fused = build_step_graph(spec, 2, TilePlan(gateup_rows=32, expert_fused=True))
    assert kinds(fused) == [Kind.QKV, Kind.ATTN, Kind.COMBINE, Kind.ROUTER, Kind.OPROJ, Kind.EMLP]
    split = build_step_graph(spec, 2, TilePlan())
    assert kinds(split) == [Kind.QKV, Kind.ATTN, Kind.COMBINE, Kind.OPROJ, Kind.ROUTER, Kind.ROUTE, Kind.EGATEUP,
                            Kind.EDOWN]
    cal = load_calibration(gpu)
    for g, on_ring in ((fused, False), (split, True)):
        costs = cost_table(g, gpu, cal).layer
        assert {c.gemv for t, c in zip(g.layer, costs) if t.kind == Kind.ROUTER} == {on_ring}
    assert _fused_schedule(spec, 2).predicted_step_us > 0   # list-scheduled and simulated without a deadlock


@pytest.mark.parametrize("o_rows", [16, 24, 40])
def test_oproj_streams_the_router_through_o_under_the_fused_plan(o_rows):
    """Under TilePlan.expert_fused OPROJ's row tiles cover H + E rows: rows from H on are the router through
    o, which add into router_acc (a tile may hold both kinds of rows), and their bf16 bytes are priced as
    OPROJ's own; every OPROJ task waits for ROUTER (which reads x and stores the accumulators first).
    The search offers OPROJ tiles by waves over those rows. The split plan's OPROJ covers H."""
    from trtllm_mk.search.plans import field_candidates
    spec = sparse_spec("qwen3_moe")
    H, E, QD = spec.hidden_size, spec.num_experts, spec.q_size
    for fused in (True, False):
        plan = TilePlan(gateup_rows=32, o_rows=o_rows, o_ksplit=2, expert_fused=fused)
        tasks = [t for t in build_step_graph(spec, 2, plan).layer if t.kind == Kind.OPROJ]
        rows = H + (E if fused else 0)
        assert sorted({(t.r0, t.r1) for t in tasks}) == [(a, min(a + o_rows, rows)) for a in range(0, rows, o_rows)]
        assert sum(t.weight_bytes for t in tasks) == rows * QD * 2
        for t in tasks:
            acc = [a for a in t.writes if a.buf == "router_acc"]
            assert [(a.lo, a.hi) for a in acc] == ([(max(t.r0, H) - H, t.r1 - H)] if t.r1 > H else [])
            assert any(a.buf == "x" for a in t.writes) == (t.r0 < H)
            assert any(w.event == "router_done" for w in t.waits) == fused
    want = -(-(H + E) * 2 // 132 // 8) * 8
    assert field_candidates("o_rows", TilePlan(o_ksplit=2, expert_fused=True), spec, 132, 64, 1)[0] == max(want, 8)


def test_a_layer_whose_kinds_wait_in_a_cycle_is_refused():
    from trtllm_mk.graph.builder import _dependency_order
    a = (Kind.QKV, [dict(waits=(EventRef("b", 0, 0),), signals=(EventRef("a", 0, 0),))])
    b = (Kind.ATTN, [dict(waits=(EventRef("a", 0, 0),), signals=(EventRef("b", 0, 0),))])
    with pytest.raises(ValueError, match="cycle"):
        _dependency_order([a, b])
    c = (Kind.OPROJ, [dict(waits=(EventRef("a", 0, 0),), signals=())])
    # a wait on the previous layer's row (index -1 / signalled at +1) orders nothing within the layer
    d = (Kind.GATEUP, [dict(waits=(EventRef("c", 0, 0),), signals=(EventRef("a", 1, 0),))])
    assert [k for k, _ in _dependency_order([c, d])] == [Kind.OPROJ, Kind.GATEUP]
    e = (Kind.DOWN, [dict(waits=(), signals=(EventRef("a", 0, 0),))])
    assert [k for k, _ in _dependency_order([c, d, e])] == [Kind.GATEUP, Kind.DOWN, Kind.OPROJ]


def test_routing_from_fixed_point_logits_ranks_as_the_reference_and_breaks_ties_low():
    """route_fixed (the fused plan's routing, kinds/route.py): the experts of the largest fixed-point logits,
    the lowest index on ties, weighted by the softmax of the logits over the rows' rms; as model.moe.route
    on the normed logits where no two are tied."""
    from trtllm_mk.kinds.route import route_fixed
    from trtllm_mk.residual import from_fixed, to_fixed
    g = torch.Generator().manual_seed(3)
    x = to_fixed(torch.randn(5, 64, generator=g) * 3)
    logits = torch.randn(5, 16, generator=g)
    xf = from_fixed(x)
    rms = torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
    for norm in (False, True):
        w, e = route_fixed(to_fixed(logits * rms), x, 4, norm, 1e-6)
        rw, re = route(logits, 4, norm)
        order = e.sort(-1)
        assert torch.equal(order.values, re)
        assert torch.allclose(w.gather(-1, order.indices), rw, rtol=1e-5, atol=1e-6)
    tied = torch.zeros(1, 16, dtype=torch.int64)
    tied[0, [3, 7, 9, 12]] = 5 << 32
    tied[0, [2, 11]] = 4 << 32
    assert route_fixed(tied, x[:1], 5, True, 1e-6)[1].tolist() == [[3, 7, 9, 12, 2]]


def test_the_reference_sums_the_router_logits_along_the_chain():
    """DecoderBlock.chain_logits (the fused plan's numerics, Staging(router_through_o=True)): router(ln2 * x)
    in fp32 plus the router through o_proj (bf16) times the attention output, times 1 / rms of x after
    o_proj: the normed rows' logits up to the bf16 rounding of router_through_o, which is the same
    matrix from bf16 or fp32 copies of the weights. The sparse MLP then routes by them."""
    from trtllm_mk.model.decoder_block import DecoderBlock, rms_norm
    from trtllm_mk.model.moe import router_through_o
    from trtllm_mk.reference import Staging
    spec = sparse_spec("qwen3_moe")
    w = random_weights(spec, dtype=torch.bfloat16, seed=2)
    block = DecoderBlock(spec, w, 0, torch.float32)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, spec.hidden_size, generator=gen) * 1.37
    o = torch.randn(3, spec.q_size, generator=gen).bfloat16().float()
    after = x + o @ block.wo.T
    got = block.chain_logits(x, o, after)
    m = router_through_o(w[spec.moe_names(0)[0]], w["model.layers.0.post_attention_layernorm.weight"],
                         w["model.layers.0.self_attn.o_proj.weight"])
    assert m.dtype == torch.bfloat16 and torch.equal(m, router_through_o(block.moe.router, block.ffn_norm, block.wo))
    d = torch.float64
    r, g = block.moe.router.to(d), block.ffn_norm.to(d)
    exact = (x.to(d) * g) @ r.T + o.to(d) @ m.to(d).T
    exact *= torch.rsqrt(after.to(d).pow(2).mean(-1, keepdim=True) + spec.rms_norm_eps)
    assert torch.allclose(got.to(d), exact, rtol=1e-5, atol=1e-6)
    normed = after.to(d) * torch.rsqrt(after.to(d).pow(2).mean(-1, keepdim=True) + spec.rms_norm_eps) * g
    err = (got.to(d) - normed @ r.T).norm() / (normed @ r.T).norm()
    assert 0 < err < 1e-2
    stage = Staging(torch.bfloat16)
    h = stage(rms_norm(after, block.ffn_norm, spec.rms_norm_eps))
    chained = block.mlp_delta(after, stage, got)
    assert torch.equal(chained, block.moe(h, stage, got))
    assert not torch.equal(chained, block.mlp_delta(after, stage))


def test_the_h200_model_ranks_qwen3_30b_a3b_attention_splits_as_measured():
    """Measured on an H200 (benchmarks/NOTES.md v37, interleaved A/B of the chain's kernel at batch 1, context
    512): 8 attention splits with 4 OPROJ K-chunks of 64 rows 2555.6 us, 2 splits with 2 chunks of 32 rows
    2679.2 us. The model ranked them the other way until a tile round's cost grew with the group's heads
    (kinds/attn.py TILE_GROUP); a search that trusts it ships the slower plan."""
    from trtllm_mk.search import schedule_plan
    spec = resolve_model("qwen3-30b-a3b").spec
    gpu = get_gpu("H200")
    base = TilePlan(qkv_rows=40, o_rows=64, o_ksplit=4, gateup_rows=48, down_rows=128, lm_rows=1152, attn_splits=8,
                    o_merge=True, stages=5, slot_bytes=32768, consumer_warps=8, inflight_slots=2, inflight_chain=2,
                    expert_inflight=2, expert_fused=True)
    fewer = dataclasses.replace(base, attn_splits=2, o_ksplit=2, o_rows=32)
    fast, slow = (schedule_plan(spec, 1, gpu, p, context_len=512).predicted_step_us for p in (base, fewer))
    assert fast < slow
