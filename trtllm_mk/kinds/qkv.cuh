// QKV's device part: RMS-norm x (ln1), then the grouped q/k/v weight rows (plus Qwen2's bias).
// The GEMV machinery is mk_gemv.cuh; inlined by codegen after the shared device headers.
#pragma once

namespace mk {

template <>
struct GemvKind<QKV> : NoTally {
  static constexpr int KT = cfg::H;
  static constexpr int PAIR = 1;
  static constexpr int WBITS = cfg::WBITS;
  using G = Geometry<KT, PAIR, WBITS>;

  // Grouped row order: [q heads of KV group g, k_g, v_g] for g = 0 .. NKV-1.
  static __device__ __forceinline__ WeightRef weight_ref(const Params& p, const TaskArgs& a, int grp, int j) {
    const LayerWeights& w = p.layers[a.layer];
    const LayerScales& s = layer_scales(p, a.layer);
    int r = a.r0 + grp * G::OUT_ROWS + j;
    int g = r / cfg::GR, within = r % cfg::GR, h = within / cfg::D, i = within % cfg::D;
    if (h < cfg::G) return weight_at(w.q, s.q, (g * cfg::G + h) * cfg::D + i, cfg::H, 0);
    if (h == cfg::G) return weight_at(w.k, s.k, g * cfg::D + i, cfg::H, 0);
    return weight_at(w.v, s.v, g * cfg::D + i, cfg::H, 0);
  }

  static __device__ __forceinline__ void stage(Ctx& c, const TaskArgs& a) {
    if constexpr (cfg::EXPERT_FUSED)   // x + the previous layer's experts' outputs (kinds/router.py)
      stage_normed<QKV, true>(c, c.p->layers[a.layer].ln1, expert_sum_at(*c.p, a.layer));
    else
      stage_normed_resid<QKV>(c, c.p->layers[a.layer].ln1, a.layer, 0, cfg::EV_RESID_READY);
  }

  static __device__ __forceinline__ void epilogue(const Ctx& c, const TaskArgs& a, int r, int b, float v, float) {
    const Params& p = *c.p;
    if constexpr (cfg::QKV_BIAS) {
      const LayerWeights& w = p.layers[a.layer];
      int g = r / cfg::GR, within = r % cfg::GR, h = within / cfg::D, i = within % cfg::D;
      const bf16* bias = h < cfg::G ? w.q_bias + (g * cfg::G + h) * cfg::D : h == cfg::G ? w.k_bias + g * cfg::D : w.v_bias + g * cfg::D;
      v += bf16_to_f(bias[i]);
    }
    st_tagged(p.qkv + (size_t)b * cfg::QKVR + r, v, data_tag(c.step, a.layer));   // qkv_done is polled (kinds/qkv.py)
  }
};

template <> struct KindBody<QKV> : GemvBody<QKV> {};

}  // namespace mk
