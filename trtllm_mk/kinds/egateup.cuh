// EGATEUP's device part: GATEUP for the expert in slot a.tile (kinds/route.py) on the normed rows the
// layer's ROUTER tasks published (moe_xn), into the slot's activation. The expert is known only once
// the router's logits land, so the loader waits for the task's first event (router_done), routes the
// rows itself (route.cuh ExpertSource) and then streams the expert's weights (LOADER_WAITS,
// mk_gemv.cuh gemv_load); for an idle slot it streams nothing, and the consumers, who route the rows
// too, skip the task. Inlined by codegen after the shared device headers.
#pragma once

namespace mk {

template <>
struct GemvKind<EGATEUP> : NoTally {
  static constexpr int KT = cfg::H;
  static constexpr int PAIR = 2;
  static constexpr int WBITS = cfg::WBITS;
  using G = Geometry<KT, PAIR, WBITS>;

  static __device__ __forceinline__ WeightRef weight_ref(const ExpertWeights& w, const TaskArgs& a, int grp, int j) {
    return expert_gateup_ref(w, a, G::OUT_ROWS, grp, j);
  }

  // Also routes the rows (while the loader does the same) into union masks in the scratch, where the
  // layer's later EGATEUP tasks on this SM find them (route.cuh scratch_masks).
  static __device__ __forceinline__ void stage(Ctx& c, const TaskArgs& a) {
    static_assert(ROUTE_MASK_WORDS * 4 <= SMEM_SCRATCH, "the rows' expert masks fit the scratch");
    route_rows_by_warp(c, scratch_masks(), nullptr, nullptr);
    stage_rows<EGATEUP, cfg::H>(c, a, c.p->moe_xn);   // its barrier publishes the masks
  }

  // slots at and beyond the count of distinct experts are idle
  static __device__ __forceinline__ bool idle(const Ctx&, const TaskArgs& a) { return a.tile >= union_count(scratch_masks()); }

  static __device__ __forceinline__ void epilogue(const Ctx& c, const TaskArgs& a, int r, int b, float v, float v_up) {
    const Params& p = *c.p;
    p.moe_act[((size_t)a.tile * cfg::B + b) * cfg::I + r] = silu(v) * v_up;
  }
};

template <> struct WeightSource<EGATEUP> : ExpertSource {};
template <> struct KindBody<EGATEUP> : GemvBody<EGATEUP> {};

}  // namespace mk
