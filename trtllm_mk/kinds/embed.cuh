// EMBED's device body: copies the token's embedding rows [r0, r1) into the (fixed-point) residual x.
// Inlined by codegen after the shared device headers (trtllm_mk/device), before mk_kernel.cuh.
#pragma once

namespace mk {

__device__ void embed_compute(Ctx& c, const TaskArgs& a) {
  const Params& p = *c.p;
  const int n = a.r1 - a.r0;
  for (int i = threadIdx.x; i < cfg::B * n; i += CTHREADS) {
    const int b = i / n, r = a.r0 + i % n;
    int tok = ld_act(p.tokens + b);
    if ((unsigned)tok >= (unsigned)cfg::V) tok = 0;   // never read outside the table (ARGMAX flags a bad row)
    p.x[(size_t)b * cfg::H + r] = resid_fixed(bf16_to_f(p.embed[(size_t)tok * cfg::H + r]));
  }
  consumer_sync(CTHREADS);
}

template <>
struct KindBody<EMBED> : NoLoad, NoPrologue {
  static __device__ __forceinline__ void compute(Ctx& c, const TaskArgs& a, Pre&) { embed_compute(c, a); }
};

}  // namespace mk
