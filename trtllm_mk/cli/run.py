"""``run``: generate with an engine. Text in/out when the checkpoint has a tokenizer (local files
only); token ids otherwise. ``--simulate`` decodes on the CPU task-graph executor (no GPU needed).

    python -m trtllm_mk run --engine engines/h100_bs1 --prompt "Hello" --max-new-tokens 32 [--weights CKPT]
"""
from __future__ import annotations

import argparse
from pathlib import Path

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
    return ap.parse_args(argv)


def _tokenizer(weights: str):
    if weights in ("random", "tensors"):
        return None
    p = Path(weights)
    if not any((p / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(p, local_files_only=True)


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise UserError(f"prompt '{text[:40]}' is not token ids and the weights have no tokenizer; pass ids like "
                        "'1 2 3' or a checkpoint with a tokenizer (--weights DIR)") from None


def main(argv=None) -> int:
    args = parse_args(argv)
    from ..runtime.hybrid import HybridEngine
    eng = HybridEngine(args.engine, weights=args.weights, simulate=args.simulate, seed=args.seed)
    tok = _tokenizer(eng.weights_source)
    prompts = [tok.encode(p) if tok else _token_ids(p) for p in args.prompt]
    res = eng.generate(prompts, args.max_new_tokens)
    for i, toks in enumerate(res.tokens):
        text = tok.decode(toks) if tok else " ".join(map(str, toks))
        print(f"[{i}] {text}")
    unit = "CPU executor" if args.simulate else "megakernel"
    print(f"TTFT {res.ttft_ms:.2f} ms ({res.prefill_backend} prefill); TPOT median {res.tpot_median_ms:.3f} ms "
          f"over {len(res.tpot_ms)} {unit} steps")
    return 0
