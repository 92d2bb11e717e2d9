// LMHEAD's device part: the final RMS norm and one tile of logits; its Tally keeps each thread's best
// logit per batch row as the logits are stored and leaves the tile's first argmax in lm_val / lm_idx
// for ARGMAX. The GEMV machinery is mk_gemv.cuh; inlined by codegen after the shared device headers.
#pragma once

namespace mk {

template <>
struct GemvKind<LMHEAD> {
  static constexpr int KT = cfg::H;
  static constexpr int PAIR = 1;
  using G = Geometry<KT, PAIR>;

  static __device__ __forceinline__ const bf16* weight_row(const Params& p, const TaskArgs& a, int grp, int j) {
    return p.lm_head + (size_t)(a.r0 + grp * G::OUT_ROWS + j) * cfg::H;
  }

  static __device__ __forceinline__ void stage(Ctx& c, const TaskArgs&) { stage_normed<LMHEAD>(c, c.p->final_norm); }

  static __device__ __forceinline__ void epilogue(const Params& p, const TaskArgs&, int r, int b, float v, float) {
    p.logits[(size_t)b * cfg::V + r] = v;
  }

  struct Tally {
    float best[cfg::B];
    int bidx[cfg::B];
    __device__ __forceinline__ Tally() {
#pragma unroll
      for (int b = 0; b < cfg::B; ++b) { best[b] = -INFINITY; bidx[b] = 0x7fffffff; }
    }
  };

  // rows only grow within a thread, so '>' keeps the first index of a tie
  static __device__ __forceinline__ void tally(Tally& t, int r, int b, float v) {
#pragma unroll
    for (int bb = 0; bb < cfg::B; ++bb)
      if (bb == b && v > t.best[bb]) { t.best[bb] = v; t.bidx[bb] = r; }
  }

  static __device__ __forceinline__ void tally_reduce(Ctx& c, Tally& t) {
#pragma unroll
    for (int b = 0; b < cfg::B; ++b) {
      warp_argmax(t.best[b], t.bidx[b]);
      if (c.lane() == 0) {
        c.scratch()[c.warp() * cfg::B + b] = t.best[b];
        reinterpret_cast<int*>(c.scratch())[128 + c.warp() * cfg::B + b] = t.bidx[b];
      }
    }
  }

  // after the consumer barrier: thread 0 merges the warps' candidates into the tile's
  static __device__ __forceinline__ void tally_publish(Ctx& c, const TaskArgs& a) {
    if (threadIdx.x == 0) {
      const Params& p = *c.p;
      for (int b = 0; b < cfg::B; ++b) {
        float bv = c.scratch()[b];
        int bi = reinterpret_cast<int*>(c.scratch())[128 + b];
        for (int w = 1; w < cfg::CWARPS; ++w) {
          const float ov = c.scratch()[w * cfg::B + b];
          const int oi = reinterpret_cast<int*>(c.scratch())[128 + w * cfg::B + b];
          if (argmax_better(ov, oi, bv, bi)) { bv = ov; bi = oi; }
        }
        p.lm_val[b * cfg::N_LM_TILES + a.tile] = bv;
        p.lm_idx[b * cfg::N_LM_TILES + a.tile] = bi;
      }
    }
  }
};

template <> struct KindBody<LMHEAD> : GemvBody<LMHEAD> {};

}  // namespace mk
