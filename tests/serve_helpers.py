"""Tiny engines and checkpoints (with a tokenizer, a chat template and generation_config.json) for the
generation, scheduler and server tests: everything built here, in seconds, on the CPU."""
from pathlib import Path

import pytest

from trtllm_mk.config import load_config, with_overrides
from trtllm_mk.model.tiny import write_tiny_checkpoint
from trtllm_mk.model.tiny_tokenizer import write_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def tiny_checkpoint(d: Path, seed: int = 7) -> Path:
    """An untied tiny Llama (tied random embeddings make greedy decoding repeat the last token)."""
    write_tiny_checkpoint(d, family="llama", seed=seed, tie_word_embeddings=False)
    write_tiny_tokenizer(d)
    return d


def tiny_engine(out: Path, checkpoint: Path, batch: int) -> Path:
    from trtllm_mk.build import build_engine
    cfg = with_overrides(load_config(ROOT / "configs" / "tiny_cpu.yaml"), {
        "model": str(checkpoint), "max_batch_size": batch, "max_seq_len": 256, "max_input_len": 128,
        "megakernel": {"search_budget_s": 0.5, "context_len": 128}})
    build_engine(cfg, out, show_progress=False)
    return out


SERVED_MODEL = "tiny"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny checkpoint with a tokenizer, for the server tests (import the fixture by name)."""
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory, checkpoint):
    """Its 2-slot engine, named as the server tests serve it."""
    return tiny_engine(tmp_path_factory.mktemp("eng") / SERVED_MODEL, checkpoint, batch=2)
