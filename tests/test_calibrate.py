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
    # with the fitted constants the cost model's ATTN / COMBINE times are the traced bodies
    cal = replace(Calibration(), **c).resolved(H100)
    g = build_step_graph(resolve_model("llama-3.2-1b").spec, 1, TilePlan.from_dict(summary["plan"]), 512)
    dur = {t.kind: c.dur for t, c in zip(g.layer, cost_table(g, H100, cal).layer)}
    assert dur[Kind.ATTN] == pytest.approx(9.0) and dur[Kind.COMBINE] == pytest.approx(4.0)


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
