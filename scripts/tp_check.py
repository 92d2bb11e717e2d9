"""Tensor-parallel megakernels across the GPUs of one host, one rank per process:

    torchrun --nproc-per-node N scripts/tp_check.py [--model llama-3.2-1b] [--layers 4] [--batch 1]
             [--steps 32] [--speed [--trace]] [--set FIELD=VALUE ...] [--out DIR]

Each rank searches the schedule of its share of the model (the search is deterministic, so every rank
gets the same one), compiles it, binds its weight shard and its KV cache, and puts its cross-rank
buffers (residual, event counters, LM-head maxima) in torch's symmetric memory
(parallel/gpu_ranks.py). Then:

* check (default): greedy decode from a prefill of the emulated tensor-parallel decoder
  (parallel/emulate.py), every rank's tokens compared, and rank 0 replays each step with the emulation
  teacher-forced over the kernels' tokens and gathered KV caches (relative logit error, token flips).
* ``--speed``: random weights made on each rank for its shard only (full depth fits), per-step time of
  the tensor-parallel kernels (CUDA events, median after warm-up), in the same run the step of the
  gpt-fast-style tensor-parallel decoder under torch.compile with NCCL all-reduces
  (benchmarks/tp_baseline.py; ``--no-baseline`` leaves it out) on the same weight tensors, and the
  latency of an NCCL all-reduce of one step's residual message. ``--trace`` then records one step's
  per-task timeline on every rank (trtllm_mk/runtime/trace.py); rank 0 prints its per-kind table and
  writes ``tp_trace_rank0.json`` / ``.png`` (the ranks' GPU clocks are not one clock, so each rank's
  timeline stands alone).

``--set FIELD=VALUE`` replaces tile plan fields of the searched plan (every rank alike) and list-schedules
the changed plan, to measure what the search did not pick.

Results go to ``DIR/tp_check.json`` (rank 0). Exit 1 when the check fails.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def _args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (0: the model's own depth)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--context", type=int, default=512, help="--speed: tokens already cached")
    ap.add_argument("--speed", action="store_true")
    ap.add_argument("--trace", action="store_true", help="--speed: also trace one step on every rank")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="tile plan field")
    ap.add_argument("--no-baseline", dest="baseline", action="store_false",
                    help="--speed: time the megakernel only (not the torch.compile tensor-parallel decoder)")
    ap.add_argument("--budget", type=float, default=10.0, help="search budget, seconds")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--prebuild", type=int, metavar="TP", default=0,
                    help="compile the kernel of TP ranks into the cubin cache and exit (no GPU; TRTLLM_MK_TEST_GPU "
                         "names the GPU, default H100-SXM)")
    return ap.parse_args()


def _timed(fn, iters: int, warmup: int = 5) -> float:
    """Median microseconds of fn() by CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def _kernel(spec, tp, batch, gpu, context, budget, sets=None):
    """(schedule, cubin, layout) of one rank's share of ``spec`` over ``tp`` GPUs; ``sets``: tile plan
    fields that replace the searched plan's."""
    from trtllm_mk.codegen import compile_cubin, generate_source
    from trtllm_mk.parallel import rank_spec
    from trtllm_mk.search import schedule_plan
    from trtllm_mk.search.cached import cached_search
    share = rank_spec(spec, tp)
    sch = cached_search(share, batch, gpu, context, budget)
    if sets:
        sch = schedule_plan(share, batch, gpu, dataclasses.replace(sch.plan, **sets), context)
    src, layout = generate_source(sch, 32, MAX_SEQ, use_bulk_copy=gpu.has_tma)
    cubin, _ = compile_cubin(src, gpu.nvcc_arch)
    return sch, cubin, layout


MAX_SEQ = 4096


def _trace(dec, sch, rank: int, context: int, out: Path) -> dict:
    """Trace one step on every rank (they wait on each other); rank 0 summarizes its own timeline."""
    from trtllm_mk.runtime.trace import format_summary, plot_timeline, summarize
    dec.set_trace(True)
    B = sch.batch
    dec.set_state(torch.zeros(B, dtype=torch.int32, device="cuda"), torch.full((B,), context, device="cuda"))
    dist.barrier()
    for _ in range(3):
        dec.step()
    tasks, per_sm = dec.read_trace()
    dec.set_trace(False)
    summ = summarize(sch, tasks.numpy(), per_sm.numpy())
    if rank != 0:
        return {}
    print(format_summary(summ), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    plot_timeline(summ, out / "tp_trace_rank0.png", title=f"rank 0 of {dist.get_world_size()}, {sch.spec.name}")
    body = {k: v for k, v in summ.items() if k != "records"}
    (out / "tp_trace_rank0.json").write_text(json.dumps(body, indent=1) + "\n")
    return {k: body[k] for k in ("step_us", "layer_period_us", "layer_phases", "event_latency_us")}


def _spec(args):
    from trtllm_mk.model.registry import resolve_model
    spec = resolve_model(args.model).spec
    return dataclasses.replace(spec, num_layers=args.layers) if args.layers else spec


def main() -> int:
    from mk_trace import parse_sets
    args = _args()
    if args.prebuild:
        from trtllm_mk.gpus import get_gpu
        gpu = get_gpu(os.environ.get("TRTLLM_MK_TEST_GPU", "H100-SXM"))
        _, cubin, _ = _kernel(_spec(args), args.prebuild, args.batch, gpu, args.context, args.budget,
                              parse_sets(args.set))
        print(cubin)
        return 0
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    rank, tp = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD

    from trtllm_mk.gpus import detect_gpu
    from trtllm_mk.kv_cache import PagedKVCache
    from trtllm_mk.model.random_weights import random_weights
    from trtllm_mk.model.rope import rope_inv_freq
    from trtllm_mk.parallel import rank_spec, shard_weights
    from trtllm_mk.parallel.emulate import TensorParallelDecoder, cross_rank_argmax
    from trtllm_mk.parallel.gpu_ranks import connect_over_process_group, symmetric_allocator
    from trtllm_mk.runtime.megakernel import MegakernelDecoder

    spec = _spec(args)
    share = rank_spec(spec, tp)
    gpu = detect_gpu()
    sch, cubin, layout = _kernel(spec, tp, args.batch, gpu, args.context, args.budget, parse_sets(args.set))
    B, max_seq = args.batch, MAX_SEQ
    result = dict(model=spec.name, layers=spec.num_layers, tp=tp, batch=B, gpu=gpu.name,
                  device=torch.cuda.get_device_name(), predicted_step_us=sch.predicted_step_us,
                  plan=sch.plan.to_dict())

    def decoder(weights, cache):
        dec = MegakernelDecoder(sch, cubin, layout, weights, cache, rope_inv_freq(share),
                                peer_alloc=symmetric_allocator(group))
        connect_over_process_group(dec, group)
        return dec

    if args.speed:
        from trtllm_mk.model.decoder_block import share_fused_storage
        # fused q/k/v and gate/up rows: the baseline's decoder reads the very tensors the kernel binds
        weights = share_fused_storage(share, random_weights(share, device="cuda", seed=rank))
        cache = PagedKVCache.allocate(share, B, max_seq, 32, device="cuda", fill=1.0, seed=3 + rank)
        dec = decoder(weights, cache)
        dec.set_state(torch.zeros(B, dtype=torch.int32, device="cuda"), torch.full((B,), args.context, device="cuda"))
        dist.barrier()
        result["step_us_p50"] = _timed(dec.step, args.steps)   # positions advance by one per step
        dec.synchronize()
        if rank == 0:   # now, in case the baseline's compile outlasts the caller's time limit
            print(f"megakernel step p50 {result['step_us_p50']:.1f} us (predicted {sch.predicted_step_us:.1f})",
                  flush=True)
        if args.baseline:
            from benchmarks.baselines import compiled_step, random_prompt
            from benchmarks.tp_baseline import TensorParallelStaticDecoder
            base = TensorParallelStaticDecoder(spec, weights, tp, rank, group, B, args.context + 8)
            base.prefill(random_prompt(spec, B, args.context, torch.device("cuda")))
            tok = torch.zeros(B, dtype=torch.long, device="cuda")
            step, close = compiled_step(base, tok, torch.full((B,), args.context, device="cuda"))
            dist.barrier()
            result["baseline"] = "gpt-fast-style tensor-parallel decoder, torch.compile reduce-overhead, NCCL all-reduce"
            result["baseline_step_us_p50"] = _timed(step, args.steps)
            result["speedup"] = result["baseline_step_us_p50"] / result["step_us_p50"]
            close()
        msg = torch.randn(B, spec.hidden_size, device="cuda")
        result["nccl_allreduce_us_p50"] = _timed(lambda: dist.all_reduce(msg), 50)
        if args.trace:
            result["trace"] = _trace(dec, sch, rank, args.context, Path(args.out))
        ok = True
    else:
        from test_megakernel_gpu import _weights   # random weights with GPT-2's residual scaling
        weights = _weights(spec)
        emu = TensorParallelDecoder(spec, weights, tp, compute_dtype=torch.float32, gemv_input_dtype=torch.bfloat16)
        caches = [PagedKVCache.allocate(share, B, max_seq, 32, device="cuda", fill=1e4, seed=3) for _ in range(tp)]
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, spec.vocab_size, (17 + 29 * b,), generator=gen).tolist() for b in range(B)]
        first = cross_rank_argmax(emu.prefill_shards(prompts, caches))
        pos = torch.tensor([len(p) for p in prompts], device="cuda")
        dec = decoder(shard_weights(spec, weights, tp, rank), caches[rank])
        dec.set_state(first, pos)
        torch.cuda.synchronize()
        dist.barrier()   # the ranks' kernels wait on each other: start them together
        tokens, logits = [first.cpu()], []
        agree = True
        for _ in range(args.steps):
            dec.step()
            got = [torch.empty(B, dec.logits.shape[1], device="cuda") for _ in range(tp)]
            dist.all_gather(got, dec.logits.contiguous())
            toks = [torch.empty(B, dtype=torch.int32, device="cuda") for _ in range(tp)]
            dist.all_gather(toks, dec.tokens)
            agree &= all(torch.equal(toks[0], t) for t in toks[1:])
            logits.append(torch.cat(got, -1))
            tokens.append(toks[0].cpu().long())
        dec.synchronize()
        pools = [torch.empty_like(caches[rank].pool) for _ in range(tp)]
        dist.all_gather(pools, caches[rank].pool)
        errs, flips = [], 0
        ref = [PagedKVCache(p.clone(), c.block_table.clone(), c.tokens_per_block) for p, c in zip(pools, caches)]
        for t in range(args.steps):
            for rc, p in zip(ref, pools):
                rc.pool.copy_(p)
            want = emu.decode(tokens[t].cuda(), pos + t, ref)
            errs.append(((logits[t] - want).norm(dim=-1) / want.norm(dim=-1)).max().item())
            flips += int((want.argmax(-1).cpu() != tokens[t + 1]).sum())
        errs.sort()
        result.update(steps=args.steps, ranks_agree=bool(agree), rel_err_median=errs[len(errs) // 2],
                      rel_err_max=errs[-1], flips=flips, tokens=[t.tolist() for t in tokens[:8]])
        ok = agree and errs[len(errs) // 2] < 1e-2 and errs[-1] < 5e-2 and flips <= 0.1 * args.steps * B
        result["ok"] = ok
    if rank == 0:
        print(json.dumps(result, indent=1), flush=True)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        name = "tp_speed.json" if args.speed else "tp_check.json"
        (out / name).write_text(json.dumps(result, indent=1) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    root = Path(__file__).resolve().parent.parent
    # benchmarks/ (the baseline), tests/ (their weights), scripts/ (mk_trace's --set parser)
    sys.path[:0] = [str(root), str(root / "tests"), str(root / "scripts")]
    sys.exit(main())
