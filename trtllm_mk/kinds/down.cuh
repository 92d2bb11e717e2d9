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
    // act's bf16 words carry GATEUP's tags (gateup_done is polled: kinds/gateup.py); this chunk's slot
    constexpr int SLOT_COLS = cfg::I / cfg::GATEUP_DONE_SLOTS;
    const TagPoll poll{data_tag16(c.step, a.layer),
                       (uint32_t)(cfg::EV_GATEUP_DONE + a.layer * cfg::GATEUP_DONE_SLOTS + a.k0 / SLOT_COLS),
                       (uint32_t)a.layer, (uint32_t)c.task_no, c.p->error};
    stage_tagged_rows<DOWN, cfg::I>(c, a, c.p->act, poll);
  }
};

template <> struct KindBody<DOWN> : GemvBody<DOWN> {};

}  // namespace mk
