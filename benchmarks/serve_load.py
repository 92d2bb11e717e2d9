"""Load test of the OpenAI-compatible server: concurrent streaming clients through the official
``openai`` client (``AsyncOpenAI``), reporting what vLLM's ``benchmark_serving`` and trtllm-bench report.

    python -m benchmarks.serve_load --engine engines/h100_bs1 --weights random \\
        --num-prompts 64 --max-concurrency 4 --input-len 512 --max-tokens 128 --out serve_load_out
    python -m benchmarks.serve_load --url http://127.0.0.1:8000 ...     # a server that already runs

With ``--engine`` it starts ``python -m trtllm_mk serve`` itself on a free port (its output goes to
OUT/server.log), waits for ``/health``, and stops it (with anything it started) when the run ends,
fails, or is interrupted (Ctrl-C, SIGTERM). Requests arrive as a Poisson process of ``--request-rate``
per second (default: all at once) with at most ``--max-concurrency`` in flight (default: no limit), so
a fixed concurrency C is ``--max-concurrency C`` at the default rate. Every request streams, asks for
the usage counts (``stream_options.include_usage``) and ignores end-of-sequence (the ``ignore_eos``
extension), so each one produces exactly ``--max-tokens`` tokens. Per request:

- TTFT: from sending the request to the first streamed chunk with text;
- TPOT: (latency - TTFT) / (output tokens - 1), the time per output token after the first;
- latency: from sending the request to the end of its stream.

The report (OUT/serve_load.json, OUT/serve_load.md and the console) gives each as mean / p50 / p90 /
p99 / min / max, with request and token throughput over the run (first request sent to last one
done). On the GPU a streamed chunk may carry several tokens (greedy slots decode several steps per
host round trip), which is why TPOT is taken over the whole stream and no per-chunk gap is reported.

``--compare-step-ms X`` or ``--compare-bench BENCH.json`` (written by ``python -m trtllm_mk bench
--json``, its decode step p50) sets the served TPOT p50 against the engine's decode step: at
``--max-concurrency 1`` their ratio is what serving adds to every token (the target is within 10%).

Prompts: the completions API (default) gets ``--input-len`` random token ids, the exact prompt length
with or without a tokenizer (the vocabulary size comes from ``/v1/models`` or ``--vocab-size``); the
chat API (``--api chat``: the checkpoint's tokenizer and chat template) gets ``--input-len`` random
words. Prompt lengths are reported as the server counts them.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:   # `python benchmarks/serve_load.py` imports this checkout's package
    sys.path.insert(0, str(REPO))

import trtllm_mk  # noqa: E402
from trtllm_mk.cli.bench import latency_stats  # noqa: E402
from trtllm_mk.errors import UserError, read_json_object, run_cli  # noqa: E402

TPOT_TOLERANCE = 0.10        # served TPOT at concurrency 1 against the decode step (the target)
STOP_TIMEOUT_S = 30          # SIGTERM, then this long before SIGKILL
CHAT_WORDS = ("ba", "be", "ko", "zu", "da", "mi", "fe", "ga", "ki", "lo", "na", "ru", "so", "te", "vu", "wa")
STATS = ("avg", "p50", "p90", "p99", "min", "max")


# ----------------------------------------------------------------------------- arguments
def _rate(text: str) -> float:
    try:
        r = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not r > 0:
        raise argparse.ArgumentTypeError("must be > 0 (inf: every request at once)")
    return r


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.serve_load", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--engine", help="engine directory: start `python -m trtllm_mk serve` on it")
    where.add_argument("--url", help="base URL of a running server (e.g. http://127.0.0.1:8000)")
    ap.add_argument("--weights", help="passed to serve: a checkpoint directory or 'random' (with --engine)")
    ap.add_argument("--simulate", action="store_true", help="serve on the CPU executor (with --engine)")
    ap.add_argument("--server-args", default="", help="more serve options, one string (with --engine)")
    ap.add_argument("--server-timeout", type=float, default=600.0,
                    help="seconds the started server may take to answer /health")
    ap.add_argument("--model", help="model id to request (default: the first of /v1/models)")
    ap.add_argument("--api", choices=("completions", "chat"), default="completions")
    ap.add_argument("--num-prompts", type=int, default=64, help="timed requests")
    ap.add_argument("--input-len", type=int, default=128, help="prompt length (token ids; words for --api chat)")
    ap.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (end-of-sequence ignored)")
    ap.add_argument("--request-rate", type=_rate, default=math.inf,
                    help="requests per second, Poisson arrivals (inf: all at once)")
    ap.add_argument("--max-concurrency", "--concurrency", type=int, dest="max_concurrency",
                    help="requests in flight at most (default: no limit)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--warmup", type=int, default=1, help="untimed requests first, one at a time")
    ap.add_argument("--seed", type=int, default=0, help="seed of prompts, arrivals and sampling")
    ap.add_argument("--vocab-size", type=int, help="token ids of prompts are drawn below this (default: "
                                                   "/v1/models' vocab_size)")
    ap.add_argument("--request-timeout", type=float, default=3600.0, help="seconds per request")
    cmp = ap.add_mutually_exclusive_group()
    cmp.add_argument("--compare-step-ms", type=float, help="the engine's decode step (ms) to set TPOT against")
    cmp.add_argument("--compare-bench", help="a `python -m trtllm_mk bench --json` report: its decode step p50")
    ap.add_argument("--out", default="serve_load_out", help="folder for serve_load.json, serve_load.md, server.log")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap.parse_args(argv)


def check_args(args) -> None:
    """Every mistake in the arguments alone, before a server starts."""
    if args.engine is None:
        for flag, value in (("--weights", args.weights), ("--simulate", args.simulate),
                            ("--server-args", args.server_args)):
            if value:
                raise UserError(f"{flag} configures the server this tool starts: use it with --engine, not --url")
        if not args.url.startswith(("http://", "https://")):
            raise UserError(f"--url must start with http:// or https:// (got {args.url!r})")
    elif not Path(args.engine).is_dir():
        raise UserError(f"--engine {args.engine}: no such directory (build one with `python -m trtllm_mk build`)")
    for name in ("num_prompts", "input_len", "max_tokens"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        raise UserError("--warmup must be >= 0")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise UserError("--max-concurrency must be >= 1")
    if args.temperature < 0:
        raise UserError("--temperature must be >= 0")
    for name in ("server_timeout", "request_timeout", "compare_step_ms"):
        v = getattr(args, name)
        if v is not None and not v > 0:
            raise UserError(f"--{name.replace('_', '-')} must be > 0")
    if args.vocab_size is not None and args.vocab_size < 1:
        raise UserError("--vocab-size must be >= 1")
    try:
        shlex.split(args.server_args)
    except ValueError as e:
        raise UserError(f"--server-args: {e}") from None
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a directory")


def compare_step_ms(args) -> tuple[float, str] | None:
    if args.compare_step_ms is not None:
        return args.compare_step_ms, "--compare-step-ms"
    if args.compare_bench is None:
        return None
    fix = "pass the JSON written by `python -m trtllm_mk bench --json`"
    rep = read_json_object(args.compare_bench, UserError, fix)
    step = rep.get("step_ms", {}).get("p50") if isinstance(rep.get("step_ms"), dict) else None
    if not isinstance(step, (int, float)) or not step > 0:
        raise UserError(f"{args.compare_bench}: no positive step_ms.p50; {fix}")
    return float(step), f"{args.compare_bench} (step_ms.p50)"


# ----------------------------------------------------------------------------- the server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m trtllm_mk serve`` in its own process group, its output in a log file; ``stop``
    ends the group (the server and anything it started) and waits for it."""

    def __init__(self, args, log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # A queue as long as the run: the load test measures latency, not refusals (--server-args
        # "--max-queue N" overrides it, the last value winning).
        cmd = [sys.executable, "-m", "trtllm_mk", "serve", "--engine", str(args.engine), "--host", "127.0.0.1",
               "--port", str(self.port), "--max-queue", str(max(64, args.num_prompts))]
        if args.weights:
            cmd += ["--weights", args.weights]
        if args.simulate:
            cmd.append("--simulate")
        cmd += shlex.split(args.server_args)
        self.cmd = cmd
        self.log_path = log_path
        env = dict(os.environ)
        # the server imports the same trtllm_mk as this tool
        pkg_root = str(Path(trtllm_mk.__file__).resolve().parents[1])
        env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def last_line(self) -> str:
        self._log.flush()
        lines = [ln.strip() for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        return lines[-1] if lines else "(no output)"

    def check_alive(self) -> None:
        rc = self.proc.poll()
        if rc is not None:
            raise UserError(f"the server exited with code {rc} before answering /health: {self.last_line()} "
                            f"(log: {self.log_path})")

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait()
        else:
            self._signal(signal.SIGKILL)   # whatever the server left behind in its group
        self._log.close()
        return self.proc.returncode

    def _signal(self, sig) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def wait_healthy(url: str, timeout_s: float, server: ServerProcess | None = None) -> dict:
    import httpx
    deadline = time.monotonic() + timeout_s
    while True:
        if server is not None:
            server.check_alive()
        try:
            r = httpx.get(url + "/health", timeout=5)
            if r.status_code == 200:
                return r.json()
            why = f"HTTP {r.status_code}"
        except httpx.TransportError as e:
            why = type(e).__name__
        if time.monotonic() > deadline:
            log = f"; last log line: {server.last_line()} (log: {server.log_path})" if server else ""
            raise UserError(f"{url}/health did not answer within {timeout_s:g} s ({why}){log}")
        time.sleep(0.2)


def server_models(url: str) -> list[dict]:
    import httpx
    try:
        r = httpx.get(url + "/v1/models", timeout=30)
        data = r.json().get("data") if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        data = None
    if not data or not isinstance(data, list):
        raise UserError(f"{url}/v1/models lists no model: is this an OpenAI-compatible server?")
    return data


def server_idle(url: str, wait_s: float = 10.0) -> dict | None:
    """/health once the server has no busy slot and no waiting request (or after ``wait_s``): the
    slots a finished run leaves busy are leaked ones. None when the server has no such fields."""
    import httpx
    deadline = time.monotonic() + wait_s
    while True:
        try:
            h = httpx.get(url + "/health", timeout=5).json()
        except (httpx.HTTPError, ValueError):
            return None
        if not isinstance(h, dict) or "busy_slots" not in h:
            return None
        if (h["busy_slots"] == 0 and h.get("waiting", 0) == 0) or time.monotonic() > deadline:
            return h
        time.sleep(0.1)


# ----------------------------------------------------------------------------- the clients
@dataclass
class RequestRecord:
    index: int
    ok: bool = False
    start_s: float = 0.0               # when it was sent, from the start of the run
    ttft_ms: float = math.nan
    tpot_ms: float = math.nan
    latency_ms: float = math.nan
    prompt_tokens: int = 0
    output_tokens: int = 0
    chunks: int = 0                    # streamed chunks with text
    finish_reason: str | None = None
    error: str | None = None


def make_prompts(args, vocab_size: int | None) -> list:
    rng = np.random.default_rng(args.seed)
    n = args.num_prompts + args.warmup
    if args.api == "chat":
        return [" ".join(rng.choice(CHAT_WORDS, args.input_len)) for _ in range(n)]
    return [rng.integers(0, vocab_size, args.input_len).tolist() for _ in range(n)]


def _error_text(e: Exception) -> str:
    import openai
    if isinstance(e, openai.APIStatusError):
        try:
            msg = e.response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            msg = str(e)
        return f"HTTP {e.status_code}: {msg}"
    return f"{type(e).__name__}: {e}"


async def one_request(client, model: str, args, prompt, index: int, t0: float) -> RequestRecord:
    rec = RequestRecord(index)
    kw = dict(model=model, max_tokens=args.max_tokens, temperature=args.temperature, stream=True,
              stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    if args.temperature > 0:
        kw["seed"] = args.seed + index
    start = time.perf_counter()
    rec.start_s = start - t0
    first_text = first_any = None
    usage = None
    try:
        if args.api == "chat":
            stream = await client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kw)
        else:
            stream = await client.completions.create(prompt=prompt, **kw)
        async for chunk in stream:
            now = time.perf_counter()
            if getattr(chunk, "usage", None) is not None:
                usage = chunk.usage
            if not chunk.choices:
                continue
            c = chunk.choices[0]
            first_any = first_any or now
            if c.delta.content if args.api == "chat" else c.text:
                rec.chunks += 1
                first_text = first_text or now
            rec.finish_reason = c.finish_reason or rec.finish_reason
    except Exception as e:   # any failure is this request's (a stream cut off midway raises the HTTP library's own)
        rec.error = _error_text(e)
        return rec
    end = time.perf_counter()
    if rec.finish_reason is None:
        rec.error = "the stream ended without a finish_reason"
        return rec
    first = first_text or first_any or end
    rec.ttft_ms, rec.latency_ms = (first - start) * 1e3, (end - start) * 1e3
    rec.output_tokens = usage.completion_tokens if usage is not None else rec.chunks
    rec.prompt_tokens = usage.prompt_tokens if usage is not None else (len(prompt) if isinstance(prompt, list) else 0)
    if rec.output_tokens > 1:
        rec.tpot_ms = (rec.latency_ms - rec.ttft_ms) / (rec.output_tokens - 1)
    rec.ok = True
    return rec


def _client(url: str, timeout_s: float):
    import openai
    return openai.AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key=os.environ.get("OPENAI_API_KEY", "none"),
                              max_retries=0, timeout=timeout_s)


async def warm_up(url: str, model: str, args, prompts: list) -> None:
    """The untimed requests, one at a time; a failing one ends the test (bad lengths, no chat template)."""
    async with _client(url, args.request_timeout) as client:
        for i, p in enumerate(prompts):
            rec = await one_request(client, model, args, p, -1 - i, time.perf_counter())
            if not rec.ok:
                raise UserError(f"the warm-up request failed: {rec.error}")


async def drive(url: str, model: str, args, prompts: list) -> tuple[list[RequestRecord], float]:
    """Send ``prompts`` at the request rate, at most max_concurrency in flight; (records, seconds)."""
    from tqdm import tqdm
    rng = np.random.default_rng(args.seed + 1)
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    bar = tqdm(total=len(prompts), desc="requests", unit="req", disable=args.no_progress, mininterval=0.5)
    async with _client(url, args.request_timeout) as client:
        t0 = time.perf_counter()

        async def send(i, p):
            if limit is None:
                return await one_request(client, model, args, p, i, t0)
            async with limit:
                return await one_request(client, model, args, p, i, t0)

        tasks = []
        for i, p in enumerate(prompts):
            if i and math.isfinite(args.request_rate):
                await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
            t = asyncio.create_task(send(i, p))
            t.add_done_callback(lambda _: bar.update(1))
            tasks.append(t)
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    bar.close()
    return list(records), duration


# ----------------------------------------------------------------------------- the report
def _clean(x):
    """NaN and infinity as null: the JSON stays strict."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x


def summarize(records: list[RequestRecord], duration_s: float, step: tuple[float, str] | None,
              max_concurrency: int | None) -> dict:
    done = [r for r in records if r.ok]
    out_tok = sum(r.output_tokens for r in done)
    in_tok = sum(r.prompt_tokens for r in done)

    def stats(name):
        return latency_stats([getattr(r, name) for r in done if math.isfinite(getattr(r, name))])
    rep = {
        "completed": len(done), "failed": len(records) - len(done),
        "errors": sorted({r.error for r in records if not r.ok})[:10],
        "duration_s": duration_s,
        "ttft_ms": stats("ttft_ms"), "tpot_ms": stats("tpot_ms"), "latency_ms": stats("latency_ms"),
        "output_tokens": stats("output_tokens"), "prompt_tokens": stats("prompt_tokens"),
        "request_throughput_req_per_s": len(done) / duration_s,
        "output_throughput_tok_per_s": out_tok / duration_s,
        "total_throughput_tok_per_s": (in_tok + out_tok) / duration_s,
        "total_output_tokens": out_tok, "total_prompt_tokens": in_tok,
    }
    if step is not None:
        step_ms, source = step
        tpot = rep["tpot_ms"]["p50"]   # None when no request had a second token
        ratio = tpot / step_ms if tpot is not None else None
        rep["step_comparison"] = {
            "step_ms": step_ms, "step_source": source, "served_tpot_p50_ms": tpot, "ratio": ratio,
            "tolerance": TPOT_TOLERANCE, "within_tolerance": ratio is not None and ratio <= 1 + TPOT_TOLERANCE,
            "max_concurrency": max_concurrency,
            "batch1": max_concurrency == 1,
        }
    return rep


def _row(cells, widths) -> str:
    return "  ".join(f"{c:<{w}}" if i == 0 else f"{c:>{w}}" for i, (c, w) in enumerate(zip(cells, widths)))


METRICS = (("TTFT (ms)", "ttft_ms"), ("TPOT (ms)", "tpot_ms"), ("latency (ms)", "latency_ms"),
           ("output tokens", "output_tokens"), ("prompt tokens", "prompt_tokens"))
HEAD = ("metric", "mean", "p50", "p90", "p99", "min", "max")


def _cells(report) -> list[list[str]]:
    return [[label] + [f"{report[key][s]:.3f}" if report[key]["n"] else "-" for s in STATS]
            for label, key in METRICS]


def describe(report) -> list[str]:
    c = report["config"]
    conc = c["max_concurrency"] or "unlimited"
    lines = [f"{report['model']} at {report['url']} ({c['api']}, streamed); server: {report['server_desc']}",
             f"{c['num_prompts']} requests ({report['completed']} done, {report['failed']} failed), "
             f"{c['input_len']} {'words' if c['api'] == 'chat' else 'tokens'} in, {c['max_tokens']} tokens out, "
             f"max concurrency {conc}, request rate {c['request_rate']}/s, {report['duration_s']:.2f} s",
             f"throughput: {report['request_throughput_req_per_s']:.3f} req/s, "
             f"{report['output_throughput_tok_per_s']:.1f} output tok/s, "
             f"{report['total_throughput_tok_per_s']:.1f} total tok/s"]
    sc = report.get("step_comparison")
    if sc and sc["ratio"] is None:
        lines.append("no request decoded a second token: no TPOT to set against the decode step")
    elif sc:
        verdict = ("within" if sc["within_tolerance"] else "NOT within") + f" {100 * sc['tolerance']:.0f}%"
        note = "" if sc["batch1"] else " (the comparison is meant for --max-concurrency 1)"
        lines.append(f"served TPOT p50 {sc['served_tpot_p50_ms']:.3f} ms against the decode step "
                     f"{sc['step_ms']:.3f} ms ({sc['step_source']}): ratio {sc['ratio']:.3f}, {verdict}{note}")
    idle = report.get("server_after_run")
    if idle is not None and (idle.get("busy_slots") or idle.get("waiting")):
        lines.append(f"warning: after the run the server still has {idle.get('busy_slots')} busy slots and "
                     f"{idle.get('waiting')} waiting requests")
    return lines


def console_table(report) -> str:
    rows = [list(HEAD)] + _cells(report)
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEAD))]
    return "\n".join(_row(r, widths) for r in rows)


def markdown(report) -> str:
    rows = _cells(report)
    lines = ["# Serving load test", ""] + [f"{ln}  " for ln in describe(report)] + [
        "", "| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    if report["errors"]:
        lines += ["", "Errors:", ""] + [f"- {e}" for e in report["errors"]]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- main
def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    args = parse_args(argv)
    check_args(args)
    step = compare_step_ms(args)
    try:
        import httpx  # noqa: F401
        import openai  # noqa: F401
    except ImportError as e:
        raise UserError(f"the load test needs the openai client ({e.name} is missing): "
                        "pip install 'trtllm_mk[test]'") from None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    on_main_thread = threading.current_thread() is threading.main_thread()
    if on_main_thread:
        old_term = signal.signal(signal.SIGTERM, _raise_interrupt)   # the same clean-up as Ctrl-C
        # Ctrl-C stops the run even when this process started with SIGINT ignored (a shell's background
        # job, or a parent that ignores it), where Python would leave it ignored
        old_int = signal.signal(signal.SIGINT, _raise_interrupt)
    server = None
    try:
        if args.engine is not None:
            server = ServerProcess(args, out / "server.log")
            print(f"starting the server (pid {server.pid}) on {server.url}: log in {server.log_path}", flush=True)
            wait_healthy(server.url, args.server_timeout, server)
            url = server.url
        else:
            url = args.url.rstrip("/")
            wait_healthy(url, min(args.server_timeout, 10.0))
        models = server_models(url)
        entry = next((m for m in models if m.get("id") == args.model), None) if args.model else models[0]
        if entry is None:
            raise UserError(f"--model {args.model}: the server serves {', '.join(str(m.get('id')) for m in models)}")
        model = entry["id"]
        max_len, max_in = entry.get("max_model_len"), entry.get("max_input_len")
        if args.api == "completions":
            if max_in and args.input_len > max_in:
                raise UserError(f"--input-len {args.input_len} exceeds the server's max_input_len={max_in}")
            if max_len and args.input_len + args.max_tokens > max_len:
                raise UserError(f"--input-len {args.input_len} + --max-tokens {args.max_tokens} exceeds the "
                                f"server's max_model_len={max_len}")
        vocab = args.vocab_size or entry.get("vocab_size")
        if args.api == "completions" and not vocab:
            raise UserError("the server does not say its vocab_size: pass --vocab-size for token-id prompts")
        prompts = make_prompts(args, vocab)
        print(f"serving {model} at {url}; {args.warmup} warm-up, then {args.num_prompts} requests", flush=True)
        asyncio.run(warm_up(url, model, args, prompts[:args.warmup]))
        records, duration = asyncio.run(drive(url, model, args, prompts[args.warmup:]))
        report = {"tool": "benchmarks.serve_load", "url": url + "/v1", "model": model,
                  "server_desc": (f"{args.engine}, weights {args.weights or 'the engine checkpoint'}, "
                                  f"{'CPU executor' if args.simulate else 'megakernel'}" if server else "external"),
                  "server": ({"engine": str(args.engine), "weights": args.weights, "simulate": args.simulate,
                              "pid": server.pid, "command": server.cmd, "log": str(server.log_path)}
                             if server else None),
                  "config": {k: getattr(args, k) for k in ("api", "num_prompts", "input_len", "max_tokens",
                                                           "request_rate", "max_concurrency", "temperature",
                                                           "warmup", "seed")}}
        if not math.isfinite(args.request_rate):
            report["config"]["request_rate"] = "inf"
        report |= summarize(records, duration, step, args.max_concurrency)
        report["server_after_run"] = server_idle(url)
        report["requests"] = [asdict(r) for r in records]
    finally:
        if server is not None:
            server.stop()
        if on_main_thread:
            signal.signal(signal.SIGTERM, old_term)
            signal.signal(signal.SIGINT, old_int)
    (out / "serve_load.json").write_text(json.dumps(_clean(report), indent=1) + "\n")
    (out / "serve_load.md").write_text(markdown(report))
    print("\n".join(describe(report)))
    print(console_table(report))
    print(f"report: {out / 'serve_load.json'}, {out / 'serve_load.md'}")
    if report["failed"]:
        print(f"error: {report['failed']} of {len(records)} requests failed (first: {report['errors'][0]})",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    run_cli(main)
