// EDOWN's device part: a K chunk of slot a.tile's activation times its expert's down rows, scaled per
// batch row by the slot's routing weight (ROUTE's) and added into the residual (fixed point: any
// order). Its loader waits for router_done (the task's first event), routes the rows itself (route.cuh
// ExpertSource) and streams the expert's weights (LOADER_WAITS, mk_gemv.cuh gemv_load), nothing for an
// idle slot, which the consumers skip. Inlined by codegen after the shared device headers.
#pragma once

namespace mk {

template <>
struct GemvKind<EDOWN> : NoTally {
  static constexpr int KT = cfg::I / cfg::DOWN_KSPLIT;
  static constexpr int PAIR = 1;
  static constexpr int WBITS = cfg::WBITS;
  using G = Geometry<KT, PAIR, WBITS>;

  static __device__ __forceinline__ WeightRef weight_ref(const ExpertWeights& w, const TaskArgs& a, int grp, int j) {
    return weight_at(w.down, nullptr, a.r0 + grp * G::OUT_ROWS + j, cfg::I, a.k0);
  }

  // The slot's routing weights are read once per task, beside the activation (the epilogue would wait
  // for a memory round trip in every output group), and so is ROUTE's expert of the slot (-1: idle,
  // as the loader finds; the task then computes nothing). Both stay in the rows' skew.
  static __device__ __forceinline__ void stage(Ctx& c, const TaskArgs& a) {
    static_assert(cfg::B < CTHREADS, "a consumer thread per batch row, and one for the slot");
    const float w = threadIdx.x < cfg::B ? ld_act(c.p->moe_w + a.tile * cfg::B + threadIdx.x) : 0.f;
    const int e = threadIdx.x == cfg::B ? ld_act(c.p->moe_slot + a.tile) : 0;
    stage_rows<EDOWN, cfg::I>(c, a, c.p->moe_act + (size_t)a.tile * cfg::B * cfg::I);
    if (threadIdx.x < cfg::B) act_row_scale<EDOWN>(threadIdx.x) = w;
    if (threadIdx.x == cfg::B) act_skew<EDOWN>(0, 1) = e < 0 ? 1.f : 0.f;
    consumer_sync(CTHREADS);
  }

  static __device__ __forceinline__ bool idle(const Ctx&, const TaskArgs&) { return act_skew<EDOWN>(0, 1) != 0.f; }

  // a row that did not choose the slot's expert adds nothing (at batch > 1 most rows of a slot)
  static __device__ __forceinline__ void epilogue(const Ctx& c, const TaskArgs&, int r, int b, float v, float) {
    const Params& p = *c.p;
    const float w = act_row_scale<EDOWN>(b);
    if (w != 0.f) add_resid(p.x + (size_t)b * cfg::H + r, w * v);
  }
};

template <> struct WeightSource<EDOWN> : ExpertSource {};
template <> struct KindBody<EDOWN> : GemvBody<EDOWN> {};

}  // namespace mk
