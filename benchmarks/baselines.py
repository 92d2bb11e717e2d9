"""Baseline decoders the megakernel is measured against, and the registry of timed systems.

``StaticCacheDecoder`` is a plain gpt-fast style decoder for Llama / Mistral / Qwen2 / Qwen3 specs:
the project's shared decoder block (``trtllm_mk.model.decoder_block``: fused QKV and gate/up
matrices), a preallocated static KV cache ``[B, kv_heads, max_seq, head_dim]`` written with index
assignment, and a position mask instead of a variable cache length, so that one decode step has
fixed shapes and addresses: it can be captured in a CUDA graph or compiled with
``torch.compile(mode="reduce-overhead", fullgraph=True)`` unchanged.

Systems (``SYSTEMS``) turn a model into one timed decode step at a given batch and context:
  torch.compile    the decoder's step, compiled, CUDA graphs by inductor (reduce-overhead)
  eager+cudagraph  the eager step captured once with torch.cuda.CUDAGraph and replayed
  eager            the eager step, kernel by kernel (no graph)
  hf-eager         transformers AutoModelForCausalLM with eager attention and a DynamicCache
Each factory takes ``(spec, weights, batch, context_len, device)``, prefills a ``context_len`` token
prompt, and returns a ``SystemRun`` whose ``step()`` decodes one token at position ``context_len``.
The step always rewrites the same cache slot, so every timed step sees exactly ``context_len``
earlier tokens. Other systems (the megakernel) join with ``register_system`` from their own module.
"""
from __future__ import annotations

import gc
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from trtllm_mk.model.decoder_block import Decoder
from trtllm_mk.model.rope import rope_cos_sin, rope_inv_freq
from trtllm_mk.model.spec import ModelSpec

from .timing import time_steps

# ---------------------------------------------------------------------------------------------
# The static-cache decoder
# ---------------------------------------------------------------------------------------------


class StaticKVCache(nn.Module):
    """gpt-fast's KV cache of one layer: contiguous ``k_cache, v_cache [B, kv_heads, S, d]``, written at
    each row's position and read whole under a position mask, so a decode step has fixed shapes and
    addresses and its attention is plain SDPA that torch.compile fuses."""

    def __init__(self, spec: ModelSpec, max_batch: int, max_seq: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.spec = spec
        shape = (max_batch, spec.num_kv_heads, max_seq, spec.head_dim)
        # Buffers, not attributes: torch.compile's CUDA graphs then keep them at fixed addresses and
        # mutate them in place instead of copying them in as inputs on every replay.
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, input_pos: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
        """One token per row: q ``[B, 1, heads, d]``, k, v ``[B, 1, kv_heads, d]`` at ``input_pos [B]``,
        over the cache slots ``mask [B, 1, 1, S]`` lets it see -> ``[B, 1, heads, d]``."""
        s = self.spec
        B = q.shape[0]
        # Advanced indices on dims 0 and 2 (split by a slice) put the batch dim first: [B, kv, d].
        rows = torch.arange(B, device=q.device)
        self.k_cache[rows, :, input_pos] = k[:, 0]
        self.v_cache[rows, :, input_pos] = v[:, 0]
        # GQA without repeating K/V: the G query heads of a KV head become G "query rows" of it.
        qg = q.reshape(B, s.num_kv_heads, s.group_size, s.head_dim)
        o = F.scaled_dot_product_attention(qg, self.k_cache[:B], self.v_cache[:B], attn_mask=mask)
        return o.reshape(B, 1, s.num_heads, s.head_dim)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Positions 0..T-1 of every row: q ``[B, T, heads, d]``, k, v ``[B, T, kv_heads, d]``, causal."""
        s = self.spec
        B, T = q.shape[:2]
        self.k_cache[:B, :, :T] = k.transpose(1, 2)
        self.v_cache[:B, :, :T] = v.transpose(1, 2)
        # Repeating K/V keeps prefill on the fused causal kernels whatever the torch version's GQA
        # support; it costs one copy of this layer's K/V, small next to the activations.
        kr = k.transpose(1, 2).repeat_interleave(s.group_size, dim=1)
        vr = v.transpose(1, 2).repeat_interleave(s.group_size, dim=1)
        if s.sliding_window is not None and T > s.sliding_window:   # HF/Mistral: q - kv < window
            i = torch.arange(T, device=q.device)
            window = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - s.sliding_window)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), kr, vr, attn_mask=window)
        else:
            o = F.scaled_dot_product_attention(q.transpose(1, 2), kr, vr, is_causal=True)
        return o.transpose(1, 2)


class StaticCacheDecoder(nn.Module):
    """The shared decoder (``trtllm_mk.model.decoder_block``: fused QKV and gate/up, packed once here)
    over gpt-fast's static KV cache, built from HF-named weights (kept in their dtype)."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], max_batch: int, max_seq: int):
        super().__init__()
        self.spec = spec
        self.decoder = Decoder(spec, weights)
        self.kv = nn.ModuleList()
        for name in ("rope_cos", "rope_sin", "key_pos"):
            self.register_buffer(name, None, persistent=False)
        self.max_batch = self.max_seq = 0
        self.setup_cache(max_batch, max_seq)

    def setup_cache(self, max_batch: int, max_seq: int) -> None:
        """(Re)allocate the zeroed KV cache and the fp32 RoPE tables for ``max_seq`` positions."""
        if max_batch < 1 or max_seq < 1:
            raise ValueError(f"setup_cache: max_batch and max_seq must be >= 1 (got {max_batch}, {max_seq})")
        s, emb = self.spec, self.decoder.tok_embeddings
        self.kv = nn.ModuleList(StaticKVCache(s, max_batch, max_seq, emb.dtype, emb.device)
                                for _ in range(s.num_layers))
        cos, sin = rope_cos_sin(torch.arange(max_seq), rope_inv_freq(s), torch.float32)   # [S, 1, d]
        self.rope_cos, self.rope_sin = cos.to(emb.device), sin.to(emb.device)
        self.key_pos = torch.arange(max_seq, device=emb.device)
        self.max_batch, self.max_seq = max_batch, max_seq

    def decode_step(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """One token per row: tokens [B], input_pos [B] (each row's own position) -> logits [B, V].

        Writes K/V at ``input_pos`` and attends to cache slots ``<= input_pos`` of its row; slots past
        it (stale or padding) are masked, so a row may rewrite an earlier position."""
        B = tokens.shape[0]
        pos = input_pos[:, None]
        mask = self.key_pos[None, :] <= pos
        if self.spec.sliding_window is not None:
            mask = mask & (self.key_pos[None, :] > pos - self.spec.sliding_window)
        mask = mask.view(B, 1, 1, self.max_seq)

        def attention(layer, q, k, v):
            return self.kv[layer].decode(q, k, v, input_pos, mask)

        return self.decoder(tokens[:, None], self.rope_cos[pos], self.rope_sin[pos], attention)

    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        """Prompts of equal length: tokens [B, T] at positions 0..T-1 -> logits of the last [B, V]."""
        B, T = tokens.shape
        if B > self.max_batch or T > self.max_seq or T < 2:
            raise ValueError(f"prefill: need 2 <= T <= {self.max_seq} and B <= {self.max_batch} (got B={B}, T={T}); "
                             f"a single token is a decode_step")

        def attention(layer, q, k, v):
            return self.kv[layer].prefill(q, k, v)

        cos, sin = self.rope_cos[:T].expand(B, T, 1, -1), self.rope_sin[:T].expand(B, T, 1, -1)
        return self.decoder(tokens, cos, sin, attention)


def swap_layer_linears(spec: ModelSpec, decoder: StaticCacheDecoder, make: Callable[[list[str]], nn.Module],
                       what: str) -> None:
    """Replace every decoder-layer linear of ``decoder`` (fused q/k/v, o, fused gate/up, down) by
    ``make(names)``, a module built for the HF weight names it fuses (a quantized baseline's linears)."""
    if spec.is_moe:
        raise ValueError(f"the {what} baseline decodes dense models only ({spec.name} has experts)")
    for i, block in enumerate(decoder.decoder.layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        parts = {"wqkv": [a + n + "_proj.weight" for n in "qkv"], "wo": [a + "o_proj.weight"],
                 "w_gate_up": [m + n + "_proj.weight" for n in ("gate", "up")], "w_down": [m + "down_proj.weight"]}
        for attr, names in parts.items():
            delattr(block, attr)   # a parameter slot takes no module: free the name first
            setattr(block, attr, make(names))


# ---------------------------------------------------------------------------------------------
# HF transformers from a ModelSpec (same weights, no checkpoint on disk)
# ---------------------------------------------------------------------------------------------

_HF_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM"}


def hf_config_dict(spec: ModelSpec) -> dict[str, Any]:
    """An HF config.json dict describing ``spec`` (the inverse of ``spec_from_hf_config``)."""
    d: dict[str, Any] = {
        "architectures": [_HF_ARCH[spec.family]], "model_type": spec.family, "hidden_act": "silu",
        "hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "vocab_size": spec.vocab_size,
        "rms_norm_eps": spec.rms_norm_eps, "rope_theta": spec.rope_theta,
        "max_position_embeddings": spec.max_position_embeddings, "tie_word_embeddings": spec.tie_word_embeddings,
        "torch_dtype": spec.dtype, "attention_dropout": 0.0,
    }
    if spec.family in ("llama", "qwen3"):
        d["attention_bias"] = False
    if spec.rope_scaling:
        d["rope_scaling"] = dict(spec.rope_scaling)
    if spec.family == "mistral":
        d["sliding_window"] = spec.sliding_window
    if spec.family in ("qwen2", "qwen3"):
        d.update(use_sliding_window=False, sliding_window=None, max_window_layers=spec.num_layers)
    return d


def hf_model(spec: ModelSpec, weights: dict[str, torch.Tensor], attn_implementation: str = "eager"):
    """``AutoModelForCausalLM`` for ``spec`` whose parameters *are* ``weights`` (no copy)."""
    import transformers

    w0 = weights["model.embed_tokens.weight"]
    cfg = hf_config_dict(spec)
    cfg["torch_dtype"] = str(w0.dtype).removeprefix("torch.")  # HF >= 5 builds in the config's dtype
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    prev = torch.get_default_dtype()
    # Build directly on the weights' device and in their dtype (an fp32 host copy of an 8B model would
    # not fit); the random init is then replaced by the given tensors.
    torch.set_default_dtype(w0.dtype)
    try:
        with torch.device(w0.device):
            model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    finally:
        torch.set_default_dtype(prev)
    sd = dict(weights)
    if spec.tie_word_embeddings:
        sd["lm_head.weight"] = w0
    model.load_state_dict(sd, strict=True, assign=True)
    return model.eval()


# ---------------------------------------------------------------------------------------------
# Systems
# ---------------------------------------------------------------------------------------------


@dataclass
class SystemRun:
    """A set-up system: ``step()`` decodes one token (B rows) at the configured context."""
    step: Callable[[], Any]
    # Releases what dropping the run would not (graph memory pools, compile caches); the caller then
    # drops the run and empties the allocator cache.
    close: Callable[[], None] = lambda: None
    info: dict[str, Any] = field(default_factory=dict)  # recorded in the report (e.g. cache length)


SystemFactory = Callable[[ModelSpec, dict, int, int, torch.device], SystemRun]
SYSTEMS: dict[str, SystemFactory] = {}


def register_system(name: str, factory: SystemFactory, replace: bool = False) -> None:
    """Add a system under ``name``; the benchmark times every registered system it is asked for."""
    if name in SYSTEMS and not replace:
        raise ValueError(f"register_system: '{name}' is already registered (pass replace=True)")
    SYSTEMS[name] = factory


def setup_system(name: str, spec: ModelSpec, weights: dict[str, torch.Tensor], batch: int, context_len: int,
                 device: str | torch.device) -> SystemRun:
    if name not in SYSTEMS:
        raise KeyError(f"unknown system '{name}'; registered: {', '.join(SYSTEMS)}")
    return SYSTEMS[name](spec, weights, batch, context_len, torch.device(device))


def cache_len(context_len: int) -> int:
    """Static cache length for decoding at ``context_len``: the context plus the decoded token,
    rounded up to 16 slots so SDPA's masked kernels need no padding copy (the <= 15 extra slots are
    masked; they add < 0.1% to the KV read at context 128 and more)."""
    return int(math.ceil((context_len + 1) / 16) * 16)


def random_prompt(spec: ModelSpec, batch: int, length: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, spec.vocab_size, (batch, length), generator=gen).to(device)


def _require_cuda(device: torch.device, name: str) -> None:
    if device.type != "cuda":
        raise RuntimeError(f"{name} needs a CUDA device (got {device})")


def prefilled_decoder(spec: ModelSpec, weights: dict[str, torch.Tensor], batch: int, context_len: int,
                      device: torch.device, convert: Callable[[StaticCacheDecoder], None] | None = None):
    """A StaticCacheDecoder holding a prefilled random prompt, and the static inputs of a decode step
    at position ``context_len`` (tokens [B], input_pos [B]). ``convert`` changes the decoder in place
    before the prefill (the int4 baseline swaps in its linears)."""
    dec = StaticCacheDecoder(spec, weights, batch, cache_len(context_len))
    if convert is not None:
        convert(dec)
    prompt = random_prompt(spec, batch, context_len, device)
    if context_len >= 2:
        dec.prefill(prompt)
    else:
        dec.decode_step(prompt[:, 0], torch.zeros(batch, dtype=torch.long, device=device))
    tokens = random_prompt(spec, batch, 1, device, seed=1)[:, 0].contiguous()
    input_pos = torch.full((batch,), context_len, dtype=torch.long, device=device)
    return dec, tokens, input_pos


def free_memory() -> None:
    """Return unreferenced GPU memory to the driver (after a full gc: HF models and compiled graphs
    hold reference cycles). On a CPU-only machine there is nothing to hand back, and gc is slow."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


def eager_system(spec, weights, batch, context_len, device) -> SystemRun:
    dec, tok, pos = prefilled_decoder(spec, weights, batch, context_len, device)
    return SystemRun(step=lambda: dec.decode_step(tok, pos), info={"cache_len": dec.max_seq})


def cudagraph_system(spec, weights, batch, context_len, device) -> SystemRun:
    _require_cuda(device, "eager+cudagraph")
    dec, tok, pos = prefilled_decoder(spec, weights, batch, context_len, device)
    # Warm up on a side stream before capture (lazy cuBLAS/SDPA init must not happen while capturing).
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            dec.decode_step(tok, pos)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dec.decode_step(tok, pos)
    return SystemRun(step=graph.replay, close=graph.reset, info={"cache_len": dec.max_seq})


def compile_system(spec, weights, batch, context_len, device) -> SystemRun:
    """Inductor with CUDA graphs (reduce-overhead), whole step as one graph (fullgraph), shapes static:
    every (model, batch, context) is compiled for exactly its shapes, as a deployment would be."""
    _require_cuda(device, "torch.compile")
    dec, tok, pos = prefilled_decoder(spec, weights, batch, context_len, device)
    step, close = compiled_step(dec, tok, pos)
    return SystemRun(step=step, close=close, info={"cache_len": dec.max_seq})


def compiled_step(dec: StaticCacheDecoder, tok: torch.Tensor, pos: torch.Tensor):
    """(step, close): ``dec``'s decode step compiled and warmed up (compiled, CUDA graph recorded);
    ``close`` drops the compiled graphs and their cudagraph memory pools (torch._dynamo.reset)."""
    import torch._dynamo

    fn = torch.compile(dec.decode_step, mode="reduce-overhead", fullgraph=True, dynamic=False)

    def step():
        torch.compiler.cudagraph_mark_step_begin()  # previous step's logits may be overwritten
        return fn(tok, pos)

    for _ in range(3):  # compile, then record the CUDA graph, before timing starts
        step()
    return step, torch._dynamo.reset


HF_PREFILL_CHUNK = 256  # eager attention materializes [B, heads, chunk, context] scores


def hf_eager_system(spec, weights, batch, context_len, device) -> SystemRun:
    """transformers eager: DynamicCache prefilled to ``context_len``; after each decoded token the
    cache drops it again (a view; the next step's concat is HF's usual per-token cost)."""
    from transformers import DynamicCache

    model = hf_model(spec, weights, attn_implementation="eager")
    cache = DynamicCache()
    prompt = random_prompt(spec, batch, context_len, device)
    for a in range(0, context_len, HF_PREFILL_CHUNK):
        model.model(input_ids=prompt[:, a:a + HF_PREFILL_CHUNK], past_key_values=cache, use_cache=True)
    tok = random_prompt(spec, batch, 1, device, seed=1)

    def step():
        logits = model(input_ids=tok, past_key_values=cache, use_cache=True).logits
        cache.crop(-1)  # negative = drop that many tokens, in transformers 4.x and 5.x alike
        return logits

    return SystemRun(step=step, info={"cache": "DynamicCache"})


register_system("torch.compile", compile_system)
register_system("eager+cudagraph", cudagraph_system)
register_system("hf-eager", hf_eager_system)
register_system("eager", eager_system)


# ---------------------------------------------------------------------------------------------
# Read bandwidth (the floor's denominator)
# ---------------------------------------------------------------------------------------------


def measure_read_bandwidth(device: str | torch.device, nbytes: int | None = None, reps: int = 20) -> dict[str, Any]:
    """Read bandwidth in bytes/s: ``torch.sum`` over one large bf16 tensor (a read-only kernel: it reads
    every byte once and writes one scalar), median time of ``reps`` runs after warm-up.

    Default size: 4 GiB on a GPU (capped at a quarter of free memory; far beyond L2), 64 MiB on a CPU.
    Returns {"bytes_per_s", "nbytes", "method"}."""
    dev = torch.device(device)
    if nbytes is None:
        if dev.type == "cuda":
            free, _ = torch.cuda.mem_get_info(dev)
            nbytes = min(4 << 30, free // 4)
        else:
            nbytes = 64 << 20
    x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=dev)
    stats = time_steps(lambda: torch.sum(x), steps=reps, warmup=3, device=dev)
    n = x.numel() * 2
    del x
    free_memory()
    return {"bytes_per_s": n / (stats.p50 * 1e-3), "nbytes": n,
            "method": f"torch.sum over a {n / 2**30:.2f} GiB bf16 tensor, median of {reps}"}
