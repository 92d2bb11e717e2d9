"""A tiny word-level tokenizer with a chat template, saved next to a tiny checkpoint, so that text
prompts, chat, stop strings and the server run end to end without downloads.

    python -m trtllm_mk.model.tiny_tokenizer CKPT_DIR [--vocab-size 512]

Ids 0..5 are ``<unk> <s> </s> <|user|> <|assistant|> <|end|>`` (the tiny configs' bos 1 and eos 2);
the rest are short pronounceable words. ``generation_config.json`` lists ``</s>`` and ``<|end|>`` as
end-of-sequence ids, as chat checkpoints list their end-of-turn token.
"""
from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

from ..errors import UserError, run_cli

SPECIALS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> "
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _words(n: int) -> list[str]:
    cons, vow = "bdfgklmnprstvz", "aeiou"
    out = [c + v for c, v in itertools.product(cons, vow)]
    out += [c + v + e for c, v, e in itertools.product(cons, vow, "klmnrst")]
    if n > len(out):
        raise UserError(f"tiny tokenizer: at most {len(out) + len(SPECIALS)} tokens")
    return out[:n]


def write_tiny_tokenizer(out_dir: str | Path, vocab_size: int = 512) -> Path:
    """Save a PreTrainedTokenizerFast (tokenizer.json + tokenizer_config.json) and generation_config.json."""
    try:
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        raise UserError("the tiny tokenizer needs transformers: pip install 'trtllm_mk[tokenizer]'") from None
    vocab = {t: i for i, t in enumerate(SPECIALS + _words(vocab_size - len(SPECIALS)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   additional_special_tokens=SPECIALS[3:])
    fast.chat_template = CHAT_TEMPLATE
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": [2, 5], "do_sample": False}, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trtllm_mk.model.tiny_tokenizer", description=__doc__.split("\n")[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--vocab-size", type=int, default=512)
    args = ap.parse_args(argv)
    print(write_tiny_tokenizer(args.out_dir, args.vocab_size))
    return 0


if __name__ == "__main__":
    run_cli(main)
