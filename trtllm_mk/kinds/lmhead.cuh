// LMHEAD's device part: the final RMS norm and one tile of logits; its Tally keeps each thread's best
// logit (or perturbed score, device/mk_sampling.cuh) per batch row as the logits are stored and leaves
// the tile's first argmax in lm_val / lm_idx, and its log-sum-exp partials in lm_lse, for ARGMAX. The GEMV machinery is mk_gemv.cuh; inlined by codegen after the shared device headers.
#pragma once

namespace mk {

template <>
struct GemvKind<LMHEAD> {
  static constexpr int KT = cfg::H;
  static constexpr int PAIR = 1;
  static constexpr int WBITS = 16;
  using G = Geometry<KT, PAIR, WBITS>;

  static __device__ __forceinline__ WeightRef weight_ref(const Params& p, const TaskArgs& a, int grp, int j) {
    return weight_at(p.lm_head, nullptr, a.r0 + grp * G::OUT_ROWS + j, cfg::H, 0);
  }

  static __device__ __forceinline__ void stage(Ctx& c, const TaskArgs&) {
    if constexpr (cfg::EXPERT_FUSED)   // x + the last layer's experts' outputs (kinds/router.py)
      stage_normed<LMHEAD, true>(c, c.p->final_norm, expert_sum_at(*c.p, cfg::L));
    else
      stage_normed_resid<LMHEAD>(c, c.p->final_norm, cfg::L, 0, cfg::EV_RESID_READY);
  }

  static __device__ __forceinline__ void epilogue(const Ctx& c, const TaskArgs&, int r, int b, float v, float) {
    const Params& p = *c.p;
    p.logits[(size_t)b * cfg::V + r] = v;
  }

  // Per batch row: the best score so far (the logit, or z + g for an unfiltered sampled row) and its
  // index; the online log-sum-exp of l (rows asking for log-probabilities) and of z = l / T (top-p
  // without top-k: the whole vocabulary normalizes). Flags are per row, uniform over the CTA.
  struct Tally {
    float best[cfg::B];
    int bidx[cfg::B];
    float temp[cfg::B];
    uint32_t key[cfg::B];
    float m1[cfg::B], s1[cfg::B], m2[cfg::B], s2[cfg::B];
    uint32_t perturb, lse, lse_z, cand;   // bit b: row b
    uint32_t* hist;                       // cand_hist: rows whose ARGMAX searches candidates count bins
  };

  static __device__ __forceinline__ Tally tally_begin(const Ctx& c, const TaskArgs&) {
    Tally t;
    t.perturb = t.lse = t.lse_z = t.cand = 0;
    t.hist = c.p->cand_hist;
#pragma unroll
    for (int b = 0; b < cfg::B; ++b) {
      t.best[b] = -INFINITY;
      t.bidx[b] = 0x7fffffff;
      t.m1[b] = t.m2[b] = -INFINITY;
      t.s1[b] = t.s2[b] = 0.f;
      const SamplingSlot s = c.p->sampling[b];
      t.temp[b] = s.temperature;
      t.key[b] = 0;
      if (samples(s) && !filters(s)) {
        t.perturb |= 1u << b;
        t.key[b] = gumbel_row_key(s, ld_act(c.p->pos + b) + 1);
      }
      if (needs_lse(s)) t.lse |= 1u << b;
      if (needs_lse_z(s)) t.lse_z |= 1u << b;
      if (candidates_needed(s) > 0) t.cand |= 1u << b;
    }
    return t;
  }

  // rows only grow within a thread, so '>' keeps the first index of a tie
  static __device__ __forceinline__ void tally(Tally& t, int r, int b, float v) {
#pragma unroll
    for (int bb = 0; bb < cfg::B; ++bb) {
      if (bb != b) continue;
      float score = v;
      if (t.perturb >> bb & 1u) score = v / t.temp[bb] + gumbel(t.key[bb], (uint32_t)r);
      if (score > t.best[bb]) { t.best[bb] = score; t.bidx[bb] = r; }
      if (t.lse >> bb & 1u) lse_add(t.m1[bb], t.s1[bb], v);
      if (t.lse_z >> bb & 1u) lse_add(t.m2[bb], t.s2[bb], v / t.temp[bb]);
      if (t.cand >> bb & 1u) {
        // lanes counting the same (row, bin) add once: logits crowd into few bins
        const uint32_t bin = candidate_bin(v);
        const uint32_t peers = __match_any_sync(__activemask(), bin | (uint32_t)bb << 12);
        if ((peers & ((1u << (threadIdx.x & 31)) - 1)) == 0)
          atomicAdd(t.hist + (size_t)bb * CAND_HIST_BINS + bin, (uint32_t)__popc(peers));
      }
    }
  }

  static __device__ __forceinline__ void tally_reduce(Ctx& c, const TaskArgs& a, Tally& t) {
#pragma unroll
    for (int b = 0; b < cfg::B; ++b) {
      warp_argmax(t.best[b], t.bidx[b]);
      if (c.lane() == 0) {
        c.scratch()[c.warp() * cfg::B + b] = t.best[b];
        reinterpret_cast<int*>(c.scratch())[128 + c.warp() * cfg::B + b] = t.bidx[b];
      }
    }
    if (t.lse | t.lse_z) {
      const int groups = (a.r1 - a.r0 + G::OUT_ROWS - 1) / G::OUT_ROWS;
      float* part = c.red() + (groups & 1) * cfg::CWARPS * 16 * cfg::B;   // [warp][B][4]
#pragma unroll
      for (int b = 0; b < cfg::B; ++b) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
          lse_merge(t.m1[b], t.s1[b], __shfl_xor_sync(0xffffffffu, t.m1[b], o), __shfl_xor_sync(0xffffffffu, t.s1[b], o));
          lse_merge(t.m2[b], t.s2[b], __shfl_xor_sync(0xffffffffu, t.m2[b], o), __shfl_xor_sync(0xffffffffu, t.s2[b], o));
        }
        if (c.lane() == 0) {
          float* w = part + (c.warp() * cfg::B + b) * LSE_WORDS;
          w[0] = t.m1[b]; w[1] = t.s1[b]; w[2] = t.m2[b]; w[3] = t.s2[b];
        }
      }
    }
  }

  // after the consumer barrier: thread 0 merges the warps' candidates into the tile's; with log-sum-exp
  // partials in red(), a second barrier keeps the next task's first partial sums off them
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
        if constexpr (cfg::TP > 1) {   // this rank's column of every rank's maxima, with global token ids
          const int col = b * cfg::LM_TILES_ALL + (int)p.rank * cfg::N_LM_TILES + a.tile;
          const int gi = bi == 0x7fffffff ? bi : bi + (int)p.rank * cfg::V;
#pragma unroll
          for (int k = 0; k < cfg::TP; ++k) { p.peers[k].lm_val[col] = bv; p.peers[k].lm_idx[col] = gi; }
        } else {
          p.lm_val[b * cfg::N_LM_TILES + a.tile] = bv;
          p.lm_idx[b * cfg::N_LM_TILES + a.tile] = bi;
        }
        if ((t.lse | t.lse_z) >> b & 1u) {
          const int groups = (a.r1 - a.r0 + G::OUT_ROWS - 1) / G::OUT_ROWS;
          const float* part = c.red() + (groups & 1) * cfg::CWARPS * 16 * cfg::B;
          float m1 = -INFINITY, s1 = 0.f, m2 = -INFINITY, s2 = 0.f;
          for (int w = 0; w < cfg::CWARPS; ++w) {
            const float* q = part + (w * cfg::B + b) * LSE_WORDS;
            lse_merge(m1, s1, q[0], q[1]);
            lse_merge(m2, s2, q[2], q[3]);
          }
          float* out = p.lm_lse + ((size_t)b * cfg::N_LM_TILES + a.tile) * LSE_WORDS;
          out[0] = m1; out[1] = s1; out[2] = m2; out[3] = s2;
        }
      }
    }
    if (t.lse | t.lse_z) consumer_sync(CTHREADS);
  }
};

template <> struct KindBody<LMHEAD> : GemvBody<LMHEAD> {};

}  // namespace mk
