// GATEUP's device part: RMS-norm x (ln2), gate and up rows of the same output rows in one ring slot
// (PAIR = 2: slot rows [0, RS/2) are gate, [RS/2, RS) up), silu(gate) * up into act as tagged bf16
// words. The GEMV machinery is mk_gemv.cuh; inlined by codegen after the shared device headers.
#pragma once

namespace mk {

__device__ __forceinline__ float silu(float g) { return g / (1.f + __expf(-g)); }

template <>
struct GemvKind<GATEUP> : NoTally {
  static constexpr int KT = cfg::H;
  static constexpr int PAIR = 2;
  static constexpr int WBITS = cfg::WBITS;
  using G = Geometry<KT, PAIR, WBITS>;

  static __device__ __forceinline__ WeightRef weight_ref(const Params& p, const TaskArgs& a, int grp, int j) {
    const LayerWeights& w = p.layers[a.layer];
    const LayerScales& s = layer_scales(p, a.layer);
    int half = G::OUT_ROWS;
    int r = a.r0 + grp * half + (j % half);
    return j < half ? weight_at(w.gate, s.gate, r, cfg::H, 0) : weight_at(w.up, s.up, r, cfg::H, 0);
  }

  static __device__ __forceinline__ void stage(Ctx& c, const TaskArgs& a) {
    stage_normed_resid<GATEUP>(c, c.p->layers[a.layer].ln2, a.layer, cfg::RESID_O_ADDS, cfg::EV_OPROJ_DONE);
  }

  static __device__ __forceinline__ void epilogue(const Ctx& c, const TaskArgs& a, int r, int b, float v, float v_up) {
    const Params& p = *c.p;
    // gateup_done is polled (kinds/gateup.py): the bf16 word is DOWN's signal
    st_tagged_bf16(p.act + (size_t)b * cfg::I + r, silu(v) * v_up, data_tag16(c.step, a.layer));
  }
};

template <> struct KindBody<GATEUP> : GemvBody<GATEUP> {};

}  // namespace mk
