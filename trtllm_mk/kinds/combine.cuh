// COMBINE's device body: attn_out of one KV group, merged from its split partials (merge_heads,
// shared with OPROJ's o_merge staging in oproj.cuh). Inlined by codegen after the shared headers.
#pragma once

namespace mk {

// The split-merge factors of heads [head0, head0 + NH) (the rank's q-head numbers) of every batch
// row, into shared `w`: per (row, head) S + 1 floats, f_s = exp(m_s - M) (0 for an empty split) and
// 1 / sum_s f_s l_s. They are per head, not per element: one thread per (row, head) loads its S
// (max, sum) pairs together and divides once, so that the elements multiply.
template <int NH>
__device__ __forceinline__ void merge_factors(const Params& p, int head0, float* w) {
  for (int i = threadIdx.x; i < cfg::B * NH; i += CTHREADS) {
    const int b = i / NH, head = head0 + i % NH;
    const size_t base = ((size_t)b * cfg::NKV + head / cfg::G) * cfg::S * cfg::G + head % cfg::G;  // + s*G
    float2 ml[cfg::S];
#pragma unroll
    for (int s = 0; s < cfg::S; ++s) ml[s] = __ldcg(reinterpret_cast<const float2*>(p.part_ml) + base + s * cfg::G);
    float M = -INFINITY;
#pragma unroll
    for (int s = 0; s < cfg::S; ++s) M = fmaxf(M, ml[s].x);
    float* f = w + i * (cfg::S + 1);
    float den = 0.f;
#pragma unroll
    for (int s = 0; s < cfg::S; ++s) {
      const float e = ml[s].x == -INFINITY ? 0.f : __expf(ml[s].x - M);
      f[s] = e;
      if (e != 0.f) den += e * ml[s].y;
    }
    f[cfg::S] = 1.f / den;
  }
}

// W consecutive floats, loaded (and, up to two, stored) in one instruction.
template <int W> struct FloatVec;
template <> struct FloatVec<4> { using T = float4; };
template <> struct FloatVec<2> {
  using T = float2;
  static __device__ __forceinline__ T of(const float (&r)[2]) { return make_float2(r[0], r[1]); }
};
template <> struct FloatVec<1> {
  using T = float;
  static __device__ __forceinline__ T of(const float (&r)[1]) { return r[0]; }
};

// The attention output of heads [head0, head0 + NH) of every batch row, merged from ATTN's S split
// partials: the one merge of COMBINE and of OPROJ's staging under TilePlan.o_merge. A thread loads the
// partials of 32 / S elements together (U vectors of W consecutive elements of one head: a 16-byte load
// per split where S <= 8), the first ones before merge_factors' loads, so a merge of up to
// 32 / S * CTHREADS elements is one L2 round trip and a barrier. Elements i0, i0 + 1 of [B][NH * D] go
// to out(i0, float2) in one store (i0 even; out(i0, float) one at a time where S > 16): pairs, not whole
// vectors, since four merged values held for one store push kernels whose task bodies sit at the
// register cap into spilling. `w`: shared scratch of B * NH * (S + 1) floats
// (trtllm_mk/kinds/combine.py merge_scratch_bytes).
template <int NH, typename Out>
__device__ __forceinline__ void merge_heads(const Params& p, int head0, float* w, Out out) {
  constexpr int W = cfg::S <= 8 ? 4 : cfg::S <= 16 ? 2 : 1, U = max_i(1, 32 / (cfg::S * W));
  constexpr int P = W < 2 ? W : 2;   // elements a store takes
  constexpr int N = cfg::B * NH * cfg::D, NV = N / W;
  static_assert(cfg::D % W == 0, "a vector holds elements of one head");
  using V = typename FloatVec<W>::T;
  V o[U][cfg::S];
  const auto load = [&](int v0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = v0 + u * CTHREADS, i = v * W, b = i / (NH * cfg::D), head = head0 + (i / cfg::D) % NH;
      const float* src = p.part_o + ((((size_t)b * cfg::NKV + head / cfg::G) * cfg::S) * cfg::G + head % cfg::G) * cfg::D +
                         i % cfg::D;
#pragma unroll
      for (int s = 0; s < cfg::S; ++s)
        o[u][s] = v < NV ? __ldcg(reinterpret_cast<const V*>(src + (size_t)s * cfg::G * cfg::D)) : V{};
    }
  };
  load(threadIdx.x);
  merge_factors<NH>(p, head0, w);
  consumer_sync(CTHREADS);
  for (int v0 = threadIdx.x; v0 < NV; v0 += U * CTHREADS) {
    if (v0 != (int)threadIdx.x) load(v0);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = v0 + u * CTHREADS, i = v * W;
      if (v >= NV) break;
      const float* f = w + (i / cfg::D) * (cfg::S + 1);   // (row, head) = i / D
#pragma unroll
      for (int e0 = 0; e0 < W; e0 += P) {
        float r[P];
#pragma unroll
        for (int e = 0; e < P; ++e) {
          float num = 0.f;
#pragma unroll
          for (int s = 0; s < cfg::S; ++s)
            if (f[s] != 0.f) num += f[s] * reinterpret_cast<const float*>(&o[u][s])[e0 + e];
          r[e] = num * f[cfg::S];
        }
        out(i + e0, FloatVec<P>::of(r));
      }
    }
  }
}

__device__ void combine_compute(Ctx& c, const TaskArgs& a) {
  const Params& p = *c.p;
  // the merge factors take the activation region, which COMBINE does not stage into
  static_assert(cfg::B * cfg::G * (cfg::S + 1) * 4 <= cfg::ACT_SMEM_BYTES, "merge factors exceed the activation region");
  merge_heads<cfg::G>(p, a.group * cfg::G, reinterpret_cast<float*>(c.act()), [&](int i, const auto& v) {
    const int b = i / (cfg::G * cfg::D);
    using V = std::decay_t<decltype(v)>;
    *reinterpret_cast<V*>(p.attn_out + (size_t)b * cfg::QD + a.group * cfg::G * cfg::D + i % (cfg::G * cfg::D)) = v;
  });
  consumer_sync(CTHREADS);
}

template <>
struct KindBody<COMBINE> : NoLoad, NoPrologue {
  static __device__ __forceinline__ void compute(Ctx& c, const TaskArgs& a, Pre&) { combine_compute(c, a); }
};

}  // namespace mk
