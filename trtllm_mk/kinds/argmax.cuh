// ARGMAX's device body: the second-level argmax over the LM-head tiles, and the end of the step.
// Inlined by codegen after the shared device headers (trtllm_mk/device), before mk_kernel.cuh.
#pragma once

namespace mk {

// First argmax over the consumer threads' candidates; the result is valid in consumer thread 0.
__device__ void block_argmax(Ctx& c, float& best, int& bi) {
  warp_argmax(best, bi);
  if (c.lane() == 0) { c.scratch()[c.warp()] = best; reinterpret_cast<int*>(c.scratch())[128 + c.warp()] = bi; }
  consumer_sync(CTHREADS);
  if (threadIdx.x == 0) {
    for (int w = 1; w < cfg::CWARPS; ++w) {
      const float ov = c.scratch()[w];
      const int oi = reinterpret_cast<int*>(c.scratch())[128 + w];
      if (argmax_better(ov, oi, best, bi)) { best = ov; bi = oi; }
    }
  }
}

// ARGMAX's step-invariant input, read before its wait: this step's positions (nothing writes them
// until ARGMAX itself), so the history store and the advance below cost no round trip on the tail.
__device__ __forceinline__ void argmax_prologue(const Ctx& c, int (&pos)[cfg::B]) {
  if (threadIdx.x == 0) {
#pragma unroll
    for (int b = 0; b < cfg::B; ++b) pos[b] = ld_act(c.p->pos + b);
  }
}

// The second-level argmax, and the end of the step: ARGMAX is the step's last task (it waits on every
// LM-head tile, and every other task of the step precedes those), so no CTA reads pos or the step
// counter after it, and it advances both itself; the next launch sees them at the kernel boundary. An
// end-of-kernel "last CTA to finish" protocol put a fence, an atomic round trip and a read-modify-
// write of pos after this task on the step's critical path (benchmarks/NOTES.md).
__device__ void argmax_compute(Ctx& c, const TaskArgs& a, const int (&pos)[cfg::B]) {
  const Params& p = *c.p;
  for (int b = 0; b < cfg::B; ++b) {
    float best = -INFINITY;
    int bi = 0x7fffffff;
    for (int t = threadIdx.x; t < cfg::N_LM_TILES; t += CTHREADS) {
      const float v = ld_act(p.lm_val + b * cfg::N_LM_TILES + t);
      const int idx = ld_act(p.lm_idx + b * cfg::N_LM_TILES + t);
      if (argmax_better(v, idx, best, bi)) { best = v; bi = idx; }
    }
    block_argmax(c, best, bi);
    if (threadIdx.x == 0) {
      if (bi == 0x7fffffff) {   // no logit of the row is a number above -inf: report it, emit token 0
        if (atomicCAS(&p.error->code, 0u, (uint32_t)ERR_NONFINITE_LOGITS) == 0u) { p.error->sm = blockIdx.x; p.error->layer = b; p.error->task = c.step; }
        bi = 0;
      }
      p.tokens[b] = bi;
      if (pos[b] + 1 < cfg::HISTORY_LEN) p.history[(size_t)b * cfg::HISTORY_LEN + pos[b] + 1] = bi;
      p.pos[b] = pos[b] + 1;
#if defined(MK_USE_BULK_COPY)
      if (diag::PREFETCH_NEXT) bulk_prefetch_l2(p.embed + (size_t)bi * cfg::H, cfg::H * 2);   // the next step's EMBED row
#endif
    }
    consumer_sync(CTHREADS);
  }
  if (threadIdx.x == 0) p.control[0] = c.step + 1;
}

template <>
struct KindBody<ARGMAX> : NoLoad {
  struct Pre { int pos[cfg::B]; };
  static __device__ __forceinline__ void prologue(Ctx& c, const TaskArgs&, Pre& pre) { argmax_prologue(c, pre.pos); }
  static __device__ __forceinline__ void compute(Ctx& c, const TaskArgs& a, Pre& pre) { argmax_compute(c, a, pre.pos); }
};

}  // namespace mk
