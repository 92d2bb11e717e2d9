// ROUTER's device part: RMS-norm x (ln2), then rows of the sparse layer's router weight [E, H]: the
// experts' logits of every batch row, for ROUTE. The GEMV machinery is mk_gemv.cuh; inlined by codegen
// after the shared device headers.
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

  static __device__ __forceinline__ void epilogue(const Params& p, const TaskArgs&, int r, int b, float v, float) {
    p.router_logits[(size_t)b * cfg::E + r] = v;
  }
};

template <> struct KindBody<ROUTER> : GemvBody<ROUTER> {};

}  // namespace mk
