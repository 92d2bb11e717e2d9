"""The OpenAI-compatible server on a tiny ``--simulate`` engine, driven by the official ``openai``
client: completions, chat, streaming, seeds, logprobs, errors (400/404/429/503), dropped clients
and concurrent clients. The server binds 127.0.0.1 on a free port and stops with the module."""
import subprocess
import sys
import threading
import time

import pytest
import torch

from serve_helpers import checkpoint, engine_dir  # noqa: F401  (module fixtures)

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from benchmarks.serve_load import free_port  # noqa: E402

MODEL = "tiny"
MAX_QUEUE = 2


def wait_until(cond, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def server(engine_dir, checkpoint):
    from trtllm_mk.runtime.hybrid import HybridEngine
    from trtllm_mk.serve.api import create_app
    eng = HybridEngine(engine_dir, weights=checkpoint, simulate=True)
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(create_app(eng, MODEL, max_queue=MAX_QUEUE), host="127.0.0.1", port=port,
                                       log_level="error"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: srv.started, what="the server to start")
    yield url, eng
    srv.should_exit = True
    th.join(timeout=30)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=60)


def health(url):
    return httpx.get(url + "/health", timeout=10).json()


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    h = health(server[0])
    assert h["status"] == "ok" and h["slots"] == 2


def test_greedy_completion_equals_the_engine(server, client):
    url, eng = server
    r = client.completions.create(model=MODEL, prompt="ba be ko", max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    ids = eng.tokenizer.encode("ba be ko")
    want = eng.generate([ids], 6, eos_ids=()).tokens[0]
    assert r.choices[0].text == eng.tokenizer.decode(want, skip_special_tokens=True)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), 6, len(ids) + 6)
    # token-id prompts are accepted as well
    r2 = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert r2.choices[0].text == r.choices[0].text


def test_chat_streaming_equals_non_streaming_for_a_seed(client):
    msgs = [{"role": "user", "content": "ba be ko"}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, seed=11, temperature=0.9)
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, seed=11, temperature=0.9,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content and full.choices[0].message.role == "assistant"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 2   # streamed, not one blob
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    # with include_usage every chunk has the key, null before the last (OpenAI's stream)
    assert all("usage" in c.model_fields_set and c.usage is None for c in chunks[:-1])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason


def test_seeds(client):
    def text(seed):
        return client.completions.create(model=MODEL, prompt="ba be", max_tokens=10, temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text
    a, b, c = text(5), text(5), text(6)
    assert a == b and a != c


def test_logprobs(server, client):
    eng = server[1]
    r = client.completions.create(model=MODEL, prompt="ba be ko", max_tokens=4, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens[i] if i == 0 else " " + lp.tokens[i] for i in range(4)) == r.choices[0].text
    ids = eng.tokenizer.encode("ba be ko")
    logits = eng.prefill.impl.prefill([ids], _scratch_cache(eng))[0]
    want = torch.log_softmax(logits.float(), 0)
    assert lp.token_logprobs[0] == pytest.approx(float(want.max()), abs=1e-4)   # greedy: the top token
    assert len(lp.top_logprobs[0]) == 3 and max(lp.top_logprobs[0].values()) == pytest.approx(lp.token_logprobs[0])
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "ba"}], max_tokens=3,
                                       logprobs=True, top_logprobs=2, seed=1)
    content = c.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def _scratch_cache(eng):
    from trtllm_mk.kv_cache import PagedKVCache
    return PagedKVCache.allocate(eng.spec, 1, 256, eng.tokens_per_block, dtype=torch.float32)


@pytest.mark.parametrize("kwargs,status,needle", [
    (dict(top_p=1.5), 400, "top_p"),
    (dict(max_tokens=0), 400, "max_tokens"),
    (dict(max_tokens=500), 400, "max_tokens 500 with the prompt's"),
    (dict(n=2), 400, "n must be 1"),
    (dict(n=0), 400, "n must be 1"),
    (dict(model="gpt-9"), 404, "does not exist"),
    (dict(prompt=["a", "b"]), 400, "one prompt"),
    (dict(prompt=[1, 99999]), 400, "token ids"),
    (dict(temperature=-1), 400, "temperature"),
    (dict(logit_bias={"5": 100}), 400, "logit_bias"),   # never answered as if not asked
    (dict(best_of=2), 400, "best_of"),
    (dict(suffix="ko"), 400, "suffix"),
    (dict(seed=2 ** 64), 400, "seed"),                  # not wrapped into another seed's tokens
    (dict(stream_options={"include_usage": True}), 400, "stream_options"),
    (dict(stop=[f"s{i}" for i in range(17)]), 400, "at most 16"),   # matched on the shared scheduler thread
    (dict(stop="x" * 1001), 400, "at most 16"),
])
def test_bad_completion_requests(client, kwargs, status, needle):
    args = dict(model=MODEL, prompt="ba", max_tokens=4) | kwargs
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(**args)
    assert e.value.status_code == status
    body = e.value.response.json()["error"]
    assert needle in body["message"] and body["type"]
    if status == 400 and len(kwargs) == 1 and next(iter(kwargs)) != "prompt":
        assert body["param"] == next(iter(kwargs))   # the field the client sent, by its API name


@pytest.mark.parametrize("body,needle", [
    ({"prompt": "ba", "max_tokens": True}, "max_tokens"),      # not read as 1
    ({"prompt": "ba", "stream": "yes"}, "stream"),              # not read as true
    ({"prompt": "ba", "n": 1.5}, "n"),
])
def test_counts_and_switches_are_strictly_typed(server, body, needle):
    r = httpx.post(server[0] + "/v1/completions", json={"model": MODEL} | body)
    assert r.status_code == 400 and r.json()["error"]["param"] == needle


def test_a_body_that_is_not_a_json_object_is_one_clean_line(server):
    url = server[0] + "/v1/completions"
    for r in (httpx.post(url, data={"prompt": "ba"}), httpx.post(url, json=[]), httpx.post(url, json=None)):
        msg = r.json()["error"]["message"]
        assert r.status_code == 400 and msg.startswith("the request body must be a JSON object"), msg
        assert "\n" not in msg and "File" not in msg


def test_extreme_sampling_values_neither_fail_nor_stop_the_server(server, client):
    args = dict(model=MODEL, prompt="ba be", max_tokens=4, extra_body={"ignore_eos": True})
    greedy = client.completions.create(temperature=0, **args).choices[0].text
    # fp32 rounds this top_p to 0: the first candidate stays kept and the engine's thread keeps serving
    assert client.completions.create(temperature=1, top_p=1e-300, seed=3, **args).choices[0].text == greedy
    assert client.completions.create(temperature=1e-300, seed=3, **args).choices[0].text == greedy
    assert health(server[0])["status"] == "ok"


def test_malformed_json_and_bad_chat(server):
    url = server[0]
    r = httpx.post(url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [1.5]})
    assert r.status_code == 400 and r.json()["error"]["message"] == "prompt: not one of the accepted forms"
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "max_tokens": "many", "prompt": "ba"})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert r.status_code == 400 and "text" in r.json()["error"]["message"]
    for text in (5, None, ["a"]):   # a text part whose text is not a string
        r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": [
            {"type": "text", "text": text}]}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content"
    r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "robot", "content": "x"}]})
    assert r.status_code == 400 and "messages[0].role 'robot'" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "developer", "content": "be brief"}, {"role": "user", "content": "ba"}]})
    assert r.status_code == 200, r.text   # OpenAI's developer role is the template's system role


@pytest.mark.parametrize("kwargs,needle", [
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
          tool_choice="required"), "tools"),
    (dict(response_format={"type": "json_object"}), "response_format"),
    (dict(logprobs=True, top_logprobs=10), "top_logprobs 10"),
    (dict(max_completion_tokens=0), "max_completion_tokens must be >= 1"),
])
def test_bad_chat_requests_name_the_field(client, kwargs, needle):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "ba"}], **kwargs)
    assert needle in e.value.response.json()["error"]["message"]


def test_model_retrieve_and_unknown_routes(server, client):
    m = client.models.retrieve(MODEL)
    assert m.id == MODEL and m.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    r = httpx.get(server[0] + "/v1/nothing-here")
    assert r.status_code == 404 and "/v1/nothing-here" in r.json()["error"]["message"]


def test_streamed_logprob_offsets_continue_across_chunks(client):
    args = dict(model=MODEL, prompt="ba be ko", max_tokens=6, temperature=0, logprobs=1,
                extra_body={"ignore_eos": True})
    full = client.completions.create(**args).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **args) if c.choices]
    offs = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
    assert offs == full.logprobs.text_offset and len(offs) == 6
    # each token's text runs from its offset to the next token's
    text = full.text
    pieces = [text[a:b] for a, b in zip(offs, offs[1:] + [len(text)])]
    assert offs[0] == 0 and "".join(pieces) == text
    assert all(p.strip() == t for p, t in zip(pieces, full.logprobs.tokens))


def test_full_queue_gets_429_and_dropped_clients_free_their_slots(server, client):
    url, eng = server
    streams = []
    try:
        for _ in range(2 + MAX_QUEUE):   # both slots busy, the queue full
            s = client.completions.create(model=MODEL, prompt="ba be", max_tokens=200, stream=True,
                                          extra_body={"ignore_eos": True})
            streams.append(s)
        wait_until(lambda: health(url)["busy_slots"] == 2 and health(url)["waiting"] == MAX_QUEUE,
                   what="busy slots and a full queue")
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model=MODEL, prompt="ba", max_tokens=2)
        assert e.value.status_code == 429
    finally:
        for s in streams:
            s.close()                    # the clients go away mid-stream
    wait_until(lambda: health(url)["busy_slots"] == 0 and health(url)["waiting"] == 0,
               what="the dropped requests to free their slots")
    assert client.completions.create(model=MODEL, prompt="ba", max_tokens=2).usage.completion_tokens >= 1


def test_closed_scheduler_gets_503(server, client):
    url, eng = server
    eng.scheduler.closed = "maintenance"
    try:
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model=MODEL, prompt="ba", max_tokens=2)
        assert e.value.status_code == 503
        assert httpx.get(url + "/health").status_code == 503
    finally:
        eng.scheduler.closed = None


def test_concurrent_clients_get_what_they_get_alone(client):
    prompts = ["ba be", "ko zu da", "mi", "fe ga ki lo"]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, seed=i, temperature=0.8,
                                       extra_body={"ignore_eos": True}).choices[0].text for i, p in enumerate(prompts)]
    got = [None] * len(prompts)

    def one(i):
        got[i] = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=6, seed=i, temperature=0.8,
                                           extra_body={"ignore_eos": True}).choices[0].text
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert got == alone


def test_serve_command(engine_dir, checkpoint):
    p, url = _serve(engine_dir, checkpoint)
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "ba"}], max_tokens=3)
        assert r.usage.completion_tokens >= 1 and r.choices[0].finish_reason in ("stop", "length")
    finally:
        p.terminate()
        p.wait(timeout=30)


# The server as `python -m trtllm_mk`, with Python's own Ctrl-C handler: a test run in the background of a
# non-interactive shell inherits SIGINT ignored, and Python keeps an ignored SIGINT ignored
SERVE = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
         "sys.argv[0] = 'trtllm_mk'; runpy.run_module('trtllm_mk', run_name='__main__', alter_sys=True)")


def _serve(engine_dir, checkpoint, *extra):
    """A ``serve`` process on a free port, once it answers /health: (process, url)."""
    port = free_port()
    p = subprocess.Popen([sys.executable, "-c", SERVE, "serve", "--engine", str(engine_dir), "--weights",
                          str(checkpoint), "--simulate", "--port", str(port), *extra],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"

    def up():
        assert p.poll() is None, p.communicate()[1]
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False
    wait_until(up, timeout=60, what="serve to answer /health")
    return p, url


def _long_stream(url, got: list, started: threading.Event):
    body = {"model": MODEL, "prompt": "ba be", "max_tokens": 240, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    got.append(line[6:])
                    started.set()
    except httpx.HTTPError as e:
        got.append(f"transport error: {type(e).__name__}")
    started.set()


def test_a_stop_signal_ends_what_outlives_the_shutdown_timeout_as_readable_errors(engine_dir, checkpoint):
    # at --shutdown-timeout the requests still running end as errors their clients can read (an SSE
    # error event then [DONE]; a 503 body), and the process says what it waits for, without tracebacks
    import json
    import signal
    p, url = _serve(engine_dir, checkpoint, "--shutdown-timeout", "0")
    got, started = [], threading.Event()
    stream = threading.Thread(target=_long_stream, args=(url, got, started))
    stream.start()
    full = {}
    other = threading.Thread(target=lambda: full.update(r=httpx.post(url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "ba", "max_tokens": 240, "ignore_eos": True})))
    other.start()
    assert started.wait(30)

    def both_in():   # the non-streamed request too has reached the scheduler
        h = health(url)
        return h["busy_slots"] + h["waiting"] == 2
    wait_until(both_in, timeout=30, what="both requests to be in flight")
    p.send_signal(signal.SIGTERM)
    stream.join(60)
    other.join(60)
    out, err = p.communicate(timeout=60)
    assert got[-1] == "[DONE]" and "shutting down" in json.loads(got[-2])["error"]["message"], got[-3:]
    assert full["r"].status_code == 503 and "shutting down" in full["r"].json()["error"]["message"]
    assert "stopping: 2 request(s) in flight" in out and "Traceback" not in err, err[-2000:]


def test_a_second_ctrl_c_stops_at_once_and_cleanly(engine_dir, checkpoint):
    import signal
    p, url = _serve(engine_dir, checkpoint, "--shutdown-timeout", "60")
    got, started = [], threading.Event()
    stream = threading.Thread(target=_long_stream, args=(url, got, started))
    stream.start()
    assert started.wait(30)
    p.send_signal(signal.SIGINT)
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    stream.join(60)
    assert p.returncode == 130 and "terminate called" not in err and err.strip().splitlines()[-1] == "interrupted", err[-2000:]
