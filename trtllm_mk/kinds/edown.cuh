// EDOWN's device part: a K chunk of slot a.tile's activation times its expert's down rows, scaled per
// batch row by the slot's routing weight and added into the residual (fixed point: any order). Its
// loader waits for route_done (the task's first event) before it streams the expert's weights
// (LOADER_WAITS, mk_gemv.cuh gemv_load). Inlined by codegen after the shared device headers.
#pragma once

namespace mk {

template <>
struct GemvKind<EDOWN> : NoTally {
  static constexpr int KT = cfg::I / cfg::DOWN_KSPLIT;
  static constexpr int PAIR = 1;
  static constexpr int WBITS = cfg::WBITS;
  using G = Geometry<KT, PAIR, WBITS>;

  static __device__ __forceinline__ WeightRef weight_ref(const Params& p, const TaskArgs& a, int grp, int j) {
    const ExpertWeights& w = p.experts[(size_t)a.layer * cfg::E + slot_expert(p, a)];
    return weight_at(w.down, nullptr, a.r0 + grp * G::OUT_ROWS + j, cfg::I, a.k0);
  }

  static __device__ __forceinline__ void stage(Ctx& c, const TaskArgs& a) {
    stage_rows<EDOWN, cfg::I>(c, a, c.p->moe_act + (size_t)a.tile * cfg::B * cfg::I);
  }

  static __device__ __forceinline__ void epilogue(const Params& p, const TaskArgs& a, int r, int b, float v, float) {
    add_resid(p.x + (size_t)b * cfg::H + r, ld_act(p.moe_w + a.tile * cfg::B + b) * v);
  }
};

template <> struct KindBody<EDOWN> : GemvBody<EDOWN> {};

}  // namespace mk
