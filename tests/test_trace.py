"""The trace reader (trtllm_mk/runtime/trace.py) on timelines whose answers are known: a simulated step
written in the kernel's trace format must give back the simulator's own constants."""
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from trtllm_mk.gpus import get_gpu
from trtllm_mk.graph import TilePlan, build_step_graph
from trtllm_mk.model.spec import load_spec
from trtllm_mk.runtime.trace import format_summary, plot_timeline, summarize
from trtllm_mk.search.calibration import Calibration
from trtllm_mk.search.naive import naive_schedule
from trtllm_mk.search.simulate import Simulator

MODELS = Path(__file__).resolve().parents[1] / "configs" / "models"
H100 = get_gpu("H100-SXM")
SYNC_US = 1.7          # an unusual value, so recovering it is no coincidence
ORIGIN_NS = 5_000_000_000


def simulated_trace(nsm: int = 6):
    """A tiny model's naive schedule, simulated, and its timeline in the kernel's trace layout:
    t0 = the SM's previous task end, t1 = t2 = start (after waits + sync), t3 = end (ns)."""
    spec = load_spec(MODELS / "tiny-llama.json")
    plan = TilePlan(qkv_rows=32, o_rows=32, gateup_rows=32, down_rows=32, lm_rows=64, attn_splits=2)
    graph = build_step_graph(spec, 1, plan, 64)
    sched = naive_schedule(spec, graph, H100, num_sms=nsm)
    cal = replace(Calibration(), sync_us=SYNC_US)
    sim = Simulator(graph, H100, cal)
    res = sim.run(sched.programs, record=True)
    seqs = sim.sequences(sched.programs)
    width = max(len(s) for s in seqs)
    tasks = np.zeros((nsm, width, 4), dtype=np.int64)
    for sm, seq in enumerate(seqs):
        prev = 0.0
        for n, u in enumerate(seq):
            st, en = res.start[u], res.end[u]
            tasks[sm, n] = [ORIGIN_NS + round(x * 1e3) for x in (prev, st, st, en)]
            prev = en
    per_sm = np.zeros((nsm, 4), dtype=np.int64)
    per_sm[:, 0] = 250                     # 0.25 us of ring-full time per SM
    return sched, res, tasks, per_sm


def test_summary_recovers_the_simulated_sync_latency_and_step():
    sched, res, tasks, per_sm = simulated_trace()
    s = summarize(sched, tasks, per_sm)
    assert s["tasks"] == sum(len(p.head) + sched.graph().num_layers * len(p.layer) + len(p.tail)
                             for p in sched.programs)
    assert s["step_us"] == pytest.approx(res.makespan_us, abs=5.1e-3)   # printed to 0.01 us
    lat = s["event_latency_us"]
    assert lat["waits"] > 10
    assert lat["median"] == pytest.approx(SYNC_US, abs=2e-3)
    assert lat["p10"] == pytest.approx(SYNC_US, abs=2e-3) and lat["p90"] == pytest.approx(SYNC_US, abs=2e-3)
    assert s["loader_ring_full_us"]["mean"] == pytest.approx(0.25, abs=0.05)
    # every task of every kind is counted once; staging is zero in this timeline (t2 = t1)
    assert sum(k["tasks"] for k in s["kinds"].values()) == s["tasks"]
    assert all(k["staging_us"] == 0 for k in s["kinds"].values())
    assert 0 < s["consumer_busy_frac"]["mean"] <= 1
    # layer period: the spacing of the layers' last task ends, as the simulator computed it
    assert s["layer_period_us"] == pytest.approx(float(np.mean(np.diff(res.layer_end))), abs=5.1e-3)  # printed to 0.01 us
    assert list(s["layer_phases"])[0] == "QKV" and all(v["end_us"] > v["start_us"] for v in s["layer_phases"].values())


def test_summary_sees_a_slower_signal(tmp_path):
    """Release every blocked waiter 0.5 us later (signals unchanged): the measured latency moves with it."""
    sched, res, tasks, per_sm = simulated_trace()
    blocked = tasks[:, :, 1] - tasks[:, :, 0] >= 50
    later = tasks.copy()
    later[:, :, 1] += np.where(blocked, 500, 0)
    s = summarize(sched, later, per_sm)
    assert s["event_latency_us"]["median"] == pytest.approx(SYNC_US + 0.5, abs=2e-3)
    text = format_summary(s)
    assert "event latency" in text and "| QKV |" in text
    plot_timeline(s, tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 1000


def test_full_trace_words_time_the_hand_off_and_the_publication():
    """The kernel's 11-word rows: events count from when the signaller published them (word 10), and
    the per-kind table splits the body into ring wait, stores + sync and the time to publish."""
    from trtllm_mk.runtime.trace import TRACE_WORDS
    sched, res, tasks, per_sm = simulated_trace()
    full = np.zeros(tasks.shape[:2] + (TRACE_WORDS,), dtype=np.int64)
    full[:, :, :4] = tasks
    used = tasks[:, :, 3] > 0
    full[:, :, 4] = np.where(used, 120, 0)                      # 0.12 us waiting for ring slots
    full[:, :, 8] = np.where(used, tasks[:, :, 3] - 300, 0)      # reduction done 0.3 us before the end
    full[:, :, 9] = np.where(used, tasks[:, :, 3] - 100, 0)      # handed off 0.1 us before the end
    full[:, :, 10] = np.where(used, tasks[:, :, 3] + 400, 0)     # published 0.4 us after the end
    s = summarize(sched, full, per_sm)
    # waiters were released SYNC_US after the consumer's end, i.e. SYNC_US - 0.4 after the publication
    assert s["event_latency_us"]["median"] == pytest.approx(SYNC_US - 0.4, abs=2e-3)
    k = s["kinds"]["ATTN"]
    assert k["mean_ring_wait_us"] == pytest.approx(0.12, abs=1e-3)
    assert k["mean_epilogue_us"] == pytest.approx(0.2, abs=1e-3)
    assert k["mean_signal_us"] == pytest.approx(0.5, abs=1e-3)
    # QKV's and DOWN's events after their bodies are polled (qkv_done: ATTN loads the tagged words;
    # resid_ready: the counted residual), so they publish nothing then: no time to publish, and the table
    # says so
    for kind in ("QKV", "DOWN"):
        assert "mean_signal_us" not in s["kinds"][kind]
        assert s["kinds"][kind]["mean_epilogue_us"] == pytest.approx(0.2, abs=1e-3)
    text = format_summary(s)
    assert "ring wait" in text and re.search(r"^\| QKV \|.*\| - \|", text, re.M)
