// EMBED's device body: copies the token's embedding rows [r0, r1) into the (fixed-point) residual x.
// Under tensor parallelism the rank holding the token's row in its vocabulary shard writes it into
// every rank's x. Inlined by codegen after the shared device headers (trtllm_mk/device), before
// mk_kernel.cuh.
#pragma once

namespace mk {

__device__ void embed_compute(Ctx& c, const TaskArgs& a) {
  const Params& p = *c.p;
  const int n = a.r1 - a.r0;
  for (int i = threadIdx.x; i < cfg::B * n; i += CTHREADS) {
    const int b = i / n, r = a.r0 + i % n;
    int tok = ld_act(p.tokens + b);
    if ((unsigned)tok >= (unsigned)(cfg::TP * cfg::V)) tok = 0;   // never read outside the table (ARGMAX flags a bad row)
    if constexpr (cfg::TP > 1) {
      const int local = tok - (int)p.rank * cfg::V;
      if ((unsigned)local >= (unsigned)cfg::V) continue;   // another rank's token: that rank writes the row
      const long long v = resid_fixed(bf16_to_f(p.embed[(size_t)local * cfg::H + r]));
#pragma unroll
      for (int k = 0; k < cfg::TP; ++k) p.peers[k].x[(size_t)b * cfg::H + r] = v;
    } else {
      const long long v = resid_fixed(bf16_to_f(p.embed[(size_t)tok * cfg::H + r]));
      if constexpr (cfg::RESID_COUNTED)   // the step's first count: QKV polls it (graph.builder counted_residual)
        st_resid_counted(p.x + (size_t)b * cfg::H + r, v, resid_count(c.step, 0, 0));
      else
        p.x[(size_t)b * cfg::H + r] = v;
    }
  }
  consumer_sync(CTHREADS);
}

template <>
struct KindBody<EMBED> : NoLoad, NoPrologue {
  static __device__ __forceinline__ void compute(Ctx& c, const TaskArgs& a, Pre&) { embed_compute(c, a); }
};

}  // namespace mk
