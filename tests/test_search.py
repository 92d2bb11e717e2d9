"""Cost model, simulator, naive baseline, search and report (all on CPU, small budgets)."""
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from trtllm_mk import verify
from trtllm_mk.errors import ConfigError
from trtllm_mk.gpus import get_gpu
from trtllm_mk.graph import Dims, Event, EventRef, Kind, StepGraph, Task, TilePlan, build_step_graph
from trtllm_mk.graph.tasks import LAYER
from trtllm_mk.model.spec import load_spec
from trtllm_mk.report import write_report
from trtllm_mk.schedule import Schedule, SMProgram
from trtllm_mk.search import (Calibration, SimulationError, Simulator, load_calibration, naive_plan,
                              naive_programs, naive_schedule, search)
from trtllm_mk.search.cost import CostTable, TaskCost, cost_table, default_streaming, sm_rates, task_cost
from trtllm_mk.search.improve import improve
from trtllm_mk.search.listsched import list_schedule
from trtllm_mk.search.simulate import streaming_sms
from trtllm_mk.smem import fits

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "configs" / "models"
H100 = get_gpu("H100-SXM")
L20 = get_gpu("L20")


def spec_of(name):
    return load_spec(MODELS / f"{name}.json")


# ------------------------------------------------------------------------------ calibration
def test_calibration_defaults_and_file(tmp_path):
    with pytest.raises(ConfigError, match="no calibration file for H100-SXM"):
        load_calibration(H100, directory=tmp_path)   # never silent defaults
    (tmp_path / "H100-SXM.json").write_text(json.dumps({"_note": "defaults"}))
    assert load_calibration(H100, directory=tmp_path) == replace(Calibration(),
                                                                 source=str(tmp_path / "H100-SXM.json"))
    (tmp_path / "H100-SXM.json").write_text(json.dumps({"sync_us": 0.7, "launch_us": 3, "_measured_on": "x"}))
    cal = load_calibration(H100, directory=tmp_path)
    assert cal.sync_us == 0.7 and cal.launch_us == 3.0 and cal.task_overhead_us == Calibration().task_overhead_us
    assert cal.source.endswith("H100-SXM.json")
    r = cal.resolved(H100)
    assert r.fp32_lanes == 128 and r.sm_clock_ghz == 1.98 and r.read_bandwidth == H100.read_bandwidth
    (tmp_path / "H100-SXM.json").write_text(json.dumps({"sink_us": 1.0}))
    with pytest.raises(ConfigError, match="unknown calibration key 'sink_us'"):
        load_calibration(H100, directory=tmp_path)
    (tmp_path / "H100-SXM.json").write_text(json.dumps({"sync_us": -1}))
    with pytest.raises(ConfigError, match="non-negative"):
        load_calibration(H100, directory=tmp_path)


# ------------------------------------------------------------------------------ cost model
def test_rates_share_bandwidth():
    cal = Calibration()
    fair = H100.read_bandwidth / 1e6 / H100.sm_count
    last = None
    for n in (1, 8, 33, 66, 132):
        r = sm_rates(H100, cal, 1, ((int(Kind.QKV), n),)).stream_rate(Kind.QKV)
        assert fair * (1 - 1e-9) <= r <= cal.sm_bw_cap * fair * (1 + 1e-9)
        assert last is None or r <= last
        last = r
    assert last == pytest.approx(fair)
    # the tensor-core consumer reduces weight bytes at the same rate for every batch up to 8 (the
    # batch is the mma's N), several times faster than one SM's share of HBM
    assert sm_rates(H100, cal, 8).gemv == sm_rates(H100, cal, 1).gemv > 4 * fair
    # fewer consumer warps than full_rate_warps run slower
    assert sm_rates(H100, cal, 1, consumer_warps=4).gemv == pytest.approx(sm_rates(H100, cal, 1).gemv / 2)


def _single_task_time(task: Task, graph: StepGraph, cal: Calibration) -> float:
    """Step time of a one-SM, one-task schedule of ``task`` (costed by the real cost model)."""
    g = StepGraph(1, graph.batch, graph.plan, [], [replace(task, waits=(), signals=(), index=0)], [], {},
                  graph.dims)
    progs = [SMProgram(layer=[0])]
    key = streaming_sms(progs, g)
    rates = sm_rates(H100, cal, graph.batch, key, graph.plan.consumer_warps)
    ct = CostTable([], [task_cost(g.layer[0], g, rates, cal.resolved(H100))], [], rates, key)
    return Simulator(g, H100, cal, costs=ct).run(progs).step_us


def test_cost_monotonic_in_bytes():
    spec = spec_of("qwen3-8b")
    cal = Calibration(sm_bw_cap=1.0)      # a lone SM gets only its fair share: bandwidth-bound
    times = []
    for rows in (8, 32, 128, 512):
        g = build_step_graph(spec, 1, TilePlan(qkv_rows=rows), 512)
        qkv = g.layer[0]
        assert qkv.kind == Kind.QKV and qkv.weight_bytes == rows * spec.hidden_size * 2
        times.append(_single_task_time(qkv, g, cal))
    assert all(a < b for a, b in zip(times, times[1:]))
    # past the fixed costs, each extra byte costs 1 / (the SM's share of the read bandwidth)
    per_byte = (times[3] - times[2]) / ((512 - 128) * spec.hidden_size * 2)
    assert per_byte == pytest.approx(H100.sm_count * 1e6 / H100.read_bandwidth, rel=1e-6)
    # a slower sync or a larger task overhead can only make a real schedule slower
    g = build_step_graph(spec_of("tiny-llama"), 1, TilePlan(qkv_rows=32, o_rows=32, gateup_rows=32,
                                                           down_rows=32, lm_rows=64), 64)
    progs = naive_programs(g, 4)
    cal = Calibration()
    base = Simulator(g, H100, cal).run(progs).step_us
    assert Simulator(g, H100, replace(cal, sync_us=3.0)).run(progs).step_us > base
    assert Simulator(g, H100, replace(cal, task_overhead_us=1.0)).run(progs).step_us > base


def test_attention_cost_streams_tokens_past_the_ring():
    """ATTN's cached tokens beyond the ring's capacity stream through the ring while the consumers
    compute (kinds/attn.cuh attn_load): a split costs its tile rounds or, where slower, the stream of
    its later rounds (their bytes at the loader's rate plus a per-token cost); the tokens of a row's
    first round were loaded before the wait and cost nothing on the consumer."""
    from trtllm_mk.search.cost import cost_table
    from trtllm_mk.smem import attention_chunk
    spec = spec_of("llama-3.1-8b")
    token = 2 * spec.head_dim * 2
    plan = TilePlan(slot_bytes=16384, attn_splits=16, stages=4)   # K and V of 64 tokens in a slot each

    def attn(ctx, cal):
        g = build_step_graph(spec, 1, plan, ctx)
        ct = cost_table(g, H100, cal)
        t, c = next((t, c) for t, c in zip(g.layer, ct.layer) if t.kind == Kind.ATTN)
        return c.dur - max(0, t.act_bytes - attention_chunk(ctx, 16) * token) / ct.rates.l2, ct.rates

    base = Calibration(attn_tile_us=0.0, attn_fixed_us=0.0, task_overhead_us=0.0)
    assert attn(1023, base)[0] == pytest.approx(attn(512, base)[0]) == 0.0   # 64 tokens per split: in the ring
    slow = replace(base, attn_late_token_us=0.01)
    for ctx in (2047, 3071):
        late = attention_chunk(ctx, 16) - 64                       # 64 or 128 tokens past the first round
        fast, rates = attn(ctx, base)
        assert fast >= late * token / rates.hbm * (1 - 1e-9)       # never faster than the SM's HBM share
        assert attn(ctx, slow)[0] == pytest.approx(fast + late * 0.01)
    # a deeper ring keeps more of the stream in flight: never slower
    assert attn(3071, replace(base, mem_latency_us=5.0))[0] >= attn(3071, base)[0]
    # where the math is slower than the stream, the tile rounds are the cost: 192 tokens arrive in
    # three rounds of 64, and a round's 64 tokens are 8 tiles (spaced 8 apart), one per warp
    assert attention_chunk(3071, 16) == 192
    assert attn(3071, replace(base, attn_tile_us=50.0))[0] == pytest.approx(3 * 50.0)


def test_attention_splits_start_at_whole_runs():
    """KV splits longer than one ring round (KV_CAP tokens) start at equal shares rounded down to whole
    runs of attn_kv_run tokens (kinds/attn.cuh split_start), so that a run's copy never crosses a cache
    block; shorter ones keep equal shares. Either way the splits cover the step's tokens exactly once,
    none more than a run longer than an equal share."""
    from trtllm_mk.smem import attention_chunk, split_bounds
    assert [split_bounds(8192, 4, 16, 256, s) for s in range(4)] == [(0, 2048), (2048, 4096), (4096, 6144), (6144, 8193)]
    assert attention_chunk(8192, 4, 16, 256) == 2049
    assert [split_bounds(512, 8, 8, 128, s) for s in (0, 1, 7)] == [(0, 65), (65, 130), (455, 513)]   # one round each
    assert split_bounds(30, 16, 8, 0, 0) == (0, 0)        # 31 tokens past a cap of 0: four runs for sixteen splits
    for position, splits, run, cap in ((8192, 4, 16, 256), (8192, 4, 8, 128), (512, 8, 8, 128), (512, 8, 8, 32),
                                       (30, 16, 8, 0), (30, 16, 8, 64), (0, 4, 8, 0), (2047, 16, 16, 64)):
        share, covered = -(-(position + 1) // splits), []
        for s in range(splits):
            t0, t1 = split_bounds(position, splits, run, cap, s)
            assert share <= cap or t0 % run == 0
            assert t1 - t0 < share + run
            covered += range(t0, t1)
        assert covered == list(range(position + 1))


def test_attention_rows_after_the_first_stream_all_their_tokens():
    """A task over two batch rows: only its first round (the first row's first KV_CAP tokens) lands
    before the wait; the second row's rounds queue behind the first row's in the ring, so all its
    tokens are stream. And each row pays the fixed chain (staging, merge, barriers) once."""
    from trtllm_mk.search.cost import cost_table
    from trtllm_mk.smem import attention_chunk, attention_kv_ring
    spec = spec_of("llama-3.1-8b")
    base = Calibration(attn_tile_us=0.0, attn_fixed_us=0.0, task_overhead_us=0.0)

    def attn(rows, cal=base):
        plan = TilePlan(slot_bytes=32768, attn_splits=8, stages=5, attn_rows=rows)
        g = build_step_graph(spec, 2, plan, 8192)
        ct = cost_table(g, H100, cal)
        t, c = next((t, c) for t, c in zip(g.layer, ct.layer) if t.kind == Kind.ATTN)
        return c.dur - max(0, t.act_bytes - t.rows * attention_chunk(8192, 8) * 4 * spec.head_dim) / ct.rates.l2

    split = attention_chunk(8192, 8)
    cap = attention_kv_ring(spec.head_dim, 32768, 8, 8192)[1]
    one, two = attn(1), attn(2)
    per_token = one / (split - cap)                 # one row: its tokens past the first round
    assert two == pytest.approx((2 * split - cap) * per_token)
    assert attn(2, replace(base, attn_fixed_us=1.0)) == pytest.approx(two + 2.0)


def test_attention_tile_rounds_follow_the_run_spacing():
    """attn_compute's tiles are 16 tokens spaced attn_kv_run apart, per ring round of KV_CAP tokens
    (the new token joins the last): counted by hand for 8 warps."""
    from trtllm_mk.kinds.attn import tile_rounds
    assert tile_rounds(128, 128, 8, 8) == 1      # 8 full tiles, one per warp
    assert tile_rounds(128, 128, 16, 8) == 2     # 16 tiles of 8 tokens each: two per warp
    assert tile_rounds(256, 256, 16, 8) == 2     # 16 full tiles
    assert tile_rounds(129, 128, 8, 8) == 2      # 128 cached + the new token: 16 tiles
    assert tile_rounds(300, 128, 8, 8) == 3      # rounds of 128, 128 and 43 + 1
    assert tile_rounds(300, 128, 8, 4) == 6      # with 4 warps: 2 + 2 + 2 (44 tokens 8 apart fill 8 tiles)


def test_attention_kv_runs_priced_by_copies_and_tile_rounds():
    """Runs of 16 tokens halve the copies of 128-byte K/V rows (the 1B's head 64), where one SM's
    copy issue bounds the stream; with 256-byte rows in rounds of 128 tokens (the 8B's) the stream is
    bandwidth-bound and the half-empty tiles hold each round's slots longer, so runs of 8 stay ahead."""
    from trtllm_mk.search.cost import cost_table
    h200 = get_gpu("H200")

    def attn(name, run):
        plan = TilePlan(attn_splits=4, attn_rows=1, slot_bytes=32768, stages=6, attn_kv_run=run)
        g = build_step_graph(spec_of(name), 4, plan, 8192)
        ct = cost_table(g, h200, load_calibration(h200))
        return next(c.dur for t, c in zip(g.layer, ct.layer) if t.kind == Kind.ATTN)

    assert attn("llama-3.2-1b", 16) < 0.9 * attn("llama-3.2-1b", 8)
    assert attn("llama-3.1-8b", 16) >= attn("llama-3.1-8b", 8)


def test_attention_kv_run_candidates_fill_whole_tiles():
    """The search tries runs of 16 only where a round of the split holds 16 x 16 tokens, so that
    its tiles (16 tokens spaced 16 apart) are full: rounds of 128 tokens (the 8B: 256-byte rows in
    32 KB slots) would leave every tile half empty."""
    from trtllm_mk.search.plans import field_candidates

    def runs(name, ctx=8192, slot=32768):
        plan = TilePlan(attn_splits=4, slot_bytes=slot)
        return field_candidates("attn_kv_run", plan, spec_of(name), 132, ctx, 4)

    assert runs("llama-3.2-1b") == [8, 16]          # head 64: rounds of 256 tokens
    assert runs("llama-3.1-8b") == [8]              # head 128: rounds of 128
    assert runs("llama-3.2-1b", slot=16384) == [8]  # rounds of 128


def test_attention_math_costs_tile_rounds():
    """The consumer warps take a split's 16-token tensor-core tiles in turns: up to 16 x warps tokens
    are one round of attn_tile_us, one token more is two (1B, 8 warps: up to 65 tokens per split at
    context 512 with 8 splits, 129 with 4, both all in the ring), for every batch row in turn."""
    from trtllm_mk.search.cost import cost_table
    from trtllm_mk.smem import attention_chunk
    spec = spec_of("llama-3.2-1b")
    cal = Calibration(attn_tile_us=0.5, attn_fixed_us=0.0)   # (the fixed part is per row)

    def attn(splits, batch=1):
        g = build_step_graph(spec, batch, TilePlan(attn_splits=splits, slot_bytes=32768, stages=6), 512)
        ct = cost_table(g, H100, cal)
        t, c = next((t, c) for t, c in zip(g.layer, ct.layer) if t.kind == Kind.ATTN)
        kv = batch * attention_chunk(512, splits) * 2 * spec.head_dim * 2    # ring-borne K/V: not on the consumer
        return c.dur - (t.act_bytes - kv) / ct.rates.l2

    assert attn(4) - attn(8) == pytest.approx(0.5)
    assert attn(8, batch=2) - attn(8) == pytest.approx(0.5)


# ------------------------------------------------------------------------------ simulator, by hand
CAL = Calibration(sync_us=1.0, mem_latency_us=0.8, launch_us=4.0)


def _hand(tasks, costs, programs, events, cal=CAL):
    """A one-layer graph of hand-made tasks with hand-given costs."""
    dims = Dims(batch=1, layers=1, hidden=64, intermediate=64, vocab=64, heads=1, kv_heads=1, head_dim=32, group=1,
                splits=1, group_rows=96, qkv_rows=96, q_dim=32, n_lm_tiles=1, context_len=16)
    g = StepGraph(1, 1, TilePlan(), [], tasks, [], events, dims)
    ct = CostTable([], costs, [], None, streaming_sms(programs, g))
    return Simulator(g, H100, cal, costs=ct).run(programs, record=True)


EV = {"e": Event("e", 1, 1, ((1,),), True)}
SIG = (EventRef("e", 0, 0),)


def _attn(i, dur, signals=(), waits=()):
    return Task(Kind.ATTN, LAYER, i, waits=waits, signals=signals), TaskCost(False, dur=dur)


def _gemv(i, weight, ring, waits=(), signals=()):
    t = Task(Kind.QKV, LAYER, i, r0=0, r1=8, k0=0, k1=64, waits=waits, signals=signals, weight_bytes=weight)
    return t, TaskCost(True, weight=weight, pre=1.0, comp=2.0, slot_t=0.5, fill=ring / 4, ring=ring, rate=10.0)


def test_simulation_hand_computed_event_and_prefetch():
    # SM0: X (10 us) signals e. SM1: a GEMV of 100 B at 10 B/us waits e, ring 40 B.
    (x, cx), (y, cy) = _attn(0, 10.0, signals=SIG), _gemv(1, 100.0, 40.0, waits=SIG)
    r = _hand([x, y], [cx, cy], [SMProgram(layer=[0]), SMProgram(layer=[1])], EV)
    # loader prefetches 40 B by t=4; consumer starts at 10 + sync 1 + pre 1 = 12; the other 60 B
    # need ring space the consumer frees from t=12: issued by 18, land at 18.8, last slot done 19.3
    assert r.start[1] == pytest.approx(11.0) and r.end[1] == pytest.approx(19.3)
    assert r.step_us == pytest.approx(19.3 + 4.0)
    # a ring holding the whole task: everything arrived at 10.8 and the math ends at 12 + 2 = 14
    (y2, cy2) = _gemv(1, 100.0, 200.0, waits=SIG)
    r = _hand([x, y2], [cx, cy2], [SMProgram(layer=[0]), SMProgram(layer=[1])], EV)
    assert r.end[1] == pytest.approx(14.0)


def test_simulation_hand_computed_ring_across_tasks():
    # SM1 runs GEMV A (no wait) then GEMV B (waits X = 50 us on SM0); ring 40 B, 100 B each.
    (x, cx) = _attn(0, 50.0, signals=SIG)
    (a, ca), (b, cb) = _gemv(1, 100.0, 40.0), _gemv(2, 100.0, 40.0, waits=SIG)
    r = _hand([x, a, b], [cx, ca, cb], [SMProgram(layer=[0]), SMProgram(layer=[1, 2])], EV)
    # A: head issued by 4, consumer starts 1, body issued 4..10, lands 10.8, ends 11.3
    assert r.end[1] == pytest.approx(11.3)
    # B: its head needs A consumed (11.3) and the loader (10 + 4 = 14); consumer 50+1+1 = 52;
    # body issued 52..58, ends 58 + 0.8 + 0.5
    assert r.end[2] == pytest.approx(59.3)
    # now A waits and B does not: B's head must wait for A's consumption (ends 59.3), so the loader
    # issues it by max(58 + 4, 59.3) = 62 and B ends 62 + 6 + 0.8 + 0.5
    (a2, ca2), (b2, cb2) = _gemv(1, 100.0, 40.0, waits=SIG), _gemv(2, 100.0, 40.0)
    r = _hand([x, a2, b2], [cx, ca2, cb2], [SMProgram(layer=[0]), SMProgram(layer=[1, 2])], EV)
    assert r.end[1] == pytest.approx(59.3) and r.end[2] == pytest.approx(69.3)


def test_simulation_hand_computed_publish_and_landing():
    """A task's events reach its waiters ``publish_us`` after it ends (the signaller's release) while
    its SM's consumer goes straight on; the bytes of a stream's last copy land ``landing_us`` after
    its issue, not the ring's turnover latency (mem_latency_us)."""
    cal = replace(CAL, publish_us=2.0, landing_us=0.3)
    # SM0: X (10 us) signals e, then Z (5 us, no wait). SM1: a GEMV of 100 B at 10 B/us waits e, ring 40 B.
    (x, cx), (z, cz), (y, cy) = _attn(0, 10.0, signals=SIG), _attn(1, 5.0), _gemv(2, 100.0, 40.0, waits=SIG)
    r = _hand([x, z, y], [cx, cz, cy], [SMProgram(layer=[0, 1]), SMProgram(layer=[2])], EV, cal)
    assert (r.start[1], r.end[1]) == pytest.approx((10.0, 15.0))      # Z does not wait for the release
    # e is seen at 10 + 2, the GEMV starts at 12 + sync 1, stages by 14; its head (40 B) is in by 4, the
    # other 60 B issue 14..20 as the consumer frees slots and land 0.3 later; the last slot's math 0.5
    assert r.start[2] == pytest.approx(13.0) and r.end[2] == pytest.approx(20.8)
    # without the two constants (publish 0, landing = mem_latency_us 0.8): 11 and 12 + 6 + 0.8 + 0.5
    r = _hand([x, z, y], [cx, cz, cy], [SMProgram(layer=[0, 1]), SMProgram(layer=[2])], EV)
    assert r.start[2] == pytest.approx(11.0) and r.end[2] == pytest.approx(19.3)


def test_simulation_hand_computed_idle_publish():
    """A release is ``publish_idle_us`` late where its task's end was set by its consumer, or the task
    streams nothing (its SM's loader then sits on a full ring), and ``publish_us`` where its stream set
    the end; a calibration without the idle constant prices both as ``publish_us``."""
    ev = {"e1": Event("e1", 1, 1, ((1,),), True), "e2": Event("e2", 1, 1, ((1,),), True)}
    e1, e2 = (EventRef("e1", 0, 0),), (EventRef("e2", 0, 0),)
    cal = replace(CAL, publish_us=2.0, publish_idle_us=0.5)

    def chain(ring, cal):   # SM0: X (20 us) -> SM1: a GEMV of 100 B at 10 B/us -> SM2: Z (1 us)
        (x, cx), (z, cz) = _attn(0, 20.0, signals=e1), _attn(2, 1.0, waits=e2)
        y, cy = _gemv(1, 100.0, ring, waits=e1, signals=e2)
        return _hand([x, y, z], [cx, cy, cz], [SMProgram(layer=[i]) for i in range(3)], ev, cal)

    # a ring that holds the GEMV: its bytes are in by 10.8, X's release is seen at 20.5, the GEMV stages
    # by 22.5 and its math (2 us) sets its end, 24.5; its release is seen at 25, Z runs 26..27
    r = chain(200.0, cal)
    assert (r.start[1], r.end[1]) == pytest.approx((21.5, 24.5)) and r.end[2] == pytest.approx(27.0)
    # a 40 B ring: the other 60 B stream 22.5..28.5 and set the end (+ landing 0.8, last slot 0.5)
    r = chain(40.0, cal)
    assert r.end[1] == pytest.approx(29.8) and r.start[2] == pytest.approx(29.8 + 2.0 + 1.0)
    # without publish_idle_us every release takes publish_us
    r = chain(200.0, replace(cal, publish_idle_us=0.0))
    assert r.end[1] == pytest.approx(26.0) and r.end[2] == pytest.approx(30.0)


def test_simulation_hand_computed_loader_time_per_task():
    """``loader_task_us`` delays the first copy of every GEMV task on the loader: a stream of many
    small tasks pays it once each, a long task once."""
    cal = replace(CAL, loader_task_us=1.0)
    (a, ca), (b, cb) = _gemv(0, 100.0, 40.0), _gemv(1, 100.0, 40.0)
    r = _hand([a, b], [ca, cb], [SMProgram(layer=[0, 1])], EV, cal)
    # A: its head issues 1..5, its body 5..11 (the consumer started at 1), lands 0.8 later, last slot 0.5
    assert r.end[0] == pytest.approx(12.3)
    # B: its loader starts at 11 + 1, its head by 16 (A's last byte is consumed at 12.3), body 16..22
    assert r.end[1] == pytest.approx(23.3)
    r = _hand([a, b], [ca, cb], [SMProgram(layer=[0, 1])], EV)
    assert (r.end[0], r.end[1]) == pytest.approx((11.3, 21.3))


def test_simulator_detects_deadlock():
    (x, cx), (y, cy) = _attn(0, 10.0, signals=SIG), _gemv(1, 100.0, 40.0, waits=SIG)
    with pytest.raises(SimulationError, match="deadlock"):
        _hand([x, y], [cx, cy], [SMProgram(layer=[1, 0])], EV)


# ------------------------------------------------------------------------------ simulator on real shapes
@pytest.fixture(scope="module")
def llama1b_graph():
    spec = spec_of("llama-3.2-1b")
    plan = TilePlan(qkv_rows=24, o_rows=16, gateup_rows=64, down_rows=16, lm_rows=1024, attn_splits=8,
                    stages=8, slot_bytes=16384)
    return spec, build_step_graph(spec, 1, plan, 512)


def test_extrapolated_simulation_matches_exact(llama1b_graph):
    _, g = llama1b_graph
    cal = Calibration()
    progs = list_schedule(g, cost_table(g, H100, cal, default_streaming(g, 132)), 132, cal.resolved(H100),
                          np.random.default_rng(0))
    exact = Simulator(g, H100, cal).run(progs)
    for k in (3, 4):
        approx = Simulator(g, H100, cal, layers=k).run(progs)
        assert approx.layers_simulated == k
        assert approx.step_us == pytest.approx(exact.step_us, rel=2e-3)


def test_barrier_and_naive(llama1b_graph):
    spec, g = llama1b_graph
    cal = Calibration()
    progs = naive_programs(g, 132)
    free = Simulator(g, H100, cal).run(progs).step_us
    assert Simulator(g, H100, cal, barrier=True).run(progs).step_us >= free
    sched = naive_schedule(spec, g, H100)
    assert verify.check(sched, g).ok
    # the naive plan has no K-split and fits (stages / slot shrink on the 99 KB L20)
    for gpu in (H100, L20):
        p = naive_plan(spec_of("qwen3-8b"), 1, gpu)
        assert p.o_ksplit == p.down_ksplit == 1 and fits(gpu, spec_of("qwen3-8b"), 1, p)


def test_improve_repairs_a_bad_assignment():
    spec = spec_of("tiny-llama")
    g = build_step_graph(spec, 1, TilePlan(qkv_rows=32, o_rows=32, gateup_rows=32, down_rows=32, lm_rows=64,
                                           attn_splits=2, stages=4, slot_bytes=8192), 64)
    cal = Calibration()
    sim = Simulator(g, H100, cal)
    lumped = [SMProgram(head=list(range(len(g.head))), layer=list(range(len(g.layer))),
                      tail=list(range(len(g.tail))))] + [SMProgram() for _ in range(3)]
    progs, res, st = improve(g, sim, lumped, 4, 60, np.random.default_rng(0))
    assert st.accepted > 0 and st.end_us < 0.8 * st.start_us
    assert res.step_us == pytest.approx(sim.run(progs).step_us)
    assert verify.check(Schedule(spec, 1, g.plan, 4, "H100-SXM", progs, context_len=64), g).ok


# ------------------------------------------------------------------------------ search
PROGRESS: list = []


@pytest.fixture(scope="module")
def tiny_search():
    spec = spec_of("tiny-llama")
    return spec, search(spec, 2, H100, context_len=128, budget_s=2.0, seed=3, num_sms=8,
                        progress=lambda *a: PROGRESS.append(a))


def test_search_beats_naive_tiny_and_is_valid(tiny_search):
    spec, (sched, stats) = tiny_search
    assert stats.predicted_us < stats.naive_us and stats.improvement_pct > 0
    assert sched.predicted_step_us == pytest.approx(stats.predicted_us)
    assert sched.num_sms == 8 and len(sched.programs) == 8
    assert fits(H100, spec, 2, sched.plan)
    m = sched.meta["search"]
    for k in ("plan_evals", "improve_steps", "naive_us", "improvement_pct", "seed", "budget_s", "ksplit"):
        assert k in m
    verify.check(sched)
    # progress: (stage, done, total) with done non-decreasing and bounded by the work budget
    stages = [p[0] for p in PROGRESS]
    assert stages[0] == "plans" and "improve" in stages and "references" in stages
    done = [p[1] for p in PROGRESS]
    assert done == sorted(done) and all(p[2] == stats.work_budget for p in PROGRESS)


def test_search_is_deterministic(tiny_search):
    spec, (sched, _) = tiny_search
    again, _ = search(spec, 2, H100, context_len=128, budget_s=2.0, seed=3, num_sms=8)
    assert again.to_json() == sched.to_json()
    assert Schedule.from_json(sched.to_json()).programs == sched.programs


def test_search_real_shape_l20_within_budget(monkeypatch):
    from trtllm_mk.search.planeval import Evaluator
    heaviest = [0.0]
    work_of = Evaluator.work_of

    def counted(graph):
        heaviest[0] = max(heaviest[0], work_of(graph))
        return work_of(graph)

    monkeypatch.setattr(Evaluator, "work_of", staticmethod(counted))
    spec = spec_of("qwen3-8b")
    sched, stats = search(spec, 1, L20, context_len=512, budget_s=4.0, seed=0)
    assert stats.predicted_us < stats.naive_us
    assert fits(L20, spec, 1, sched.plan)
    # the budget is work, not time: each budgeted stage starts no evaluation once its share is spent,
    # so the work counter ends at most one evaluation per stage past the budget (9 stages: the two
    # descents, two family descents and trims, the trim and two reference trims), plus the 5
    # unconditional start evaluations (two initial candidates, the wide ring, two family starts)
    assert 0 < stats.work_spent <= stats.work_budget + 14 * heaviest[0]
    # prediction is at most the ideal: weights over the read bandwidth, plus the launch
    assert stats.predicted_us >= stats.floor_us
    verify.check(sched)


def test_ksplit_comparison_arithmetic():
    """smemref.compare on a hand-filled memo: families, iso-time and at-chosen-time cuts."""
    from trtllm_mk.search.planeval import Evaluator, PlanEval, least_smem
    from trtllm_mk.search.smemref import Family, compare
    spec = spec_of("tiny-llama")     # small enough that 16 whole rows of every kind fit a slot
    ev = Evaluator(spec, 1, L20, Calibration(), 92, 512, 0)
    split = TilePlan(o_ksplit=2, down_ksplit=2, stages=8, slot_bytes=4096)
    whole = TilePlan(o_ksplit=1, down_ksplit=1, stages=2, slot_bytes=32768)    # rows fit one slot
    pieces = TilePlan(o_ksplit=1, down_ksplit=1, stages=12, slot_bytes=4096)   # rows in pieces
    evals = {"A": PlanEval(split, 100.0, 50_000, []), "B": PlanEval(whole, 100.1, 90_000, []),
             "C": PlanEval(pieces, 99.0, 80_000, []), "D": PlanEval(replace(split, stages=12), 99.1, 60_000, [])}
    for e in evals.values():
        ev.cache[e.plan] = e
    chosen = least_smem(list(evals.values()), 99.0, 0.0025)
    assert chosen is evals["D"]                      # 0.1% slower than C, 20 KB less
    cmp = compare(ev, chosen, {"no_ksplit": Family(evals["C"], ev), "no_k_tiling": Family(evals["B"], ev)}, 0.0025)
    ns, nt = cmp["no_ksplit"], cmp["no_k_tiling"]
    assert ns["best_us"] == 99.0 and ns["peak_smem"] == 80_000
    assert ns["iso_time"]["peak_smem"] == 60_000 and ns["iso_time"]["cut_pct"] == 25.0
    assert ns["at_chosen_time"]["cut_pct"] == 25.0
    assert nt["best_us"] == 100.1 and nt["peak_smem"] == 90_000 and not nt["reaches_chosen_time"]
    assert nt["iso_time"]["peak_smem"] == 50_000 and nt["iso_time"]["cut_pct"] == pytest.approx(44.44)



def test_trim_at_references_targets_each_family_reference_time(monkeypatch):
    """The iso-time trim starts from the chosen plan and aims at each family's reference time (its
    least-smem plan at its best time), over that family's plans only; a family with no plan is skipped."""
    from trtllm_mk.search import smemref
    from trtllm_mk.search.planeval import Evaluator, PlanEval
    spec = spec_of("tiny-llama")
    ev = Evaluator(spec, 1, L20, Calibration(), 92, 512, 0)
    split = TilePlan(o_ksplit=2, down_ksplit=2, stages=8, slot_bytes=4096)
    pieces = TilePlan(o_ksplit=1, down_ksplit=1, stages=12, slot_bytes=4096)
    smaller = replace(pieces, stages=10)
    evals = [PlanEval(split, 99.0, 60_000, []), PlanEval(pieces, 100.0, 80_000, []),
             PlanEval(smaller, 100.2, 70_000, [])]
    for e in evals:
        ev.cache[e.plan] = e
    calls = []
    monkeypatch.setattr(smemref, "trim", lambda ev_, start, target, tol, limit, tick=None:
                        calls.append((start, target, tol, limit - ev_.work)))
    smemref.trim_at_references(ev, evals[0], {"no_ksplit": smemref.Family(evals[1], ev), "no_k_tiling": None},
                               500.0, 0.0025)
    # the reference is the 70 KB plan at 100.2 us (within 0.25% of the family's best 100.0 us)
    assert calls == [(split, 100.2, 0.0025, 500.0)]


def test_no_k_tiling_family_is_searched_without_the_limit_when_nothing_fits():
    """Qwen3-8B on an L20: a 16-row block of whole DOWN rows is 384 KB, so no K-tile-free plan fits
    99 KB. The family is searched in its own evaluator with the limit lifted; its plans keep every row
    in one slot, need more than the limit, and their work counts in the search's budget."""
    from trtllm_mk.search.planeval import Evaluator
    from trtllm_mk.search.plans import initial_plan, valid
    from trtllm_mk.search.smemref import FAMILIES, compare, search_families
    from trtllm_mk.smem import geometries
    spec = spec_of("qwen3-8b")
    cal = Calibration().resolved(L20)
    ev = Evaluator(spec, 1, L20, cal, L20.sm_count, 512, 0)
    start = ev(initial_plan(spec, 1, L20, L20.sm_count, 512))
    work0 = ev.work
    fams = search_families(ev, start.plan, 20_000, 0.0025)
    nt, ns = fams["no_k_tiling"], fams["no_ksplit"]
    assert not ns.over_limit and ns.ev is ev and valid(ns.best.plan, spec, 1, L20)
    assert nt.over_limit and nt.ev is not ev and not nt.ev.cache.keys() & ev.cache.keys()
    assert nt.pool(FAMILIES["no_k_tiling"])
    for e in nt.pool(FAMILIES["no_k_tiling"]):
        assert all(g.pieces == 1 for g in geometries(spec, e.plan).values())
        assert e.peak_smem > L20.smem_per_block_optin and not valid(e.plan, spec, 1, L20)
    assert ev.work >= work0 + nt.ev.work
    cmp = compare(ev, start, fams, 0.0025)
    assert cmp["no_k_tiling"]["exists"] and not cmp["no_k_tiling"]["fits"] and cmp["no_ksplit"]["fits"]
    assert cmp["no_k_tiling"]["peak_smem"] > cmp["limit"] == L20.smem_per_block_optin


def test_wide_ring_start_has_the_smallest_activations_and_the_largest_ring():
    from trtllm_mk.search.plans import ksplit_candidates, ring_candidates, wide_ring_plan
    from trtllm_mk.smem import plan_smem
    h100 = get_gpu("H100-SXM")
    spec = spec_of("llama-3.2-1b")
    p = wide_ring_plan(spec, 4, h100, h100.sm_count, 8192)
    o_ks, d_ks = ksplit_candidates(spec)
    assert (p.o_ksplit, p.down_ksplit) == (max(o_ks), max(d_ks)) and fits(h100, spec, 4, p)
    ring = p.stages * p.slot_bytes
    assert ring == max(q.stages * q.slot_bytes for q in ring_candidates(p, spec, 4, h100))
    assert plan_smem(spec, 4, p).peak <= h100.smem_per_block_optin


def test_search_descends_from_the_wide_ring_start_too():
    """Llama-3.2-1B, batch 4, context 8192 on H100: attention chunks exceed the initial plan's small
    ring, and the descent from the initial plan stalls far behind the wide-ring start (under the
    shipped calibration); the search keeps the better of the two descents."""
    from trtllm_mk.search.planeval import Evaluator
    from trtllm_mk.search.plans import initial_plan, wide_ring_plan
    h100 = get_gpu("H100-SXM")
    spec = spec_of("llama-3.2-1b")
    cal = load_calibration(h100)
    sched, stats = search(spec, 4, h100, context_len=8192, budget_s=4.0, seed=0, calibration=cal)
    ev = Evaluator(spec, 4, h100, cal.resolved(h100), h100.sm_count, 8192, 0)
    wide = ev(wide_ring_plan(spec, 4, h100, h100.sm_count, 8192)).step_us
    init = ev(initial_plan(spec, 4, h100, h100.sm_count, 8192)).step_us
    assert stats.list_schedule_us <= wide * (1 + 1e-9) < init

def test_slot_size_limit_of_the_calibration_bounds_every_start_and_the_search():
    """max_slot_bytes (a measured limit: H100's 64 KB slots were slower than 32 KB ones) keeps larger
    slots out of the initial plan, the wide-ring start and the searched plan; without it the same
    search may use them."""
    from trtllm_mk.search.plans import SLOT_SIZES, initial_plan, wide_ring_plan
    spec = spec_of("llama-3.2-1b")
    cal = replace(Calibration(), max_slot_bytes=8192)
    slots = cal.slot_sizes(SLOT_SIZES)
    assert slots and max(slots) == 8192 and Calibration().slot_sizes(SLOT_SIZES) == SLOT_SIZES
    assert initial_plan(spec, 1, H100, H100.sm_count, 512, slots).slot_bytes <= 8192
    assert wide_ring_plan(spec, 1, H100, H100.sm_count, 512, slots).slot_bytes <= 8192
    assert wide_ring_plan(spec, 1, H100, H100.sm_count, 512).slot_bytes > 8192
    sched, _ = search(spec, 1, H100, context_len=512, budget_s=1.0, seed=0, calibration=cal)
    assert sched.plan.slot_bytes <= 8192


def test_descent_sweeps_the_ring_first():
    """With budget for one field only, the descent has tried every ring of its start plan and nothing
    else (the ring decides what the other fields may take; swept last, it went untried)."""
    from trtllm_mk.search.planeval import Evaluator, descend
    from trtllm_mk.search.plans import initial_plan, ring_candidates
    spec = spec_of("llama-3.2-1b")
    cal = Calibration().resolved(H100)
    ev = Evaluator(spec, 1, H100, cal, H100.sm_count, 512, 0)
    start = initial_plan(spec, 1, H100, H100.sm_count, 512)
    rings = ring_candidates(start, spec, 1, H100)
    ev(start)
    descend(ev, start, ev.work + sum(ev.work_of(ev.graph(p)) for p in rings if p != start) - 1.0)
    tried = set(ev.cache)
    assert tried == {start, *rings}


def test_oproj_merge_is_searched_and_drops_the_combine_level():
    """o_merge is a field of the descent; with it the graph has no COMBINE tasks, and the model
    prices OPROJ's staging of the partials (S x the bytes of attn_out) instead."""
    from trtllm_mk.search.planeval import FIELDS, Evaluator, field_variants
    spec = spec_of("llama-3.2-1b")
    cal = Calibration().resolved(H100)
    ev = Evaluator(spec, 1, H100, cal, H100.sm_count, 512, 0)
    plan = TilePlan(qkv_rows=24, o_rows=128, o_ksplit=8, gateup_rows=64, down_rows=128, down_ksplit=8,
                    lm_rows=976, stages=6, slot_bytes=32768)
    assert "o_merge" in FIELDS
    assert {p.o_merge for p in field_variants("o_merge", plan, ev)} == {False, True}
    combine, merged = (build_step_graph(spec, 1, replace(plan, o_merge=m), 512) for m in (False, True))
    kinds = [{t.kind for t in g.layer} for g in (combine, merged)]
    assert Kind.COMBINE in kinds[0] and Kind.COMBINE not in kinds[1]
    o_c, o_m = ([t for t in g.layer if t.kind == Kind.OPROJ][0] for g in (combine, merged))
    assert o_m.act_bytes - o_m.rows * 8 == plan.attn_splits * (o_c.act_bytes - o_c.rows * 8) * (64 + 2) // 64
    assert ev(replace(plan, o_merge=True)).step_us < ev(plan).step_us


def test_attn_split_variants_trade_splits_for_row_tiles():
    """The descent's attn_splits variants include fewer splits over more batch-row tiles (and the
    reverse) at the same ATTN task count, which neither field reaches alone: at 8B batch 4, context 8192
    on an H200 the model ranks 8 splits x 2 row tiles ahead of 16 splits over all rows, while 8 splits
    over all rows (half the tasks) and 16 splits x 2 row tiles (twice as many) each rank behind."""
    from trtllm_mk.search.planeval import Evaluator, field_variants
    from trtllm_mk.search.plans import attn_tasks_per_group
    spec, h200 = spec_of("llama-3.1-8b"), get_gpu("H200")
    ev = Evaluator(spec, 4, h200, load_calibration(h200).resolved(h200), h200.sm_count, 8192, 0)
    plan = TilePlan(qkv_rows=16, o_rows=256, o_ksplit=8, o_merge=True, gateup_rows=112, down_rows=224, down_ksplit=7,
                    lm_rows=976, stages=5, slot_bytes=32768, attn_splits=16, attn_rows=0)
    variants = field_variants("attn_splits", plan, ev)
    traded = replace(plan, attn_splits=8, attn_rows=2)
    assert traded in variants
    assert all(attn_tasks_per_group(v, 4) == 16 for v in variants if v.attn_rows != plan.attn_rows)
    assert ev(traded).step_us < ev(plan).step_us
    assert ev(replace(plan, attn_splits=8)).step_us > ev(traded).step_us
    assert ev(replace(plan, attn_rows=2)).step_us > ev(traded).step_us


def test_oproj_row_variants_move_the_qkv_tiles_too():
    """The descent's o_rows variants include each OPROJ tile size with every other QKV tile size: the
    chain's two GEMV kinds share the SMs the list scheduler hands them, and at Qwen3-30B-A3B batch 4 on an
    H200 the model ranks 40-row QKV with 72-row OPROJ tiles ahead of 24 / 40, while each single move
    (40 / 40, 24 / 72) ranks behind it: one coordinate at a time, the descent would stop at 24 / 40."""
    from trtllm_mk.search.planeval import Evaluator, field_variants
    spec, h200 = spec_of("qwen3-30b-a3b"), get_gpu("H200")
    # the H200 constants this ranking was found under (before the polled QKV -> ATTN edge, poll_us)
    cal = replace(load_calibration(h200), poll_us=0.0).resolved(h200)
    ev = Evaluator(spec, 4, h200, cal, h200.sm_count, 512, 0)
    plan = TilePlan(qkv_rows=24, o_rows=40, o_ksplit=4, o_merge=True, gateup_rows=192, down_rows=64, lm_rows=1152,
                    stages=5, slot_bytes=32768, attn_splits=2, attn_rows=1, expert_fused=True, expert_inflight=2)
    pair = replace(plan, qkv_rows=40, o_rows=72)
    assert pair in field_variants("o_rows", plan, ev)
    assert ev(pair).step_us < ev(plan).step_us
    assert ev(replace(plan, qkv_rows=40)).step_us > ev(plan).step_us
    assert ev(replace(plan, o_rows=72)).step_us > ev(plan).step_us


def test_ring_variants_move_the_down_ksplit_too():
    """For quantized weights the descent's ring variants at another slot size include each of DOWN's
    K-splits: which K-chunk's packed rows fill a slot whole depends on the slot size. For the 4-bit Llama-3.1-8B at batch 1 on an H200
    (32 and 48 KB slots allowed) the model ranks 4 x 48 KB with 224-row, 7-way split DOWN tiles ahead of
    6 x 32 KB with 64-row, 2-way ones and ahead of each single move: one coordinate at a time, the
    descent stopped short of it (at 32 KB, measured 10% slower, benchmarks/NOTES.md v33)."""
    from benchmarks.w4a16_weights import w4a16_spec
    from trtllm_mk.search.planeval import Evaluator, field_variants
    from trtllm_mk.search.plans import SLOT_SIZES
    spec, h200 = w4a16_spec(spec_of("llama-3.1-8b"), 128), get_gpu("H200")
    cal = load_calibration(h200).resolved(h200)
    ev = Evaluator(spec, 1, h200, cal, h200.sm_count, 512, 0, slot_sizes=cal.slot_sizes(SLOT_SIZES, quantized=True))
    plan = TilePlan(qkv_rows=48, o_rows=256, o_ksplit=8, o_merge=True, gateup_rows=112, down_rows=64, down_ksplit=2,
                    lm_rows=976, stages=6, slot_bytes=32768, attn_splits=8, inflight_slots=4, inflight_chain=4)
    pair = replace(plan, stages=4, slot_bytes=49152, down_rows=224, down_ksplit=7)
    assert pair in field_variants("ring", plan, ev)
    assert ev(pair).step_us < ev(plan).step_us
    assert ev(replace(plan, stages=4, slot_bytes=49152)).step_us > ev(pair).step_us
    assert ev(replace(plan, down_rows=224, down_ksplit=7)).step_us > ev(plan).step_us


def test_norm_staging_reads_the_residual_at_its_device_width():
    """QKV, GATEUP and the LM head stage x, the 8-byte fixed-point residual, and under the fused expert
    plan QKV and the LM head also the experts' sum beside it: their staged bytes count 8 bytes an element."""
    from trtllm_mk.residual import RESIDUAL_BYTES
    assert RESIDUAL_BYTES == 8
    spec, H = spec_of("llama-3.2-1b"), 2048
    g = build_step_graph(spec, 4, TilePlan(qkv_rows=24, o_rows=128, gateup_rows=64, down_rows=128, lm_rows=976), 512)
    for t in g.layer + g.tail:
        if t.kind in (Kind.QKV, Kind.GATEUP, Kind.LMHEAD):
            assert t.act_bytes == 4 * (H * 8 + t.rows * 4)
    moe = spec_of("qwen3-30b-a3b")
    g = build_step_graph(moe, 1, TilePlan(qkv_rows=40, o_rows=72, o_ksplit=4, gateup_rows=48, lm_rows=1152,
                                          expert_fused=True, expert_inflight=2), 512)
    for t in g.layer + g.tail:
        if t.kind in (Kind.QKV, Kind.LMHEAD):
            assert t.act_bytes == 2 * moe.hidden_size * 8 + t.rows * 4


def test_norm_staging_reads_x_at_its_own_rate():
    """The RMSNorm kinds read x at norm_stage_bw_factor x the SM's HBM share (0: l2_bw_factor, as every
    other activation); OPROJ and DOWN, which stage L2-resident slices, keep l2_bw_factor."""
    from trtllm_mk.search.cost import cost_table
    spec = spec_of("llama-3.2-1b")
    g = build_step_graph(spec, 4, TilePlan(qkv_rows=24, o_rows=128, gateup_rows=64, down_rows=128, lm_rows=976), 512)
    base = Calibration(l2_bw_factor=3.0)

    def stages(cal):
        ct = cost_table(g, H100, cal)
        return {t.kind: (c.stage, t.act_bytes, ct.rates) for t, c in zip(g.layer, ct.layer)}

    same, slow = stages(base), stages(replace(base, norm_stage_bw_factor=1.0))
    for k in (Kind.QKV, Kind.GATEUP):
        stage, act, rates = slow[k]
        assert rates.norm == pytest.approx(rates.hbm) and same[k][2].norm == pytest.approx(same[k][2].l2)
        assert stage - same[k][0] == pytest.approx(act / rates.hbm - act / rates.l2)
    for k in (Kind.OPROJ, Kind.DOWN):
        assert slow[k][0] == pytest.approx(same[k][0])


def test_attention_fixed_part_grows_with_the_groups_width():
    """ATTN's fixed part stages a KV group's q, k and v and merges its q heads across the warps:
    attn_fixed_us is given for a group of 4 q heads of 128 (Llama-3.1-8B's) and scales with the group's
    (q heads + 2) x head_dim, so Qwen3-30B-A3B's 8 heads of 128 pay 10 / 6 of it, Llama-3.2-1B's 4 of
    64 half."""
    from trtllm_mk.search.cost import cost_table

    def fixed(model):
        spec = spec_of(model)
        g = build_step_graph(spec, 1, TilePlan(slot_bytes=32768, attn_splits=8, stages=5), 512)
        durs = [next(c.dur for t, c in zip(g.layer, cost_table(g, H100, Calibration(attn_fixed_us=a)).layer)
                     if t.kind == Kind.ATTN) for a in (0.0, 1.0)]
        return durs[1] - durs[0]

    assert fixed("llama-3.1-8b") == pytest.approx(1.0)
    assert fixed("qwen3-30b-a3b") == pytest.approx(10 / 6)
    assert fixed("llama-3.2-1b") == pytest.approx(0.5)


def test_emlp_staging_pays_the_consumers_routing():
    """An EMLP task's consumers route the rows from the chain's logits before they stage x: its staging
    costs emlp_route_us more, the split expert kinds' (EGATEUP, which ROUTE routed for) nothing more."""
    from trtllm_mk.search.cost import cost_table
    spec = spec_of("qwen3-30b-a3b")

    def stage(kind, fused, route):
        g = build_step_graph(spec, 1, TilePlan(gateup_rows=48, expert_fused=fused, expert_inflight=2 if fused else 0), 512)
        ct = cost_table(g, H100, Calibration(emlp_route_us=route))
        return next(c.stage for t, c in zip(g.layer, ct.layer) if t.kind == kind)

    assert stage(Kind.EMLP, True, 2.5) == pytest.approx(stage(Kind.EMLP, True, 0.0) + 2.5)
    assert stage(Kind.EGATEUP, False, 2.5) == pytest.approx(stage(Kind.EGATEUP, False, 0.0))


def test_merge_cost_counts_the_load_rounds_of_each_consumer_thread():
    """A merge of the split partials (COMBINE, OPROJ under o_merge) costs per split, times the rounds
    of loads on a consumer thread's path: a thread loads the partials of 32 // splits elements together
    (combine.cuh merge_heads), so 70B TP4 OPROJ chunks (1024 elements over 256 threads, 8 splits) are
    one round where merging element by element took four. A round after the first also waits an L2
    round trip: its loads follow the merge before them."""
    from trtllm_mk.search.cost import merge_cost
    cal = Calibration(merge_split_us=0.1, l2_latency_us=0.5)
    assert merge_cost(8, 256, 8, cal) == pytest.approx(0.8)
    assert merge_cost(8, 1024, 8, cal) == pytest.approx(0.8)          # four elements a thread, one round
    assert merge_cost(8, 4096, 8, cal) == pytest.approx(3.2 + 1.5)    # sixteen: four rounds
    assert merge_cost(16, 257, 8, cal) == pytest.approx(1.6)          # two a thread, two at once
    assert merge_cost(16, 1024, 8, cal) == pytest.approx(3.2 + 0.5)
    assert merge_cost(64, 256, 8, cal) == pytest.approx(6.4)          # more splits than 32: one at a time
    assert merge_cost(8, 1024, 4, cal) == pytest.approx(1.6 + 0.5)    # fewer consumer warps


def test_oproj_chunks_of_one_merge_round_rank_ahead_at_8b_batch_4_long_context():
    """Llama-3.1-8B at batch 4, context 8192, 4 KV splits: OPROJ tasks of 1024 columns merge 4096
    attention outputs, two load rounds a consumer thread, where 512-column tasks take one; on the
    H200 the one-round chunks measure faster (benchmarks/NOTES.md, v27) although their 1 KB row
    copies stream slower, and the model ranks them so."""
    from trtllm_mk.model.registry import resolve_model
    from trtllm_mk.search.planeval import Evaluator
    spec = resolve_model("llama-3.1-8b").spec
    gpu = get_gpu("H200")
    ev = Evaluator(spec, 4, gpu, load_calibration(gpu), gpu.sm_count, 8192, seed=0)
    base = TilePlan(qkv_rows=16, o_rows=128, o_ksplit=4, gateup_rows=112, down_rows=224, down_ksplit=7, lm_rows=976,
                    attn_splits=4, attn_rows=1, o_merge=True, stages=5, slot_bytes=32768)
    assert ev(replace(base, o_rows=256, o_ksplit=8)).step_us < ev(base).step_us


def test_partial_slot_groups_cost_whole_slots_on_the_consumer():
    """A GEMV task whose rows leave its last slot group part-empty: the loader copies only its rows
    (fewer bytes per slot through the ring), the consumers reduce whole 16-row blocks (the same math
    time as the full group)."""
    from trtllm_mk.smem import slot_geometry
    spec = spec_of("llama-3.2-1b")
    g = build_step_graph(spec, 1, TilePlan(qkv_rows=24, stages=4, slot_bytes=32768), 512)
    cal = Calibration().resolved(H100)
    rates = sm_rates(H100, cal, 1)
    qkv = [t for t in g.layer if t.kind == Kind.QKV]
    part = next(t for t in qkv if t.rows == 24)
    full = replace(part, r1=part.r0 + 32, weight_bytes=part.weight_bytes // 24 * 32)   # two whole groups
    geo = slot_geometry(part.k1 - part.k0, 1, 32768, 8)
    assert geo.out_rows == 16 and geo.slots_for(24) == geo.slots_for(32)
    cp, cf = task_cost(part, g, rates, cal), task_cost(full, g, rates, cal)
    assert cp.comp == pytest.approx(cf.comp)
    assert cp.fill == pytest.approx(part.weight_bytes / geo.slots_for(24)) and cp.fill < cf.fill == geo.fill_bytes
    assert cp.ring < cf.ring


SHIPPED = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED or [None], ids=[p.stem for p in SHIPPED] or ["none"])
def test_search_beats_naive_on_shipped_configs(path):
    if path is None:
        pytest.skip("no deployment YAMLs in configs/ yet")
    from trtllm_mk.config import load_config
    from trtllm_mk.search import search_deployment
    cfg = load_config(path)

    # the search's work budget counts simulated task instances, so an 80-layer model needs more of it
    # to move off the naive plan
    sched, stats = search_deployment(cfg, budget_s=3.0 if cfg.model_spec.num_layers <= 40 else 10.0)
    assert stats.predicted_us < stats.naive_us, path.name
    assert fits(cfg.gpu_spec, cfg.rank_spec, cfg.max_batch_size, sched.plan)   # one GPU's share


# ------------------------------------------------------------------------------ report
def test_report_files(tiny_search, tmp_path):
    spec, (sched, stats) = tiny_search
    rep = write_report(tmp_path, sched, stats)
    body = json.loads((tmp_path / "report.json").read_text())
    assert body == json.loads(json.dumps(rep))
    assert body["predicted_step_us"] == pytest.approx(sched.predicted_step_us, abs=0.01)
    assert 0 < body["bandwidth_utilization"] <= 1.0
    assert body["naive_step_us"] == pytest.approx(stats.naive_us)
    sm = body["smem"]
    assert sm["chosen"]["peak"] <= sm["limit"]
    assert set(sm["chosen"]["per_kind"]) >= {"QKV", "ATTN", "OPROJ", "GATEUP", "DOWN", "LMHEAD"}
    assert sm["same_plan_without_ksplit"]["o_ksplit"] == sm["same_plan_without_ksplit"]["down_ksplit"] == 1
    md = (tmp_path / "report.md").read_text()
    assert "predicted per-token latency" in md and "What K-splitting saves" in md and "gantt.png" in md
    png = (tmp_path / "gantt.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_report_draws_a_kind_without_a_colour(tiny_search, tmp_path, monkeypatch):
    """A kind missing from KIND_COLORS gets a default colour: the Gantt chart still draws."""
    from trtllm_mk import report
    spec, (sched, stats) = tiny_search
    monkeypatch.delitem(report.KIND_COLORS, Kind.QKV)
    write_report(tmp_path, sched, stats)
    assert (tmp_path / "gantt.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report.kind_color(Kind.QKV).startswith("#") and report.kind_color(Kind.ATTN) == "#d62728"


def test_simulation_skips_staging_of_a_repeated_input():
    # two GEMVs of one kind, reduction range and waits on one SM: the second reuses the staged
    # activation (codegen emits stage = 0), so its consumer starts `stage` earlier; a different
    # reduction range must stage again. Ring larger than both tasks: the consumer alone sets the end.
    def gemv(i, k0):
        t = Task(Kind.GATEUP, LAYER, i, r0=8 * i, r1=8 * i + 8, k0=k0, k1=k0 + 64, weight_bytes=100)
        return t, TaskCost(True, weight=100.0, pre=1.0, comp=2.0, slot_t=0.5, fill=100.0, ring=400.0, rate=1000.0,
                           stage=0.6)
    (a, ca), (b, cb), (c, cc) = gemv(0, 0), gemv(1, 0), gemv(1, 64)
    assert b.reuses_staged_input(a) and not c.reuses_staged_input(a)
    assert not replace(b, waits=SIG).reuses_staged_input(a)
    assert not Task(Kind.ATTN, LAYER, 1).reuses_staged_input(Task(Kind.ATTN, LAYER, 0))
    progs = [SMProgram(layer=[0, 1])]
    reused = _hand([a, b], [ca, cb], progs, EV)
    staged = _hand([a, c], [ca, cc], progs, EV)
    # A: consumer 0 + pre 1 + comp 2 = 3; B: 3 + (1 - 0.6) + 2 = 5.4 against 3 + 1 + 2 = 6
    assert reused.end[1] == pytest.approx(5.4) and staged.end[1] == pytest.approx(6.0)


@pytest.mark.parametrize("batch", [1, 4])
def test_expert_tiles_are_proposed_in_waves_over_every_slot(batch):
    """A sparse layer's MLP tiles repeat for each of the step's expert slots: the row counts the search
    proposes fill the SMs with the tasks of all slots (one wave first), not with those of one expert;
    the router's few rows spread over many SMs."""
    from trtllm_mk.kinds.router import ROUTER_TASKS
    from trtllm_mk.model.registry import resolve_model
    from trtllm_mk.search.plans import field_candidates, initial_plan
    spec = resolve_model("qwen3-30b-a3b").spec
    slots, nsm = spec.moe_slots(batch), H100.sm_count
    assert slots == min(spec.num_experts, batch * spec.num_experts_per_tok)
    plan = initial_plan(spec, batch, H100, nsm, 512)
    for field, n, ks in (("gateup_rows", spec.moe_intermediate_size, 1), ("down_rows", spec.hidden_size, plan.down_ksplit)):
        rows = field_candidates(field, plan, spec, nsm, 512, batch)
        one_wave = slots * ks * -(-n // rows[0])
        assert nsm // 2 < one_wave <= nsm, (field, rows[0], one_wave)
    graph = build_step_graph(spec, batch, plan, 512)
    kinds = [t.kind for t in graph.layer]
    assert kinds.count(Kind.EGATEUP) == slots * -(-spec.moe_intermediate_size // plan.gateup_rows)
    assert kinds.count(Kind.ROUTER) == ROUTER_TASKS


def test_quantized_weights_take_their_own_slot_limit_and_slot_cost():
    """quant_max_slot_bytes bounds the slots of a quantized spec (max_slot_bytes still bounds bf16
    ones), and quant_slot_overhead_us is what a quantized GEMV task pays per slot: its consumer time
    grows by exactly slots x the difference, while a bf16 task's does not move."""
    from trtllm_mk.search.plans import SLOT_SIZES
    from trtllm_mk.smem import slot_geometry
    cal = replace(Calibration(), max_slot_bytes=32768, quant_max_slot_bytes=49152)
    assert max(cal.slot_sizes(SLOT_SIZES)) == 32768
    assert max(cal.slot_sizes(SLOT_SIZES, quantized=True)) == 49152
    assert max(replace(cal, quant_max_slot_bytes=0).slot_sizes(SLOT_SIZES, quantized=True)) == 32768
    bf16 = spec_of("llama-3.2-1b")
    w4 = replace(bf16, weight_bits=4, weight_group=128)
    plan = TilePlan(stages=4, slot_bytes=49152)
    for spec, quantized in ((w4, True), (bf16, False)):
        g = build_step_graph(spec, 1, plan, 512)
        task = next(t for t in g.layer if t.kind == Kind.GATEUP)
        low = replace(Calibration(), quant_slot_overhead_us=0.05).resolved(H100)
        high = replace(low, quant_slot_overhead_us=0.45)
        rates = sm_rates(H100, low, 1)
        grow = task_cost(task, g, rates, high).comp - task_cost(task, g, rates, low).comp
        bits = 4 if quantized else 16
        geo = slot_geometry(task.k1 - task.k0, 2, plan.slot_bytes, plan.consumer_warps, bits,
                            128 if quantized else 0, g.dims.weight_tile if quantized else 0)
        assert grow == pytest.approx(0.4 * geo.slots_for(task.rows) if quantized else 0.0)


def test_quantized_gemv_tasks_take_their_own_fixed_cost():
    """quant_task_overhead_us replaces task_overhead_us in a quantized layer GEMV task's consumer
    time (0 keeps task_overhead_us); a bf16 task and the bf16 LM head of a quantized model keep
    task_overhead_us."""
    bf16 = spec_of("llama-3.2-1b")
    w4 = replace(bf16, weight_bits=4, weight_group=128)
    plan = TilePlan(stages=4, slot_bytes=32768)
    base = replace(Calibration(), task_overhead_us=2.0).resolved(H100)
    own = replace(base, quant_task_overhead_us=0.25)
    for spec, kind, quantized in ((w4, Kind.GATEUP, True), (w4, Kind.LMHEAD, False), (bf16, Kind.GATEUP, False)):
        g = build_step_graph(spec, 1, plan, 512)
        task = next(t for t in g.head + g.layer + g.tail if t.kind == kind)
        rates = sm_rates(H100, base, 1)
        drop = task_cost(task, g, rates, base).pre - task_cost(task, g, rates, own).pre
        assert drop == pytest.approx(1.75 if quantized else 0.0), (spec.weight_bits, kind)
    assert base.task_overhead(True) == base.task_overhead(False) == 2.0


def test_the_calibrations_slot_limits_bound_the_ring_unless_none_fits():
    """min_slot_bytes / max_slot_bytes bound the slots the search walks; where no ring of the allowed
    slots fits at all, the search falls back to the smaller slots instead of failing."""
    from trtllm_mk.search.plans import SLOT_SIZES
    cal = replace(Calibration(), min_slot_bytes=32768, max_slot_bytes=32768)
    assert cal.slot_sizes(SLOT_SIZES) == (32768,)
    assert cal.slot_sizes(SLOT_SIZES, with_min=False) == tuple(s for s in SLOT_SIZES if s <= 32768)
    spec = spec_of("tiny-llama")
    sch, _ = search(spec, 1, H100, context_len=64, budget_s=0.5, seed=0, calibration=cal)
    assert sch.plan.slot_bytes == 32768
    huge = replace(Calibration(), min_slot_bytes=1 << 20)   # no slot size reaches it
    sch, _ = search(spec, 1, H100, context_len=64, budget_s=0.5, seed=0, calibration=huge)
    assert sch.plan.slot_bytes in SLOT_SIZES


def test_schedule_cache_key_follows_python_and_device_sources(tmp_path, monkeypatch):
    """The cached schedules a benchmark reuses are keyed on everything that decides them: the search's
    Python and the device sources its spill checks compile (a shipped plan is the best one whose kernel
    does not spill), so editing either gives a new key."""
    from trtllm_mk.search import cached
    (tmp_path / "kinds").mkdir()
    (tmp_path / "search.py").write_text("x = 1\n")
    (tmp_path / "kinds" / "attn.cuh").write_text("// body\n")
    (tmp_path / "notes.txt").write_text("not a source\n")
    monkeypatch.setattr(cached, "PACKAGE", tmp_path)

    def key():
        return cached.schedule_key(spec_of("llama-3.2-1b"), 1, H100, 512, 1.0)

    k0 = key()
    assert key() == k0
    (tmp_path / "notes.txt").write_text("edited\n")
    assert key() == k0
    (tmp_path / "kinds" / "attn.cuh").write_text("// body, changed\n")
    k1 = key()
    assert k1 != k0
    (tmp_path / "search.py").write_text("x = 2\n")
    assert key() not in (k0, k1)
