// ROUTER's device part (kinds/router.py): rows of the sparse layer's router weight [E, H]. Beside the split
// expert kinds, a GEMV: RMS-norm x (ln2) after OPROJ, the experts' logits of every batch row for ROUTE.
// Under TilePlan.expert_fused (router_in_chain below): at the layer's start, the logits of ln2 * (x +
// expert_sum), not normed, in fixed point (router_acc), which OPROJ's router rows add to. The GEMV machinery
// is mk_gemv.cuh; inlined by codegen after the shared device headers.
#pragma once

namespace mk {

template <>
struct GemvKind<ROUTER> : NoTally {
  static constexpr int KT = cfg::H;
  static constexpr int PAIR = 1;
  static constexpr int WBITS = 16;   // bf16, as checkpoints keep the router
  using G = Geometry<KT, PAIR, WBITS>;

  static __device__ __forceinline__ WeightRef weight_ref(const Params& p, const TaskArgs& a, int grp, int j) {
    return weight_at(p.routers[a.layer], nullptr, a.r0 + grp * G::OUT_ROWS + j, cfg::H, 0);
  }

  // Also publishes this task's share of the staged (normed, bf16) rows as the experts' input, moe_xn
  // (kinds/router.py normed_share): EGATEUP then need not read x, which EDOWN adds into.
  static __device__ __forceinline__ void stage(Ctx& c, const TaskArgs& a) {
    stage_normed<ROUTER>(c, c.p->layers[a.layer].ln2);
    constexpr int AS = KT + ACT_PAD;
    const int c0 = a.r0 * cfg::H / cfg::E, n = a.r1 * cfg::H / cfg::E - c0;
    for (int i = threadIdx.x; i < cfg::B * n; i += CTHREADS) {
      const int b = i / n, col = c0 + i % n;
      c.p->moe_xn[(size_t)b * cfg::H + col] = __bfloat162float(c.act()[b * AS + col]);
    }
  }

  static __device__ __forceinline__ void epilogue(const Ctx& c, const TaskArgs&, int r, int b, float v, float) {
    const Params& p = *c.p;
    p.router_logits[(size_t)b * cfg::E + r] = v;
  }
};

// The chain's share (TilePlan.expert_fused): thread t takes 4-column groups t, t + CTHREADS, ... of the
// task's rows. For each group it loads its columns of ln2 * (x + expert_sum) once, then the rows'
// weights RC rows at a time (the loader brought them into L2); the warps' partial sums meet in red[] in
// a fixed order. fp32 on the CUDA cores, from the weights in global memory: the task is off the chain
// (it runs beside QKV and ATTN), and fp32 inputs keep the logits at the fp32 router's numerics (a
// bf16-staged x would round them as much as the reference's bf16 normed rows do, differently).
__device__ __forceinline__ void router_in_chain(Ctx& c, const TaskArgs& a) {
  constexpr int R = cfg::ROUTER_ROWS, RC = R < 4 ? R : 4, NG = cfg::H / 4;
  static_assert(R <= 32, "ROUTER rows exceed red[]");
  const Params& p = *c.p;
  const long long* kept = expert_sum_at(p, a.layer);
  const bf16* g = p.layers[a.layer].ln2;
  const bf16* wr = p.routers[a.layer] + (size_t)a.r0 * cfg::H;
  const int rows = a.r1 - a.r0;
  float acc[R][cfg::B];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int b = 0; b < cfg::B; ++b) acc[r][b] = 0.f;
  for (int grp = threadIdx.x; grp < NG; grp += CTHREADS) {
    const int k = 4 * grp;
    float xg[cfg::B][4];
    const uint2 gv = __ldg(reinterpret_cast<const uint2*>(g + k));
    const float2 g01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&gv.x));
    const float2 g23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&gv.y));
#pragma unroll
    for (int b = 0; b < cfg::B; ++b) {
      const size_t at = (size_t)b * cfg::H;
      const float4 v = ld_resid4_sum(p.x + at, kept + at, grp);
      xg[b][0] = v.x * g01.x; xg[b][1] = v.y * g01.y; xg[b][2] = v.z * g23.x; xg[b][3] = v.w * g23.y;
    }
#pragma unroll
    for (int r0 = 0; r0 < R; r0 += RC) {
      uint2 wv[RC];
#pragma unroll
      for (int r = 0; r < RC; ++r)
        if (r0 + r < rows) wv[r] = __ldg(reinterpret_cast<const uint2*>(wr + (size_t)(r0 + r) * cfg::H + k));
#pragma unroll
      for (int r = 0; r < RC; ++r) {
        if (r0 + r >= rows) break;
        const float2 w01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&wv[r].x));
        const float2 w23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&wv[r].y));
#pragma unroll
        for (int b = 0; b < cfg::B; ++b)
          acc[r0 + r][b] = fmaf(w23.y, xg[b][3], fmaf(w23.x, xg[b][2], fmaf(w01.y, xg[b][1], fmaf(w01.x, xg[b][0], acc[r0 + r][b]))));
      }
    }
  }
  float* red = c.red();   // [warp][R][B]: R <= 32 rows fit its 2 x CWARPS x 16 x B floats
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int b = 0; b < cfg::B; ++b) {
      const float v = warp_sum(acc[r][b]);
      if (c.lane() == 0 && r < rows) red[(c.warp() * R + r) * cfg::B + b] = v;
    }
  consumer_sync(CTHREADS);
  for (int i = threadIdx.x; i < rows * cfg::B; i += CTHREADS) {
    float v = 0.f;
    for (int w = 0; w < cfg::CWARPS; ++w) v += red[w * R * cfg::B + i];
    *router_acc_at(p, a.layer, i % cfg::B, a.r0 + i / cfg::B) = resid_fixed(v);
  }
  c.mark_computed();
  consumer_sync(CTHREADS);   // every logit is stored before the task signals (and red[] is free again)
}

template <bool CHAIN> struct RouterBody : GemvBody<ROUTER> {};
template <> struct RouterBody<true> : NoPrologue {
  // the loader reaches the task before its consumers have waited for x: it brings the rows into L2
  static __device__ __forceinline__ void load(Ctx& c, const TaskArgs& a) {
    const bf16* wr = c.p->routers[a.layer];
    for (int r = a.r0 + c.lane(); r < a.r1; r += 32) prefetch_l2(wr + (size_t)r * cfg::H, cfg::H * 2);
  }
  static __device__ __forceinline__ void compute(Ctx& c, const TaskArgs& a, Pre&) { router_in_chain(c, a); }
};
template <> struct KindBody<ROUTER> : RouterBody<cfg::EXPERT_FUSED> {};

}  // namespace mk
