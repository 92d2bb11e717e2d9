// Small tasks: embedding lookup and the final (second-level) argmax.
#pragma once
#include "mk_gemv.cuh"

namespace mk {

__device__ void embed_compute(Ctx& c, const TaskArgs& a) {
  const Params& p = *c.p;
  const int n = a.r1 - a.r0;
  for (int i = threadIdx.x; i < cfg::B * n; i += CTHREADS) {
    const int b = i / n, r = a.r0 + i % n;
    const int tok = ld_act(p.tokens + b);
    p.x[(size_t)b * cfg::H + r] = bf16_to_f(p.embed[(size_t)tok * cfg::H + r]);
  }
  consumer_sync(CTHREADS);
}

__device__ void argmax_compute(Ctx& c, const TaskArgs& a) {
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
      p.tokens[b] = bi;
      const int pos = ld_act(p.pos + b);
      if (pos + 1 < cfg::HISTORY_LEN) p.history[(size_t)b * cfg::HISTORY_LEN + pos + 1] = bi;
    }
    consumer_sync(CTHREADS);
  }
}

}  // namespace mk
