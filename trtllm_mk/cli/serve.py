"""``serve``: an OpenAI-compatible HTTP server over one engine (FastAPI + uvicorn, the ``server`` extra).

    python -m trtllm_mk serve --engine engines/h100_bs1 [--weights CKPT] [--simulate] [--host H] [--port P]

Then any OpenAI client: ``/v1/completions``, ``/v1/chat/completions`` (needs the checkpoint's chat
template), ``/v1/models``, ``/health``. Each engine batch row serves one request at a time; further
requests wait in a queue of ``--max-queue`` (then 429).
"""
from __future__ import annotations

import argparse
import socket
import threading
from pathlib import Path

from ..errors import UserError
from ..serve.scheduler import DEFAULT_MAX_QUEUE
from ..serve.text import INSTALL_HINT


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m trtllm_mk serve", description=__doc__.splitlines()[0])
    ap.add_argument("--engine", required=True, help="engine directory written by build")
    ap.add_argument("--weights",
                    help="HF checkpoint directory (its tokenizer, chat template and generation_config.json are "
                         "used; default: the checkpoint the engine was built from), or 'random' (prompts are then "
                         "token ids)")
    ap.add_argument("--simulate", action="store_true", help="decode on the CPU executor instead of the GPU")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="TCP port, 0-65535 (0: any free one)")
    ap.add_argument("--served-model-name", help="the model id clients send (default: the engine directory's name)")
    ap.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                    help="requests that may wait for a free slot; more get HTTP 429")
    ap.add_argument("--seed", type=int, default=0, help="seed of random weights")
    ap.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    ap.add_argument("--shutdown-timeout", type=float, default=30.0,
                    help="seconds a stop signal waits for requests in flight before closing them")
    args = ap.parse_args(argv)
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port {args.port}: not a TCP port (0-65535)")
    if args.shutdown_timeout < 0:
        raise UserError("--shutdown-timeout must be >= 0")
    return args


def listen(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound before the engine loads: an address in use or a host that
    cannot be bound is one line, not a traceback after minutes of loading."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UserError(f"--host {host}: {e.strerror}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    return sock


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import uvicorn
        from ..serve.api import create_app
    except ImportError as e:
        raise UserError(f"serve needs fastapi and uvicorn ({e.name} is missing): {INSTALL_HINT}") from None
    if args.max_queue < 0:
        raise UserError("--max-queue must be >= 0")
    from ..engine import EngineDir
    from ..runtime.hybrid import HybridEngine
    sock = listen(args.host, args.port)
    tp = EngineDir.open(args.engine).schedule.spec.tensor_parallel
    if tp > 1:   # one server would have to drive every rank's process
        raise UserError(f"{args.engine}: a tensor-parallel engine ({tp} GPUs) is not served yet; run it with "
                        f"torchrun --nproc-per-node {tp} -m trtllm_mk run (or bench)")
    eng = HybridEngine(args.engine, weights=args.weights, simulate=args.simulate, seed=args.seed)
    eng.record_steps = False   # a server runs for days: per-step times would only accumulate
    eng.tokenizer   # read it now: a broken tokenizer fails at start, not on the first request
    name = args.served_model_name or Path(args.engine).resolve().name
    app = create_app(eng, name, max_queue=args.max_queue)
    port = sock.getsockname()[1]
    print(f"serving {name} ({eng.batch} slots, {'CPU executor' if args.simulate else 'megakernel'}) on "
          f"http://{args.host}:{port}/v1", flush=True)
    # uvicorn's own limit backs ours up: at --shutdown-timeout the scheduler ends what is left as errors
    # the clients can read (an SSE error event, a 503), and those responses still need to go out
    config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=args.shutdown_timeout + SEND_S)
    try:
        stopping_server(uvicorn.Server, eng.scheduler, args.shutdown_timeout)(config).run(sockets=[sock])
    finally:
        # a second Ctrl-C skips the app's shutdown: the scheduler thread must not be inside the engine
        # when the interpreter exits
        eng.scheduler.close()
    return 0


SEND_S = 5.0   # seconds the responses ended at the shutdown timeout get to go out


def stopping_server(server_cls, sched, timeout: float):
    """``server_cls`` (uvicorn.Server) that, at the first stop signal, says how many requests it waits
    for and closes the scheduler after ``timeout`` seconds (ending those left with an error their
    clients receive). A second Ctrl-C ends the server at once; ``main`` then closes the scheduler."""
    class StoppingServer(server_cls):
        def handle_exit(self, sig, frame) -> None:
            first = not self.should_exit
            super().handle_exit(sig, frame)
            if first:
                n = sched.busy + len(sched.waiting)
                print(f"stopping: {n} request(s) in flight, waiting up to {timeout:g} s for them", flush=True)
                timer = threading.Timer(timeout, sched.close)
                timer.daemon = True
                timer.start()
    return StoppingServer
