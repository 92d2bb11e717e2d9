"""The benchmark harness on CPU: the static-cache baseline decoder against the reference decoder,
the transformers model of the hf-eager system, the timing statistics, and decode_latency --cpu-smoke."""
import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

# benchmarks/ is a top-level directory of the repository, not part of the installed package.
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import timing  # noqa: E402
from benchmarks.decode_latency import merge_reports, write_outputs  # noqa: E402
from benchmarks.baselines import StaticCacheDecoder, hf_model, prefilled_decoder  # noqa: E402
from trtllm_mk.kv_cache import PagedKVCache  # noqa: E402
from trtllm_mk.model.random_weights import random_weights  # noqa: E402
from trtllm_mk.model.spec import spec_from_hf_config  # noqa: E402
from trtllm_mk.model.tiny import tiny_config  # noqa: E402
from trtllm_mk.reference import ReferenceDecoder  # noqa: E402


def _tiny(family, seed=0):
    spec = spec_from_hf_config(tiny_config(family), name=f"tiny-{family}")
    return spec, random_weights(spec, "cpu", torch.float32, seed=seed)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("family,window", [("llama", None), ("mistral", None), ("mistral", 8), ("qwen2", None),
                                           ("qwen3", None)])
def test_static_cache_decoder_matches_reference(family, window):
    """A window of 8 (shorter than the prompt) checks the baseline's prefill and decode masks."""
    spec, w = _tiny(family, seed=3)
    spec = dataclasses.replace(spec, sliding_window=window)
    gen = torch.Generator().manual_seed(1)
    seq = torch.randint(0, spec.vocab_size, (2, 13), generator=gen)
    dec = StaticCacheDecoder(spec, w, max_batch=2, max_seq=32)
    ref = ReferenceDecoder(spec, w, compute_dtype=torch.float32)
    cache = PagedKVCache.allocate(spec, 2, 32, tokens_per_block=8, dtype=torch.float32, fill=1e4)
    with torch.no_grad():
        assert _rel(dec.prefill(seq[:, :9]), ref.prefill(seq[:, :9].tolist(), cache)) < 1e-4
        for t in range(9, 13):
            pos = torch.full((2,), t)
            assert _rel(dec.decode_step(seq[:, t], pos), ref.decode(seq[:, t], pos, cache)) < 1e-4
        # Rows at different positions: row 1 rewrites its position 5, so the slots it filled at 6..12
        # must be masked out (the reference rewrites and masks the same way).
        pos = torch.tensor([13, 5])
        tok = torch.tensor([7, 11])
        assert _rel(dec.decode_step(tok, pos), ref.decode(tok, pos, cache)) < 1e-4


def test_hf_model_of_the_hf_system_matches_reference():
    """hf-eager builds its transformers model from the spec (no checkpoint): same logits as ours."""
    spec, w = _tiny("llama", seed=5)  # llama: tied embeddings and llama3 rope scaling both matter
    ids = torch.randint(0, spec.vocab_size, (1, 11), generator=torch.Generator().manual_seed(2))
    cache = PagedKVCache.allocate(spec, 1, 16, tokens_per_block=8, dtype=torch.float32)
    with torch.no_grad():
        hf = hf_model(spec, w)(ids).logits[:, -1]
        ref = ReferenceDecoder(spec, w, compute_dtype=torch.float32).prefill(ids.tolist(), cache)
    assert _rel(hf, ref) < 1e-4


def test_decode_step_traces_as_one_graph():
    """fullgraph=True fails on any graph break: the step torch.compile and CUDA graphs need."""
    spec, w = _tiny("qwen3")
    with torch.no_grad():
        dec, tok, pos = prefilled_decoder(spec, w, 2, 20, torch.device("cpu"))
        want = dec.decode_step(tok, pos).clone()
        got = torch.compile(dec.decode_step, backend="eager", fullgraph=True, dynamic=False)(tok, pos)
    torch.testing.assert_close(got, want)


class _FakeClock:
    """perf_counter stand-in: the fake step advances it by the next duration of a list."""

    def __init__(self, durations_ms):
        self.now, self.durations, self.calls = 0.0, list(durations_ms), 0

    def perf_counter(self):
        return self.now

    def step(self):
        self.now += self.durations[self.calls] / 1e3
        self.calls += 1


def test_time_steps_times_each_step_after_warmup(monkeypatch):
    durations = [1000.0] * 3 + list(np.arange(1, 101, dtype=float))  # 3 slow warm-up steps, then 1..100 ms
    clock = _FakeClock(durations)
    monkeypatch.setattr(timing.time, "perf_counter", clock.perf_counter)
    s = timing.time_steps(clock.step, steps=100, warmup=3, device="cpu")
    assert clock.calls == 103 and s.steps == 100
    np.testing.assert_allclose(s.times_ms, np.arange(1, 101), rtol=1e-9)  # warm-up excluded
    assert s.p50 == pytest.approx(50.5) and s.avg == pytest.approx(50.5)
    assert s.p90 == pytest.approx(90.1) and s.p95 == pytest.approx(95.05) and s.p99 == pytest.approx(99.01)
    assert (s.min, s.max) == (pytest.approx(1.0), pytest.approx(100.0))
    assert "times_ms" not in s.to_dict() and len(s.to_dict(with_samples=True)["times_ms"]) == 100


def test_summarize_rejects_empty():
    with pytest.raises(ValueError):
        timing.summarize([])


PLUGIN = textwrap.dedent("""
    from benchmarks.baselines import SystemRun, register_system

    def fake(spec, weights, batch, context_len, device):
        return SystemRun(step=lambda: None, info={"predicted_step_us": 12.5, "context": context_len})

    def broken(spec, weights, batch, context_len, device):
        raise RuntimeError("kernel exploded")

    register_system("fake-mk", fake)
    register_system("broken", broken)
""")


def _run(args, tmp_path):
    env = {"PYTHONPATH": f"{REPO}:{tmp_path}", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    return subprocess.run([sys.executable, "-m", "benchmarks.decode_latency", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_cpu_smoke_writes_report_with_every_system(tmp_path):
    (tmp_path / "mk_plugin.py").write_text(PLUGIN)
    out = tmp_path / "out"
    r = _run(["--cpu-smoke", "--out", str(out), "--plugin", "mk_plugin"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads((out / "report.json").read_text())
    assert rep["gpu"] == "cpu" and rep["read_bandwidth"]["bytes_per_s"] > 0
    assert [c["name"] for c in rep["configs"]] == [f"tiny-llama/b{b}/ctx{c}" for b in (1, 2) for c in (16, 32)]
    for c in rep["configs"]:
        assert set(c["systems"]) == {"torch.compile", "eager+cudagraph", "hf-eager", "eager", "fake-mk", "broken"}
        assert c["ttft_ms"] > 0 and c["floor_ms"] > 0
        for name in ("eager", "hf-eager", "fake-mk"):
            r_ = c["systems"][name]
            assert r_["status"] == "ok", r_
            t = r_["tpot_ms"]
            assert t["min"] <= t["p50"] <= t["p90"] <= t["p95"] <= t["p99"] <= t["max"]
            assert r_["fraction_of_floor"] == pytest.approx(c["floor_ms"] / t["p50"])
            assert r_["tokens_per_sec_per_user"] == pytest.approx(1e3 / t["p50"])
        assert c["systems"]["fake-mk"]["info"] == {"predicted_step_us": 12.5, "context": c["context_len"]}
        broken = c["systems"]["broken"]
        assert broken["status"] == "error" and broken["error"] == "RuntimeError: kernel exploded"
        assert "CUDA" in c["systems"]["torch.compile"]["error"]
    # floor: weights once (tied embedding counted once) + the context's KV, at the measured bandwidth
    c = rep["configs"][-1]
    spec = spec_from_hf_config(tiny_config("llama"))
    kv = 2 * 32 * spec.kv_bytes_per_token(4)
    assert c["kv_bytes"] == kv and c["weight_bytes"] == spec.num_params() * 4
    assert c["floor_ms"] == pytest.approx((c["weight_bytes"] + kv) / rep["read_bandwidth"]["bytes_per_s"] * 1e3)
    md = (out / "report.md").read_text()
    assert "| tiny-llama | 2 | 32 | hf-eager |" in md and "broken: RuntimeError: kernel exploded" in md
    assert (out / "latency_vs_context.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_refuses_to_run_without_gpu(tmp_path):
    r = _run(["--out", str(tmp_path / "out")], tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "--cpu-smoke" in r.stderr
    assert not (tmp_path / "out").exists()


def _report(date, systems, configs):
    """A decode_latency report with the given {config name: {system: p50 ms or None (failed)}}."""
    def res(p50):
        if p50 is None:
            return {"status": "error", "error": "OutOfMemoryError: CUDA out of memory"}
        t = {k: p50 for k in ("avg", "p50", "p90", "p95", "p99", "min", "max")}
        return {"status": "ok", "tpot_ms": t, "tokens_per_sec_per_user": 1e3 / p50, "fraction_of_floor": 0.5 / p50}

    cfgs = []
    for name, by_system in configs.items():
        model, b, c = name.split("/")
        cfgs.append({"name": name, "model": model, "batch": int(b[1:]), "context_len": int(c[3:]), "floor_ms": 0.5,
                     "ttft_ms": 9.0, "systems": {s: res(v) for s, v in by_system.items()}})
    return {"schema": "trtllm_mk.decode_latency/1", "device": "NVIDIA H100 80GB HBM3", "gpu": "H100-SXM",
            "date": date, "torch_version": "x", "dtype": "bfloat16", "steps": 100, "warmup": 20,
            "read_bandwidth": {"bytes_per_s": 3.08e12, "method": "m"}, "systems": systems, "configs": cfgs}


def test_merge_reports_of_a_matrix_measured_in_parts(tmp_path):
    a = _report("d1", ["eager+cudagraph"], {"m/b1/ctx128": {"eager+cudagraph": 2.0},
                                            "m/b1/ctx512": {"eager+cudagraph": None}})
    b = _report("d2", ["torch.compile", "eager+cudagraph"], {"m/b1/ctx512": {"torch.compile": 1.4,
                                                                             "eager+cudagraph": 2.5}})
    m = merge_reports([a, b])
    assert m["systems"] == ["eager+cudagraph", "torch.compile"] and m["merged_dates"] == ["d1", "d2"]
    assert [c["name"] for c in m["configs"]] == ["m/b1/ctx128", "m/b1/ctx512"]
    assert m["configs"][1]["systems"]["eager+cudagraph"]["tpot_ms"]["p50"] == 2.5  # the later run wins
    assert a["configs"][1]["systems"]["eager+cudagraph"]["status"] == "error"     # inputs untouched
    write_outputs(m, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "| m | 1 | 512 | torch.compile | 1.400 |" in md and "## Failed" not in md
    with pytest.raises(Exception, match="different devices"):
        merge_reports([a, {**b, "device": "NVIDIA H200"}])


def test_report_lists_predicted_against_measured():
    from benchmarks.decode_latency import render_markdown
    r = _report("d", ["trtllm_mk megakernel", "torch.compile"],
                {"m/b1/ctx512": {"trtllm_mk megakernel": 1.25, "torch.compile": 1.5}})
    r["configs"][0]["systems"]["trtllm_mk megakernel"]["info"] = {"predicted_ms": 1.0}
    md = render_markdown(r)
    assert "## Predicted (cost model at search time) vs measured" in md
    assert "| m | 1 | 512 | trtllm_mk megakernel | 1.000 | 1.250 | -20.0% |" in md
    section = md[md.index("## Predicted"):]
    assert "torch.compile" not in section                  # systems without a prediction are not listed
