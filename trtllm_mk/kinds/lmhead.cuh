// LMHEAD's device part: the final RMS norm and one tile of logits; its Tally keeps each thread's best
// logit per batch row as the logits are stored and leaves the tile's first argmax in lm_val / lm_idx
// for ARGMAX; rows that sample get the tile's perturbed argmax there instead, and their log-sum-exp
// partials and candidate bin counts (device/mk_sampling.cuh). The GEMV machinery is mk_gemv.cuh; inlined by codegen after the shared device headers.
#pragma once

namespace mk {

static_assert(cfg::CWARPS <= 24, "the sampling pass keeps 4 words per consumer warp in scratch[32, 128)");

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

  // Per batch row: each thread's best logit and its index, as the logits are stored. What sampling
  // needs (device/mk_sampling.cuh) runs after the tile's GEMV, over the tile's logits read back
  // (tally_publish), so the GEMV loop keeps the registers of the unsampled kernel; `rows` holds which
  // rows need that pass, loaded before the loop.
  struct Tally {
    float best[cfg::B];
    int bidx[cfg::B];
    uint32_t rows;   // 4 bits per batch row: perturb, lse, lse_z, cand (sample_flags)
  };

  static __device__ __forceinline__ uint32_t sample_flags(const SamplingSlot& s) {
    return (samples(s) && !filters(s) ? 1u : 0u) | (needs_lse(s) ? 2u : 0u) | (needs_lse_z(s) ? 4u : 0u) |
           (candidates_needed(s) > 0 ? 8u : 0u);
  }

  static __device__ __forceinline__ Tally tally_begin(const Ctx& c, const TaskArgs&) {
    Tally t;
    t.rows = 0;
#pragma unroll
    for (int b = 0; b < cfg::B; ++b) {
      t.best[b] = -INFINITY;
      t.bidx[b] = 0x7fffffff;
      t.rows |= sample_flags(c.p->sampling[b]) << (4 * b);
    }
    return t;
  }

  // rows only grow within a thread, so '>' keeps the first index of a tie
  static __device__ __forceinline__ void tally(Tally& t, int r, int b, float v) {
#pragma unroll
    for (int bb = 0; bb < cfg::B; ++bb)
      if (bb == b && v > t.best[bb]) { t.best[bb] = v; t.bidx[bb] = r; }
  }

  static __device__ __forceinline__ void tally_reduce(Ctx& c, const TaskArgs&, Tally& t) {
#pragma unroll
    for (int b = 0; b < cfg::B; ++b) {
      warp_argmax(t.best[b], t.bidx[b]);
      if (c.lane() == 0) {
        c.scratch()[c.warp() * cfg::B + b] = t.best[b];
        reinterpret_cast<int*>(c.scratch())[128 + c.warp() * cfg::B + b] = t.bidx[b];
      }
    }
  }

  // The sampling pass of row b over the tile's logits (stored by this CTA before the last barrier):
  // the first argmax of z + g (perturb), the log-sum-exp of l (lse) and of z (lse_z), the bin counts
  // of the candidate search (cand). Every consumer thread takes part; scratch is free on entry.
  static __device__ void sample_row(Ctx& c, const TaskArgs& a, int b, uint32_t f) {
    const Params& p = *c.p;
    const SamplingSlot s = p.sampling[b];
    const uint32_t key = (f & 1u) ? gumbel_row_key(s, ld_act(p.pos + b) + 1) : 0u;
    const float* l = p.logits + (size_t)b * cfg::V;
    uint32_t* hist = p.cand_hist + (size_t)b * CAND_HIST_BINS;
    float best = -INFINITY, m1 = -INFINITY, s1 = 0.f, m2 = -INFINITY, s2 = 0.f;
    int bi = 0x7fffffff;
    for (int r = a.r0 + threadIdx.x; r < a.r1; r += CTHREADS) {
      const float v = ld_act(l + r);
      if (f & 1u) {
        const float score = v / s.temperature + gumbel(key, (uint32_t)r);
        if (score > best) { best = score; bi = r; }
      }
      if (f & 2u) lse_add(m1, s1, v);
      if (f & 4u) lse_add(m2, s2, v / s.temperature);
      if (f & 8u) {
        // lanes counting the same bin add once: logits crowd into few bins
        const uint32_t bin = candidate_bin(v);
        const uint32_t peers = __match_any_sync(__activemask(), bin);
        if ((peers & ((1u << c.lane()) - 1)) == 0) atomicAdd(hist + bin, (uint32_t)__popc(peers));
      }
    }
    warp_argmax(best, bi);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      lse_merge(m1, s1, __shfl_xor_sync(0xffffffffu, m1, o), __shfl_xor_sync(0xffffffffu, s1, o));
      lse_merge(m2, s2, __shfl_xor_sync(0xffffffffu, m2, o), __shfl_xor_sync(0xffffffffu, s2, o));
    }
    float* sc = c.scratch();
    if (c.lane() == 0) {
      sc[c.warp()] = best;
      reinterpret_cast<int*>(sc)[128 + c.warp()] = bi;
      float* w = sc + 32 + LSE_WORDS * c.warp();
      w[0] = m1; w[1] = s1; w[2] = m2; w[3] = s2;
    }
    consumer_sync(CTHREADS);
    if (threadIdx.x == 0) {
      float m1t = -INFINITY, s1t = 0.f, m2t = -INFINITY, s2t = 0.f;
      for (int w = 0; w < cfg::CWARPS; ++w) {
        const float ov = sc[w];
        const int oi = reinterpret_cast<int*>(sc)[128 + w];
        if (w == 0 || argmax_better(ov, oi, best, bi)) { best = ov; bi = oi; }
        const float* q = sc + 32 + LSE_WORDS * w;
        lse_merge(m1t, s1t, q[0], q[1]);
        lse_merge(m2t, s2t, q[2], q[3]);
      }
      if (f & 1u) {
        p.lm_val[b * cfg::N_LM_TILES + a.tile] = best;
        p.lm_idx[b * cfg::N_LM_TILES + a.tile] = bi;
      }
      if (f & 6u) {
        float* out = p.lm_lse + ((size_t)b * cfg::N_LM_TILES + a.tile) * LSE_WORDS;
        out[0] = m1t; out[1] = s1t; out[2] = m2t; out[3] = s2t;
      }
    }
    consumer_sync(CTHREADS);   // scratch read before the next row (or task) writes it
  }

  // after the consumer barrier: thread 0 merges the warps' candidates into the tile's first argmax;
  // then the rows that sample or want log-probabilities take their pass over the tile
  static __device__ __forceinline__ void tally_publish(Ctx& c, const TaskArgs& a, const Tally& t) {
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
    if (t.rows == 0) return;
    consumer_sync(CTHREADS);   // thread 0 is done with the scratch
    for (int b = 0; b < cfg::B; ++b) {
      const uint32_t f = (t.rows >> (4 * b)) & 15u;
      if (f) sample_row(c, a, b, f);
    }
  }
};

template <> struct KindBody<LMHEAD> : GemvBody<LMHEAD> {};

}  // namespace mk
