"""benchmarks/serve_load.py against a tiny ``--simulate`` server: the report of concurrent streaming
clients (every request done, exactly max_tokens tokens, TTFT within latency, ordered percentiles,
strict JSON), the server it starts and stops (also on Ctrl-C and SIGTERM, leaving no process behind),
a full queue reported as 429s with every slot free afterwards, and one-line errors for bad input.
Timings are measured, never asserted."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from serve_helpers import ROOT, checkpoint, engine_dir  # noqa: F401  (module fixtures)

pytest.importorskip("openai")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from benchmarks import serve_load  # noqa: E402
from trtllm_mk.errors import UserError  # noqa: E402

MODEL = "tiny"
STATS_ORDER = ("min", "p50", "p90", "p95", "p99", "max")


@pytest.fixture(scope="module")
def server(engine_dir, checkpoint):
    """A server in this process (a queue of one request beyond the 2 slots), for --url runs."""
    from trtllm_mk.runtime.hybrid import HybridEngine
    from trtllm_mk.serve.api import create_app
    eng = HybridEngine(engine_dir, weights=checkpoint, simulate=True)
    port = serve_load.free_port()
    srv = uvicorn.Server(uvicorn.Config(create_app(eng, MODEL, max_queue=1), host="127.0.0.1", port=port,
                                       log_level="error"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", eng
    srv.should_exit = True
    th.join(timeout=30)


def strict_json(path):
    def no_constant(name):
        raise AssertionError(f"{path} holds {name}")
    return json.loads(path.read_text(), parse_constant=no_constant)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def check_report(rep: dict, n: int, max_tokens: int) -> None:
    assert (rep["completed"], rep["failed"], rep["errors"]) == (n, 0, [])
    reqs = rep["requests"]
    assert sorted(r["index"] for r in reqs) == list(range(n))
    for r in reqs:
        assert r["ok"] and r["error"] is None and r["finish_reason"] == "length"
        assert r["output_tokens"] == max_tokens           # ignore_eos: exactly the budget
        assert 0 < r["ttft_ms"] <= r["latency_ms"]
        assert r["tpot_ms"] * (max_tokens - 1) == pytest.approx(r["latency_ms"] - r["ttft_ms"])
        assert r["prompt_tokens"] > 0 and r["start_s"] >= 0
    for key in ("ttft_ms", "tpot_ms", "latency_ms"):
        s = rep[key]
        assert s["n"] == n
        assert [s[k] for k in STATS_ORDER] == sorted(s[k] for k in STATS_ORDER)
        assert s["min"] <= s["avg"] <= s["max"]
    assert rep["ttft_ms"]["max"] <= rep["latency_ms"]["max"]
    assert rep["output_tokens"]["min"] == rep["output_tokens"]["max"] == max_tokens
    assert rep["total_output_tokens"] == n * max_tokens
    assert rep["output_throughput_tok_per_s"] == pytest.approx(n * max_tokens / rep["duration_s"])
    assert rep["request_throughput_req_per_s"] == pytest.approx(n / rep["duration_s"])
    after = rep["server_after_run"]
    assert after["busy_slots"] == 0 and after["waiting"] == 0     # no slot leaked


def test_four_clients_three_requests_each(engine_dir, checkpoint, tmp_path, capsys):
    out = tmp_path / "out"
    rc = serve_load.main(["--engine", str(engine_dir), "--weights", str(checkpoint), "--simulate",
                          "--num-prompts", "12", "--max-concurrency", "4", "--input-len", "8", "--max-tokens", "5",
                          "--compare-step-ms", "2.5", "--out", str(out), "--no-progress"])
    assert rc == 0
    rep = strict_json(out / "serve_load.json")
    check_report(rep, 12, 5)
    assert rep["prompt_tokens"]["min"] == rep["prompt_tokens"]["max"] == 8   # token-id prompts: exact length
    assert rep["config"]["max_concurrency"] == 4 and rep["config"]["request_rate"] == "inf"
    sc = rep["step_comparison"]
    assert sc["step_ms"] == 2.5 and sc["ratio"] == pytest.approx(rep["tpot_ms"]["p50"] / 2.5)
    assert sc["within_tolerance"] == (sc["ratio"] <= 1.1) and sc["batch1"] is False
    # the server it started is stopped and reaped, and its output is in the log
    assert gone(rep["server"]["pid"])
    assert "serving tiny (2 slots, CPU executor)" in (out / "server.log").read_text()
    md = (out / "serve_load.md").read_text()
    assert "| TTFT (ms) |" in md and "| TPOT (ms) |" in md and "12 done, 0 failed" in md
    printed = capsys.readouterr().out
    assert "TPOT (ms)" in printed and "served TPOT p50" in printed


def test_chat_at_a_request_rate_against_a_running_server(server, tmp_path):
    url = server[0]
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"step_ms": {"p50": 0.5}}))
    out = tmp_path / "out"
    rc = serve_load.main(["--url", url, "--api", "chat", "--num-prompts", "4", "--request-rate", "20",
                          "--max-concurrency", "1", "--input-len", "4", "--max-tokens", "3", "--temperature", "0.8",
                          "--compare-bench", str(bench), "--out", str(out), "--no-progress"])
    assert rc == 0
    rep = strict_json(out / "serve_load.json")
    check_report(rep, 4, 3)
    assert rep["server"] is None and not (out / "server.log").exists()
    assert rep["prompt_tokens"]["min"] >= 4          # the chat template adds its own tokens
    sc = rep["step_comparison"]
    assert sc["step_ms"] == 0.5 and sc["batch1"] is True and str(bench) in sc["step_source"]


def test_full_queue_is_reported_as_429_and_frees_every_slot(server, tmp_path):
    # 2 slots and a queue of 1: of 6 requests sent at once at least 3 are served, the rest refused
    out = tmp_path / "out"
    rc = serve_load.main(["--url", server[0], "--num-prompts", "6", "--input-len", "4", "--max-tokens", "40",
                          "--warmup", "0", "--out", str(out), "--no-progress"])
    rep = strict_json(out / "serve_load.json")
    assert rep["completed"] + rep["failed"] == 6 and rep["completed"] >= 3
    assert rc == (1 if rep["failed"] else 0)
    refused = [r for r in rep["requests"] if not r["ok"]]
    assert all(r["error"].startswith("HTTP 429") for r in refused)
    assert all(r["output_tokens"] == 40 for r in rep["requests"] if r["ok"])
    after = rep["server_after_run"]
    assert after["busy_slots"] == 0 and after["waiting"] == 0


def _ignore_sigint():   # what a shell does for a background job: the child starts with SIGINT ignored
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("sig,started_ignoring", [(signal.SIGINT, False), (signal.SIGTERM, False),
                                                  (signal.SIGINT, True)])
def test_interrupt_stops_the_server(engine_dir, checkpoint, tmp_path, sig, started_ignoring):
    p = subprocess.Popen([sys.executable, "-m", "benchmarks.serve_load", "--engine", str(engine_dir), "--weights",
                          str(checkpoint), "--simulate", "--num-prompts", "500", "--max-tokens", "100",
                          "--max-concurrency", "2", "--input-len", "4", "--out", str(tmp_path / "out"),
                          "--no-progress"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=_ignore_sigint if started_ignoring else None)
    pid = None
    try:
        for line in p.stdout:
            if line.startswith("starting the server (pid "):
                pid = int(line.split("(pid ")[1].split(")")[0])
            if line.startswith("serving "):   # healthy, requests about to go out
                break
        assert pid is not None, p.communicate(timeout=30)
        time.sleep(1.0)                       # requests in flight
        assert p.poll() is None
        p.send_signal(sig)
        _, err = p.communicate(timeout=90)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130 and "interrupted" in err
    assert gone(pid)


@pytest.mark.parametrize("argv,needle", [
    (["--engine", "/nonexistent/engine"], "no such directory"),
    (["--url", "http://127.0.0.1:1", "--simulate"], "use it with --engine"),
    (["--url", "127.0.0.1:8000"], "http://"),
    (["--url", "http://127.0.0.1:1", "--num-prompts", "0"], "--num-prompts must be >= 1"),
    (["--url", "http://127.0.0.1:1", "--max-concurrency", "0"], "--max-concurrency must be >= 1"),
    (["--url", "http://127.0.0.1:1", "--server-args", "'unclosed"], "--server-args"),
])
def test_bad_arguments(argv, needle, tmp_path):
    with pytest.raises(UserError, match=needle):
        serve_load.main(argv + ["--out", str(tmp_path / "out")])


def test_bad_input_against_a_server(server, tmp_path):
    args = ["--url", server[0], "--out", str(tmp_path / "out"), "--no-progress"]
    with pytest.raises(UserError, match="max_input_len=128"):
        serve_load.main(args + ["--input-len", "200"])
    with pytest.raises(UserError, match="max_model_len=256"):
        serve_load.main(args + ["--input-len", "100", "--max-tokens", "200"])
    with pytest.raises(UserError, match="--model gpt-9: the server serves tiny"):
        serve_load.main(args + ["--model", "gpt-9"])
    bad = tmp_path / "bench.json"
    bad.write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        serve_load.main(args + ["--compare-bench", str(bad)])


def test_unreachable_url_and_broken_engine_are_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "benchmarks.serve_load", "--url", f"http://127.0.0.1:"
                        f"{serve_load.free_port()}", "--server-timeout", "1", "--out", str(tmp_path / "a")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "did not answer" in r.stderr
    not_an_engine = tmp_path / "empty"
    not_an_engine.mkdir()
    r = subprocess.run([sys.executable, "-m", "benchmarks.serve_load", "--engine", str(not_an_engine), "--simulate",
                        "--out", str(tmp_path / "b")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "the server exited with code 2 before answering /health" in r.stderr
    assert (tmp_path / "b" / "server.log").is_file()


def test_dropped_non_streaming_client_frees_its_slot(server):
    # (test_serve.py drops streaming clients.) A client that gives up on a long non-streaming request
    # cancels it: its slot is free long before the request's 250 tokens would have been decoded.
    url, eng = server
    steps_before = len(eng.step_ms)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 250,
                                                  "ignore_eos": True}, timeout=1.0)
    deadline = time.monotonic() + 60
    while (h := httpx.get(url + "/health").json())["busy_slots"] or h["waiting"]:
        assert time.monotonic() < deadline, "the dropped request kept its slot"
        time.sleep(0.05)
    assert len(eng.step_ms) - steps_before < 200
