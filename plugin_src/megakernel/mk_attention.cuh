// Split-KV GQA decode attention over the paged KV cache (TRT-LLM layout, HND inside a block), and
// the combine of the split partials. One ATTN task = one KV group x one split, for every batch row.
//
// The cached K/V of a split (every token before this step's) does not depend on this step, so the
// loader warp copies it into the weight ring when it reaches the task in its list, as it does for a
// GEMV's weights: the DRAM round trips (block table, then K/V under the loaders' traffic) leave the
// chain QKV -> ATTN -> COMBINE. Per batch row the task takes KV_SLOTS ring slots: with one slot, K
// sits in its first half and V in its second; with two, K and V take a slot each. Each row's K and
// V hold KV_CAP tokens (trtllm_mk/smem.py attention_kv_ring); tokens beyond that (long contexts) are
// read from global memory after the wait, and the new token comes from this step's q/k/v.
#pragma once
#include "mk_gemv.cuh"

namespace mk {

constexpr int EPL = cfg::D / 32;  // head elements per lane
static_assert(cfg::KV_SLOTS == 1 || cfg::KV_SLOTS == 2, "K/V take one slot per batch row, or one each");
static_assert(cfg::KV_CAP >= 1 && cfg::KV_CAP * cfg::D * 2 * (3 - cfg::KV_SLOTS) <= cfg::SLOT_BYTES,
              "K/V capacity exceeds a ring slot");
static_assert(cfg::STAGES >= 2, "a batch row's K and V slots must be in the ring together");

// Where an ATTN task's trace mark ("staging" in runtime/trace.py) is taken, for batch row 0:
// 0 inputs ready (q/k/v prepared and the ring's K/V landed), 1 q/k/v loaded, 2 RoPE done,
// 3 token loop done. Only 0 is meaningful as "staging"; 1-3 split the body when diagnosing.
#ifndef MK_ATTN_MARK
#define MK_ATTN_MARK 0
#endif

__device__ __forceinline__ size_t kv_offset(const Params& p, int layer, int b, int t, int kv, int g) {
  const int block = p.block_table[(size_t)b * p.block_table_stride + t / cfg::TPB];
  return ((((size_t)layer * p.num_blocks + block) * 2 + kv) * cfg::NKV + g) * (size_t)(cfg::TPB * cfg::D) +
         (size_t)(t % cfg::TPB) * cfg::D;
}

// The tokens of batch row b that split `split` attends to: [t0, t1); of them, [t0, t0 + ring_n) come
// from the ring (cached tokens, up to KV_CAP). Read from device memory by both roles.
struct SplitRange { int pos, t0, t1, ring_n; };
__device__ __forceinline__ SplitRange split_range(const Params& p, int b, int split) {
  SplitRange r;
  r.pos = ld_act(p.pos + b);
  const int len = r.pos + 1, chunk = (len + cfg::S - 1) / cfg::S;
  r.t0 = split * chunk;
  r.t1 = min(len, r.t0 + chunk);
  r.ring_n = max(0, min(min(r.t1, r.pos) - r.t0, cfg::KV_CAP));
  return r;
}

// Ring position (relative to the task's first slot) and byte offset of row b's K (kv = 0) or V.
__device__ __forceinline__ int kv_slot(int b, int kv) { return b * cfg::KV_SLOTS + kv * (cfg::KV_SLOTS - 1); }
__device__ __forceinline__ int kv_slot_offset(int kv) {
  return cfg::KV_SLOTS == 1 ? kv * cfg::KV_CAP * cfg::D * 2 : 0;
}

// ------------------------------------------------------------------------------- loader side
// Per batch row: wait for its slots, then copy the ring tokens of K and V, one copy per run of tokens
// that is contiguous in the cache (a run ends at a block boundary), so a 33-token chunk takes at most
// 2 copies each for K and V.
__device__ void attn_load(Ctx& c, const TaskArgs& a) {
  const Params& p = *c.p;
  for (int b = 0; b < cfg::B; ++b) {
    const SplitRange r = split_range(p, b, a.split);
    const int nruns = r.ring_n == 0 ? 0 : (r.t0 + r.ring_n - 1) / cfg::TPB - r.t0 / cfg::TPB + 1;
    unsigned char* dst[2];
    uint64_t* bar[2];
    for (int kv = 0; kv < 2; ++kv) {
      const uint32_t n = c.ring_n + kv_slot(b, kv), slot = n % cfg::STAGES, use = n / cfg::STAGES;
      if (kv == 0 || cfg::KV_SLOTS == 2) c.loader_wait(&c.empty[slot], (use & 1) ^ 1);
      dst[kv] = c.ring + (size_t)slot * SLOT_STRIDE + kv_slot_offset(kv);
      bar[kv] = &c.full[slot];
    }
#if defined(MK_USE_BULK_COPY)
    if (c.lane == 0) {
      if (cfg::KV_SLOTS == 2) {
        mbar_expect_tx(bar[0], r.ring_n * cfg::D * 2);
        mbar_expect_tx(bar[1], r.ring_n * cfg::D * 2);
      } else {
        mbar_expect_tx(bar[0], 2 * r.ring_n * cfg::D * 2);
      }
    }
    __syncwarp();
    for (int i = c.lane; i < 2 * nruns; i += 32) {
      const int kv = i / nruns, j = i % nruns;
      const int s0 = j == 0 ? r.t0 : (r.t0 / cfg::TPB + j) * cfg::TPB;
      const int s1 = min(r.t0 + r.ring_n, (r.t0 / cfg::TPB + j + 1) * cfg::TPB);
      bulk_copy_g2s(dst[kv] + (size_t)(s0 - r.t0) * cfg::D * 2, p.kv_pool + kv_offset(p, a.layer, b, s0, kv, a.group),
                    (s1 - s0) * cfg::D * 2, bar[kv]);
    }
#else
    constexpr int V16 = cfg::D / 8;   // 16-byte vectors per token row
    for (int kv = 0; kv < 2; ++kv) {
      for (int i = c.lane; i < r.ring_n * V16; i += 32) {
        const int t = r.t0 + i / V16;
        cp_async16(dst[kv] + (size_t)i * 16, p.kv_pool + kv_offset(p, a.layer, b, t, kv, a.group) + (i % V16) * 8);
      }
      if (kv == 1 || cfg::KV_SLOTS == 2) cp_async_arrive(bar[kv]);
    }
#endif
  }
  c.ring_n += cfg::B * cfg::KV_SLOTS;
}

// Step-invariant inputs of an ATTN task, gathered before its wait (nothing in them depends on this
// step's producers): per batch row its split range and where the new token's K/V go, the RoPE cos /
// sin at pos, and the QK-norm weights. After the wait only q/k/v are left to load from L2: one round
// trip on the dependency chain instead of four dependent ones (pos, inv_freq, block table, q/k/v),
// each ~1 us while the loaders stream.
struct AttnRow { int pos, t0, t1, ring_n; long long kv_new; int pad[2]; };   // 32 bytes
static_assert(sizeof(AttnRow) == 32, "mirror: trtllm_mk/smem.py attention_scratch_bytes");

// [G+2][D] q / k / v | [G][4] running max, sum, tile correction | ATTN_WORK | [B][D] RoPE cos (first
// D/2) and sin | [2][D] q_norm, k_norm | [B] AttnRow  (mirror: trtllm_mk/smem.py attention_scratch_bytes)
constexpr int TT = 128;            // tokens per score tile (mirror: trtllm_mk/smem.py ATTN_TILE_TOKENS)
constexpr int NCH = cfg::D / 8;    // 16-byte chunks of a bf16 K row
constexpr int ATTN_WORK = cfg::G * TT > cfg::CWARPS * cfg::G * cfg::D ? cfg::G * TT : cfg::CWARPS * cfg::G * cfg::D;
constexpr int ATTN_ROPE = (cfg::G + 2) * cfg::D + 4 * cfg::G + ATTN_WORK;   // float offsets
constexpr int ATTN_NORM = ATTN_ROPE + cfg::B * cfg::D;
constexpr int ATTN_ROWS = ATTN_NORM + 2 * cfg::D;
static_assert(ATTN_ROWS % 4 == 0, "the AttnRow table must be 16-byte aligned");
static_assert(ATTN_ROWS * 4 + cfg::B * (int)sizeof(AttnRow) <= cfg::ACT_SMEM_BYTES,
              "attention scratch exceeds the activation region (trtllm_mk/smem.py attention_scratch_bytes)");

__device__ void attn_prologue(Ctx& c, const TaskArgs& a) {
  const Params& p = *c.p;
  float* sm = reinterpret_cast<float*>(c.act);
  for (int i = threadIdx.x; i < cfg::B * cfg::D / 2; i += CTHREADS) {
    const int b = i / (cfg::D / 2), j = i % (cfg::D / 2);
    float sn, cs;
    sincosf((float)ld_act(p.pos + b) * p.inv_freq[j], &sn, &cs);
    sm[ATTN_ROPE + b * cfg::D + j] = cs;
    sm[ATTN_ROPE + b * cfg::D + cfg::D / 2 + j] = sn;
  }
  if constexpr (cfg::QK_NORM) {
    const LayerWeights& w = p.layers[a.layer];
    for (int i = threadIdx.x; i < 2 * cfg::D; i += CTHREADS)
      sm[ATTN_NORM + i] = bf16_to_f(i < cfg::D ? w.q_norm[i] : w.k_norm[i - cfg::D]);
  }
  if (threadIdx.x < cfg::B) {
    const int b = threadIdx.x;
    const SplitRange r = split_range(p, b, a.split);
    AttnRow row{r.pos, r.t0, r.t1, r.ring_n, 0, {0, 0}};
    if (r.t0 <= r.pos && r.pos < r.t1) row.kv_new = (long long)kv_offset(p, a.layer, b, r.pos, 0, a.group);
    reinterpret_cast<AttnRow*>(sm + ATTN_ROWS)[b] = row;
  }
  // ordered before the task body by wait_all's consumer barrier
}

// q heads, k and v of group g for batch row b: QK-norm (qwen3), RoPE at the row's position; k and v
// rounded to bf16 exactly as they are stored in the cache. Result in sm: [G+2][D] fp32.
__device__ void prepare_qkv(Ctx& c, const TaskArgs& a, int b, float* sm) {
  const Params& p = *c.p;
  const float* src = p.qkv + (size_t)b * cfg::QKVR + a.group * cfg::GR;
  for (int i = threadIdx.x; i < cfg::GR; i += CTHREADS) sm[i] = ld_act(src + i);
  consumer_sync(CTHREADS);
  if (MK_ATTN_MARK == 1 && b == 0) c.mark();
  const float* rope = sm + ATTN_ROPE + b * cfg::D;
  // one warp per head (q heads 0..G-1, k = head G); v (head G+1) is only rounded
  for (int h = c.warp; h < cfg::G + 1; h += cfg::CWARPS) {
    float* hv = sm + h * cfg::D;
    if constexpr (cfg::QK_NORM) {
      const float* nw = sm + ATTN_NORM + (h < cfg::G ? 0 : cfg::D);
      float ss = 0.f;
      for (int i = c.lane; i < cfg::D; i += 32) ss = fmaf(hv[i], hv[i], ss);
      const float rstd = rsqrtf(warp_sum(ss) / cfg::D + cfg::EPS);
      __syncwarp();
      for (int i = c.lane; i < cfg::D; i += 32) hv[i] = hv[i] * rstd * nw[i];
      __syncwarp();
    }
    for (int i = c.lane; i < cfg::D / 2; i += 32) {
      const float cs = rope[i], sn = rope[cfg::D / 2 + i];
      const float x1 = hv[i], x2 = hv[i + cfg::D / 2];
      hv[i] = x1 * cs - x2 * sn;
      hv[i + cfg::D / 2] = x2 * cs + x1 * sn;
    }
    if (h == cfg::G) {
      __syncwarp();
      for (int i = c.lane; i < cfg::D; i += 32) hv[i] = round_bf16(hv[i]);
    }
  }
  for (int i = c.lane + c.warp * 32; i < cfg::D; i += CTHREADS) {
    float* vv = sm + (cfg::G + 1) * cfg::D;
    vv[i] = round_bf16(vv[i]);
  }
  consumer_sync(CTHREADS);
  if (MK_ATTN_MARK == 2 && b == 0) c.mark();
}

// Where token t's K and V rows of this split live: the new token in the prepared q/k/v (fp32), the
// first ring_n cached tokens in the ring, the rest (past the ring's capacity) in the cache.
struct KvRows {
  const Params* p;
  const bf16* ring[2];
  const float* fresh[2];   // this step's k and v (bf16-rounded, fp32)
  int layer, b, group, t0, ring_n, pos;
  __device__ __forceinline__ const bf16* row(int t, int kv) const {
    return t - t0 < ring_n ? ring[kv] + (t - t0) * cfg::D : p->kv_pool + kv_offset(*p, layer, b, t, kv, group);
  }
  // elements [8 * ch, 8 * ch + 8) of a row: bf16 `row` in the ring or cache, or fp32 `fresh_row`
  __device__ __forceinline__ static void load8(const bf16* row, const float* fresh_row, int ch, float (&out)[8]) {
    if (fresh_row != nullptr) {
#pragma unroll
      for (int i = 0; i < 8; ++i) out[i] = fresh_row[ch * 8 + i];
    } else {
      const bf16x8 v = *reinterpret_cast<const bf16x8*>(row + ch * 8);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(v.h[i]);
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
      }
    }
  }
  // elements [EPL * lane, EPL * lane + EPL) of V row t
  __device__ __forceinline__ void load_v(int t, int lane, float (&out)[EPL]) const {
    if (t == pos) {
#pragma unroll
      for (int e = 0; e < EPL; ++e) out[e] = fresh[1][lane * EPL + e];
    } else {
      const bf16* v = row(t, 1) + lane * EPL;
#pragma unroll
      for (int e = 0; e < EPL; ++e) out[e] = bf16_to_f(v[e]);
    }
  }
};

// Attention of one split in tiles of TT tokens (scores, softmax, P.V), with a running max across
// tiles. Scores: one thread per token computes all G heads (K row read once; q from shared memory;
// each lane starts at a different 16-byte chunk so a phase of 8 lanes hits 8 bank groups). P.V:
// warp w takes tokens w, w + CWARPS, ... and lane l elements [EPL l, EPL l + EPL) of every head.
// The warps' partial outputs meet in shared memory at the end.
__device__ void attn_compute(Ctx& c, const TaskArgs& a) {
  const Params& p = *c.p;
  // the layout is attn_prologue's; work holds a tile's [G][TT] scores, then the [CWARPS][G][D] merge
  float* sm = reinterpret_cast<float*>(c.act);
  float* stats = sm + (cfg::G + 2) * cfg::D;
  float* work = stats + 4 * cfg::G;
  const AttnRow* rows = reinterpret_cast<const AttnRow*>(sm + ATTN_ROWS);
  const float scale = rsqrtf((float)cfg::D);
  const uint32_t ring0 = c.ring_n;
  for (int b = 0; b < cfg::B; ++b) {
    const AttnRow r = rows[b];
    const int pos = r.pos, t0 = r.t0, t1 = r.t1;
    prepare_qkv(c, a, b, sm);
    const float* knew = sm + cfg::G * cfg::D;
    const float* vnew = knew + cfg::D;
    if (t0 <= pos && pos < t1) {  // this split owns the new token: append it to the cache
      bf16* kd = p.kv_pool + r.kv_new;
      bf16* vd = kd + (size_t)cfg::NKV * cfg::TPB * cfg::D;   // kv_offset(.., kv = 1, ..)
      for (int i = threadIdx.x; i < cfg::D; i += CTHREADS) { kd[i] = f_to_bf16(knew[i]); vd[i] = f_to_bf16(vnew[i]); }
    }
    if (threadIdx.x < cfg::G) {
      stats[threadIdx.x * 4] = -INFINITY;
      stats[threadIdx.x * 4 + 1] = 0.f;
    }
    // this row's cached K/V in the ring (the loader copied it before the task's wait)
    KvRows kv{&p, {nullptr, nullptr}, {knew, vnew}, a.layer, b, a.group, t0, r.ring_n, pos};
    uint32_t slots[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const uint32_t n = ring0 + kv_slot(b, k);
      slots[k] = n % cfg::STAGES;
      if (k == 0 || cfg::KV_SLOTS == 2) c.consumer_wait(&c.full[slots[k]], (n / cfg::STAGES) & 1);
      kv.ring[k] = reinterpret_cast<const bf16*>(c.ring + (size_t)slots[k] * SLOT_STRIDE + kv_slot_offset(k));
    }
    if (MK_ATTN_MARK == 0 && b == 0) c.mark();
    float o[cfg::G][EPL];
#pragma unroll
    for (int h = 0; h < cfg::G; ++h)
#pragma unroll
      for (int e = 0; e < EPL; ++e) o[h][e] = 0.f;
    for (int tb = t0; tb < t1; tb += TT) {
      const int n = min(TT, t1 - tb);
      for (int i = threadIdx.x; i < n; i += CTHREADS) {
        float acc[cfg::G];
#pragma unroll
        for (int h = 0; h < cfg::G; ++h) acc[h] = 0.f;
        const bool fresh = tb + i == pos;
        const bf16* krow = fresh ? nullptr : kv.row(tb + i, 0);
#pragma unroll 4
        for (int cc = 0; cc < NCH; ++cc) {
          const int ch = (cc + i) % NCH;
          float kf[8];
          KvRows::load8(krow, fresh ? knew : nullptr, ch, kf);
#pragma unroll
          for (int h = 0; h < cfg::G; ++h) {
            const float4 q0 = *reinterpret_cast<const float4*>(sm + h * cfg::D + ch * 8);
            const float4 q1 = *reinterpret_cast<const float4*>(sm + h * cfg::D + ch * 8 + 4);
            acc[h] = fmaf(q0.x, kf[0], fmaf(q0.y, kf[1], fmaf(q0.z, kf[2], fmaf(q0.w, kf[3], acc[h]))));
            acc[h] = fmaf(q1.x, kf[4], fmaf(q1.y, kf[5], fmaf(q1.z, kf[6], fmaf(q1.w, kf[7], acc[h]))));
          }
        }
#pragma unroll
        for (int h = 0; h < cfg::G; ++h) work[h * TT + i] = acc[h] * scale;
      }
      consumer_sync(CTHREADS);
      // softmax of the tile per head (warp h), folded into the running max and sum
      for (int h = c.warp; h < cfg::G; h += cfg::CWARPS) {
        float* sh = work + h * TT;
        float mx = -INFINITY;
        for (int i = c.lane; i < n; i += 32) mx = fmaxf(mx, sh[i]);
        const float m_old = stats[h * 4], m_new = fmaxf(m_old, warp_max(mx));
        float sum = 0.f;
        for (int i = c.lane; i < n; i += 32) {
          const float e = __expf(sh[i] - m_new);
          sh[i] = e;
          sum += e;
        }
        sum = warp_sum(sum);
        __syncwarp();
        if (c.lane == 0) {
          const float corr = __expf(m_old - m_new);   // 0 on the first tile (m_old = -inf)
          stats[h * 4] = m_new;
          stats[h * 4 + 1] = stats[h * 4 + 1] * corr + sum;
          stats[h * 4 + 2] = corr;
        }
      }
      consumer_sync(CTHREADS);
#pragma unroll
      for (int h = 0; h < cfg::G; ++h) {
        const float corr = stats[h * 4 + 2];
#pragma unroll
        for (int e = 0; e < EPL; ++e) o[h][e] *= corr;
      }
      for (int i = c.warp; i < n; i += cfg::CWARPS) {
        float vf[EPL];
        kv.load_v(tb + i, c.lane, vf);
#pragma unroll
        for (int h = 0; h < cfg::G; ++h) {
          const float pr = work[h * TT + i];
#pragma unroll
          for (int e = 0; e < EPL; ++e) o[h][e] = fmaf(pr, vf[e], o[h][e]);
        }
      }
      consumer_sync(CTHREADS);   // the next tile overwrites the scores
    }
    if (MK_ATTN_MARK == 3 && b == 0) c.mark();
    if (b == cfg::B - 1) c.mark_computed();
    // the warp is done with the ring slots of this row (same release protocol as the GEMV consumer)
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      if (k == 1 && cfg::KV_SLOTS == 1) break;
#if defined(MK_EMPTY_ARRIVE_ALL_LANES)
      mbar_arrive(&c.empty[slots[k]]);
#else
      __syncwarp();
      if (c.lane == 0) mbar_arrive(&c.empty[slots[k]]);
#endif
    }
    // the warps' partial outputs (one running max for all of them) meet in shared memory
    float* mw = work + c.warp * cfg::G * cfg::D;
#pragma unroll
    for (int h = 0; h < cfg::G; ++h)
#pragma unroll
      for (int e = 0; e < EPL; ++e) mw[h * cfg::D + c.lane * EPL + e] = o[h][e];
    consumer_sync(CTHREADS);
    const size_t part = (((size_t)b * cfg::NKV + a.group) * cfg::S + a.split) * cfg::G;
    for (int i = threadIdx.x; i < cfg::G * cfg::D; i += CTHREADS) {
      const int h = i / cfg::D, e = i % cfg::D;
      float O = 0.f;
      for (int w = 0; w < cfg::CWARPS; ++w) O += work[(w * cfg::G + h) * cfg::D + e];
      p.part_o[(part + h) * cfg::D + e] = O;
      if (e == 0) { p.part_ml[(part + h) * 2] = stats[h * 4]; p.part_ml[(part + h) * 2 + 1] = stats[h * 4 + 1]; }
    }
    consumer_sync(CTHREADS);
  }
  c.ring_n = ring0 + cfg::B * cfg::KV_SLOTS;
}

__device__ void combine_compute(Ctx& c, const TaskArgs& a) {
  const Params& p = *c.p;
  for (int i = threadIdx.x; i < cfg::B * cfg::G * cfg::D; i += CTHREADS) {
    const int b = i / (cfg::G * cfg::D), h = (i / cfg::D) % cfg::G, e = i % cfg::D;
    const size_t base = ((size_t)b * cfg::NKV + a.group) * cfg::S * cfg::G + h;  // + s*G
    // every split's (max, sum, o) loaded before any is used: one L2 round trip, not S dependent ones
    float ms[cfg::S], ls[cfg::S], os[cfg::S];
#pragma unroll
    for (int s = 0; s < cfg::S; ++s) {
      const float2 ml = __ldcg(reinterpret_cast<const float2*>(p.part_ml) + base + s * cfg::G);
      ms[s] = ml.x;
      ls[s] = ml.y;
      os[s] = ld_act(p.part_o + (base + s * cfg::G) * cfg::D + e);
    }
    float M = -INFINITY;
#pragma unroll
    for (int s = 0; s < cfg::S; ++s) M = fmaxf(M, ms[s]);
    float num = 0.f, den = 0.f;
#pragma unroll
    for (int s = 0; s < cfg::S; ++s) {
      if (ms[s] == -INFINITY) continue;   // an empty split (t0 >= len)
      const float f = __expf(ms[s] - M);
      num += f * os[s];
      den += f * ls[s];
    }
    p.attn_out[(size_t)b * cfg::QD + (a.group * cfg::G + h) * cfg::D + e] = num / den;
  }
  consumer_sync(CTHREADS);
}

}  // namespace mk
