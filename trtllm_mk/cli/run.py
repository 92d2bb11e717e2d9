"""``run``: generate with an engine. Text in/out when the checkpoint has a tokenizer (local files
only; special tokens are left out of the text); token ids otherwise. ``--simulate`` decodes on the CPU
task-graph executor (no GPU needed).

    python -m trtllm_mk run --engine engines/h100_bs1 --prompt "Hello" --max-new-tokens 32 [--weights CKPT]
        [--chat] [--temperature 0.7 --top-k 50 --top-p 0.9 --sample-seed 1] [--stop STR] [--stream]

Generation stops at the checkpoint's end-of-sequence ids (``generation_config.json`` first), a
``--stop`` string or ``--max-new-tokens``. Each prompt gets its own batch slot.

A tensor-parallel engine runs one rank per GPU: ``torchrun --nproc-per-node N -m trtllm_mk run ...``
(greedy; rank 0 prints).
"""
from __future__ import annotations

import argparse

from ..errors import UserError


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m trtllm_mk run", description="Generate with a megakernel engine.")
    ap.add_argument("--engine", required=True, help="engine directory written by build")
    ap.add_argument("--prompt", action="append", required=True,
                    help="a prompt (text when the checkpoint has a tokenizer, else token ids like '1 2 3'); "
                         "repeat for a batch")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--weights", help="HF checkpoint directory, or 'random' for random weights (default: the "
                                      "checkpoint the engine was built from)")
    ap.add_argument("--simulate", action="store_true", help="decode on the CPU executor instead of the GPU")
    ap.add_argument("--seed", type=int, default=0, help="seed of random weights")
    ap.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    ap.add_argument("--top-k", type=int, default=0, help="0 (default): off")
    ap.add_argument("--top-p", type=float, default=1.0, help="1 (default): off")
    ap.add_argument("--sample-seed", type=int, default=0, help="seed of the sampling noise (same seed, same tokens)")
    ap.add_argument("--stop", action="append", default=[], help="stop string (repeatable; needs a tokenizer)")
    ap.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    ap.add_argument("--stream", action="store_true", help="print the first prompt's text as it is decoded")
    return ap.parse_args(argv)


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise UserError(f"prompt '{text[:40]}' is not token ids and the weights have no tokenizer; pass ids like "
                        "'1 2 3' or a checkpoint with a tokenizer (--weights DIR)") from None


def main(argv=None) -> int:
    args = parse_args(argv)
    from ..runtime.hybrid import HybridEngine
    from ..serve.scheduler import make_request
    from ..serve.text import apply_chat_template
    eng = HybridEngine(args.engine, weights=args.weights, simulate=args.simulate, seed=args.seed)
    out = print if eng.rank == 0 else (lambda *a, **k: None)   # tensor parallel: rank 0 reports
    tok = eng.tokenizer
    if args.chat:
        prompts = [apply_chat_template(tok, [{"role": "user", "content": p}]) for p in args.prompt]
    else:
        prompts = [tok.encode(p) if tok else _token_ids(p) for p in args.prompt]
    if len(prompts) > eng.batch:
        raise UserError(f"{len(prompts)} prompts but the engine was built for max_batch_size={eng.batch}")
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.sample_seed,
                    stop=args.stop or None, ignore_eos=args.ignore_eos)
    reqs = [make_request(eng, p, args.max_new_tokens, **sampling) for p in prompts]
    first_step = len(eng.step_ms)
    if args.stream:   # without a tokenizer the text is the token ids, space-separated
        sched = eng.scheduler
        sched.start()
        for r in reqs:
            sched.submit(r)
        out("[0] ", end="", flush=True)
        for ev in reqs[0].events():
            out(ev.text, end="", flush=True)
        out()
    else:
        eng.scheduler.run(reqs)
    results = [r.result() for r in reqs]
    for i, res in enumerate(results[1 if args.stream else 0:], start=1 if args.stream else 0):
        out(f"[{i}] {res.text}")
    steps = eng.step_ms[first_step:]
    ttft = max((r.t_first - r.t_submit) * 1e3 for r in reqs)
    unit = "CPU executor" if args.simulate else "megakernel"
    tpot = (f"TPOT median {sorted(steps)[len(steps) // 2]:.3f} ms over {len(steps)} {unit} steps" if steps else
            f"no {unit} step (the first token came from the prefill)")
    out(f"TTFT {ttft:.2f} ms ({eng.prefill_name} prefill); {tpot}; "
        f"finish: {', '.join(r.finish_reason for r in results)}")
    eng.close()
    return 0
