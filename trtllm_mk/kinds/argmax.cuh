// ARGMAX's device body: the second-level argmax over the LM-head tiles, and the end of the step.
// Inlined by codegen after the shared device headers (trtllm_mk/device), before mk_kernel.cuh.
#pragma once

namespace mk {

// First argmax over the consumer threads' candidates; the result is valid in consumer thread 0.
__device__ void block_argmax(Ctx& c, float& best, int& bi) {
  warp_argmax(best, bi);
  if (c.lane() == 0) { c.scratch()[c.warp()] = best; reinterpret_cast<int*>(c.scratch())[128 + c.warp()] = bi; }
  consumer_sync(CTHREADS);
  if (threadIdx.x == 0) {
    for (int w = 1; w < cfg::CWARPS; ++w) {
      const float ov = c.scratch()[w];
      const int oi = reinterpret_cast<int*>(c.scratch())[128 + w];
      if (argmax_better(ov, oi, best, bi)) { best = ov; bi = oi; }
    }
  }
}

// ARGMAX's step-invariant input, read before its wait: this step's positions (nothing writes them
// until ARGMAX itself), so the history store and the advance below cost no round trip on the tail.
__device__ __forceinline__ void argmax_prologue(const Ctx& c, int (&pos)[cfg::B]) {
  if (threadIdx.x == 0) {
#pragma unroll
    for (int b = 0; b < cfg::B; ++b) pos[b] = ld_act(c.p->pos + b);
  }
}

// ----------------------------------------------------------------- candidates (top-k, top-p, top logprobs)
// ARGMAX is its SM's last task of the step, so the weight ring is idle: the candidate search works
// there. The LM-head tiles counted the row's keys by their top 12 bits (cand_hist), so one pass over
// the logits collects every key above the bin that holds the K-th largest and the keys of that bin;
// a radix select among the latter in shared memory finds the threshold. When the bin holds more keys
// than the ring has room for (a nearly flat distribution), radix passes over the logits in global
// memory find it instead.
struct CandidateScratch {
  uint64_t key[CANDIDATES];    // candidate_key of each candidate, sorted descending once selected
  uint32_t hist[256];          // radix-select histogram
  uint32_t count, kept, digit, need, done, pool_n, total;
  int n;                       // position of the token being chosen (Gumbel noise)
};
constexpr size_t POOL_AT = (sizeof(CandidateScratch) + 15) / 16 * 16;
constexpr int POOL_CAP = (int)(((size_t)cfg::STAGES * cfg::SLOT_BYTES - POOL_AT) / 8);   // keys of the threshold bin
// the bin counts are staged where the pool goes; a ring too small for them takes the radix passes
constexpr bool BINS_FIT = (size_t)cfg::STAGES * cfg::SLOT_BYTES >= POOL_AT + 4 * CAND_HIST_BINS;
static_assert(CAND_HIST_BINS == 4096, "cand_hist bins are the keys' top 12 bits");

__device__ __forceinline__ float key_logit(uint64_t key) {
  uint32_t u = (uint32_t)(key >> 32);
  u = (u & 0x80000000u) ? (u & 0x7FFFFFFFu) : ~u;
  return __uint_as_float(u);
}

// f(key) for every logit of the row, 16-byte loads batched so that many are in flight per thread.
template <class F>
__device__ __forceinline__ void for_each_key(const float* l, F&& f) {
  if constexpr (cfg::V % 4 == 0) {
    constexpr int V4 = cfg::V / 4, U = 8;
    for (int base = threadIdx.x; base < V4; base += CTHREADS * U) {
      float4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i = base + u * CTHREADS;
        v[u] = i < V4 ? __ldcg(reinterpret_cast<const float4*>(l) + i) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i = base + u * CTHREADS;
        if (i < V4) {
          f(candidate_key(v[u].x, 4 * i));
          f(candidate_key(v[u].y, 4 * i + 1));
          f(candidate_key(v[u].z, 4 * i + 2));
          f(candidate_key(v[u].w, 4 * i + 3));
        }
      }
    }
  } else {
    for (int i = threadIdx.x; i < cfg::V; i += CTHREADS) f(candidate_key(ld_act(l + i), (uint32_t)i));
  }
}

// The threshold key t: exactly `need` keys k with (k & mask) == prefix have k >= t. Radix select, 8
// bits per pass from `shift` down; keys are unique, so it always ends with an exact count.
template <class Each>
__device__ uint64_t radix_threshold(Ctx& c, Each&& each, int need, uint64_t prefix, uint64_t mask, int shift,
                                   CandidateScratch& cs) {
  // the last pass may overlap bits already fixed (shift 4 -> 0): they match the prefix, so it still counts exactly
  for (;; shift = shift > 8 ? shift - 8 : 0) {
    for (int i = threadIdx.x; i < 256; i += CTHREADS) cs.hist[i] = 0;
    consumer_sync(CTHREADS);
    each([&](uint64_t k) {
      if ((k & mask) == prefix) atomicAdd(&cs.hist[(k >> shift) & 255], 1u);
    });
    consumer_sync(CTHREADS);
    if (c.warp() == 0) {
      // lane j holds digits 255-8j .. 248-8j; a suffix scan over lanes finds the digit where the
      // count of larger keys reaches `need`
      const int lane = c.lane();
      uint32_t local = 0;
#pragma unroll
      for (int d = 0; d < 8; ++d) local += cs.hist[255 - 8 * lane - d];
      uint32_t incl = local;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const uint32_t v = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += v;
      }
      const uint32_t before = incl - local;   // keys in higher lanes' digits
      if (before < (uint32_t)need && incl >= (uint32_t)need) {
        uint32_t cum = before;
        int d = 255 - 8 * lane;
        while (cum + cs.hist[d] < (uint32_t)need) cum += cs.hist[d--];
        cs.digit = d;
        cs.need = need - cum;
        cs.done = cs.hist[d] == need - cum;   // the whole bucket is taken: the threshold is found
      }
    }
    consumer_sync(CTHREADS);
    // digit, need and done change only after the next pass's first barrier: read them here, not hist
    need = cs.need;
    prefix |= (uint64_t)cs.digit << shift;
    mask |= 0xFFull << shift;
    if (cs.done || shift == 0) return prefix;
  }
}

// Bitonic sort of cs.key[0, CANDIDATES), descending (unused entries are 0, below every key).
__device__ void sort_candidates(CandidateScratch& cs) {
  for (int size = 2; size <= CANDIDATES; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int t = threadIdx.x; t < CANDIDATES / 2; t += CTHREADS) {
        const int i = 2 * t - (t & (stride - 1)), j = i + stride;
        const bool desc = (i & size) == 0;
        const uint64_t x = cs.key[i], y = cs.key[j];
        if ((x < y) == desc) { cs.key[i] = y; cs.key[j] = x; }
      }
      consumer_sync(CTHREADS);
    }
  }
}

// The K largest candidate keys of row l (K <= CANDIDATES), sorted descending into cs.key[0, K).
// ghist: the row's cand_hist, zeroed again here for the next step.
__device__ void select_candidates(Ctx& c, const float* l, uint32_t* ghist, int K, CandidateScratch& cs) {
  const int tid = threadIdx.x;
  uint64_t* pool = reinterpret_cast<uint64_t*>(c.ring() + POOL_AT);
  // the LM-head tiles' bin counts, staged in the pool region (4096 words), zeroed in global memory
  uint32_t* bins = reinterpret_cast<uint32_t*>(pool);
  if (tid == 0) { cs.count = 0; cs.pool_n = 0; cs.total = 0; }
  for (int i = tid; i < CANDIDATES; i += CTHREADS) cs.key[i] = 0;
  consumer_sync(CTHREADS);
  uint32_t mine = 0;
  for (int i = tid; i < CAND_HIST_BINS; i += CTHREADS) {
    const uint32_t v = __ldcg(ghist + i);
    if constexpr (BINS_FIT) bins[i] = v;
    mine += v;
    ghist[i] = 0;
  }
  atomicAdd(&cs.total, mine);
  consumer_sync(CTHREADS);
  int bin = -1;
  uint32_t above = 0;
  // a complete count (anything else, e.g. after a step that faulted, takes the slow path below)
  if (BINS_FIT && !diag::RADIX_ONLY && cs.total == (uint32_t)cfg::V) {
    if (c.warp() == 0) {   // lane j: bins 4095-128j .. 3968-128j, as radix_threshold's scan
      const int lane = c.lane();
      uint32_t local = 0;
      for (int d = 0; d < 128; ++d) local += bins[4095 - 128 * lane - d];
      uint32_t incl = local;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const uint32_t v = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += v;
      }
      const uint32_t before = incl - local;
      if (before < (uint32_t)K && incl >= (uint32_t)K) {
        uint32_t cum = before;
        int d = 4095 - 128 * lane;
        while (cum + bins[d] < (uint32_t)K) cum += bins[d--];
        cs.digit = d;
        cs.need = cum;                      // keys above the bin
        cs.done = bins[d] <= (uint32_t)POOL_CAP;
      }
    }
    consumer_sync(CTHREADS);
    if (cs.done) { bin = (int)cs.digit; above = cs.need; }
  }
  if (bin >= 0) {
    // one pass: keys above the bin straight into the candidates, the bin's keys into the pool
    for_each_key(l, [&](uint64_t k) {
      const int d = (int)(k >> 52);
      if (d > bin) cs.key[atomicAdd(&cs.count, 1u)] = k;
      else if (d == bin) pool[atomicAdd(&cs.pool_n, 1u)] = k;
    });
    consumer_sync(CTHREADS);
    const int n = (int)cs.pool_n;
    const uint64_t t = radix_threshold(c, [&](auto&& f) { for (int i = threadIdx.x; i < n; i += CTHREADS) f(pool[i]); },
                                       K - (int)above, (uint64_t)bin << 52, 0xFFFull << 52, 44, cs);
    for (int i = tid; i < n; i += CTHREADS)
      if (pool[i] >= t) cs.key[atomicAdd(&cs.count, 1u)] = pool[i];
  } else {
    const uint64_t t = radix_threshold(c, [&](auto&& f) { for_each_key(l, f); }, K, 0, 0, 56, cs);
    for_each_key(l, [&](uint64_t k) {
      if (k >= t) cs.key[atomicAdd(&cs.count, 1u)] = k;
    });
  }
  consumer_sync(CTHREADS);
  sort_candidates(cs);
}

// The row's log-sum-exp from its LM-head tiles' partials (word w = 0: of l; 2: of l / T), merged by
// every consumer thread at once (one L2 round trip, not one per tile); valid in every thread.
__device__ float tiles_lse(Ctx& c, const Params& p, int b, int w) {
  float m = -INFINITY, sum = 0.f;
  for (int t = threadIdx.x; t < cfg::N_LM_TILES; t += CTHREADS) {
    const float2 q = __ldcg(reinterpret_cast<const float2*>(p.lm_lse + ((size_t)b * cfg::N_LM_TILES + t) * LSE_WORDS + w));
    lse_merge(m, sum, q.x, q.y);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    lse_merge(m, sum, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, sum, o));
  consumer_sync(CTHREADS);   // the scratch's previous readers are done
  if (c.lane() == 0) { c.scratch()[2 * c.warp()] = m; c.scratch()[2 * c.warp() + 1] = sum; }
  consumer_sync(CTHREADS);
  m = -INFINITY;
  sum = 0.f;
  for (int k = 0; k < cfg::CWARPS; ++k) lse_merge(m, sum, c.scratch()[2 * k], c.scratch()[2 * k + 1]);
  return m + logf(sum);
}

// A filtered row's token: the kept prefix of the candidates (top-k, then top-p on their fp32
// probabilities, accumulated in candidate order as trtllm_mk/sampling.py does), then the first argmax of
// z + g over it. Valid in consumer thread 0.
__device__ int sample_filtered(Ctx& c, const Params& p, int b, const SamplingSlot& s, CandidateScratch& cs) {
  const float lse_z = needs_lse_z(s) ? tiles_lse(c, p, b, 2) : 0.f;
  if (threadIdx.x == 0) {
    const int K = (int)cs.count;
    const int kk = s.top_k > 0 ? min_i(s.top_k, K) : K;
    int kept = kk;
    if (s.top_p > 0.f && s.top_p < 1.f) {
      float norm;
      if (s.top_k > 0) {
        const float m = key_logit(cs.key[0]) / s.temperature;
        float sum = 0.f;
        for (int j = 0; j < kk; ++j) sum += expf(key_logit(cs.key[j]) / s.temperature - m);
        norm = m + logf(sum);
      } else {
        norm = lse_z;
      }
      double acc = 0.0;   // the running sum in double, each prefix rounded to fp32 (torch's CPU cumsum)
      kept = 0;
      for (int j = 0; j < kk; ++j) {
        const float pj = expf(key_logit(cs.key[j]) / s.temperature - norm);
        acc += pj;
        if ((float)acc - pj >= s.top_p) break;
        kept = j + 1;
      }
    }
    cs.kept = kept;
  }
  consumer_sync(CTHREADS);
  const uint32_t rk = gumbel_row_key(s, cs.n);
  float best = -INFINITY;
  int bi = 0x7fffffff;
  for (int j = threadIdx.x; j < (int)cs.kept; j += CTHREADS) {
    const uint32_t idx = candidate_index(cs.key[j]);
    const float v = key_logit(cs.key[j]) / s.temperature + gumbel(rk, idx);
    if (argmax_better(v, (int)idx, best, bi)) { best = v; bi = (int)idx; }
  }
  block_argmax(c, best, bi);
  return bi;
}

// The second-level argmax, and the end of the step: ARGMAX is the step's last task (it waits on every
// LM-head tile, and every other task of the step precedes those), so no CTA reads pos or the step
// counter after it, and it advances both itself; the next launch sees them at the kernel boundary. An
// end-of-kernel "last CTA to finish" protocol put a fence, an atomic round trip and a read-modify-
// write of pos after this task on the step's critical path (benchmarks/NOTES.md). Greedy rows and
// unfiltered sampled rows take the tiles' maxima (LMHEAD perturbed the sampled ones); filtered rows
// and rows asking for top log-probabilities search the candidates.
__device__ void argmax_compute(Ctx& c, const TaskArgs& a, const int (&pos)[cfg::B]) {
  const Params& p = *c.p;
  CandidateScratch& cs = *reinterpret_cast<CandidateScratch*>(c.ring());
  for (int b = 0; b < cfg::B; ++b) {
    const SamplingSlot s = p.sampling[b];
    float best = -INFINITY;
    int bi = 0x7fffffff;
    for (int t = threadIdx.x; t < cfg::LM_TILES_ALL; t += CTHREADS) {   // every rank's tiles
      const float v = ld_act(p.lm_val + b * cfg::LM_TILES_ALL + t);
      const int idx = ld_act(p.lm_idx + b * cfg::LM_TILES_ALL + t);
      if (argmax_better(v, idx, best, bi)) { best = v; bi = idx; }
    }
    block_argmax(c, best, bi);
    const int nc = candidates_needed(s);
    if (nc > 0) {
      if (threadIdx.x == 0) cs.n = pos[b] + 1;
      select_candidates(c, p.logits + (size_t)b * cfg::V, p.cand_hist + (size_t)b * CAND_HIST_BINS, min_i(nc, cfg::V), cs);
      if (filters(s)) {
        const int t = sample_filtered(c, p, b, s, cs);
        if (threadIdx.x == 0) bi = t;
      }
    }
    const float lse = needs_lse(s) ? tiles_lse(c, p, b, 0) : 0.f;   // the model's, at temperature 1
    if (threadIdx.x == 0) {
      if (bi == 0x7fffffff) {   // no logit of the row is a number above -inf: report it, emit token 0
        if (atomicCAS(&p.error->code, 0u, (uint32_t)ERR_NONFINITE_LOGITS) == 0u) { p.error->sm = blockIdx.x; p.error->layer = b; p.error->task = c.step; }
        bi = 0;
      }
      p.tokens[b] = bi;
      if (pos[b] + 1 < cfg::HISTORY_LEN) p.history[(size_t)b * cfg::HISTORY_LEN + pos[b] + 1] = bi;
      p.pos[b] = pos[b] + 1;
      if (needs_lse(s)) {   // log-probabilities of the model (temperature 1, before any filter)
        float* out = p.logprobs + (size_t)b * (1 + MAX_TOP_LOGPROBS);
        out[0] = ld_act(p.logits + (size_t)b * cfg::V + bi) - lse;
        for (int j = 0; j < s.logprobs - 1; ++j) {
          out[1 + j] = key_logit(cs.key[j]) - lse;
          p.top_ids[b * MAX_TOP_LOGPROBS + j] = (int)candidate_index(cs.key[j]);
        }
      }
      if constexpr (cfg::TP > 1) {   // the rank holding the row in its shard of the table prefetches it
        const int local = bi - (int)p.rank * cfg::V;
        if (diag::PREFETCH_NEXT && (unsigned)local < (unsigned)cfg::V)
          prefetch_l2(p.embed + (size_t)local * cfg::H, cfg::H * 2);
      } else {
        if (diag::PREFETCH_NEXT) prefetch_l2(p.embed + (size_t)bi * cfg::H, cfg::H * 2);   // the next step's EMBED row
      }
    }
    consumer_sync(CTHREADS);
  }
  if (threadIdx.x == 0) p.control[0] = c.step + 1;
}

template <>
struct KindBody<ARGMAX> : NoLoad {
  struct Pre { int pos[cfg::B]; };
  static __device__ __forceinline__ void prologue(Ctx& c, const TaskArgs&, Pre& pre) { argmax_prologue(c, pre.pos); }
  static __device__ __forceinline__ void compute(Ctx& c, const TaskArgs& a, Pre& pre) { argmax_compute(c, a, pre.pos); }
};

}  // namespace mk
