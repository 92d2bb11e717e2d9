"""The reference decoder: plain PyTorch prefill and greedy decode over the paged KV cache.

This is the ground truth that the CPU executor and the megakernel are checked against, and it is
itself checked against HuggingFace transformers (tests/test_reference.py). The layers are the shared
decoder block (``model.decoder``) with HF's eager attention over the paged cache; it is written for
reading, not for speed.

Numerics. ``compute_dtype=None`` computes in the weights' dtype and rounds where HF's eager
implementation rounds in that dtype (RMSNorm in fp32 then cast back, RoPE cos/sin cast to the
activation dtype, softmax in fp32 then cast back, everything else in the activation dtype).
``compute_dtype=torch.float32`` upcasts the weights once and computes everything in fp32: the
tolerance-tight reference for a bf16 kernel with fp32 accumulation. K and V always pass through the
cache, so they carry the cache's dtype (bf16 normally), exactly as the kernel sees them.

The cache is TensorRT-LLM's paged layout (``kv_cache.PagedKVCache``); sequence ``b`` of a batch is
row ``b`` of its block table. K is stored after RoPE (and after Qwen3's k-norm), as HF and TRT-LLM do.
Nothing here assumes a device or synchronises with the host, so it runs on CPU and CUDA tensors alike.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from .kv_cache import PagedKVCache
from .model.decoder import Decoder, PagedAttention
from .model.spec import ModelSpec


class ReferenceDecoder:
    """Greedy prefill/decode of a Llama-family model over a ``PagedKVCache``; fp32 logits out."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], compute_dtype: torch.dtype | None = None,
                 gemv_input_dtype: torch.dtype | None = None):
        """``gemv_input_dtype`` (e.g. torch.bfloat16 with fp32 compute) rounds the input of every
        linear layer to that dtype, exactly where the megakernel stages its activations in shared
        memory, and nowhere else: the kernel's numerics up to fp32 summation order, for comparisons
        that must not flip near-tied argmaxes."""
        # HF's eager model rounds RoPE's cos/sin to the activation dtype; so does the reference
        self.model = Decoder(spec, weights, compute_dtype, gemv_input_dtype, rope_in_fp32=False)
        self.spec = spec
        self.dtype = self.model.dtype
        self.device = self.model.tok_embeddings.device

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor, cache: PagedKVCache) -> torch.Tensor:
        """Tokens ``ids [N, T]`` at positions ``pos [N, T]`` of cache sequences ``rows [N]``: append
        their K/V to the cache and return fp32 logits ``[N, V]`` of each row's last token."""
        attention = PagedAttention(cache, rows, pos, kernel="eager", sliding_window=self.spec.sliding_window)
        return self.model(ids, pos, attention).float()

    # -- public API ------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, prompts: Sequence[Sequence[int]], cache: PagedKVCache) -> torch.Tensor:
        """Write K/V of positions 0..len-1 of prompt b into cache row b; fp32 logits ``[B, V]`` of
        each prompt's last token. Prompts run one at a time: their lengths differ."""
        out = []
        for b, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prompt {b} is empty")
            ids = torch.as_tensor(list(prompt), dtype=torch.long, device=self.device)[None]
            pos = torch.arange(ids.shape[1], device=self.device)[None]
            rows = torch.tensor([b], device=self.device)
            out.append(self._forward(ids, pos, rows, cache)[0])
        return torch.stack(out)

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, pos: torch.Tensor, cache: PagedKVCache) -> torch.Tensor:
        """One step for a batch: token b sits at position pos[b] of cache row b (its K/V are
        written there; positions 0..pos[b]-1 must already be in the cache). fp32 logits ``[B, V]``."""
        tokens = torch.as_tensor(tokens, device=self.device).long().reshape(-1)
        pos = torch.as_tensor(pos, device=self.device).long().reshape(-1)
        rows = torch.arange(tokens.shape[0], device=self.device)
        return self._forward(tokens[:, None], pos[:, None], rows, cache)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, cache: PagedKVCache | None = None,
                 eos_ids: Iterable[int] = ()) -> list[list[int]]:
        """Greedy generation; returns the new tokens of each prompt (without the prompt), cut after
        the first token in ``eos_ids``. Without ``cache``, one is allocated in the compute dtype (the
        cache HF would keep)."""
        longest = max(len(p) for p in prompts) + max_new_tokens
        if cache is None:
            cache = PagedKVCache.allocate(self.spec, len(prompts), longest, dtype=self.dtype, device=self.device)
        if longest - 1 > cache.max_seq_len:  # the last new token is returned, never written
            raise ValueError(f"cache holds {cache.max_seq_len} tokens per sequence, generation needs {longest - 1}")
        eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=self.device)
        pos = torch.tensor([len(p) for p in prompts], device=self.device)
        done = torch.zeros(len(prompts), dtype=torch.bool, device=self.device)
        steps = []
        logits = self.prefill(prompts, cache)
        for t in range(max_new_tokens):
            tok = logits.argmax(-1)
            steps.append(tok)
            if eos.numel():  # one device read per step, only when stopping is asked for
                done |= torch.isin(tok, eos)
                if bool(done.all()):
                    break
            if t + 1 < max_new_tokens:
                logits = self.decode(tok, pos + t, cache)
        stop = set(eos.tolist())
        out = []
        for seq in torch.stack(steps, 1).tolist():
            cut = next((j + 1 for j, tk in enumerate(seq) if tk in stop), len(seq))
            out.append(seq[:cut])
        return out
