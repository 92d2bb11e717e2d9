// DOWN's device part: a K chunk of act times the down-projection rows, added into the residual.
// The GEMV machinery is mk_gemv.cuh; inlined by codegen after the shared device headers.
#pragma once

namespace mk {

template <>
struct GemvKind<DOWN> : NoTally, AddsToResidual {
  static constexpr int KT = cfg::I / cfg::DOWN_KSPLIT;
  static constexpr int PAIR = 1;
  static constexpr int WBITS = cfg::WBITS;
  using G = Geometry<KT, PAIR, WBITS>;

  static __device__ __forceinline__ WeightRef weight_ref(const Params& p, const TaskArgs& a, int grp, int j) {
    return weight_at(p.layers[a.layer].down, layer_scales(p, a.layer).down, a.r0 + grp * G::OUT_ROWS + j, cfg::I, a.k0);
  }

  static __device__ __forceinline__ void stage(Ctx& c, const TaskArgs& a) {
    stage_rows<DOWN, cfg::I>(c, a, c.p->act);
  }
};

template <> struct KindBody<DOWN> : GemvBody<DOWN> {};

}  // namespace mk
