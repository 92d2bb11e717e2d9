"""Text around the token stream: the checkpoint's tokenizer and chat template, its end-of-sequence
ids (``generation_config.json`` first, as transformers' ``generate`` reads them), and incremental
detokenization with stop strings.

The tokenizer is read from local files only (no network at run time) through transformers, an
optional dependency (the ``tokenizer`` and ``server`` extras); without it, text prompts fail with one
line naming the fix.
"""
from __future__ import annotations

import json
import os
import re
from functools import cached_property, lru_cache
from pathlib import Path

from ..errors import UserError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
TOKENIZER_HINT = "pip install 'trtllm_mk[tokenizer]'"
INSTALL_HINT = "pip install 'trtllm_mk[server]'"


def has_tokenizer(weights: str | Path | None) -> bool:
    if weights is None or str(weights) == "random" or not Path(weights).is_dir():
        return False
    return any((Path(weights) / f).exists() for f in TOKENIZER_FILES)


def load_tokenizer(weights: str | Path):
    """The checkpoint's tokenizer (local files only); a UserError when transformers is missing."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise UserError(f"reading the tokenizer of {weights} needs transformers: {TOKENIZER_HINT}") from None
    try:
        return AutoTokenizer.from_pretrained(str(weights), local_files_only=True)
    except (OSError, ValueError) as e:
        raise UserError(f"{weights}: cannot read its tokenizer ({' '.join(str(e).split())[:200]})") from None


def _ids(value) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, (list, tuple)) else {int(value)}


def eos_token_ids(weights: str | Path | None, spec_eos: tuple[int, ...], tokenizer=None) -> set[int]:
    """End-of-sequence ids: ``generation_config.json``'s ``eos_token_id`` when present (chat models
    list their end-of-turn token there), else config.json's (the spec's), else the tokenizer's."""
    if weights is not None and str(weights) != "random":
        gc = Path(weights) / "generation_config.json"
        if gc.is_file():
            try:
                ids = _ids(json.loads(gc.read_text()).get("eos_token_id"))
            except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
                raise UserError(f"{gc}: not a JSON object with an integer or list eos_token_id") from None
            if ids:
                return ids
    if spec_eos:
        return set(spec_eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return {int(tokenizer.eos_token_id)}
    return set()


def apply_chat_template(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` rendered by the checkpoint's chat template, ready for the reply."""
    if tokenizer is None:
        raise UserError("chat needs a tokenizer: pass --weights with a checkpoint directory that has one")
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("this checkpoint's tokenizer has no chat template; send the prompt as plain text instead "
                        "(run without --chat, or the completions API)")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as e:   # the template's own checks (raise_exception) or its reading of the messages
        from jinja2 import TemplateError
        if not isinstance(e, (TemplateError, TypeError, ValueError, KeyError)):
            raise
        raise UserError(f"messages: the model's chat template refused them: {' '.join(str(e).split())[:300]}") from None
    # The template writes the special tokens (BOS included) itself.
    return tokenizer.encode(text, add_special_tokens=False)


class TextStream:
    """Incremental detokenization of one request with stop strings.

    ``push(token)`` returns the text that is final so far: special tokens are skipped, a token that
    ends inside a multi-byte character waits for the next one, and text that could be the start of a
    stop string is held back until it is known not to be. ``stopped`` turns true when a stop string
    appears; the text ends before it (OpenAI's behaviour).
    """

    def __init__(self, tokenizer, stop: list[str] | None = None, skip_special_tokens: bool = True):
        self.tok, self.skip = tokenizer, skip_special_tokens
        self.stop = [s for s in (stop or []) if s]
        self.ids: list[int] = []
        self.prefix_offset = self.read_offset = 0
        self.pending = ""       # decoded, not yet emitted (a possible stop-string prefix)
        self.text = ""          # emitted so far
        self.offsets: list[int] = []   # where each pushed token's text starts in the request's text
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def push(self, token: int) -> str:
        if self.stopped:
            return ""
        self.offsets.append(len(self.text) + len(self.pending))
        self.ids.append(token)
        # Decoding from a few tokens back keeps the spacing a tokenizer derives from the previous
        # token (SentencePiece's leading spaces) without re-decoding the whole sequence.
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        now = self._decode(self.ids[self.prefix_offset:])
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""
        # The tokens held back since read_offset (their bytes ended inside a character) and this one:
        # each starts at the first character of the final text that the tokens before it leave
        # unfinished (the common prefix of the text decoded without it and the final text: a partial
        # character decodes as U+FFFD, which the final text does not share), so every byte of a
        # character starts where the character does, as it was streamed while held back.
        start, added = self.offsets[self.read_offset], len(now) - len(before)
        for j in range(self.read_offset + 1, len(self.ids)):
            common = len(os.path.commonprefix([self._decode(self.ids[self.prefix_offset:j]), now])) - len(before)
            self.offsets[j] = start + min(max(common, 0), added)
        self.pending += now[len(before):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._release()

    def _release(self) -> str:
        if not self.stop:
            out, self.pending = self.pending, ""
            self.text += out
            return out
        window = self.text[-max(map(len, self.stop)):] + self.pending
        base = len(window) - len(self.pending)
        hits = [i for i in (window.find(s) for s in self.stop) if i >= 0]
        if hits:
            # Stop-string prefixes are held back, so a match starts inside the pending text.
            out = window[base:max(min(hits), base)]
            self.pending, self.stopped = "", True
            self.text += out
            return out
        hold = 0   # the longest tail of the window that starts some stop string
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if window.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        out = self.pending[:len(self.pending) - hold]
        self.pending = self.pending[len(self.pending) - hold:]
        self.text += out
        return out

    def flush(self) -> str:
        """Text still held back, at the end of the request: a stop string may still complete in it,
        and an unfinished multi-byte character ends as the tokenizer decodes it (U+FFFD), so the text
        is the decoded tokens however the request finished."""
        if self.stopped:
            return ""
        self.pending += self._decode(self.ids[self.prefix_offset:])[
            len(self._decode(self.ids[self.prefix_offset:self.read_offset])):]
        self.prefix_offset = self.read_offset = len(self.ids)
        out = self._release()
        if not self.stopped and self.pending:   # a stop string's prefix that nothing completed
            self.text += self.pending
            out, self.pending = out + self.pending, ""
        return out

    def token_text(self, token: int) -> str:
        """One token's own text (for log-probability entries)."""
        return self.tok.decode([token], skip_special_tokens=False)

    def token_bytes(self, token: int) -> list[int]:
        """One token's own bytes (OpenAI's ``bytes`` of a log-probability entry): a byte-level BPE
        token's vocabulary characters stand for bytes, a SentencePiece byte-fallback token is
        ``<0xNN>``; a token whose bytes end inside a character has no text of its own (U+FFFD)."""
        piece = self.tok.convert_ids_to_tokens(int(token))
        if isinstance(piece, str):
            m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
            if m:
                return [int(m.group(1), 16)]
            table = self._byte_table
            if table is not None and piece and all(ch in table for ch in piece):
                return [table[ch] for ch in piece]
        return list(self.token_text(token).encode())

    @cached_property
    def _byte_table(self) -> dict[str, int] | None:
        """Vocabulary character -> byte for a byte-level BPE tokenizer, else None."""
        return _unicode_to_bytes() if _byte_level(self.tok) else None


def _byte_level(tokenizer) -> bool:
    """Whether a (fast) tokenizer decodes with byte-level BPE (GPT-2, Llama 3, Qwen)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and "ByteLevel" in repr(backend.decoder)


@lru_cache(maxsize=1)
def _unicode_to_bytes() -> dict[str, int]:
    try:
        from transformers.convert_slow_tokenizer import bytes_to_unicode
    except ImportError:
        from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode
    return {ch: b for b, ch in bytes_to_unicode().items()}


class IdText:
    """The text of a checkpoint without a tokenizer: each token id, space-separated (as ``run`` prints)."""

    stopped = False

    def __init__(self):
        self.text = ""
        self.offsets: list[int] = []

    def push(self, token: int) -> str:
        out = f"{' ' if self.text else ''}{token}"
        self.text += out
        self.offsets.append(len(self.text) - len(str(token)))
        return out

    def flush(self) -> str:
        return ""

    def token_text(self, token: int) -> str:
        return str(token)

    def token_bytes(self, token: int) -> list[int]:
        return list(str(token).encode())
