"""The generated megakernel source executes the schedule it was generated from (no GPU needed)."""
import re
from dataclasses import replace
from pathlib import Path

import pytest

from trtllm_mk.codegen import Diagnostics, generate_source
from trtllm_mk.errors import UserError
from trtllm_mk.gpus import get_gpu
from trtllm_mk.model.spec import load_spec
from trtllm_mk.graph import TilePlan
from trtllm_mk.search import schedule_plan

ROOT = Path(__file__).resolve().parents[1]
CALL = re.compile(r"run_task<mk::(\w+)>\(c, mk::TaskArgs\{([^{]*)\{")


def sm_calls(src: str) -> dict[int, list[tuple[str, list[str]]]]:
    """Per SM case of run_program: (kind, scalar TaskArgs fields) of every task call, in order."""
    out, sm = {}, None
    for line in src[src.index("mk::Ctx run_program"):].splitlines():
        m = re.match(r"\s*case (\d+): \{", line)
        if m:
            sm = int(m.group(1))
            out[sm] = []
        c = CALL.search(line)
        if c and sm is not None:
            out[sm].append((c.group(1), [f.strip() for f in c.group(2).split(",") if f.strip()]))
    return out


def test_stage_flags_follow_the_schedule():
    # Llama-3.2-1B shapes with 16-row GATEUP tiles (the v5 plan measured on H100): several GATEUP
    # tiles per SM, so some calls reuse the staged input
    spec = load_spec(ROOT / "configs" / "models" / "llama-3.2-1b.json")
    plan = TilePlan(qkv_rows=24, o_rows=16, o_ksplit=1, gateup_rows=16, down_rows=16, down_ksplit=2, lm_rows=976,
                    attn_splits=8, stages=4, slot_bytes=32768, consumer_warps=8)
    # the plan list-scheduled as the search would: the test does not hinge on what the search picks
    sched = schedule_plan(spec, 1, get_gpu("H100-SXM"), plan, 512)
    assert sched.plan == plan and sched.predicted_step_us > 0
    src, _ = generate_source(sched, 16, 256, use_bulk_copy=True)
    calls = sm_calls(src)
    g = sched.graph()
    reused = 0
    for sm, prog in enumerate(sched.programs):
        expect = []
        for tasks, idx in ((g.head, prog.head), (g.layer, prog.layer), (g.tail, prog.tail)):
            for n, i in enumerate(idx):
                t = tasks[i]
                reuse = n > 0 and t.reuses_staged_input(tasks[idx[n - 1]])
                reused += reuse
                expect.append((t.kind.name, "0" if reuse else "1"))
        # TaskArgs{layer, r0, r1, k0, k1, group, split, tile, stage, nw, ...}
        assert [(k, f[8]) for k, f in calls[sm]] == expect, f"SM {sm}"
    assert reused > 0, "the 1B schedule should have consecutive GEMVs sharing an input"
    # the diagnostic switches are one generated namespace ahead of the device headers, which read it
    assert "constexpr int ALL_LANES_RELEASE = 0;" in src and "constexpr int ATTN_MARK = 0;" in src
    sanitizer = generate_source(sched, 16, 256, True, Diagnostics(all_lanes_release=1))[0]
    assert "constexpr int ALL_LANES_RELEASE = 1;" in sanitizer
    diag = generate_source(sched, 16, 256, True, Diagnostics.parse(["attn_mark=3"]))[0]
    assert diag.index("constexpr int ATTN_MARK = 3;") < diag.index("diag::ATTN_MARK")
    # no device header keeps a macro switch of its own
    assert not re.search(r"#ifndef MK_|#if defined\(MK_(?!USE_BULK_COPY)", src)


def test_diagnostics_parse_refuses_bad_switches():
    assert Diagnostics.parse(["gemv_mark=2", "prefetch_next=0"]).changed() == {"gemv_mark": 2, "prefetch_next": 0}
    assert Diagnostics().is_production
    for bad in (["attn_mark=7"], ["nope=1"], ["gemv_mark"], ["prefetch_next=x"], ["prefetch_next=2"]):
        with pytest.raises(UserError):
            Diagnostics.parse(bad)


def test_inflight_caps_follow_the_plan():
    # the loader's in-flight caps are plan fields: the generated constants change with them, and a
    # plan whose chain cap exceeds the streaming cap is refused before codegen
    spec = load_spec(ROOT / "configs" / "models" / "llama-3.2-1b.json")
    plan = TilePlan(qkv_rows=24, o_rows=16, gateup_rows=64, down_rows=16, down_ksplit=2, lm_rows=976)
    gpu = get_gpu("H100-SXM")
    for slots, chain in ((2, 1), (3, 3)):
        src, _ = generate_source(schedule_plan(spec, 1, gpu, replace(plan, inflight_slots=slots,
                                                                    inflight_chain=chain), 512), 16, 256, True)
        assert f"constexpr int INFLIGHT = {slots};" in src
        assert f"constexpr int INFLIGHT_CHAIN = {chain};" in src
    with pytest.raises(ValueError, match="inflight_chain"):
        schedule_plan(spec, 1, gpu, replace(plan, inflight_slots=1, inflight_chain=2), 512)


def test_the_cp_async_ring_has_its_loader_warps_in_its_launch():
    # the kernel's roles follow LOADER_WARPS, and the launch block must hold them: a block one warp short
    # would leave every slot's barrier waiting for the missing warp's arrivals
    from trtllm_mk.codegen.source import CP_ASYNC_LOADER_WARPS
    spec = load_spec(ROOT / "configs" / "models" / "llama-3.2-1b.json")
    plan = TilePlan(qkv_rows=24, o_rows=16, gateup_rows=64, down_rows=16, down_ksplit=2, lm_rows=976, consumer_warps=8)
    sched = schedule_plan(spec, 1, get_gpu("H100-SXM"), plan, 512)
    for bulk, loaders, asked in ((True, 1, None), (False, CP_ASYNC_LOADER_WARPS, None), (False, 2, 2), (False, 1, 1)):
        src, layout = generate_source(sched, 16, 256, bulk, loader_warps=asked)
        assert f"constexpr int LOADER_WARPS = {loaders};" in src
        assert layout.block == (8 + loaders + 1) * 32
    for bulk, asked in ((True, 2), (False, 0), (False, 9)):
        with pytest.raises(ValueError, match="loader_warps"):
            generate_source(sched, 16, 256, bulk, loader_warps=asked)


def test_oproj_merge_and_next_step_prefetch_are_emitted():
    # o_merge is a compile-time constant of the kernel; each SM's program ends with the prefetch of
    # the first weights its loader streams in the next step (its first GEMV of the layer template)
    spec = load_spec(ROOT / "configs" / "models" / "llama-3.2-1b.json")
    plan = TilePlan(qkv_rows=24, o_rows=128, o_ksplit=8, gateup_rows=64, down_rows=128, down_ksplit=8, lm_rows=976)
    gpu = get_gpu("H100-SXM")
    for merge in (False, True):
        sched = schedule_plan(spec, 1, gpu, replace(plan, o_merge=merge), 512)
        src, _ = generate_source(sched, 16, 256, True)
        assert f"constexpr bool O_MERGE = {'true' if merge else 'false'};" in src
        assert ("run_task<mk::COMBINE>" in src) != merge
        # the step's kinds' device files, and COMBINE's (OPROJ merges with its merge_splits); no expert bodies
        assert "// ===== combine.cuh =====" in src and "// ===== oproj.cuh =====" in src
        assert "// ===== egateup.cuh =====" not in src and "// ===== router.cuh =====" not in src
    g = sched.graph()
    cases = src[src.index("mk::Ctx run_program"):].split("  case ")[1:]
    for sm, (prog, case) in enumerate(zip(sched.programs, cases)):
        first = next((g.layer[i] for i in prog.layer if g.layer[i].kind.streams_weights), None)
        m = re.search(r"prefetch_next_step<mk::(\w+)>\(c, mk::TaskArgs\{0, (\d+), (\d+), (\d+), (\d+),", case)
        if first is None:   # an SM without weights in its layers (attention only) prefetches nothing
            assert m is None, f"SM {sm}"
            continue
        assert m and (m.group(1), *map(int, m.groups()[1:])) == (first.kind.name, first.r0, first.r1, first.k0,
                                                                  first.k1), f"SM {sm}"


POLLED = {"qkv_done": ("QKV", "ATTN"), "gateup_done": ("GATEUP", "DOWN"),
          # a counted residual (graph.builder counted_residual): x's words carry these two
          "oproj_done": ("OPROJ", "GATEUP"), "resid_ready": ("DOWN", "QKV")}


@pytest.mark.parametrize("event", sorted(POLLED))
def test_a_polled_event_has_no_counter_on_the_device(event):
    # QKV stores q/k/v as tagged words that ATTN polls (kinds/qkv.py), GATEUP act as tagged bf16 words
    # that DOWN polls (kinds/gateup.py), OPROJ and DOWN count their adds into x, which GATEUP and QKV
    # poll: those events are polled, so the kernel neither releases nor waits for their counters,
    # unless the diagnostic switch keeps them; the CPU executor and the simulator keep the edges
    # (their counts are the graph's)
    from trtllm_mk.codegen.source import program_calls
    from trtllm_mk.graph.builder import _polled
    producer, consumer = POLLED[event]
    spec = load_spec(ROOT / "configs" / "models" / "llama-3.2-1b.json")
    plan = TilePlan(qkv_rows=24, o_rows=128, o_ksplit=8, gateup_rows=64, down_rows=128, down_ksplit=8, lm_rows=976,
                    o_merge=True)
    sched = schedule_plan(spec, 1, get_gpu("H100-SXM"), plan, 512)
    g = sched.graph()
    assert {n for n, e in g.events.items() if e.polled} == set(POLLED)
    offsets = g.counter_offsets()
    lo, hi = offsets[event], offsets[event] + g.events[event].slots * g.events[event].rows

    def refs(calls, kind, key):
        return [int(w, 16) & 0xFFFF for sm in calls for _, c in sm if c.kind == kind
                for w in c.args[key][:c.args["n" + key]]]
    for diag, counted in ((Diagnostics(), False), (Diagnostics(polled_events=0), True)):
        calls = program_calls(sched, g, diag)
        waits, signals = refs(calls, consumer, "w"), refs(calls, producer, "s")
        assert any(lo <= w < hi for w in waits) == counted
        assert any(lo <= s < hi for s in signals) == counted
        # every other event keeps its counter either way
        kept = {r.event for t in g.layer if t.kind.name == producer for r in t.signals if not g.events[r.event].polled}
        assert any(not lo <= s < hi for s in signals) == bool(kept)
    # a kind that waits for a polled event without polling it is a kind-definition error
    prod = next(t for t in g.layer if t.kind.name == producer)
    oproj = next(t for t in g.layer if t.kind.name == "OPROJ")
    deaf = replace(oproj, waits=oproj.waits + tuple(r for r in prod.signals if r.event == event))
    with pytest.raises(ValueError, match="without polling"):
        _polled(event, [prod, deaf], counted=True)


def test_down_polls_its_chunk_and_waits_for_every_tile_staging():
    # a K-split DOWN task polls only its chunk's act words (one gateup_done slot per chunk), so the
    # tiles' staging of x, which DOWN adds into, is guarded by the counted gateup_staged; one chunk
    # polls every tile's words, which follow the tile's staging
    spec = load_spec(ROOT / "configs" / "models" / "llama-3.2-1b.json")
    for ksplit in (1, 4):
        plan = TilePlan(qkv_rows=24, o_rows=128, o_ksplit=8, gateup_rows=64, down_rows=128, down_ksplit=ksplit,
                        lm_rows=976, o_merge=True)
        g = schedule_plan(spec, 1, get_gpu("H100-SXM"), plan, 512).graph()
        assert g.events["gateup_done"].slots == ksplit
        downs = [t for t in g.layer if t.kind.name == "DOWN"]
        for t in downs:
            assert {(w.event, w.slot) for w in t.waits if w.event == "gateup_done"} == \
                {("gateup_done", t.k0 * ksplit // spec.mlp_intermediate)}
            assert any(w.event == "gateup_staged" for w in t.waits) == (ksplit > 1)
        staged = [t for t in g.layer if t.kind.name == "GATEUP" and t.staged_signals]
        assert len(staged) == (len([t for t in g.layer if t.kind.name == "GATEUP"]) if ksplit > 1 else 0)
        # QKV's guard of x (qkv_all) is a staged signal, whatever DOWN's split
        assert all(t.staged_signals == 1 and t.signals[0].event == "qkv_all" for t in g.layer if t.kind.name == "QKV")


def test_a_dense_step_on_one_gpu_counts_its_residual():
    # OPROJ and DOWN add into x with a count in each word; GATEUP, QKV and LMHEAD poll the counts (their
    # events polled), and the kernel gets the counts a layer takes (mk_common.cuh resid_count)
    from trtllm_mk.codegen.source import program_calls
    from trtllm_mk.residual import counted_states
    spec = load_spec(ROOT / "configs" / "models" / "llama-3.2-1b.json")
    plan = TilePlan(qkv_rows=24, o_rows=128, o_ksplit=8, gateup_rows=64, down_rows=128, down_ksplit=4, lm_rows=976,
                    o_merge=True)
    sched = schedule_plan(spec, 1, get_gpu("H100-SXM"), plan, 512)
    g = sched.graph()
    assert (g.dims.resid_o_adds, g.dims.resid_layer_adds) == (8, 12)
    assert g.events["resid_ready"].polled and g.events["oproj_done"].polled
    src, _ = generate_source(sched, 16, 256, use_bulk_copy=True)
    consts = dict(re.findall(r"constexpr int (RESID_\w+) = (\d+);", src))
    assert consts == {"RESID_FRAC_BITS": "32", "RESID_COUNTED": "1", "RESID_COUNT_BITS": "10", "RESID_O_ADDS": "8",
                      "RESID_LAYER_ADDS": "12", "RESID_STATES": str(counted_states(spec.num_layers, 12))}
    # EMBED, OPROJ and DOWN release nothing for x: their only signals were its events
    calls = [c for sm in program_calls(sched) for _, c in sm]
    assert all(c.args["ns"] == 0 for c in calls if c.kind in ("EMBED", "OPROJ"))
    assert all(c.args["ns"] == 0 and c.args["nw"] == 1 for c in calls if c.kind == "DOWN")   # gateup_staged
    assert all(c.args["nw"] == 0 for c in calls if c.kind in ("QKV", "GATEUP", "LMHEAD"))


@pytest.mark.parametrize("case", ["two ranks", "mixture of experts", "counts overflow"])
def test_a_residual_is_counted_only_where_its_counts_say_it_all(case):
    # under tensor parallelism peers add into x too; an expert kind adds only where its routing says (a
    # count the readers cannot know); a step with more adds than the word's count holds would let
    # counts repeat: x is then not counted, and its events are counters
    from trtllm_mk.graph import build_step_graph
    from trtllm_mk.residual import fits_counts
    if case == "two ranks":
        from trtllm_mk.parallel import rank_spec
        spec = rank_spec(load_spec(ROOT / "configs" / "models" / "llama-3.1-8b.json"), 2)
        plan = TilePlan(o_ksplit=4, down_ksplit=2)
    elif case == "mixture of experts":
        spec = load_spec(ROOT / "configs" / "models" / "qwen3-30b-a3b.json")
        plan = TilePlan(o_ksplit=4, down_ksplit=2)
    else:
        spec = load_spec(ROOT / "configs" / "models" / "llama-3.1-8b.json")
        plan = TilePlan(o_ksplit=8, down_ksplit=32)
        assert not fits_counts(spec.num_layers, 8 + 32) and fits_counts(spec.num_layers, 8 + 16)
        assert build_step_graph(spec, 1, replace(plan, down_ksplit=16)).dims.resid_counted
    g = build_step_graph(spec, 1, plan)
    assert not g.dims.resid_counted and (g.dims.resid_o_adds, g.dims.resid_layer_adds) == (0, 0)
    assert not any(e.polled for n, e in g.events.items() if n in ("resid_ready", "oproj_done"))
