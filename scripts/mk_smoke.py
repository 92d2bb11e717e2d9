"""Development smoke test of the megakernel on a GPU: decode-only prefill + greedy decode, compared
step by step with HuggingFace transformers (fp32) on random weights; then a timing of the step.
Usage: python scripts/mk_smoke.py [tiny-llama|tiny-qwen3|tiny-qwen2|llama-1b] [batch] [--prebuild]
(--prebuild: compile the kernel into the cubin cache for a 132-SM H100 without a GPU; MK_SMOKE_MERGE=1:
a plan whose OPROJ merges the attention partials, TilePlan.o_merge; MK_SMOKE_W4=1: the decoder layers'
weights RTN-quantized to 4 bits in groups of 64, the kernel streaming them packed; MK_SMOKE_W4=8: FP8
e4m3 with per-channel scales; MK_SMOKE_CPASYNC=1: the weight ring of GPUs without bulk copies, the loader
warps' 16-byte cp.async)"""
import dataclasses
import os
import sys
import time

import torch

from trtllm_mk.codegen import Diagnostics, compile_cubin, generate_source
from trtllm_mk.graph import TilePlan, build_step_graph
from trtllm_mk.kv_cache import PagedKVCache
from trtllm_mk.model.rope import rope_inv_freq
from trtllm_mk.model.spec import spec_from_hf_config
from trtllm_mk.runtime.megakernel import MegakernelDecoder
from trtllm_mk.model.random_weights import random_weights
from trtllm_mk.schedule import Schedule
from trtllm_mk.search import naive_programs

SHAPES = {
    "tiny-llama": dict(architectures=["LlamaForCausalLM"], hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                       num_attention_heads=8, num_key_value_heads=2, head_dim=32, vocab_size=512, tie_word_embeddings=False,
                       rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=4096),
    "tiny-qwen3": dict(architectures=["Qwen3ForCausalLM"], hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=512, tie_word_embeddings=True,
                       rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=4096),
    "tiny-qwen2": dict(architectures=["Qwen2ForCausalLM"], hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False,
                       rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=4096),
    "llama-1b": dict(architectures=["LlamaForCausalLM"], hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True,
                     rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072,
                     rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                       original_max_position_embeddings=8192)),
}


def main():
    args = [a for a in sys.argv[1:] if a != "--prebuild"]
    prebuild = "--prebuild" in sys.argv
    name = args[0] if args else "tiny-llama"
    B = int(args[1]) if len(args) > 1 else 1
    cfg = SHAPES[name]
    spec = spec_from_hf_config(cfg, name)
    quant = os.environ.get("MK_SMOKE_W4", "0")
    w4 = quant in ("1", "8")
    if quant == "1":
        spec = dataclasses.replace(spec, weight_bits=4, weight_group=64)
    elif quant == "8":
        from trtllm_mk.quant.kernel_layout import tile_cols
        spec = dataclasses.replace(spec, weight_bits=8, weight_group=tile_cols(spec))
    nsm = 132 if prebuild else torch.cuda.get_device_properties(0).multi_processor_count
    big = spec.hidden_size >= 1024
    small = 16 if w4 else 8   # 4-bit tiles hold 16 rows
    plan = TilePlan(qkv_rows=32 if big else small, o_rows=16 if big else small, gateup_rows=64 if big else small,
                    down_rows=16 if big else small, lm_rows=1024 if big else 64, attn_splits=8, stages=6, slot_bytes=32768)  # 6 x 33 KB ring
    if os.environ.get("MK_SMOKE_MERGE") == "1":   # OPROJ merges the attention partials (no COMBINE tasks)
        plan = dataclasses.replace(plan, o_merge=True, o_ksplit=spec.num_kv_heads)
    sch = Schedule(spec=spec, batch=B, plan=plan, num_sms=nsm, gpu="H100-SXM", programs=[])
    g = build_step_graph(spec, B, plan)
    sch.programs = naive_programs(g, nsm)
    max_seq = 1024
    # MK_SMOKE_ARRIVE_ALL=1: the sanitizer variant of the ring release (see EMPTY_ARRIVALS in mk_kernel.cuh)
    diag = Diagnostics(all_lanes_release=int(os.environ.get("MK_SMOKE_ARRIVE_ALL") == "1"))
    src, layout = generate_source(sch, 32, max_seq, use_bulk_copy=os.environ.get("MK_SMOKE_CPASYNC") != "1",
                                  diagnostics=diag)
    t0 = time.time()
    cubin, rep = compile_cubin(src, "sm_90a")
    print(f"compiled in {time.time() - t0:.1f}s smem={layout.smem_bytes}", [l for l in rep.splitlines() if "Used" in l][:1])
    if prebuild:
        return
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    w = random_weights(spec, device=dev, seed=0)
    bind = w
    if w4:   # the kernel binds the packed layout; the reference below runs the kernel's own weights
        from trtllm_mk.quant.kernel_layout import kernel_weights, quantize_model
        bind, w = kernel_weights(spec, quantize_model(spec, w, symmetric=False) if quant == "1"
                                 else quantize_model(spec, w))
    cache = PagedKVCache.allocate(spec, B, max_seq, 32, device=dev, fill=1e4)
    dec = MegakernelDecoder(sch, cubin, layout, bind, cache, rope_inv_freq(spec))
    if os.environ.get("MK_SMOKE_SAMPLE") == "1":   # every row samples: top-k + top-p, 5 top log-probabilities
        from trtllm_mk.sampling import SamplingParams
        for b in range(B):
            dec.set_sampling(b, SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=b, logprobs=5))
    short = os.environ.get("MK_SMOKE_SHORT") == "1"   # under compute-sanitizer: a few steps, no timing
    P, N = (4, 4) if short else (20, 40)
    prompt = torch.randint(0, spec.vocab_size, (B, P), generator=gen, device=dev)
    seq = prompt.clone()
    logits_mk = []
    for t in range(P + N - 1):
        if t < P:
            dec.set_state(seq[:, t], torch.full((B,), t, device=dev))
        dec.step()
        dec.synchronize()
        logits_mk.append(dec.logits.clone())
        if t >= P - 1:
            seq = torch.cat([seq, dec.tokens.clone().long()[:, None]], 1)
    # HF reference on the final sequence (teacher forcing with our tokens)
    import transformers
    hf_cfg = transformers.AutoConfig.for_model(cfg.get("model_type", {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3", "Qwen2ForCausalLM": "qwen2"}[cfg["architectures"][0]]), **{k: v for k, v in cfg.items() if k != "architectures"})
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager").float().to(dev)
    sd = {k: v.float() for k, v in w.items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and spec.tie_word_embeddings)]
    assert not missing, missing
    if spec.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    with torch.no_grad():
        ref = model(seq[:, :-1]).logits.float()  # [B, T, V]
    mk = torch.stack(logits_mk, 1)
    T = mk.shape[1]
    ref = ref[:, :T]
    rel = ((mk - ref).norm(dim=-1) / ref.norm(dim=-1))
    print(f"{name} B={B}: per-step rel err max {rel.max().item():.3e} mean {rel.mean().item():.3e}")
    agree = (mk.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"argmax agreement {agree:.4f}")
    if short:
        return
    # timing
    for _ in range(5):
        dec.step()
    dec.synchronize()
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(30):
        st.record(); dec.step(); en.record(); en.synchronize(); times.append(st.elapsed_time(en))
    times.sort()
    gb = spec.decode_weight_bytes() / 1e9
    print(f"step median {times[15] * 1000:.1f} us  ({gb / (times[15] / 1e3):.0f} GB/s weights)")


if __name__ == "__main__":
    main()
