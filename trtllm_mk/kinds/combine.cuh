// COMBINE's device body: attn_out of one KV group, merged from its split partials (merge_splits,
// shared with OPROJ's o_merge staging in oproj.cuh). Inlined by codegen after the shared headers.
#pragma once

namespace mk {

// Element e of head h of KV group g, batch row b, of the attention output, merged from ATTN's S split
// partials: the one merge of COMBINE and of OPROJ's staging under TilePlan.o_merge. Every split's
// (max, sum, o) is loaded before any is used: one L2 round trip, not S dependent ones.
__device__ __forceinline__ float merge_splits(const Params& p, int b, int g, int h, int e) {
  const size_t base = ((size_t)b * cfg::NKV + g) * cfg::S * cfg::G + h;  // + s*G
  float ms[cfg::S], ls[cfg::S], os[cfg::S];
#pragma unroll
  for (int s = 0; s < cfg::S; ++s) {
    const float2 ml = __ldcg(reinterpret_cast<const float2*>(p.part_ml) + base + s * cfg::G);
    ms[s] = ml.x;
    ls[s] = ml.y;
    os[s] = ld_act(p.part_o + (base + s * cfg::G) * cfg::D + e);
  }
  float M = -INFINITY;
#pragma unroll
  for (int s = 0; s < cfg::S; ++s) M = fmaxf(M, ms[s]);
  float num = 0.f, den = 0.f;
#pragma unroll
  for (int s = 0; s < cfg::S; ++s) {
    if (ms[s] == -INFINITY) continue;   // an empty split (t0 >= len)
    const float f = __expf(ms[s] - M);
    num += f * os[s];
    den += f * ls[s];
  }
  return num / den;
}

__device__ void combine_compute(Ctx& c, const TaskArgs& a) {
  const Params& p = *c.p;
  for (int i = threadIdx.x; i < cfg::B * cfg::G * cfg::D; i += CTHREADS) {
    const int b = i / (cfg::G * cfg::D), h = (i / cfg::D) % cfg::G, e = i % cfg::D;
    p.attn_out[(size_t)b * cfg::QD + (a.group * cfg::G + h) * cfg::D + e] = merge_splits(p, b, a.group, h, e);
  }
  consumer_sync(CTHREADS);
}

template <>
struct KindBody<COMBINE> : NoLoad, NoPrologue {
  static __device__ __forceinline__ void compute(Ctx& c, const TaskArgs& a, Pre&) { combine_compute(c, a); }
};

}  // namespace mk
