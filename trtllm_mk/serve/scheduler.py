"""Per-slot continuous batching: one owner of the engine, a bounded queue of requests in front of it.

Each round the scheduler (1) frees the slots of cancelled requests, (2) gives every free slot to the
oldest waiting request and prefills it alone (``HybridEngine.start``; the other slots keep their
state), (3) runs one decode round for all busy slots (``HybridEngine.decode``) and (4) hands each
request its tokens, freeing the slot on an end-of-sequence id, a stop id or string, or max_tokens.

One thread runs the rounds (``start``), so the engine is only ever touched from it; ``submit``
and ``cancel`` may be called from any thread. Without that thread, ``run`` pumps the rounds in the
caller (``HybridEngine.generate``). A full queue raises QueueFull (the server answers 429), a closed
or failed scheduler SchedulerClosed (503).
"""
from __future__ import annotations

import itertools
import os
import queue
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator

from ..errors import UserError, is_int, short_repr
from ..sampling import Choice, SamplingParams
from .text import IdText, TextStream

DEFAULT_MAX_QUEUE = 64
_ids = itertools.count()


class QueueFull(Exception):
    """More requests wait than the queue holds."""


class SchedulerClosed(UserError):
    """The scheduler is shut down (or its engine failed) and takes no more requests."""


@dataclass
class Event:
    tokens: list[int]                                    # tokens decoded since the last event
    text: str = ""                                       # their text, final (stop strings held back)
    logprobs: list[Choice] = field(default_factory=list)  # one per token, when requested
    finish_reason: str | None = None                     # stop | length | cancelled | error (last event)
    error: str | None = None


@dataclass
class RequestResult:
    tokens: list[int]
    text: str
    finish_reason: str
    logprobs: list[Choice]
    prompt_tokens: int


class Request:
    def __init__(self, prompt: list[int], params: SamplingParams, max_tokens: int, eos_ids=(), stop_ids=(),
                 text: TextStream | IdText | None = None, sink: Callable[[Event], None] | None = None):
        self.id = next(_ids)
        self.prompt, self.params, self.max_tokens = prompt, params, max_tokens
        self.eos_ids, self.stop_ids = set(eos_ids), set(stop_ids)
        self.text = text
        self._sink = sink
        self._queue: queue.Queue[Event] = queue.Queue()
        self.generated: list[int] = []
        self.logprobs: list[Choice] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.cancelled = False
        self.slot: int | None = None
        self.done = threading.Event()
        self.t_submit = self.t_first = self.t_done = 0.0

    # ---------------------------------------------------------------- engine thread side
    def accept(self, choices: list[Choice]) -> bool:
        """Take the tokens of one round; True when the request is finished."""
        if self.t_first == 0.0:
            self.t_first = time.perf_counter()
        toks, text, lps, reason = [], "", [], None
        for c in choices:
            toks.append(c.token)
            if self.params.logprobs is not None:
                lps.append(c)
            self.generated.append(c.token)
            if c.token in self.eos_ids or c.token in self.stop_ids:
                reason = "stop"
            elif self.text is not None:
                text += self.text.push(c.token)
                if self.text.stopped:
                    reason = "stop"
            if reason is None and len(self.generated) >= self.max_tokens:
                reason = "length"
            if reason:
                break
        if reason and self.text is not None:
            text += self.text.flush()
            if self.text.stopped:   # a stop string completed in the text held back until the end
                reason = "stop"
        self.logprobs.extend(lps)
        self._finish_with(Event(toks, text, lps), reason)
        return reason is not None

    def finish(self, reason: str, error: str | None = None) -> None:
        self._finish_with(Event([], ""), reason, error)

    def _finish_with(self, ev: Event, reason: str | None, error: str | None = None) -> None:
        if self.done.is_set():
            return
        if reason is not None:
            ev.finish_reason, ev.error = reason, error
            self.finish_reason, self.error = reason, error
            self.t_done = time.perf_counter()
        (self._sink or self._queue.put)(ev)
        if reason is not None:
            self.done.set()

    # ---------------------------------------------------------------- client side
    def events(self) -> Iterator[Event]:
        """Events as they come (blocking), up to the one with a finish_reason."""
        while True:
            ev = self._queue.get()
            yield ev
            if ev.finish_reason is not None:
                return

    def result(self) -> RequestResult:
        self.done.wait()
        if self.finish_reason == "error":
            raise RuntimeError(self.error)
        return RequestResult(list(self.generated), self.text.text if self.text else "", self.finish_reason,
                             list(self.logprobs), len(self.prompt))


def make_request(engine, prompt: str | list[int], max_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, stop: list[str] | None = None,
                 stop_token_ids: list[int] | None = None, logprobs: int | None = None, ignore_eos: bool = False,
                 sink: Callable[[Event], None] | None = None) -> Request:
    """A checked request for ``engine`` (UserError on bad input); text prompts use its tokenizer."""
    tok = engine.tokenizer
    if isinstance(prompt, str):
        if tok is None:
            raise UserError("a text prompt needs a tokenizer: pass --weights with a checkpoint directory that "
                            "has one, or give token ids")
        prompt = tok.encode(prompt)
    elif not isinstance(prompt, (list, tuple)) or not all(is_int(t) for t in prompt):
        raise UserError(f"a prompt is text or a list of token ids (ints), got {short_repr(prompt)}")
    prompt = [int(t) for t in prompt]
    if stop is not None and (isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop)):
        raise UserError(f"stop is a list of non-empty strings, got {short_repr(stop)}")
    if stop_token_ids is not None and (not isinstance(stop_token_ids, (list, tuple))
                                       or not all(is_int(t) and t >= 0 for t in stop_token_ids)):
        raise UserError(f"stop_token_ids is a list of token ids (ints >= 0), got {short_repr(stop_token_ids)}")
    if stop and tok is None:
        raise UserError("stop strings need a tokenizer (a checkpoint directory that has one); stop on token ids "
                        "instead (stop_token_ids)")
    if seed is None:   # each request draws its own noise
        seed = int.from_bytes(os.urandom(8), "little")
    if not is_int(seed):
        raise UserError(f"seed must be an integer, got {seed!r}")
    for name, v in (("top_k", top_k), ("max_tokens", max_tokens)):
        if not is_int(v):
            raise UserError(f"{name} must be an integer, got {v!r}")
    for name, v in (("temperature", temperature), ("top_p", top_p)):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise UserError(f"{name} must be a number, got {v!r}")
    params = SamplingParams(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p), seed=int(seed),
                            logprobs=logprobs)
    engine.check_request(prompt, int(max_tokens))
    check_sampling = getattr(engine, "check_sampling", None)   # what the engine can choose tokens by
    if check_sampling is not None:
        check_sampling(params)
    eos = () if ignore_eos else engine.eos_ids()
    text = TextStream(tok, stop) if tok is not None else IdText()
    return Request(prompt, params, int(max_tokens), eos_ids=eos, stop_ids=stop_token_ids or (), text=text, sink=sink)


class Scheduler:
    def __init__(self, engine, max_queue: int = DEFAULT_MAX_QUEUE):
        self.engine = engine
        self.max_queue = max_queue
        self.slots: list[Request | None] = [None] * engine.batch
        self.waiting: deque[Request] = deque()
        self._cond = threading.Condition()
        self._pump_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.closed: str | None = None   # why it takes no more requests

    # ---------------------------------------------------------------- any thread
    def submit(self, req: Request) -> None:
        with self._cond:
            if self.closed:
                raise SchedulerClosed(self.closed)
            # Requests that free slots will take at the next round do not wait for a slot.
            free = sum(r is None for r in self.slots)
            if len(self.waiting) - free >= self.max_queue:
                raise QueueFull(f"every slot is busy and {self.max_queue} requests wait for one")
            req.t_submit = time.perf_counter()
            self.waiting.append(req)
            self._cond.notify_all()

    def cancel(self, req: Request) -> None:
        """Drop a request (a client that went away); its slot is freed before the next round."""
        with self._cond:
            req.cancelled = True
            if req in self.waiting:
                self.waiting.remove(req)
                req.finish("cancelled")
            self._cond.notify_all()

    @property
    def busy(self) -> int:
        return sum(r is not None for r in self.slots)

    # ---------------------------------------------------------------- engine owner
    def pump(self) -> bool:
        """One round; False when there was nothing to do."""
        with self._pump_lock:
            eng = self.engine
            for b, r in enumerate(self.slots):
                if r is not None and r.cancelled:
                    r.finish("cancelled")
                    self._free(b)
            worked = False
            for b in range(len(self.slots)):
                if self.slots[b] is not None:
                    continue
                with self._cond:
                    req = self.waiting.popleft() if self.waiting else None
                if req is None:
                    break
                worked = True
                req.slot = b
                self.slots[b] = req
                if req.accept([eng.start(b, req.prompt, req.params)]):
                    self._free(b)
            busy = {b: r for b, r in enumerate(self.slots) if r is not None}
            if not busy:
                return worked
            steps = min(r.max_tokens - len(r.generated) for r in busy.values())
            out = eng.decode({b: r.params for b, r in busy.items()}, max_steps=steps)
            for b, r in busy.items():
                if r.accept(out[b]) or r.cancelled:
                    if r.cancelled:
                        r.finish("cancelled")
                    self._free(b)
            return True

    def _free(self, b: int) -> None:
        self.slots[b] = None
        self.engine.release(b)

    def _fail_all(self, why: str) -> None:
        with self._cond:
            pending = list(self.waiting)
            self.waiting.clear()
        for r in pending + [r for r in self.slots if r is not None]:
            r.finish("error", why)
        self.slots = [None] * len(self.slots)

    def run(self, reqs: list[Request]) -> None:
        """Serve ``reqs`` to completion: in this thread when no scheduler thread runs, else through it."""
        for r in reqs:
            self.submit(r)
        if self._thread is not None and self._thread.is_alive():
            for r in reqs:
                r.done.wait()
            return
        try:
            while not all(r.done.is_set() for r in reqs):
                self.pump()
        except BaseException as e:
            self._fail_all(f"{type(e).__name__}: {e}")
            raise

    def start(self) -> None:
        """Run the rounds in a background thread (idempotent)."""
        with self._cond:
            if self._thread is not None and self._thread.is_alive():
                return
            self._thread = threading.Thread(target=self._loop, name="trtllm_mk-scheduler", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self.closed and not self.waiting and not self.busy:
                    self._cond.wait()
                if self.closed:
                    return
            try:
                self.pump()
            except Exception as e:   # an engine failure ends every request with its message
                why = f"engine failed: {type(e).__name__}: {e}"
                print(f"error: {why}", file=sys.stderr)
                with self._cond:
                    self.closed = why
                self._fail_all(why)
                return

    def close(self) -> None:
        with self._cond:
            self.closed = self.closed or "the server is shutting down"
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)
        with self._pump_lock:
            self._fail_all(self.closed)
