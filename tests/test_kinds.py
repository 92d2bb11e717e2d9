"""The task-kind registry, the per-kind lowering and the event tensors derived from it."""
from __future__ import annotations

import dataclasses

import pytest

from trtllm_mk.graph import HEAD, LAYER, TAIL, Kind, TilePlan, build_step_graph
from trtllm_mk.kinds import KIND_DEFS, TASK_ARG_FIELDS, KindDef, calibration_constants
from trtllm_mk.model.families import FAMILIES
from trtllm_mk.search import Calibration
from trtllm_mk.seam import TASK_ARGS
from test_verify import tiny_spec


# The kinds that exist, in registry order: a new kind is appended after them.
KNOWN = ("EMBED", "QKV", "ATTN", "COMBINE", "OPROJ", "GATEUP", "DOWN", "LMHEAD", "ARGMAX", "ROUTER", "ROUTE",
         "EGATEUP", "EDOWN", "EMLP")


def test_kind_numbers_are_the_schedule_format():
    # schedule.json and the kernel's enum store these numbers: the registry order must not move
    assert [(k.name, int(k)) for k in Kind][:len(KNOWN)] == [(n, i) for i, n in enumerate(KNOWN)]
    assert [k for k in Kind if k.streams_weights][:8] == [Kind.QKV, Kind.OPROJ, Kind.GATEUP, Kind.DOWN, Kind.LMHEAD,
                                                          Kind.ROUTER, Kind.EGATEUP, Kind.EDOWN]
    assert all(k.definition is KIND_DEFS[int(k)] and k.module.DEF is k.definition for k in Kind)
    assert all(d.device_file == f"{d.name.lower()}.cuh" for d in KIND_DEFS)


def test_kind_args_name_task_arg_fields():
    assert all(set(d.args) <= set(TASK_ARG_FIELDS) for d in KIND_DEFS)
    # mk::TaskArgs less its event-reference lists and their lengths
    assert set(TASK_ARG_FIELDS) == {a.name for a in TASK_ARGS} - {"nw", "w", "ns", "s"}
    with pytest.raises(ValueError, match="unknown task-argument"):
        KindDef("X", streams_weights=False, args=("rows",), device_file="x.cuh")


def test_kinds_own_their_calibration_and_ring_geometry():
    fields = {f.name: f for f in dataclasses.fields(Calibration)}
    for name, (default, why, kind) in calibration_constants().items():
        assert getattr(Calibration(), name) == default and fields[name].metadata["kind"] == kind and why
    assert Calibration().attn_fixed_us == Kind.ATTN.module.CALIBRATION["attn_fixed_us"][0]
    for k in Kind:
        if k.streams_weights:   # the GEMV hooks smem.geometries reads (kinds/gemv.py)
            assert k.module.MATRICES in (1, 2) and isinstance(k.module.BF16_WEIGHTS, bool)
            assert callable(k.module.k_range)


@pytest.mark.parametrize("o_merge", [False, True])
@pytest.mark.parametrize("o_ksplit,down_ksplit", [(1, 1), (2, 2)])
def test_events_count_the_signals_of_each_slot(o_merge, o_ksplit, down_ksplit):
    spec = tiny_spec(layers=3)
    plan = TilePlan(qkv_rows=48, o_rows=32, o_ksplit=o_ksplit, gateup_rows=64, down_rows=32, down_ksplit=down_ksplit,
                    lm_rows=128, attn_splits=4, o_merge=o_merge)
    g = build_step_graph(spec, 2, plan)
    L = spec.num_layers
    n = {k: sum(t.kind == k for t in g.head + g.layer + g.tail) for k in Kind}
    ev = g.events
    assert ev["resid_ready"].rows == L + 1 and ev["resid_ready"].per_layer
    assert ev["resid_ready"].counts == ((n[Kind.EMBED],),) + ((n[Kind.DOWN],),) * L
    assert ev["oproj_done"].counts == ((n[Kind.OPROJ],),) * L
    # a slot per DOWN K-chunk, counting the GATEUP tiles whose rows fall in it; a K-split DOWN polls
    # only its chunk, so the tiles' staging of x is guarded by gateup_staged (kinds/gateup.py)
    gu = [t for t in g.layer if t.kind == Kind.GATEUP]
    chunk = spec.intermediate_size // down_ksplit
    per_chunk = tuple(sum(t.r0 < (k + 1) * chunk and t.r1 > k * chunk for t in gu) for k in range(down_ksplit))
    assert ev["gateup_done"].counts == (per_chunk,) * L and ev["gateup_done"].polled
    assert ("gateup_staged" in ev) == (down_ksplit > 1)
    assert ev["lm_done"].counts == ((n[Kind.LMHEAD],),) and not ev["lm_done"].per_layer
    assert sum(ev["qkv_done"].counts[0]) >= n[Kind.QKV]     # a tile spanning two groups signals both
    assert ("combine_done" in ev) == (not o_merge) and ("qkv_all" in ev) == (o_ksplit > 1)
    per_slot = plan.attn_splits * (spec.num_kv_heads // o_ksplit if o_merge else 1)
    assert ev["attn_done"].counts == ((per_slot,) * (o_ksplit if o_merge else spec.num_kv_heads),) * L


@pytest.mark.parametrize("down_ksplit", [1, 2])
def test_tensor_parallel_guards_of_x_are_staged_signals(down_ksplit):
    """Under tensor parallelism the guards of x are published once a tile has staged x: qkv_all by
    QKV, gateup_staged by GATEUP; gateup_done then has a slot per DOWN K-chunk, counting the GATEUP
    tiles in it, and a DOWN task waits on its chunk's slot and on gateup_staged."""
    from test_verify import tp_share
    spec = tp_share()
    plan = TilePlan(qkv_rows=48, o_rows=32, gateup_rows=64, down_rows=32, down_ksplit=down_ksplit, lm_rows=128)
    g = build_step_graph(spec, 1, plan)
    L, I = spec.num_layers, spec.intermediate_size
    gu = [t for t in g.layer if t.kind == Kind.GATEUP]
    qkv = [t for t in g.layer if t.kind == Kind.QKV]
    assert all(t.staged_signals == 1 and t.signals[0].event == "gateup_staged" for t in gu)
    assert all(t.staged_signals == 1 and t.signals[0].event == "qkv_all" for t in qkv)
    assert all(a.staged for t in gu + qkv for a in t.reads if a.buf == "x")
    chunk = I // down_ksplit
    per_chunk = tuple(sum(t.r0 < (k + 1) * chunk and t.r1 > k * chunk for t in gu) for k in range(down_ksplit))
    assert g.events["gateup_done"].counts == (per_chunk,) * L and not g.events["gateup_done"].cross_rank
    assert g.events["gateup_staged"].counts == ((len(gu),),) * L and g.events["gateup_staged"].cross_rank
    for t in g.layer:
        if t.kind == Kind.DOWN:
            assert [w.event for w in t.waits] == ["gateup_staged", "gateup_done"] and t.waits[1].slot == t.k0 // chunk


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_families_compose_the_step(family):
    """A step's tasks are its family's kinds in template order, less those the plan does not choose
    (``Kind.active``: a mixture-of-experts plan's expert_fused picks EMLP or ROUTE + EGATEUP + EDOWN), and
    with a kind moved ahead of the kinds that wait for its events (under expert_fused OPROJ waits for
    ROUTER: graph/builder.py _dependency_order)."""
    moe = FAMILIES[family].moe_block is not None
    if moe:   # every layer sparse: the layouts the expert kinds run
        from trtllm_mk.model.spec import spec_from_hf_config
        from trtllm_mk.model.tiny import tiny_config
        spec = dataclasses.replace(spec_from_hf_config(tiny_config(family), name=family), mlp_only_layers=())
    else:
        spec = tiny_spec(family=family)
    step = dict(FAMILIES[family].step)
    for fused in (False, True) if moe else (False,):
        plan = TilePlan(qkv_rows=64, lm_rows=128, attn_splits=2, gateup_rows=32, expert_fused=fused)
        g = build_step_graph(spec, 1, plan)
        for phase, tasks in ((HEAD, g.head), (LAYER, g.layer), (TAIL, g.tail)):
            kinds = list(dict.fromkeys(t.kind.name for t in tasks))
            want = [k for k in step[phase] if Kind[k].active(spec, plan)]
            if phase == LAYER and fused:
                want.remove("ROUTER")
                want.insert(want.index("OPROJ"), "ROUTER")
            assert kinds == want
        layer = {t.kind.name for t in g.layer}
        if moe:
            assert ("EMLP" in layer) == fused and ({"ROUTE", "EGATEUP", "EDOWN"} <= layer) == (not fused)
    assert spec.qkv_bias == FAMILIES[family].qkv_bias and spec.qk_norm == FAMILIES[family].qk_norm


def test_device_files_follow_the_step_and_what_it_needs():
    from trtllm_mk.kinds import device_files
    names = [p.name for p in device_files({"OPROJ", "EGATEUP"})]
    assert names == ["combine.cuh", "oproj.cuh", "gateup.cuh", "route.cuh", "egateup.cuh"]   # registry order, needs added
    assert len(device_files()) == len(KIND_DEFS)
