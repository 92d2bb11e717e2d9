"""Debug aid: per-step logits error of the megakernel against the CPU executor and the
kernel-numerics reference, each step started from the kernel's own KV cache.
Usage: python scripts/mk_steps.py [tiny-llama|tiny-qwen3|...] [batch] [steps] [layers]"""
import sys

import torch

sys.path.insert(0, "tests")
from test_megakernel_gpu import TINY, _decoder, _prompts  # noqa: E402
from trtllm_mk.executor import CpuExecutor  # noqa: E402
from trtllm_mk.kv_cache import PagedKVCache  # noqa: E402
from trtllm_mk.model.random_weights import random_weights  # noqa: E402
from trtllm_mk.model.spec import spec_from_hf_config  # noqa: E402
from trtllm_mk.reference import ReferenceDecoder  # noqa: E402
from trtllm_mk.residual import from_fixed, word_values  # noqa: E402

name = sys.argv[1] if len(sys.argv) > 1 else "tiny-llama"
B, steps, layers = (int(a) for a in (sys.argv[2:5] + ["1", "8", "2"][len(sys.argv[2:5]):]))
spec = spec_from_hf_config(dict(max_position_embeddings=4096, **{**TINY[name], "num_hidden_layers": layers}), name)
w = random_weights(spec, device="cuda", seed=0)
dec, cache = _decoder(spec, B, w)
print("plan", dec.schedule.plan)
ref = ReferenceDecoder(spec, {k: v.float() for k, v in w.items()}, torch.float32, gemv_input_dtype=torch.bfloat16)
prompts = _prompts(spec, B, torch.Generator().manual_seed(1))
first = ref.prefill(prompts, cache).argmax(-1).int()
pos = torch.tensor([len(p) for p in prompts], dtype=torch.int32, device="cuda")
dec.set_state(first, pos)
tok = first.clone()
wc = {k: v.cpu() for k, v in w.items()}
for t in range(steps):
    before = cache.pool.clone()
    dec.step()
    dec.synchronize()
    rc = PagedKVCache(before.clone(), cache.block_table, 32)
    want = ref.decode(tok, pos + t, rc)
    ex = CpuExecutor(spec, wc, dec.schedule, PagedKVCache(before.cpu(), cache.block_table.cpu(), 32))
    exl, _ = ex.step(tok.cpu(), (pos + t).cpu())
    got = dec.logits.cpu()
    e_ref = ((got - want.cpu()).norm() / want.norm()).item()
    e_ex = ((got - exl).norm() / exl.norm()).item()
    gx = from_fixed(word_values(dec.buf.x.cpu(), dec.schedule.graph().dims.resid_counted))
    ex_x = from_fixed(ex.x)
    e_x = ((gx - ex_x).norm() / ex_x.norm()).item()
    kv = (cache.pool.float().cpu() - ex.cache.pool.float()).abs().max().item()
    if t < 2 or e_ref > 1e-5 or e_ex > 1e-5:
        print(f"step {t} pos {(pos + t).tolist()}: vs reference {e_ref:.2e}, vs executor {e_ex:.2e}, x {e_x:.2e}, "
              f"kv max {kv:.2e}")
    tok = dec.tokens.clone()
