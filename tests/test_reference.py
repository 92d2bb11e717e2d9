"""The reference decoder against HuggingFace transformers, on tiny random checkpoints of every family.

HF's own config classes and eager modules define the truth: prefill logits and the K/V written to the
paged cache, greedy generations token for token, and the logits of every decode step (against HF run
on the whole sequence). The cache hands its blocks out in a shuffled order, 8 tokens per block, so
every sequence spans several non-contiguous blocks; unused slots hold large noise (or NaN), so a read
beyond a sequence's length would show in the result.
"""
from __future__ import annotations

import functools

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from trtllm_mk.errors import ModelError
from trtllm_mk.kv_cache import PagedKVCache
from trtllm_mk.model.rope import apply_rotary, rope_cos_sin
from trtllm_mk.model.rope import apply_rope, rope_inv_freq
from trtllm_mk.model.spec import spec_from_hf_config
from trtllm_mk.reference import ReferenceDecoder

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
PROMPT_LENS = (5, 19, 30)   # 1, 3 and 4 blocks of 8: different lengths, partial last blocks
NEW_TOKENS = 40
MAX_SEQ = 80                # >= 30 + 40; each sequence owns 10 blocks, shuffled across the pool
TPB = 8

_COMMON = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=512,
               # std 0.1 (not HF's 0.02) spreads the logits, so greedy choices are not near-ties
               initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _hf_config(family: str):
    if family == "llama":   # Llama-3 scaling whose original context (64) the sequences cross; tied head
        return LlamaConfig(**_COMMON, rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=500000.0,
                           rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                             high_freq_factor=4.0, original_max_position_embeddings=64))
    if family == "mistral":  # a window shorter than the sequences: the mask must apply it
        return MistralConfig(**_COMMON, rms_norm_eps=1e-5, rope_theta=1e6, sliding_window=16)
    if family == "qwen2":
        return Qwen2Config(**_COMMON, rms_norm_eps=1e-6, rope_theta=1e6)
    return Qwen3Config(**_COMMON, rms_norm_eps=1e-6, rope_theta=1e6)


def _hf_model(family: str, dtype: torch.dtype, state_dict: dict[str, torch.Tensor] | None = None):
    """HF model with eager attention, built in ``dtype`` as from_pretrained(dtype=...) builds it (RoPE's
    inv_freq stays fp32; a later model.to(bf16) would round it), with random or given weights."""
    model = AutoModelForCausalLM.from_config(_hf_config(family), attn_implementation="eager", dtype=dtype)
    if state_dict is not None:
        model.load_state_dict(state_dict)   # casts to the model's dtype
    return model.eval()


@functools.cache
def _model(family: str, dtype: torch.dtype = torch.float32):
    """The family's test model: random init with norm gains off 1 and biases off 0 so that both
    matter; the bf16 model holds the fp32 model's weights rounded to bf16."""
    if dtype != torch.float32:
        return _hf_model(family, dtype, _model(family).state_dict())
    torch.manual_seed(FAMILIES.index(family))
    model = _hf_model(family, torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.2)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    return model


def _setup(family: str, dtype: torch.dtype = torch.float32):
    """(HF model, ModelSpec, checkpoint-named weights) of ``family`` in ``dtype``."""
    model = _model(family, dtype)
    spec = spec_from_hf_config(model.config.to_dict(), name=f"tiny-{family}")
    sd = model.state_dict()
    # exactly the checkpoint's names: proves expected_tensors() speaks HF, and that a tied model's
    # lm_head.weight is really absent from what the reference gets
    weights = {name: sd[name] for name in spec.expected_tensors()}
    return model, spec, weights


def _prompts(family: str) -> list[list[int]]:
    g = torch.Generator().manual_seed(100 + FAMILIES.index(family))
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _cache(spec, dtype=torch.float32, seed=0) -> PagedKVCache:
    return PagedKVCache.allocate(spec, len(PROMPT_LENS), MAX_SEQ, TPB, dtype=dtype, shuffle_blocks=True,
                                 seed=seed, fill=1e4)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@torch.no_grad()
def _hf_logits(model, seq: list[int]) -> torch.Tensor:
    """HF logits of every position of one sequence, fp32 [T, V]."""
    return model(torch.tensor([seq])).logits[0].float()


def _teacher_forced(ref: ReferenceDecoder, prompts, continuations, cache) -> torch.Tensor:
    """Prefill, then one decode step per continuation token: fp32 logits [steps + 1, B, V]."""
    out = [ref.prefill(prompts, cache)]
    pos = torch.tensor([len(p) for p in prompts])
    for t in range(continuations.shape[1] - 1):
        out.append(ref.decode(continuations[:, t].to(torch.int32), (pos + t).to(torch.int32), cache))
    return torch.stack(out)


def _decode_errors(model, ref, prompts, cache, steps: int) -> list[float]:
    """Relative error of each step's logits (prefill, then teacher-forced decode of random tokens)
    against HF's logits at the same positions of the whole sequence."""
    g = torch.Generator().manual_seed(7)
    cont = torch.randint(0, 512, (len(prompts), steps + 1), generator=g)
    ours = _teacher_forced(ref, prompts, cont, cache)
    errs = []
    for b, p in enumerate(prompts):
        hf = _hf_logits(model, p + cont[b, :steps].tolist())[len(p) - 1:]   # positions len-1 .. len-1+steps
        errs += [_rel(ours[t, b], hf[t]) for t in range(steps + 1)]
    return errs


# ---- fp32: equal to HF up to float rounding ---------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_and_cache_match_hf(family):
    model, spec, w = _setup(family)
    prompts = _prompts(family)
    cache = _cache(spec)
    logits = ReferenceDecoder(spec, w).prefill(prompts, cache)
    assert logits.shape == (3, spec.vocab_size) and logits.dtype == torch.float32
    for b, p in enumerate(prompts):
        with torch.no_grad():
            out = model(torch.tensor([p]), use_cache=True)
        assert _rel(logits[b], out.logits[0, -1]) < 1e-4
        # the cache holds HF's K (after RoPE, after Qwen3's k-norm) and V, position by position
        for i, layer in enumerate(out.past_key_values.layers):
            k, v = cache.read(i, b, len(p))                                  # [T, kv_heads, d]
            n = layer.keys.shape[2]   # HF keeps only the last window - 1 positions under a sliding window
            assert n == len(p) or (spec.sliding_window and n == spec.sliding_window - 1)
            assert _rel(k[-n:], layer.keys[0].transpose(0, 1)) < 1e-5
            assert _rel(v[-n:], layer.values[0].transpose(0, 1)) < 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_equals_hf_generate(family):
    model, spec, w = _setup(family)
    prompts = _prompts(family)
    ours = ReferenceDecoder(spec, w).generate(prompts, NEW_TOKENS, cache=_cache(spec, seed=1))
    for p, got in zip(prompts, ours):
        with torch.no_grad():
            hf = model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(p):]
        assert got == hf.tolist()
        assert len(set(got)) >= 5, "degenerate generation: the comparison would prove little"


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_logits_match_hf_every_step(family):
    model, spec, w = _setup(family)
    errs = _decode_errors(model, ReferenceDecoder(spec, w), _prompts(family), _cache(spec, seed=2), steps=36)
    assert max(errs) < 1e-4


# ---- bf16 ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_rounds_like_hf_bf16(family):
    """In the weights' dtype the reference rounds where HF's eager bf16 model rounds. bf16 noise
    itself is ~1.5e-2 here (HF bf16 against HF fp32; a single misplaced rounding point, e.g. a bf16
    RoPE table, costs as much), so 5e-3 proves the rounding points match; on x86 CPUs the logits
    are in fact bitwise equal. Only GEMM summation order may differ across platforms."""
    model, spec, w = _setup(family, torch.bfloat16)
    ref = ReferenceDecoder(spec, w)
    assert ref.dtype == torch.bfloat16
    errs = _decode_errors(model, ref, _prompts(family), _cache(spec, torch.bfloat16, seed=3), steps=12)
    assert max(errs) < 5e-3


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_fp32_compute_on_bf16_weights_rounds_only_the_cache(family):
    """The kernel's reference: bf16 weights and cache, fp32 compute. Against HF in fp32 on the same
    (bf16-valued) weights, the only difference is K/V rounded to bf16 in the cache: much closer than
    the bf16 model is."""
    model16, spec, w16 = _setup(family, torch.bfloat16)
    hf_on_bf16_values = _hf_model(family, torch.float32, model16.state_dict())
    ref = ReferenceDecoder(spec, w16, compute_dtype=torch.float32)
    assert ref.dtype == torch.float32
    prompts = _prompts(family)
    fp32_errs = _decode_errors(hf_on_bf16_values, ref, prompts, _cache(spec, torch.bfloat16, seed=4), steps=6)
    exact = _decode_errors(hf_on_bf16_values, ref, prompts, _cache(spec, torch.float32, seed=4), steps=6)
    bf16_errs = _decode_errors(hf_on_bf16_values, ReferenceDecoder(spec, w16), prompts,
                               _cache(spec, torch.bfloat16, seed=4), steps=6)
    assert max(exact) < 1e-4                    # fp32 cache: nothing rounds
    assert 1e-4 < max(fp32_errs) < 1e-2          # bf16 cache: K/V rounding shows, and only that
    assert max(fp32_errs) < max(bf16_errs) / 2


# ---- the cache ----------------------------------------------------------------------------------

def test_slots_past_each_length_are_never_read():
    """NaN in every slot past a sequence's length (what a fresh pool may hold) changes nothing, bit for
    bit, over several decode steps."""
    _, spec, w = _setup("qwen3")
    ref = ReferenceDecoder(spec, w)
    prompts = _prompts("qwen3")
    cache = _cache(spec, seed=5)
    first = ref.prefill(prompts, cache)
    nan_cache = PagedKVCache(cache.pool.clone(), cache.block_table.clone(), TPB)
    for b, p in enumerate(prompts):
        t = torch.arange(len(p), MAX_SEQ)
        nan_cache.pool[:, nan_cache.block_table[b, t // TPB].long(), :, :, t % TPB] = float("nan")
    tok = first.argmax(-1)
    pos = torch.tensor(PROMPT_LENS)
    for step in range(4):
        a, b = ref.decode(tok, pos + step, cache), ref.decode(tok, pos + step, nan_cache)
        assert not a.isnan().any() and torch.equal(a, b)
        tok = a.argmax(-1)


def test_generate_stops_at_eos_and_allocates_its_cache():
    _, spec, w = _setup("llama")
    ref = ReferenceDecoder(spec, w)
    prompts = _prompts("llama")
    full = ref.generate(prompts, 16)   # no cache given: allocated in the compute dtype
    assert [len(s) for s in full] == [16] * 3
    stop = full[1][6]
    cut = ref.generate(prompts, 16, eos_ids=[stop])
    for f, c in zip(full, cut):
        want = f[: f.index(stop) + 1] if stop in f else f
        assert c == want
    assert len(cut[1]) <= 7


def test_rope_matches_the_shared_rope_in_fp32():
    _, spec, _ = _setup("llama")
    inv = rope_inv_freq(spec)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 11, 4, spec.head_dim, generator=g)
    pos = torch.randint(0, 500, (2, 11), generator=g)
    got = apply_rotary(x, *rope_cos_sin(pos, inv, torch.float32))
    assert torch.allclose(got, apply_rope(x, pos, inv), rtol=0, atol=1e-6)


def test_rejects_missing_or_misshaped_weights():
    _, spec, w = _setup("qwen2")
    with pytest.raises(ModelError, match="missing"):
        ReferenceDecoder(spec, {k: v for k, v in w.items() if not k.endswith("k_proj.bias")})
    bad = dict(w, **{"model.layers.1.mlp.up_proj.weight": w["model.layers.1.mlp.up_proj.weight"].T})
    with pytest.raises(ModelError, match="up_proj"):
        ReferenceDecoder(spec, bad)


@pytest.mark.gpu
def test_cuda_equals_cpu():
    _, spec, w = _setup("qwen2")
    prompts = _prompts("qwen2")
    cpu = _teacher_forced(ReferenceDecoder(spec, w), prompts, torch.arange(3 * 9).view(3, 9), _cache(spec))
    wc = {k: v.cuda() for k, v in w.items()}
    cache = _cache(spec)
    cache = PagedKVCache(cache.pool.cuda(), cache.block_table.cuda(), TPB)
    gpu = _teacher_forced(ReferenceDecoder(spec, wc), prompts, torch.arange(3 * 9).view(3, 9).cuda(), cache)
    assert gpu.is_cuda and _rel(gpu.cpu(), cpu) < 1e-4
