"""Calibration from a traced step (benchmarks/calibrate.py --from-trace): no GPU needed."""
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.calibrate import calibrate_from_traces, constants_from_trace  # noqa: E402
from trtllm_mk.gpus import get_gpu  # noqa: E402
from trtllm_mk.graph import Kind, TilePlan, build_step_graph  # noqa: E402
from trtllm_mk.model.registry import resolve_model  # noqa: E402
from trtllm_mk.search import Calibration, load_calibration  # noqa: E402
from trtllm_mk.search.cost import cost_table  # noqa: E402

STORED = ROOT / "benchmarks" / "results" / "h100_v3_trace" / "trace_llama-3.2-1b_b1.json"
H100 = get_gpu("H100-SXM")


@pytest.fixture()
def summary():
    s = json.loads(STORED.read_text())
    s["event_latency_us"]["median"] = 0.5
    s["kinds"]["OPROJ"]["mean_staging_us"] = 0.4
    s["kinds"]["DOWN"]["mean_staging_us"] = 0.8
    s["kinds"]["ATTN"]["mean_body_us"] = 9.0
    s["kinds"]["COMBINE"]["mean_body_us"] = 4.0
    return s


def test_constants_reproduce_the_traced_task_times(summary):
    c = constants_from_trace(summary, H100, Calibration())
    assert c["sync_us"] == 0.5 and c["l2_latency_us"] == pytest.approx(0.6)
    # with the fitted constants the cost model's ATTN time is the traced staging and body, COMBINE's its body
    cal = replace(Calibration(), **c).resolved(H100)
    g = build_step_graph(resolve_model("llama-3.2-1b").spec, 1, TilePlan.from_dict(summary["plan"]), 512)
    dur = {t.kind: c.dur for t, c in zip(g.layer, cost_table(g, H100, cal).layer)}
    assert dur[Kind.ATTN] == pytest.approx(summary["kinds"]["ATTN"]["mean_staging_us"] + 9.0)
    assert dur[Kind.COMBINE] == pytest.approx(4.0)


def test_from_trace_merges_into_the_calibration_file(summary, tmp_path, capsys):
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(summary))
    out = tmp_path / "cal"
    out.mkdir()
    (out / "H100-SXM.json").write_text(json.dumps({"launch_us": 0.9, "sync_us": 3.0}))
    assert calibrate_from_traces([str(trace)], out) == 0
    cal = load_calibration(H100, out)
    assert cal.launch_us == 0.9                 # kept
    assert cal.sync_us == 0.5 and cal.l2_latency_us == pytest.approx(0.6)
    assert "mean (written)" in capsys.readouterr().out
    # --fields writes only the constants named, and says so when the traces show none of them
    (out / "H100-SXM.json").write_text(json.dumps({"sync_us": 3.0}))
    assert calibrate_from_traces([str(trace)], out, ["l2_latency_us"]) == 0
    assert load_calibration(H100, out).sync_us == 3.0 and load_calibration(H100, out).l2_latency_us == pytest.approx(0.6)
    assert calibrate_from_traces([str(trace)], out, ["publish_us"]) == 2
    assert "none of publish_us can be read off these traces" in capsys.readouterr().err


V30 = ROOT / "benchmarks" / "results" / "h200_v30_2026-11-29" / "model_fit"


def test_publish_and_landing_come_from_the_streaming_kinds():
    """publish_us is the streaming kinds' mean hand-off -> published; landing_us their mean last copy ->
    reduction done less one slot's math (the model's slot_t of that kind); traces summarized before
    either was recorded give neither, and the other constants as before."""
    s = json.loads((V30 / "traces_o128" / "trace_llama-3.1-8b_b4.json").read_text())
    gpu = get_gpu("H200")
    cal = load_calibration(gpu)
    c = constants_from_trace(s, gpu, cal)
    k = s["kinds"]
    assert c["publish_us"] == pytest.approx((k["GATEUP"]["mean_signal_us"] + k["DOWN"]["mean_signal_us"]) / 2)
    g = build_step_graph(resolve_model(s["model"]).spec, s["batch"], TilePlan.from_dict(s["plan"]), s["context"])
    slot = {t.kind.name: ct.slot_t for t, ct in zip(g.layer, cost_table(g, gpu, cal.resolved(gpu)).layer)}
    assert c["landing_us"] == pytest.approx(sum(k[n]["mean_landing_us"] - slot[n] for n in ("GATEUP", "DOWN")) / 2)
    assert 0.0 < c["landing_us"] < k["GATEUP"]["mean_landing_us"]
    for n in k.values():
        del n["mean_landing_us"], n["mean_signal_us"]
    old = constants_from_trace(s, gpu, cal)
    assert "publish_us" not in old and "landing_us" not in old and old["sync_us"] == c["sync_us"]


def test_from_trace_rejects_an_unreadable_file(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert calibrate_from_traces([str(bad)], tmp_path) == 2
    assert "not a readable trace summary" in capsys.readouterr().err


def test_merge_split_cost_from_an_o_merge_trace(summary):
    """A plan whose OPROJ merges the partials has no COMBINE to read: its per-split merge cost is what
    OPROJ's staging takes beyond DOWN's plain slice, per split; DOWN alone gives the L2 round trip."""
    summary["plan"] = dict(summary["plan"], o_merge=True, o_ksplit=8, attn_splits=8)
    summary["kinds"]["OPROJ"]["mean_staging_us"] = 0.8 + 8 * 0.125
    del summary["kinds"]["COMBINE"]
    c = constants_from_trace(summary, H100, Calibration())
    assert "combine_fixed_us" not in c
    assert c["merge_split_us"] == pytest.approx(0.125)
    assert c["l2_latency_us"] == pytest.approx(0.8)


def test_merge_split_cost_leaves_out_the_later_merge_rounds_round_trips(summary):
    """Where a consumer thread merges its elements in two rounds (batch 4, 8 splits, 512-column OPROJ
    chunks: 2048 outputs over 256 threads, 4 at once), the second round's L2 round trip is not
    per-split time."""
    summary["plan"] = dict(summary["plan"], o_merge=True, o_ksplit=4, attn_splits=8)
    summary["batch"] = 4
    summary["kinds"]["OPROJ"]["mean_staging_us"] = 0.8 + 0.8 + 2 * 8 * 0.125
    del summary["kinds"]["COMBINE"]
    c = constants_from_trace(summary, H100, Calibration())
    assert c["merge_split_us"] == pytest.approx(0.125)


def test_a_sparse_models_trace_gives_the_constants_its_kinds_show():
    """A mixture-of-experts step (the stored H200 trace of Qwen3-30B-A3B) has EDOWN where a dense one
    has DOWN and no GATEUP: the L2 round trip and the merge cost come from EDOWN's plain staging, and
    no copy-issue time is read (EGATEUP's body waits on the routing and a cold ring, not on copies)."""
    s = json.loads((ROOT / "benchmarks" / "results" / "h200x2_v18_2026-11-28" / "call2" / "g1" / "trace"
                    / "trace_qwen3-30b-a3b_b1.json").read_text())
    assert "GATEUP" not in s["kinds"] and s["plan"]["o_merge"]
    c = constants_from_trace(s, get_gpu("H200"), Calibration())
    assert "copy_issue_us" not in c
    assert c["l2_latency_us"] == pytest.approx(s["kinds"]["EDOWN"]["mean_staging_us"])
    assert c["merge_split_us"] > 0 and c["sync_us"] == s["event_latency_us"]["median"]


def test_a_fused_expert_trace_gives_the_routing_of_its_staging():
    """Under the fused expert plan (EMLP) with merged partials no kind stages a plain slice, so the trace
    gives no L2 round trip and no merge cost; EMLP's staging beyond the model's read of its activation
    is the consumers' routing (emlp_route_us), which then makes the model's staging the traced one."""
    s = json.loads((ROOT / "benchmarks" / "results" / "h200_v39_2026-11-30" / "call1"
                    / "trace_qwen3-30b-a3b_b1.json").read_text())
    assert s["plan"]["expert_fused"] and s["plan"]["o_merge"]
    gpu = get_gpu("H200")
    cal = load_calibration(gpu)
    c = constants_from_trace(s, gpu, cal)
    assert "l2_latency_us" not in c and "merge_split_us" not in c and "combine_fixed_us" not in c
    assert c["emlp_route_us"] > 0
    g = build_step_graph(resolve_model("qwen3-30b-a3b").spec, 1, TilePlan.from_dict(
        {k: v for k, v in s["plan"].items() if k in TilePlan.__dataclass_fields__}), 512)
    ct = cost_table(g, gpu, replace(cal, emlp_route_us=c["emlp_route_us"]).resolved(gpu))
    stage = next(c.stage for t, c in zip(g.layer, ct.layer) if t.kind == Kind.EMLP)
    assert stage == pytest.approx(s["kinds"]["EMLP"]["mean_staging_us"])


# ------------------------------------------------------------------ link constants (tensor parallelism)

def _links_json(link, tp=4, sync_round=2.5, local_round=0.6, add_per_kb=0.2):
    """What benchmarks/micro/nvlink.cu writes, made from a known link."""
    from trtllm_mk.parallel import allreduce_cost as arc
    sizes = [1 << k for k in range(12, 25, 2)]
    return {"gpu": "NVIDIA H200", "tp": tp, "sms": 132, "sync_us": sync_round, "sync_all_sms_us": 2 * sync_round,
            "sync_one_gpu_sys_us": 0.9, "sync_one_gpu_us": local_round,
            "one_shot": [[n, arc.one_shot_us(n, tp, link)] for n in sizes],
            "two_shot": [[n, arc.two_shot_us(n, tp, link)] for n in sizes],
            "remote_add_one_sm": [[n, 1.5 + n / 1024 * (tp - 1) * add_per_kb] for n in (1024, 4096, 16384, 65536)],
            "remote_add_all_sms": [[n, 2.0 + n / 50e3] for n in (16384, 65536, 262144)]}


def test_link_constants_come_from_the_micro_benchmark(tmp_path, capsys):
    from benchmarks.calibrate import calibrate_from_links
    from trtllm_mk.parallel import allreduce_cost as arc
    h200 = get_gpu("H200")
    bw = load_calibration(h200).resolved(h200).read_bandwidth
    link = arc.LinkModel(sync_us=3.0, link_bandwidth=300e9, reduce_bandwidth=bw)
    src = tmp_path / "nvlink.json"
    src.write_text(json.dumps(_links_json(link)))
    out = tmp_path / "cal"
    out.mkdir()
    kept = {k: v for k, v in json.loads((ROOT / "trtllm_mk" / "data" / "calibration" / "H200.json").read_text()).items()
            if not k.startswith(("link_", "_link"))}
    (out / "H200.json").write_text(json.dumps(kept))
    before = load_calibration(h200, out)
    assert before.link_source == "" and not before.link().measured
    assert calibrate_from_links(str(src), out) == 0
    cal = load_calibration(h200, out)
    assert cal.link_sync_us == pytest.approx(2.5 - 0.6)          # the link's share of a cross-rank event
    assert cal.link_bandwidth == pytest.approx(300e9, rel=1e-3)  # the one-shot fit recovers the link
    assert cal.link_add_us_per_kb == pytest.approx(0.2)
    assert cal.sync_us == kept["sync_us"] and cal.link_source.endswith("calibrate.py --from-links)")
    assert cal.link().measured and cal.link().sync_us == cal.link_sync_us
    assert "link_sync_us" in capsys.readouterr().out
    # rounds measured under HBM traffic, where the file has them, are the ones that count
    src.write_text(json.dumps(dict(_links_json(link), sync_loaded_us=4.0, sync_one_gpu_loaded_us=1.5)))
    assert calibrate_from_links(str(src), out) == 0
    assert load_calibration(h200, out).link_sync_us == pytest.approx(2.5)


@pytest.mark.parametrize("broken, fragment", [
    ("{not json", "not a benchmarks/micro/nvlink.cu result"),
    (json.dumps({"gpu": "NVIDIA H200", "tp": 2}), "not a benchmarks/micro/nvlink.cu result"),
    (json.dumps(dict(_links_json(__import__("trtllm_mk.parallel.allreduce_cost", fromlist=["x"]).UNMEASURED),
                     sync_us=0.5, sync_one_gpu_us=0.6)), "is not slower than the one-GPU round"),
])
def test_a_bad_link_result_is_one_line(tmp_path, capsys, broken, fragment):
    from benchmarks.calibrate import calibrate_from_links
    src = tmp_path / "nvlink.json"
    src.write_text(broken)
    (tmp_path / "H200.json").write_text((ROOT / "trtllm_mk" / "data" / "calibration" / "H200.json").read_text())
    assert calibrate_from_links(str(src), tmp_path) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0]


def test_the_search_prices_cross_rank_events_and_remote_adds_with_the_link_constants():
    from trtllm_mk.parallel import rank_spec
    from trtllm_mk.search import predict, search
    from trtllm_mk.search.cost import remote_add_us
    h200 = get_gpu("H200")
    spec = rank_spec(resolve_model("llama-3.1-8b").spec, 2)
    sch, stats = search(spec, 1, h200, context_len=512, budget_s=1.0, seed=0)
    assert "; link: " in stats.calibration and "nvlink.cu" in stats.calibration   # the report says where from
    cal = load_calibration(h200).resolved(h200)
    slow = replace(cal, link_sync_us=cal.link_sync_us + 5.0)
    assert predict(sch, h200, slow).step_us > predict(sch, h200, cal).step_us + 5.0 * spec.num_layers
    g = sch.graph()
    adds = [t for t in g.layer if any(w.add and w.buf == "x" for w in t.writes)]
    assert {t.kind for t in adds} == {Kind.OPROJ, Kind.DOWN}
    for t in adds:
        x = sum(w.hi - w.lo for w in t.writes if w.buf == "x")
        assert remote_add_us(t, g.dims, cal) == pytest.approx(x * 8 / 1024 * cal.link_add_us_per_kb)
    one, one_stats = search(resolve_model("llama-3.2-1b").spec, 1, h200, context_len=512, budget_s=0.5, seed=0)
    assert all(remote_add_us(t, one.graph().dims, cal) == 0.0 for t in one.graph().layer)
    assert "link" not in one_stats.calibration


def test_a_measured_entry_naming_its_schedule_is_fitted_on_that_schedule(tmp_path, capsys):
    """``--from-measured``: an entry with ``"schedule"`` (a path beside the file) is predicted on the saved
    programs, not on its plan list-scheduled again."""
    from benchmarks.calibrate import calibrate_from_measured
    from trtllm_mk.search import predict, schedule_plan
    spec = resolve_model("tiny-llama").spec
    plan = TilePlan(qkv_rows=32, o_rows=32, gateup_rows=32, down_rows=32, lm_rows=64, attn_splits=2)
    listed = schedule_plan(spec, 1, H100, plan, 64)
    saved = schedule_plan(spec, 1, H100, plan, 64)
    # the layer tasks of the two busiest SMs on one of them (merged in template order): a schedule no
    # list scheduler gives
    a, b = sorted(range(len(saved.programs)), key=lambda i: -len(saved.programs[i].layer))[:2]
    saved.programs[a].layer = sorted(saved.programs[a].layer + saved.programs[b].layer)
    saved.programs[b].layer = []
    (tmp_path / "sched.json").write_text(saved.to_json())
    want, other = predict(saved, H100).step_us, predict(listed, H100).step_us
    assert abs(want - other) > 0.5
    entry = {"model": "tiny-llama", "batch": 1, "context": 64, "plan": plan.to_dict(), "measured_us": 1.1 * want,
             "gpu": "H100-SXM"}
    (tmp_path / "m.json").write_text(json.dumps([dict(entry, schedule="sched.json")]))
    out = tmp_path / "cal"
    out.mkdir()
    (out / "H100-SXM.json").write_text(json.dumps(json.loads((ROOT / "trtllm_mk" / "data" / "calibration" /
                                                              "H100-SXM.json").read_text())))
    assert calibrate_from_measured(str(tmp_path / "m.json"), out) == 0
    row = [l for l in capsys.readouterr().out.splitlines() if l.startswith("tiny-llama")][0].split()
    assert float(row[-3]) == pytest.approx(want, abs=0.06)      # "before": the saved programs' prediction
    assert float(row[-2]) == pytest.approx(1.1 * want, rel=0.01)   # the fit meets the measurement


def test_a_quantized_measurement_is_predicted_on_its_quantized_model():
    """``--from-measured`` entries name a model as decode_latency's report does: ``<model>:w4a16-g<group>``
    is the 4-bit model, whose plan is scheduled and predicted on 4-bit weights; an unknown format is a
    one-line error."""
    from benchmarks.calibrate import schedule_of
    from benchmarks.decode_latency import label_spec
    from trtllm_mk.errors import UserError
    from trtllm_mk.search import predict
    plan = TilePlan(qkv_rows=32, o_rows=32, gateup_rows=32, down_rows=32, lm_rows=64, attn_splits=2).to_dict()
    entry = {"batch": 1, "context": 64, "plan": plan, "measured_us": 100.0}
    cal = load_calibration(H100)
    w4 = schedule_of(dict(entry, model="tiny-llama:w4a16-g32"), H100, cal)
    bf16 = schedule_of(dict(entry, model="tiny-llama"), H100, cal)
    assert w4.spec.quantized and not bf16.spec.quantized
    assert w4.graph().weight_bytes() < bf16.graph().weight_bytes()
    dear = replace(cal, quant_slot_overhead_us=5.0)   # a quantized constant moves only the 4-bit prediction
    assert predict(w4, H100, dear).step_us > predict(w4, H100, cal).step_us + 1.0
    assert predict(bf16, H100, dear).step_us == predict(bf16, H100, cal).step_us
    with pytest.raises(UserError, match="w4a16-g<group>"):
        label_spec("tiny-llama:w3")
