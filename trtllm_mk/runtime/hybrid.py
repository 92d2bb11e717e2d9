"""HybridEngine: prefill on a conventional backend, every decode step on the megakernel.

    engine = HybridEngine("engines/h100_bs1")   # the engine's own checkpoint; or weights=DIR / "random"
    result = engine.generate([[1, 2, 3]], max_new_tokens=64)
    result.tokens, result.ttft_ms, result.tpot_ms

The prefill writes the paged KV cache (TensorRT-LLM layout) and yields each sequence's first token;
the megakernel then continues from that cache with positions and tokens kept on the device, so a
decode step is just a launch. ``simulate=True`` runs the decode steps on the CPU task-graph executor
instead (machines without a GPU; same schedule, same semantics, far slower).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..engine import EngineDir
from ..errors import EngineError, UserError
from ..gpus import detect_gpu, get_gpu
from ..kv_cache import PagedKVCache
from ..model.rope import rope_inv_freq


@dataclass
class GenerationResult:
    tokens: list[list[int]]              # generated tokens per prompt (EOS included when hit)
    ttft_ms: float                       # prefill + first token
    tpot_ms: list[float] = field(default_factory=list)  # per decode step (CUDA events or wall clock)
    prefill_backend: str = "torch"
    decode: str = "megakernel"

    @property
    def tpot_median_ms(self) -> float:
        return sorted(self.tpot_ms)[len(self.tpot_ms) // 2] if self.tpot_ms else float("nan")


def resolve_weights(engine: EngineDir, weights: str | Path | dict | None) -> str | Path | dict:
    """What to decode with: the checkpoint the engine was built from (None, checked unchanged), a
    checkpoint directory (checked to describe the engine's model), ``"random"`` by name, or tensors."""
    from ..model.consistency import check_matches, check_unchanged
    spec = engine.schedule.spec
    if isinstance(weights, dict) or str(weights) == "random":
        return weights
    if weights is None:
        if engine.checkpoint is None:
            raise UserError(f"engine {engine.path} was built from the architecture '{spec.name}' without a checkpoint: "
                            "pass --weights CKPT_DIR, or --weights random for random weights")
        check_unchanged(engine.checkpoint)
        weights = engine.checkpoint["path"]
    check_matches(spec, weights)
    return weights


def _load_weights(spec, weights: str | Path | dict, device: str, seed: int):
    if isinstance(weights, dict):
        return weights
    if str(weights) == "random":
        from ..model.random_weights import random_weights
        return random_weights(spec, device=device, seed=seed)
    from ..model.checkpoint import load_checkpoint
    return load_checkpoint(weights, spec, device=device)


class HybridEngine:
    def __init__(self, engine_dir: str | Path, weights: str | Path | dict | None = None, simulate: bool = False,
                 seed: int = 0, prefill_backend: str | None = None):
        self.engine = EngineDir.open(engine_dir)
        cfg = self.engine.config
        self.schedule = self.engine.schedule
        self.spec, self.batch = self.schedule.spec, self.schedule.batch
        self.max_seq_len, self.max_input_len = int(cfg["max_seq_len"]), int(cfg["max_input_len"])
        self.tokens_per_block = int(cfg["kv_cache_config"]["tokens_per_block"])
        self.simulate = simulate
        if simulate:
            self.device = "cpu"
        else:
            if not torch.cuda.is_available():
                raise EngineError("no CUDA GPU here: run with --simulate to decode on the CPU task-graph executor")
            built_for = get_gpu(cfg["gpu"])
            here = detect_gpu()
            if here.name != built_for.name:
                raise EngineError(f"engine {self.engine.path} was built for {built_for.name} but this GPU is "
                                  f"{here.name}; build a config with gpu: {here.name} (or gpu: auto) instead")
            self.device = "cuda"
        weights = resolve_weights(self.engine, weights)
        # where the weights came from: a checkpoint directory (its tokenizer, if any), "random" or "tensors"
        self.weights_source = "tensors" if isinstance(weights, dict) else str(weights)
        self.weights = _load_weights(self.spec, weights, self.device, seed)
        if simulate:  # the CPU executor computes in fp32 from bf16-valued weights
            self.weights = {k: v.float() if v.dtype == torch.bfloat16 else v for k, v in self.weights.items()}
        kv_dtype = torch.float32 if simulate else torch.bfloat16
        self.cache = PagedKVCache.allocate(self.spec, self.batch, self.max_seq_len, self.tokens_per_block,
                                           dtype=kv_dtype, device=self.device)
        from ..backends import make_prefill, resolve_backend
        self.prefill_name = resolve_backend(prefill_backend or cfg.get("prefill", {}).get("backend", "torch"))
        if self.prefill_name == "tensorrt_llm" and (simulate or not isinstance(weights, (str, Path))
                                                   or str(weights) == "random"):
            self.prefill_name = "torch"   # TensorRT-LLM needs a GPU and a checkpoint directory
        self.prefill = make_prefill(self.prefill_name, self.spec, self.weights, engine_dir=self.engine.path,
                                    weights_dir=None if isinstance(weights, dict) else weights)
        if simulate:
            from ..executor import CpuExecutor
            self.decoder = CpuExecutor(self.spec, self.weights, self.schedule, self.cache)
        else:
            from .megakernel import MegakernelDecoder
            self.decoder = MegakernelDecoder(self.schedule, self.engine.cubin, self.engine.layout, self.weights,
                                             self.cache, rope_inv_freq(self.spec))

    def _check_prompts(self, prompts: list[list[int]], max_new_tokens: int) -> None:
        if not prompts:
            raise UserError("no prompt given")
        if len(prompts) > self.batch:
            raise UserError(f"{len(prompts)} prompts but the engine was built for max_batch_size={self.batch}")
        for p in prompts:
            if not p:
                raise UserError("empty prompt")
            if len(p) > self.max_input_len:
                raise UserError(f"prompt of {len(p)} tokens is longer than max_input_len={self.max_input_len}")
            if len(p) + max_new_tokens > self.max_seq_len:
                raise UserError(f"prompt ({len(p)}) + max_new_tokens ({max_new_tokens}) exceeds "
                                f"max_seq_len={self.max_seq_len}")
            if min(p) < 0 or max(p) >= self.spec.vocab_size:
                raise UserError(f"token ids must be in [0, {self.spec.vocab_size})")

    def generate(self, prompts: list[list[int]], max_new_tokens: int, eos_ids: tuple[int, ...] | None = None
                 ) -> GenerationResult:
        """Greedy generation for up to max_batch_size prompts of different lengths."""
        if max_new_tokens < 1:
            raise UserError("max_new_tokens must be >= 1")
        self._check_prompts(prompts, max_new_tokens)
        eos = set(self.spec.eos_token_ids if eos_ids is None else eos_ids)
        n = len(prompts)
        padded = prompts + [prompts[0]] * (self.batch - n)   # unused batch slots decode a copy, ignored
        sync = torch.cuda.synchronize if self.device == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        first = self.prefill.first_tokens(padded, self.cache).to(torch.int32)
        sync()
        ttft = (time.perf_counter() - t0) * 1e3
        pos = torch.tensor([len(p) for p in padded], dtype=torch.int32, device=self.device)
        out = [[int(first[b])] for b in range(n)]
        done = [out[b][0] in eos for b in range(n)]
        tpot: list[float] = []
        if self.simulate:
            tokens = first
            for _ in range(max_new_tokens - 1):
                if all(done):
                    break
                t = time.perf_counter()
                _, tokens = self.decoder.step(tokens, pos)
                pos = pos + 1
                tpot.append((time.perf_counter() - t) * 1e3)
                self._append(out, done, tokens, eos)
            return GenerationResult(out, ttft, tpot, self.prefill_name, "cpu-executor")
        dec = self.decoder
        dec.set_state(first, pos)
        events = []
        check_every = 8   # read tokens back in chunks so the GPU never idles on the host
        steps = 0
        while steps < max_new_tokens - 1 and not all(done):
            chunk = min(check_every, max_new_tokens - 1 - steps)
            for _ in range(chunk):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                dec.step()
                e1.record()
                events.append((e0, e1))
            dec.synchronize()
            hist = dec.buf.history[:n].cpu()
            for s in range(steps, steps + chunk):
                tok = torch.tensor([int(hist[b, len(padded[b]) + 1 + s]) for b in range(n)])
                self._append(out, done, tok, eos)
            steps += chunk
        tpot = [a.elapsed_time(b) for a, b in events]
        return GenerationResult(out, ttft, tpot, self.prefill_name, "megakernel")

    @staticmethod
    def _append(out, done, tokens, eos) -> None:
        for b in range(len(out)):
            if not done[b]:
                t = int(tokens[b])
                out[b].append(t)
                done[b] = t in eos
