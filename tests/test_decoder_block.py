"""The shared decoder block on CPU: every user (the reference, the torch prefill, the benchmark's
static-cache baseline) runs one GEMM for Q/K/V and one for gate/up per layer, the baseline's decode
step is one graph with exactly those GEMMs and agrees with the reference at batch 4, and the fused
matrices share their memory with the engine's weights when those are laid out for it."""
import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))   # benchmarks/ is a top-level directory, not part of the package

from benchmarks.baselines import StaticCacheDecoder, prefilled_decoder  # noqa: E402
from trtllm_mk.backends.torch_prefill import TorchPrefill  # noqa: E402
from trtllm_mk.kv_cache import PagedKVCache  # noqa: E402
from trtllm_mk.model.decoder_block import DecoderBlock, concat_rows, share_fused_storage  # noqa: E402
from trtllm_mk.model.random_weights import random_weights  # noqa: E402
from trtllm_mk.model.spec import spec_from_hf_config  # noqa: E402
from trtllm_mk.model.tiny import tiny_config  # noqa: E402
from trtllm_mk.reference import ReferenceDecoder  # noqa: E402

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]


def _tiny(family, seed=0, dtype=torch.float32):
    spec = spec_from_hf_config(tiny_config(family), name=f"tiny-{family}")
    return spec, random_weights(spec, "cpu", dtype, seed=seed)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


class _Gemms(TorchDispatchMode):
    """Output width of every matrix multiplication with a 2-D weight (aten.linear under inference
    mode, else the aten.mm / aten.addmm it lowers to), and the shape of every concatenation."""

    def __init__(self):
        super().__init__()
        self.widths, self.cat_shapes = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.linear.default, torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.widths.append(out.shape[-1])
        elif func is torch.ops.aten.cat.default:
            self.cat_shapes.append(tuple(out.shape))
        return out


def _per_layer_gemms(spec):
    """qkv, o_proj, gate/up, down per layer, then the LM head: one GEMM each."""
    return [spec.q_size + 2 * spec.kv_size, spec.hidden_size, 2 * spec.intermediate_size,
            spec.hidden_size] * spec.num_layers + [spec.vocab_size]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_every_user_runs_one_gemm_for_qkv_and_one_for_gate_up(family):
    spec, w = _tiny(family)
    want = _per_layer_gemms(spec)
    batch = 4
    with torch.no_grad():
        dec, tok, pos = prefilled_decoder(spec, w, batch, 20, torch.device("cpu"))
        ref = ReferenceDecoder(spec, w)
        prefill = TorchPrefill(spec, w)
        cache = PagedKVCache.allocate(spec, batch, 32, tokens_per_block=8, dtype=torch.float32)
        # (name, step, passes: prompts are prefilled one at a time)
        for name, step, passes in [("baseline decode", lambda: dec.decode_step(tok, pos), 1),
                                   ("reference prefill", lambda: ref.prefill([[1, 2, 3]] * batch, cache), batch),
                                   ("reference decode", lambda: ref.decode(tok, pos - 4, cache), 1),
                                   ("torch prefill", lambda: prefill.prefill([[5, 6, 7, 8]], cache), 1)]:
            gemms = _Gemms()
            with gemms:
                step()
            assert gemms.widths == want * passes, name
            # the fused matrices are packed at construction, never per call: no 2-D concatenation
            assert all(len(s) != 2 for s in gemms.cat_shapes), (name, gemms.cat_shapes)
    for model in (dec.decoder, ref.model, prefill.model):
        assert all(type(b) is DecoderBlock for b in model.layers)


def test_compiled_decode_step_is_one_graph_with_the_fused_gemms():
    """What torch.compile sees of the baseline's step: one graph (fullgraph), one linear per fused
    projection (the same count as the dispatch-level check above, before any decomposition)."""
    spec, w = _tiny("qwen3")
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm

    with torch.no_grad():
        dec, tok, pos = prefilled_decoder(spec, w, 4, 20, torch.device("cpu"))
        want = dec.decode_step(tok, pos).clone()
        got = torch.compile(dec.decode_step, backend=capture, fullgraph=True, dynamic=False)(tok, pos)
    torch.testing.assert_close(got, want)
    assert len(graphs) == 1
    linears = [n for n in graphs[0].graph.nodes if n.op == "call_function" and n.target is torch._C._nn.linear]
    assert len(linears) == 4 * spec.num_layers + 1


@pytest.mark.parametrize("family", FAMILIES)
def test_baseline_at_batch_4_matches_the_reference(family):
    """Four rows at four different positions, each decoding several steps: the static-cache
    baseline's logits are the reference decoder's (fp32, CPU)."""
    spec, w = _tiny(family, seed=2)
    B, S = 4, 48
    g = torch.Generator().manual_seed(3)
    lens = [9, 14, 21, 30]
    seqs = [torch.randint(0, spec.vocab_size, (n + 5,), generator=g) for n in lens]
    dec = StaticCacheDecoder(spec, w, max_batch=B, max_seq=S)
    ref = ReferenceDecoder(spec, w, compute_dtype=torch.float32)
    cache = PagedKVCache.allocate(spec, B, S, tokens_per_block=8, dtype=torch.float32, fill=1e4)
    with torch.no_grad():
        ref.prefill([s[:n].tolist() for s, n in zip(seqs, lens)], cache)
        # the baseline prefills equal lengths only: each row's prompt runs as decode steps
        # (a row past its prompt writes its next slot, which its first real step then rewrites)
        for t in range(max(lens)):
            tok = torch.stack([seqs[b][min(t, lens[b])] for b in range(B)])
            pos = torch.tensor([min(t, lens[b]) for b in range(B)])
            dec.decode_step(tok, pos)
        for step in range(5):
            tok = torch.stack([seqs[b][lens[b] + step] for b in range(B)])
            pos = torch.tensor([n + step for n in lens])
            assert _rel(dec.decode_step(tok, pos), ref.decode(tok, pos, cache)) < 1e-4


def test_concat_rows_copies_only_when_the_rows_are_not_adjacent():
    base = torch.randn(10, 4)
    parts = [base[:3], base[3:5], base[5:]]
    fused = concat_rows(parts)
    assert fused.data_ptr() == base.data_ptr() and torch.equal(fused, base)
    apart = [base[:3], base[5:]]                     # rows 3..4 left out: a copy
    fused = concat_rows(apart)
    assert fused.data_ptr() != base.data_ptr() and torch.equal(fused, torch.cat(apart))
    swapped = concat_rows([base[3:5], base[:3]])     # out of order: a copy
    assert torch.equal(swapped, torch.cat([base[3:5], base[:3]]))


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_prefill_reads_the_engine_weights_in_place(family):
    """With the weights laid out by share_fused_storage (as the hybrid engine does), the prefill's
    fused Q/K/V, biases and gate/up are the same memory the engine's named tensors are: no copy,
    and the same logits and cache as from separately stored weights."""
    spec, w = _tiny(family, seed=4)
    shared = share_fused_storage(spec, w)
    for name, t in w.items():
        assert torch.equal(shared[name], t) and shared[name].is_contiguous()
    prefill = TorchPrefill(spec, shared)
    for i, block in enumerate(prefill.model.layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        assert block.wqkv.data_ptr() == shared[a + "q_proj.weight"].data_ptr()
        assert shared[a + "v_proj.weight"].data_ptr() < block.wqkv.data_ptr() + block.wqkv.nbytes
        assert block.w_gate_up.data_ptr() == shared[m + "gate_proj.weight"].data_ptr()
        if spec.qkv_bias:
            assert block.bqkv.data_ptr() == shared[a + "q_proj.bias"].data_ptr()
        assert block.wo.data_ptr() == w[a + "o_proj.weight"].data_ptr()   # unfused tensors: in place
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [5, 3, 5]]
    caches = [PagedKVCache.allocate(spec, 2, 16, tokens_per_block=8, dtype=torch.float32) for _ in range(2)]
    a = prefill.prefill(prompts, caches[0])
    b = TorchPrefill(spec, w).prefill(prompts, caches[1])
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(caches[0].pool, caches[1].pool, rtol=1e-6, atol=1e-6)


def test_reference_variant_shares_the_weights():
    spec, w = _tiny("qwen3", seed=6, dtype=torch.bfloat16)
    ref = ReferenceDecoder(spec, w, compute_dtype=torch.float32, gemv_input_dtype=torch.bfloat16)
    plain = ref.with_gemv_input_dtype(None)
    assert plain.model is ref.model and plain.gemv_input_dtype is None
    assert ref.gemv_input_dtype == torch.bfloat16
    fresh = ReferenceDecoder(spec, w, compute_dtype=torch.float32)
    cache = [PagedKVCache.allocate(spec, 1, 16, tokens_per_block=8, dtype=torch.bfloat16) for _ in range(2)]
    torch.testing.assert_close(plain.prefill([[1, 2, 3, 4]], cache[0]), fresh.prefill([[1, 2, 3, 4]], cache[1]),
                               rtol=0, atol=0)


def test_sliding_window_in_the_prefill():
    """A window shorter than the prompt (Mistral): the torch prefill's SDPA mask agrees with the
    reference (itself checked against HF's Mistral). The baseline's masks: test_benchmark_harness."""
    spec, w = _tiny("mistral", seed=8)
    spec = dataclasses.replace(spec, sliding_window=8)
    prompts = torch.randint(0, spec.vocab_size, (2, 13), generator=torch.Generator().manual_seed(5)).tolist()
    caches = [PagedKVCache.allocate(spec, 2, 16, tokens_per_block=8, dtype=torch.float32, fill=1e4) for _ in range(3)]
    with torch.no_grad():
        want = ReferenceDecoder(spec, w, compute_dtype=torch.float32).prefill(prompts, caches[0])
        unwindowed = ReferenceDecoder(dataclasses.replace(spec, sliding_window=None), w).prefill(prompts, caches[1])
    assert _rel(TorchPrefill(spec, w).prefill(prompts, caches[2]), want) < 1e-4
    assert _rel(unwindowed, want) > 1e-3   # the window matters here
