"""The reference decoder: plain PyTorch prefill and greedy decode over the paged KV cache.

This is the ground truth that the CPU executor and the megakernel are checked against, and it is
itself checked against HuggingFace transformers (tests/test_reference.py). It is written for
reading, not for speed: the layer is the shared decoder block (``model.decoder_block``), and the
attention it plugs in, below, writes each token's K/V into the paged cache, reads the sequence back
through the block table and applies HF's eager attention.
A mixture-of-experts model's sparse layers route each token to its k experts (``model.moe``:
softmax, top-k with the lowest expert index winning ties, optional renormalisation, the experts'
outputs summed in ascending index order), as HF's eager Qwen3-MoE and Mixtral modules do.

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

import copy
from collections.abc import Iterable, Sequence

import torch

from .kv_cache import PagedKVCache
from .model.decoder_block import Attention, Decoder
from .model.rope import rope_cos_sin, rope_inv_freq
from .model.spec import ModelSpec


# ---- attention over the paged KV cache -------------------------------------------------------

def write_kv(cache: PagedKVCache, layer: int, rows: torch.Tensor, pos: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Store ``k, v [N, T, kv_heads, head_dim]`` of tokens at positions ``pos [N, T]`` of the cache
    sequences ``rows [N]`` (each row may sit at a different position)."""
    tpb = cache.tokens_per_block
    blocks = cache.block_table[rows[:, None], pos // tpb].long()  # [N, T] pool block of each token
    offs = pos % tpb
    cache.pool[layer, blocks, 0, :, offs] = k.to(cache.pool.dtype)
    cache.pool[layer, blocks, 1, :, offs] = v.to(cache.pool.dtype)


def read_kv(cache: PagedKVCache, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every slot of the sequences ``rows [N]``, gathered through the block table and laid out by
    position: k, v ``[N, max_seq_len, kv_heads, head_dim]``. The caller masks slots past each
    sequence's length (gathering the whole table keeps the host out of the loop: no lengths to read)."""
    kv = cache.pool[layer, cache.block_table[rows].long()]  # [N, blocks, 2, kvh, tpb, d]
    N, nb, _, kvh, tpb, d = kv.shape
    kv = kv.permute(0, 2, 1, 4, 3, 5).reshape(N, 2, nb * tpb, kvh, d)
    return kv[:, 0], kv[:, 1]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
           sliding_window: int | None = None) -> torch.Tensor:
    """Causal GQA attention of queries ``q [N, T, heads, d]`` at positions ``pos [N, T]`` over the
    cache slots ``k, v [N, S, kv_heads, d]`` (slot s holds position s); returns ``[N, T, heads, d]``.

    Follows HF's eager attention: scores and P@V in q's dtype, softmax in fp32 then cast back.
    """
    N, T, nh, d = q.shape
    S, group = k.shape[1], nh // k.shape[2]
    slot = torch.arange(S, device=q.device)
    visible = slot <= pos[..., None]                                  # [N, T, S]: causal + length
    if sliding_window is not None:                                    # HF/Mistral: q - kv < window
        visible &= slot > pos[..., None] - sliding_window
    # Slots past a sequence's last token may hold anything (poison in tests, NaN in a fresh pool).
    # Their probabilities are exactly 0, but 0 * NaN is NaN, so they are zeroed, not just masked.
    written = (slot <= pos[:, -1:])[..., None, None]                 # [N, S, 1, 1]
    k = torch.where(written, k.to(q.dtype), 0)
    v = torch.where(written, v.to(q.dtype), 0)
    # query head h reads KV head h // group (HF's repeat_kv)
    k = k.transpose(1, 2).repeat_interleave(group, dim=1)             # [N, heads, S, d]
    v = v.transpose(1, 2).repeat_interleave(group, dim=1)
    scores = (q.transpose(1, 2) @ k.transpose(-1, -2)) * d ** -0.5    # [N, heads, T, S]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return (probs @ v).transpose(1, 2)


def paged_attention(cache: PagedKVCache, rows: torch.Tensor, pos: torch.Tensor,
                    sliding_window: int | None = None) -> Attention:
    """The block's attention for tokens at positions ``pos [N, T]`` of the cache sequences ``rows [N]``:
    each layer's K/V go through the cache and back, so this step's K/V get the cache's rounding, like
    every earlier token's."""
    def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        write_kv(cache, layer, rows, pos, k, v)
        k_all, v_all = read_kv(cache, layer, rows)
        return attend(q, k_all, v_all, pos, sliding_window)
    return attention


# ---- the decoder --------------------------------------------------------------------------------

def prompt_inputs(prompts: Sequence[Sequence[int]], device) -> Iterable[tuple[torch.Tensor, torch.Tensor,
                                                                              torch.Tensor]]:
    """A prefill's forward inputs, one prompt at a time (their lengths differ): the tokens ``[1, T]``
    at positions ``0..T-1`` of cache row ``b``."""
    for b, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {b} is empty")
        ids = torch.as_tensor(list(prompt), dtype=torch.long, device=device)[None]
        yield ids, torch.arange(ids.shape[1], device=device)[None], torch.tensor([b], device=device)


class Staging:
    """The megakernel's staging of a GEMV input: a round trip through ``dtype``. ``router_through_o``: a
    sparse layer's router logits are summed as the fused expert plans sum them
    (model/decoder_block.py DecoderBlock.chain_logits), not computed from the staged normed rows."""

    def __init__(self, dtype: torch.dtype, router_through_o: bool = False):
        self.dtype, self.router_through_o = dtype, router_through_o

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.dtype == x.dtype else x.to(self.dtype).to(x.dtype)


class ReferenceDecoder:
    """Greedy prefill/decode of a Llama-family model over a ``PagedKVCache``; fp32 logits out."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], compute_dtype: torch.dtype | None = None,
                 gemv_input_dtype: torch.dtype | None = None, router_through_o: bool = False):
        """``gemv_input_dtype`` (e.g. torch.bfloat16 with fp32 compute) rounds the input of every
        linear layer to that dtype, exactly where the megakernel stages its activations in shared
        memory, and nowhere else: the kernel's numerics up to fp32 summation order, for comparisons
        that must not flip near-tied argmaxes. ``router_through_o`` sums a sparse layer's router logits
        along the attention chain: the megakernel's numerics under TilePlan.expert_fused
        (kinds/router.py)."""
        self.spec = spec
        self.model = Decoder(spec, weights, compute_dtype)
        self.dtype = self.model.dtype
        self.device = self.model.tok_embeddings.device
        self.inv_freq = rope_inv_freq(spec).to(self.device)
        self.gemv_input_dtype = gemv_input_dtype
        self.router_through_o = router_through_o

    def with_gemv_input_dtype(self, gemv_input_dtype: torch.dtype | None) -> "ReferenceDecoder":
        """This decoder (its weights shared, not copied) rounding GEMV inputs to ``gemv_input_dtype``."""
        other = copy.copy(self)
        other.gemv_input_dtype = gemv_input_dtype
        return other


    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor, cache: PagedKVCache) -> torch.Tensor:
        """Tokens ``ids [N, T]`` at positions ``pos [N, T]`` of cache sequences ``rows [N]``: append
        their K/V to the cache and return fp32 logits ``[N, V]`` of each row's last token."""
        cos, sin = rope_cos_sin(pos, self.inv_freq, self.dtype)
        attention = paged_attention(cache, rows, pos, self.spec.sliding_window)
        stage = None if self.gemv_input_dtype is None else Staging(self.gemv_input_dtype, self.router_through_o)
        return self.model(ids, cos, sin, attention, stage).float()

    # -- public API ------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, prompts: Sequence[Sequence[int]], cache: PagedKVCache) -> torch.Tensor:
        """Write K/V of positions 0..len-1 of prompt b into cache row b; fp32 logits ``[B, V]`` of
        each prompt's last token. Prompts run one at a time: their lengths differ."""
        return torch.stack([self._forward(ids, pos, rows, cache)[0]
                            for ids, pos, rows in prompt_inputs(prompts, self.device)])

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
