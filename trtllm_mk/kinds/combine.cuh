// COMBINE's device body: attn_out of one KV group, merged from its split partials (merge_splits,
// shared with OPROJ's o_merge staging in mk_gemv.cuh). Inlined by codegen after the shared headers.
#pragma once

namespace mk {

__device__ void combine_compute(Ctx& c, const TaskArgs& a) {
  const Params& p = *c.p;
  for (int i = threadIdx.x; i < cfg::B * cfg::G * cfg::D; i += CTHREADS) {
    const int b = i / (cfg::G * cfg::D), h = (i / cfg::D) % cfg::G, e = i % cfg::D;
    p.attn_out[(size_t)b * cfg::QD + (a.group * cfg::G + h) * cfg::D + e] = merge_splits(p, b, a.group, h, e);
  }
  consumer_sync(CTHREADS);
}

}  // namespace mk
