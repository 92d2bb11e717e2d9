"""The OpenAI-compatible HTTP API over one engine: ``/health``, ``/v1/models`` (and
``/v1/models/{id}``), ``/v1/completions`` and ``/v1/chat/completions``, streamed (server-sent events)
or not, with usage counts. A field of OpenAI's API that this server cannot honour (``UNSUPPORTED``,
the penalties, ``n`` > 1, ``echo``) is refused when set, never ignored.

Errors follow OpenAI's body, ``{"error": {"message", "type", "param", "code"}}``: a malformed or
unsupported request is 400, an unknown model 404, a full queue 429, a server that is shutting down
(or whose engine failed) 503. A client that disconnects cancels its request, which frees its slot.
``/v1/models`` lists, besides OpenAI's fields, ``max_model_len`` (as vLLM does), ``max_input_len`` and
``vocab_size``, so a load generator (``benchmarks/serve_load.py``) can draw token-id prompts that fit.
One prompt per request and ``n = 1``: clients batch by sending requests concurrently, which the
scheduler puts into free slots as they arrive.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, Union

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import UserError
from ..sampling import MAX_TOP_LOGPROBS
from .scheduler import Event, QueueFull, SchedulerClosed, make_request
from .text import apply_chat_template

DISCONNECT_POLL_S = 0.25


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def _error(status: int, message: str, type_: str = "invalid_request_error", param=None, code=None) -> JSONResponse:
    return JSONResponse(status_code=status,
                        content={"error": {"message": message, "type": type_, "param": param, "code": code}})


# Counts and switches are strict: pydantic's lax mode would read "max_tokens": true as 1 and
# "stream": "yes" as true, where OpenAI's API refuses them.
class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None         # extension (vLLM, TensorRT-LLM): 0 or -1 = off
    n: StrictInt | None = 1
    stream: StrictBool | None = False
    stream_options: dict | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[StrictInt] | None = None  # extension
    seed: StrictInt | None = None
    ignore_eos: StrictBool | None = False  # extension
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class CompletionBody(_Common):
    prompt: Union[str, list[StrictInt], list[str], list[list[StrictInt]]]
    logprobs: StrictInt | None = None
    echo: StrictBool | None = False
    best_of: StrictInt | None = None
    suffix: str | None = None


class ChatBody(_Common):
    messages: list[dict[str, Any]]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None
    tools: list | None = None
    tool_choice: Union[str, dict, None] = None
    functions: list | None = None
    function_call: Union[str, dict, None] = None
    response_format: dict | None = None


# Chat roles a reply can follow here (tool and function messages need tools, which are refused).
CHAT_ROLES = ("system", "developer", "user", "assistant")

# Fields of OpenAI's API this server cannot honour: a request that sets one to anything but its
# default is refused (400) rather than answered as if it had not asked.
UNSUPPORTED = {
    "logit_bias": lambda v: not v,
    "best_of": lambda v: v in (None, 1),
    "suffix": lambda v: not v,
    "tools": lambda v: not v,
    "tool_choice": lambda v: v in (None, "none"),
    "functions": lambda v: not v,
    "function_call": lambda v: v in (None, "none"),
    "response_format": lambda v: not v or v.get("type") == "text",
}


MAX_STOP = 16            # stop strings a request may give (OpenAI takes 4)
MAX_STOP_CHARS = 1000


def create_app(engine, model_name: str, max_queue: int | None = None) -> FastAPI:
    sched = engine.scheduler
    if max_queue is not None:
        sched.max_queue = max_queue

    @asynccontextmanager
    async def lifespan(app):
        sched.start()
        yield
        await asyncio.to_thread(sched.close)

    app = FastAPI(title="trtllm_mk", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return _error(400, f"the request body is not valid JSON ({first.get('msg', '')})")
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        field = loc[0] if loc else ""
        if sum(1 for e in errors if [str(p) for p in e.get("loc", ()) if p != "body"][:1] == [field]) > 1:
            # a union field (prompt, stop, ...): pydantic reports one error per accepted form
            return _error(400, f"{field}: not one of the accepted forms", param=field)
        where = ".".join(loc)
        if not where:   # the body itself: not a JSON object (a form post, [], null, nothing)
            return _error(400, "the request body must be a JSON object (send it with Content-Type: "
                               "application/json)")
        return _error(400, f"{where}: {first.get('msg', 'invalid request')}", param=where)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        return _error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                      "not_found" if exc.status_code == 404 else "invalid_request_error")

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return _error(exc.status, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(UserError)
    async def _user_error(request, exc: UserError):
        # the sampling parameters' messages start with the field they are about
        field = str(exc).split(" ", 1)[0].rstrip(":")
        known = set(CompletionBody.model_fields) | set(ChatBody.model_fields)
        return _error(400, str(exc), param=field if field in known else None)

    @app.get("/health")
    async def health():
        if sched.closed:
            return _error(503, sched.closed, "service_unavailable")
        return {"status": "ok", "busy_slots": sched.busy, "slots": engine.batch, "waiting": len(sched.waiting)}

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "trtllm_mk",
                "max_model_len": engine.max_seq_len, "max_input_len": engine.max_input_len,
                "vocab_size": engine.spec.vocab_size}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name:
            raise ApiError(404, f"The model `{model_id}` does not exist; this server serves `{model_name}`",
                           code="model_not_found", param="model")
        return model_card()

    def check_common(body: _Common, default_max: int, max_tokens_name: str = "max_tokens") -> dict:
        if body.model is not None and body.model != model_name:
            raise ApiError(404, f"The model `{body.model}` does not exist; this server serves `{model_name}`",
                           code="model_not_found", param="model")
        if body.n is not None and body.n != 1:
            raise ApiError(400, "n must be 1 (send concurrent requests instead)", param="n")
        if body.presence_penalty or body.frequency_penalty:
            raise ApiError(400, "presence_penalty and frequency_penalty are not supported", param="presence_penalty")
        for name, is_default in UNSUPPORTED.items():
            if name in body.model_fields_set and not is_default(getattr(body, name)):
                raise ApiError(400, f"{name} is not supported by this server", param=name)
        if body.stream_options is not None and not body.stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
        max_tokens = default_max if body.max_tokens is None else body.max_tokens
        if max_tokens < 1:
            raise ApiError(400, f"{max_tokens_name} must be >= 1 (got {max_tokens})", param=max_tokens_name)
        top_k = body.top_k or 0
        stop = [body.stop] if isinstance(body.stop, str) else (body.stop or None)
        if stop and (len(stop) > MAX_STOP or max(map(len, stop)) > MAX_STOP_CHARS):
            # every stop string is matched on the scheduler's thread, which all requests share
            raise ApiError(400, f"stop: at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters",
                           param="stop")
        return dict(max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
                    top_k=0 if top_k == -1 else top_k, top_p=1.0 if body.top_p is None else body.top_p,
                    seed=body.seed, stop=stop, stop_token_ids=body.stop_token_ids, ignore_eos=bool(body.ignore_eos))

    def check_length(prompt: list[int], max_tokens: int, name: str) -> None:
        """The prompt and the tokens asked for must fit the engine's sequence length."""
        if len(prompt) > engine.max_input_len:
            raise ApiError(400, f"the prompt has {len(prompt)} tokens, more than this server's {engine.max_input_len}",
                           param="prompt" if name == "max_tokens" else "messages")
        if len(prompt) + max_tokens > engine.max_seq_len:
            raise ApiError(400, f"{name} {max_tokens} with the prompt's {len(prompt)} tokens exceeds this model's "
                                f"context of {engine.max_seq_len} tokens", param=name)

    async def submit(prompt, opts: dict, logprobs: int | None):
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def sink(ev: Event) -> None:   # called on the scheduler thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, ev)
            except RuntimeError:       # the event loop is gone (shutdown): nobody listens
                pass

        max_tokens = opts.pop("max_tokens")
        req = make_request(engine, prompt, max_tokens, logprobs=logprobs, sink=sink, **opts)
        try:
            sched.submit(req)
        except QueueFull as e:
            raise ApiError(429, f"server busy: {e}; retry later", "rate_limit_exceeded") from None
        except SchedulerClosed as e:
            raise ApiError(503, f"server unavailable: {e}", "service_unavailable") from None
        return req, events

    async def collect(req, events: asyncio.Queue, http: HttpRequest) -> list[Event]:
        got = []
        check_at = time.monotonic() + DISCONNECT_POLL_S
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
                    got.append(ev)
                    if ev.finish_reason is not None:
                        return got
                except asyncio.TimeoutError:
                    pass
                # on a clock, not only when the tokens pause: they may never pause for long
                if time.monotonic() >= check_at:
                    if await http.is_disconnected():
                        sched.cancel(req)
                        return []
                    check_at = time.monotonic() + DISCONNECT_POLL_S
        finally:
            if not req.done.is_set():
                sched.cancel(req)

    def usage(req) -> dict:
        return {"prompt_tokens": len(req.prompt), "completion_tokens": len(req.generated),
                "total_tokens": len(req.prompt) + len(req.generated)}

    def failed(ev: Event):
        if ev.finish_reason == "error":
            raise ApiError(503, f"server unavailable: {ev.error}", "service_unavailable")

    def stream_response(req, events, chunk_of, final_usage: bool) -> StreamingResponse:
        async def gen():
            try:
                first = True
                while True:
                    ev = await events.get()
                    if ev.finish_reason == "error":
                        yield _sse({"error": {"message": ev.error, "type": "service_unavailable", "param": None,
                                              "code": None}})
                        break
                    if ev.finish_reason == "cancelled":
                        break
                    if ev.tokens or ev.finish_reason or first:
                        # with include_usage every chunk carries "usage", null until the last one
                        yield _sse(chunk_of(ev, first) | ({"usage": None} if final_usage else {}))
                        first = False
                    if ev.finish_reason is not None:
                        if final_usage:
                            yield _sse(chunk_of(None, False) | {"choices": [], "usage": usage(req)})
                        break
                yield "data: [DONE]\n\n"
            finally:
                if not req.done.is_set():
                    sched.cancel(req)
        return StreamingResponse(gen(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # ------------------------------------------------------------------ completions
    def prompt_of(body: CompletionBody):
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ApiError(400, "one prompt per request (send concurrent requests instead)", param="prompt")
            p = p[0]
        if isinstance(p, str) and engine.tokenizer is None:
            raise ApiError(400, "this server has no tokenizer (random weights or none in the checkpoint): "
                                "send the prompt as token ids", param="prompt")
        if not p:
            raise ApiError(400, "empty prompt", param="prompt")
        return engine.tokenizer.encode(p) if isinstance(p, str) else p

    def completion_logprobs(req, evs: list[Event], seen: list[int]) -> dict:
        """``seen``: [the tokens described so far], carried from one streamed chunk to the next. A
        token's text_offset is where its text starts in the completion's text (an end-of-sequence
        token, which adds no text, at its end)."""
        toks, lps, tops, offs = [], [], [], []
        for c in (c for ev in evs for c in ev.logprobs):
            t = req.text.token_text(c.token)
            toks.append(t)
            lps.append(c.logprob)
            tops.append({req.text.token_text(i): v for i, v in c.top_logprobs} if c.top_logprobs else None)
            at = req.text.offsets
            offs.append(at[seen[0]] if seen[0] < len(at) else len(req.text.text))
            seen[0] += 1
        return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, http: HttpRequest):
        if body.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        prompt = await asyncio.to_thread(prompt_of, body)   # a long text's tokenizing must not hold the loop
        opts = check_common(body, 16)
        check_length(prompt, opts["max_tokens"], "max_tokens")
        req, events = await submit(prompt, opts, body.logprobs)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "text_completion", "created": created, "model": model_name}
        want_lp = body.logprobs is not None
        seen = [0]

        if body.stream:
            def chunk(ev: Event | None, first: bool) -> dict:
                if ev is None:
                    return dict(base)
                return base | {"choices": [{"index": 0, "text": ev.text, "finish_reason": ev.finish_reason,
                                            "logprobs": completion_logprobs(req, [ev], seen) if want_lp else None}]}
            return stream_response(req, events, chunk, bool((body.stream_options or {}).get("include_usage")))
        evs = await collect(req, events, http)
        if not evs:
            return _error(499, "client closed the request")
        failed(evs[-1])
        return base | {"choices": [{"index": 0, "text": "".join(e.text for e in evs), "finish_reason":
                                    evs[-1].finish_reason,
                                    "logprobs": completion_logprobs(req, evs, seen) if want_lp else None}],
                       "usage": usage(req)}

    # ------------------------------------------------------------------ chat
    def chat_prompt(body: ChatBody) -> list[int]:
        msgs = []
        for i, m in enumerate(body.messages):
            role, content = m.get("role"), m.get("content")
            if not isinstance(role, str):
                raise ApiError(400, f"messages[{i}].role must be a string", param=f"messages[{i}].role")
            if role not in CHAT_ROLES:
                raise ApiError(400, f"messages[{i}].role {role!r}: this server takes {', '.join(CHAT_ROLES)}",
                               param=f"messages[{i}].role")
            if isinstance(content, list):   # content parts: only text can be served here
                if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                    raise ApiError(400, f"messages[{i}].content: only text parts are supported",
                                   param=f"messages[{i}].content")
                if any(not isinstance(p.get("text", ""), str) for p in content):
                    raise ApiError(400, f"messages[{i}].content: a text part's text must be a string",
                                   param=f"messages[{i}].content")
                content = "".join(p.get("text", "") for p in content)
            if content is None:
                content = ""
            if not isinstance(content, str):
                raise ApiError(400, f"messages[{i}].content must be a string or text parts",
                               param=f"messages[{i}].content")
            # OpenAI's "developer" messages are what chat templates know as "system"
            msgs.append({"role": "system" if role == "developer" else role, "content": content})
        if not msgs:
            raise ApiError(400, "messages must not be empty", param="messages")
        return apply_chat_template(engine.tokenizer, msgs)

    def chat_logprobs(req, evs: list[Event]) -> dict:
        def entry(tok: int, lp: float) -> dict:
            return {"token": req.text.token_text(tok), "logprob": lp, "bytes": req.text.token_bytes(tok)}
        return {"content": [entry(c.token, c.logprob) | {"top_logprobs": [entry(i, v) for i, v in
                                                                           (c.top_logprobs or [])]}
                            for ev in evs for c in ev.logprobs]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, http: HttpRequest):
        prompt = await asyncio.to_thread(chat_prompt, body)
        name = "max_tokens"
        if body.max_tokens is None and body.max_completion_tokens is not None:
            body.max_tokens, name = body.max_completion_tokens, "max_completion_tokens"
        opts = check_common(body, max(1, engine.max_seq_len - len(prompt)), name)
        check_length(prompt, opts["max_tokens"], name)
        n_top = None
        if body.logprobs:
            n_top = body.top_logprobs or 0
            if not 0 <= n_top <= MAX_TOP_LOGPROBS:
                raise ApiError(400, f"top_logprobs {n_top} must be between 0 and {MAX_TOP_LOGPROBS} on this server",
                               param="top_logprobs")
        elif body.top_logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        req, events = await submit(prompt, opts, n_top)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "chat.completion.chunk" if body.stream else "chat.completion",
                "created": created, "model": model_name}

        if body.stream:
            def chunk(ev: Event | None, first: bool) -> dict:
                if ev is None:
                    return dict(base)
                delta = ({"role": "assistant", "content": ev.text} if first else
                         ({"content": ev.text} if ev.tokens else {}))
                return base | {"choices": [{"index": 0, "delta": delta, "finish_reason": ev.finish_reason,
                                            "logprobs": chat_logprobs(req, [ev]) if n_top is not None else None}]}
            return stream_response(req, events, chunk, bool((body.stream_options or {}).get("include_usage")))
        evs = await collect(req, events, http)
        if not evs:
            return _error(499, "client closed the request")
        failed(evs[-1])
        return base | {"choices": [{"index": 0, "message": {"role": "assistant",
                                                            "content": "".join(e.text for e in evs)},
                                    "finish_reason": evs[-1].finish_reason,
                                    "logprobs": chat_logprobs(req, evs) if n_top is not None else None}],
                       "usage": usage(req)}

    return app


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"
