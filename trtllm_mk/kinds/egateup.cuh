// EGATEUP's device part: GATEUP for the expert in slot a.tile (kinds/route.py) on the normed rows the
// layer's ROUTER tasks published (moe_xn), into the slot's activation. The expert is known only once this layer's ROUTE has run, so the loader waits for the
// task's first event (route_done) before it streams the weights. The GEMV machinery is mk_gemv.cuh;
// inlined by codegen after the shared device headers.
#pragma once

namespace mk {

// The expert of slot a.tile (read after route_done); an idle slot (-1) streams expert 0, whose
// routing weight is 0 in every row. A prefetch of the next step reads last step's slots: in range too.
__device__ __forceinline__ int slot_expert(const Params& p, const TaskArgs& a) {
  const int e = ld_act(p.moe_slot + a.tile);
  return (unsigned)e < (unsigned)cfg::E ? e : 0;
}

// A loader streaming weights that an event decides waits for it: the task's first wait (lane 0, then
// the warp, which orders the lanes' reads of what the event published after the acquire).
__device__ __forceinline__ void loader_wait_first(Ctx& c, const TaskArgs& a) {
  if (c.lane() == 0 && a.nw > 0)
    wait_counter(c.p->counters + a.w[0], cfg::EV_COUNT[a.w[0]] * (c.step + 1), c.p->error, a.w[0],
                 (uint32_t)a.layer, (uint32_t)c.task_no);
  __syncwarp();
}

template <> struct ExpertStream<EGATEUP> { static constexpr bool value = true; };

template <>
struct GemvKind<EGATEUP> : NoTally {
  static constexpr int KT = cfg::H;
  static constexpr int PAIR = 2;
  static constexpr int WBITS = cfg::WBITS;
  using G = Geometry<KT, PAIR, WBITS>;

  static __device__ __forceinline__ WeightRef weight_ref(const Params& p, const TaskArgs& a, int grp, int j) {
    const ExpertWeights& w = p.experts[(size_t)a.layer * cfg::E + slot_expert(p, a)];
    const int half = G::OUT_ROWS, r = a.r0 + grp * half + (j % half);
    return j < half ? weight_at(w.gate, nullptr, r, cfg::H, 0) : weight_at(w.up, nullptr, r, cfg::H, 0);
  }

  static __device__ __forceinline__ void stage(Ctx& c, const TaskArgs& a) {
    stage_rows<EGATEUP, cfg::H>(c, a, c.p->moe_xn);
  }

  static __device__ __forceinline__ void epilogue(const Params& p, const TaskArgs& a, int r, int b, float v, float v_up) {
    p.moe_act[((size_t)a.tile * cfg::B + b) * cfg::I + r] = silu(v) * v_up;
  }
};

template <> struct KindBody<EGATEUP> : GemvBody<EGATEUP> {
  static __device__ __forceinline__ void load(Ctx& c, const TaskArgs& a) {
    loader_wait_first(c, a);
    gemv_load<EGATEUP>(c, a);
  }
};

}  // namespace mk
