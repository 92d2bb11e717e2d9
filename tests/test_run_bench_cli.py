"""``run`` and ``bench`` on a tiny engine with ``--simulate``: text, chat, sampling options, stop
strings and streaming in ``run``; the trtllm-bench fields of ``bench``'s report; one-line errors."""
import json
import subprocess
import sys

import pytest

from serve_helpers import tiny_checkpoint, tiny_engine


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    ck = tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))
    return tiny_engine(tmp_path_factory.mktemp("eng") / "tiny", ck, batch=2), ck


def cli(*args):
    return subprocess.run([sys.executable, "-m", "trtllm_mk", *args], capture_output=True, text=True, timeout=300)


def test_run_text_chat_sampling_stop_and_stream(built):
    eng, ck = built
    base = ["run", "--engine", str(eng), "--weights", str(ck), "--simulate", "--max-new-tokens", "8", "--ignore-eos"]
    greedy = cli(*base, "--prompt", "ba be ko", "--prompt", "mi")
    assert greedy.returncode == 0, greedy.stderr
    lines = greedy.stdout.splitlines()
    assert lines[0].startswith("[0] ") and lines[1].startswith("[1] ") and "finish: length, length" in lines[2]
    words = lines[0][4:].split(" ")
    assert len(words) == 8 and all(w.isalpha() for w in words)   # text, no special tokens, no ids
    streamed = cli(*base, "--prompt", "ba be ko", "--prompt", "mi", "--stream")
    assert streamed.returncode == 0 and streamed.stdout.splitlines()[:2] == lines[:2]
    stop = cli(*base, "--prompt", "ba be ko", "--stop", " ".join(words[3:5]))
    assert stop.returncode == 0 and stop.stdout.splitlines()[0] == "[0] " + " ".join(words[:3]) + " "
    assert "finish: stop" in stop.stdout
    # sampling options and the chat template (seeds are checked at the engine, tests/test_generation.py)
    chat = cli(*base, "--prompt", "ba be", "--chat", "--temperature", "1", "--top-k", "40", "--top-p", "0.9")
    assert chat.returncode == 0 and chat.stdout.startswith("[0] ") and lines[0] != chat.stdout.splitlines()[0]


@pytest.mark.parametrize("args,needle", [(["--top-p", "0"], "top_p"),
                                         (["--prompt", "ba", "--prompt", "be", "--prompt", "ko"], "max_batch_size")])
def test_run_mistakes_are_one_line(built, args, needle):
    eng, ck = built
    r = cli("run", "--engine", str(eng), "--weights", str(ck), "--simulate", "--prompt", "ba", *args)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr, r.stderr


def test_bench_simulate_reports_trtllm_bench_fields(built, tmp_path):
    eng, ck = built
    out = tmp_path / "report.json"
    r = cli("bench", "--engine", str(eng), "--weights", str(ck), "--simulate", "--input-len", "12",
            "--output-len", "4", "--runs", "2", "--json", str(out))
    assert r.returncode == 0, r.stderr
    rep = json.loads(out.read_text())
    assert rep["num_requests"] == 4 and rep["batch"] == 2 and rep["device"].startswith("CPU executor")
    for key in ("request_latency_ms", "ttft_ms", "tpot_ms"):
        st = rep[key]
        assert set(st) >= {"avg", "p50", "p90", "p95", "p99", "min", "max"}
        assert st["min"] <= st["p50"] <= st["max"] and st["n"] == 4
    assert rep["output_throughput_tok_per_s"] > 0 and rep["request_throughput_req_per_s"] > 0
    assert rep["tokens_per_sec_per_user"] == pytest.approx(1e3 / rep["tpot_ms"]["avg"])
    assert "request latency ms" in r.stdout and "req/s" in r.stdout
    bad = cli("bench", "--engine", str(eng), "--weights", str(ck), "--simulate", "--input-len", "500")
    assert bad.returncode == 2 and "max_input_len" in bad.stderr


@pytest.mark.parametrize("args,needle", [
    (["run", "--top-p", "1e-300", "--temperature", "1"], None),        # keeps the first candidate, no crash
    (["run", "--temperature", "1e-300"], None),                          # greedy
    (["bench", "--json", "/nonexistent-dir/x.json"], "--json"),         # before the runs, not after them
    (["bench", "--json", "."], "--json"),
    (["serve", "--port", "99999"], "--port 99999"),
    (["serve", "--port", "-5"], "--port -5"),
])
def test_cli_edges(built, args, needle):
    eng, ck = built
    cmd, rest = args[0], args[1:]
    extra = {"run": ["--prompt", "ba", "--max-new-tokens", "3"], "bench": ["--input-len", "4", "--output-len", "2",
                                                                         "--runs", "1"], "serve": []}[cmd]
    r = cli(cmd, "--engine", str(eng), "--weights", str(ck), "--simulate", *extra, *rest)
    if needle is None:
        assert r.returncode == 0 and r.stdout.startswith("[0] "), r.stderr
    else:
        assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_serve_on_a_busy_port_is_one_line(built):
    import socket
    eng, ck = built
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        r = cli("serve", "--engine", str(eng), "--weights", str(ck), "--simulate", "--port", str(s.getsockname()[1]))
    assert r.returncode == 2 and "cannot listen on 127.0.0.1" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "serving" not in r.stdout   # nothing claims to serve before the socket is bound


def test_subcommand_usage_names_the_command():
    r = cli("build", "--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: python -m trtllm_mk build")
    r = cli("bench", "--help")   # the description is a whole sentence, not a docstring's first line cut short
    assert "an engine, reported as trtllm-bench reports them." in " ".join(r.stdout.split())


def test_one_output_token_has_no_tpot_and_the_report_stays_json(built, tmp_path):
    eng, ck = built
    out = tmp_path / "b.json"
    r = cli("bench", "--engine", str(eng), "--weights", str(ck), "--simulate", "--input-len", "4", "--output-len", "1",
            "--runs", "1", "--warmup", "0", "--json", str(out))
    assert r.returncode == 0, r.stderr

    def no_constants(name):
        raise AssertionError(f"{name} in a JSON report")
    rep = json.loads(out.read_text(), parse_constant=no_constants)
    assert rep["tpot_ms"]["avg"] is None and rep["tpot_ms"]["n"] == 0 and rep["tokens_per_sec_per_user"] is None
    assert "n/a" in r.stdout and "nan" not in r.stdout
    run = cli("run", "--engine", str(eng), "--weights", str(ck), "--simulate", "--prompt", "ba", "--max-new-tokens", "1")
    assert run.returncode == 0 and "nan" not in run.stdout and "no CPU executor step" in run.stdout, run.stdout
    long = cli("bench", "--engine", str(eng), "--weights", str(ck), "--simulate", "--input-len", "100",
               "--output-len", "200")
    assert long.returncode == 2 and "--input-len 100 + --output-len 200 exceeds" in long.stderr, long.stderr


def test_cli_warnings_are_one_line_once():
    code = ("import warnings; from trtllm_mk.errors import run_cli\n"
            "def main():\n    for _ in range(2): warnings.warn('ckpt: ignoring 9 tensor(s)\\n  the config does not use')\n"
            "    warnings.warn('ckpt: ignoring 9 tensor(s)\\n  the config does not use')\n"
            "run_cli(main)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == "warning: ckpt: ignoring 9 tensor(s) the config does not use\n", r.stderr


def test_verify_and_run_name_what_became_of_the_checkpoint(tmp_path):
    ck = tiny_checkpoint(tmp_path / "ck")
    eng = tiny_engine(tmp_path / "eng" / "tiny", ck, batch=1)
    ok = cli("verify", "--engine", str(eng))
    assert ok.returncode == 0 and f"checkpoint {ck}: unchanged since the build" in ok.stdout, ok.stderr
    wrong = cli("run", "--engine", str(ck), "--simulate", "--prompt", "1 2")   # a checkpoint given as the engine
    assert wrong.returncode == 2 and "is a model checkpoint, not an engine" in wrong.stderr, wrong.stderr
    cfg = ck / "config.json"
    cfg.write_text(cfg.read_text().replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": 1e-06'))
    changed = cli("verify", "--engine", str(eng))
    assert changed.returncode == 2 and "its config.json changed since the engine was built" in changed.stderr
    ck.rename(tmp_path / "moved")
    gone = cli("verify", "--engine", str(eng))
    assert gone.returncode == 0 and "not on this machine (run, bench and serve need --weights)" in gone.stdout
    run = cli("run", "--engine", str(eng), "--simulate", "--prompt", "1 2", "--max-new-tokens", "2")
    assert run.returncode == 2 and "the checkpoint this engine was built from is not there" in run.stderr, run.stderr
