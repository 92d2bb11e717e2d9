"""Debug aid: one decode step of the megakernel against the CPU executor (the task graph's exact
semantics) from the same KV cache, buffer by buffer, on a one-layer model so that every
intermediate buffer still holds that layer's values. Usage: python scripts/mk_diff.py [family] [batch]"""
import dataclasses
import sys

import torch

from trtllm_mk.executor import CpuExecutor
from trtllm_mk.gpus import detect_gpu
from trtllm_mk.kv_cache import PagedKVCache
from trtllm_mk.model.random_weights import random_weights
from trtllm_mk.model.spec import spec_from_hf_config
from trtllm_mk.model.tiny import tiny_config
from trtllm_mk.reference import ReferenceDecoder
from trtllm_mk.runtime.megakernel import build_decoder
from trtllm_mk.search import search

family = sys.argv[1] if len(sys.argv) > 1 else "llama"
B = int(sys.argv[2]) if len(sys.argv) > 2 else 1
if family in ("llama", "qwen2", "qwen3", "mistral"):
    spec = spec_from_hf_config(tiny_config(family, num_hidden_layers=1), f"tiny1-{family}")
else:  # an architecture from configs/models with one layer: real widths, every kernel path
    from trtllm_mk.model.registry import resolve_model
    spec = dataclasses.replace(resolve_model(family).spec, num_layers=1)
gpu = detect_gpu()
w = random_weights(spec, device="cuda", seed=2, std=0.02 if spec.hidden_size > 512 else 0.1)
sched, _ = search(spec, B, gpu, context_len=64, budget_s=1.0, seed=0)
cache = PagedKVCache.allocate(spec, B, 256, 32, device="cuda", fill=1e4)
ref = ReferenceDecoder(spec, {k: v.float() for k, v in w.items()}, torch.float32, gemv_input_dtype=torch.bfloat16)
prompts = [list(range(3 + 7 * b, 40 + 11 * b)) for b in range(B)]
first = ref.prefill(prompts, cache).argmax(-1).int()
pos = torch.tensor([len(p) for p in prompts], dtype=torch.int32)
cpu_cache = PagedKVCache(cache.pool.cpu().clone(), cache.block_table.cpu().clone(), cache.tokens_per_block)
dec = build_decoder(sched, w, cache, gpu.nvcc_arch, gpu.has_tma)
dec.set_state(first, pos)
dec.step()
dec.synchronize()
ex = CpuExecutor(spec, {k: v.cpu() for k, v in w.items()}, sched, cpu_cache)
ex.step(first.cpu(), pos)
want_ref = ref.decode(first.cuda(), pos.cuda(), PagedKVCache(cpu_cache.pool.cuda(), cache.block_table, 32))
print("plan", sched.plan)
for name in ("qkv", "part_o", "part_ml", "attn_out", "act", "x", "logits"):
    a, b = dec.buf.values(name).float().cpu(), getattr(ex, name).float()
    fin = torch.isfinite(b)
    err = ((a - b)[fin].norm() / b[fin].norm()).item()
    worst = (a - b).abs()[fin].max().item()
    print(f"{name:9s} rel {err:.3e}  max abs {worst:.3e}")
print(f"logits kernel vs reference {((dec.logits.cpu() - want_ref.cpu()).norm() / want_ref.norm()).item():.3e}")
print(f"executor vs reference {((ex.logits - want_ref.cpu()).norm() / want_ref.norm()).item():.3e}")
kd = (cache.pool.float().cpu() - cpu_cache.pool.float()).abs()
print("kv cache max abs diff", kd.max().item())
