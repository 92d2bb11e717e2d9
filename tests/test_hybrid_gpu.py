"""HybridEngine end to end on the GPU: torch prefill into the paged cache, megakernel decode, 256
new tokens at batch 1 and 4 with prompts of different lengths; TTFT and TPOT reported.

The generated tokens are checked against the reference decoder, teacher-forced over the engine's
own tokens and KV history with the kernel's rounding points (see test_megakernel_gpu.py for why a
free-running comparison of random-weight models is ill-posed at bf16 precision)."""
from pathlib import Path

import pytest
import torch

from trtllm_mk.config import load_config, with_overrides
from trtllm_mk.kv_cache import PagedKVCache
from trtllm_mk.model.checkpoint import load_checkpoint
from trtllm_mk.model.tiny import write_tiny_checkpoint
from trtllm_mk.reference import ReferenceDecoder

pytestmark = pytest.mark.gpu
NEW = 256


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    write_tiny_checkpoint(d, family="qwen3", seed=11)
    return d


@pytest.mark.parametrize("batch", [1, 4])
def test_generate_matches_reference_and_reports_latency(tmp_path, checkpoint, batch):
    from trtllm_mk.build import build_engine
    from trtllm_mk.runtime.hybrid import HybridEngine
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.yaml")
    cfg = with_overrides(cfg, {"model": str(checkpoint), "gpu": "auto", "max_batch_size": batch,
                               "megakernel": {"search_budget_s": 2.0}})
    out, _ = build_engine(cfg, tmp_path / "engine", show_progress=False)
    eng = HybridEngine(out, weights=str(checkpoint))
    gen = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, eng.spec.vocab_size, (9 + 23 * b,), generator=gen).tolist() for b in range(batch)]
    res = eng.generate(prompts, NEW, eos_ids=())
    assert [len(t) for t in res.tokens] == [NEW] * batch
    assert res.ttft_ms > 0 and len(res.tpot_ms) == NEW - 1 and all(t > 0 for t in res.tpot_ms)
    print(f"batch {batch}: TTFT {res.ttft_ms:.2f} ms, TPOT median {res.tpot_median_ms * 1e3:.1f} us")
    # teacher-forced reference over the engine's tokens and its KV history
    w = {k: v.float() for k, v in load_checkpoint(checkpoint, eng.spec, device="cuda").items()}
    ref = ReferenceDecoder(eng.spec, w, torch.float32, gemv_input_dtype=torch.bfloat16)
    cache = PagedKVCache(eng.cache.pool.clone(), eng.cache.block_table.clone(), eng.cache.tokens_per_block)
    lens = torch.tensor([len(p) for p in prompts], device="cuda")
    flips = 0
    first_ref = ref.prefill(prompts, PagedKVCache.allocate(eng.spec, batch, 512, eng.tokens_per_block, device="cuda"))
    assert first_ref.argmax(-1).tolist() == [t[0] for t in res.tokens]
    for t in range(NEW - 1):
        cache.pool.copy_(eng.cache.pool)   # each reference step starts from the engine's own state
        tok = torch.tensor([res.tokens[b][t] for b in range(batch)], device="cuda")
        want = ref.decode(tok, lens + t, cache).argmax(-1).tolist()
        flips += sum(int(want[b] != res.tokens[b][t + 1]) for b in range(batch))
    assert flips <= max(1, (NEW - 1) * batch // 100), f"{flips} tokens differ from the reference"


def test_slots_on_the_gpu_decode_as_if_alone_and_seeds_repeat(tmp_path, checkpoint):
    """Per-slot batching on the megakernel: a request that joins while another decodes gets the tokens
    it gets alone (batch rows are computed independently), and a seeded sampled request (logits read
    back each step, token chosen by trtllm_mk.sampling) repeats exactly."""
    from trtllm_mk.build import build_engine
    from trtllm_mk.runtime.hybrid import HybridEngine
    from trtllm_mk.sampling import SamplingParams
    from trtllm_mk.serve.scheduler import make_request
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.yaml")
    cfg = with_overrides(cfg, {"model": str(checkpoint), "gpu": "auto", "max_batch_size": 2,
                               "megakernel": {"search_budget_s": 2.0}})
    out, _ = build_engine(cfg, tmp_path / "engine", show_progress=False)
    eng = HybridEngine(out, weights=str(checkpoint))
    prompts = [[3, 141, 59, 26, 5, 358, 97], [6, 7, 8, 9, 10]]
    alone = [eng.generate([p], 24, eos_ids=()).tokens[0] for p in prompts]
    sched = eng.scheduler
    sched.start()
    long = make_request(eng, prompts[0], 64, ignore_eos=True)
    sched.submit(long)
    next(long.events())
    late = make_request(eng, prompts[1], 24, ignore_eos=True)
    sched.submit(late)
    assert late.result().tokens == alone[1]
    assert long.result().tokens[:24] == alone[0]
    p = SamplingParams(temperature=1.0, top_k=40, seed=7)
    a = eng.generate(prompts, 24, eos_ids=(), sampling=p).tokens
    b = eng.generate(prompts[:1], 24, eos_ids=(), sampling=p).tokens
    assert a[0] == b[0]
    eng.close()
