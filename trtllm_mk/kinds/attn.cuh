// ATTN's device body: split-KV GQA decode attention over the paged KV cache (TRT-LLM layout, HND
// inside a block). Inlined by codegen after the shared device headers. One ATTN task = one KV group x one split, for every batch row.
//
// The cached K/V of a split (every token before this step's) does not depend on this step, so the
// loader warp streams it through the weight ring as it does a GEMV's weights: the DRAM round trips
// (block table, then K/V under the loaders' traffic) leave the chain QKV -> ATTN -> COMBINE, and a
// long split's later rounds land while the consumers compute the earlier ones. A round is KV_CAP
// tokens of one batch row in KV_SLOTS ring slots (with one slot, K sits in its first half and V in
// its second; with two, K and V take a slot each: trtllm_mk/smem.py attention_kv_ring). How many
// rounds a row takes depends on this step's position, which both roles read from device memory
// (split_range), so both count the same slots. The new token comes from this step's q/k/v. Scores
// and P V run on the tensor cores (attn_tile).
#pragma once

namespace mk {

static_assert(cfg::KV_SLOTS == 1 || cfg::KV_SLOTS == 2, "K/V take one slot per batch row, or one each");
static_assert(cfg::KV_CAP >= 1 && cfg::KV_CAP * cfg::D * 2 * (3 - cfg::KV_SLOTS) <= cfg::SLOT_BYTES,
              "K/V capacity exceeds a ring slot");
static_assert(cfg::STAGES >= 2, "a batch row's K and V slots must be in the ring together");

// Where an ATTN task's trace mark is taken: diag::ATTN_MARK (trtllm_mk/codegen/diagnostics.py).

__device__ __forceinline__ size_t kv_offset(const Params& p, int layer, int b, int t, int kv, int g) {
  const int block = p.block_table[(size_t)b * p.block_table_stride + t / cfg::TPB];
  return ((((size_t)layer * p.num_blocks + block) * 2 + kv) * cfg::NKV + g) * (size_t)(cfg::TPB * cfg::D) +
         (size_t)(t % cfg::TPB) * cfg::D;
}

// First token of split `split` when a step attends to `len` tokens. Splits of at most KV_CAP tokens
// (one ring round) take equal shares; longer ones stream their rounds at what the loader's copies
// sustain, so they start at the equal share rounded down to a whole run of KV_RUN tokens: no run's
// copy crosses a cache block. The last split ends at the last token (mirror: trtllm_mk/smem.py
// split_start).
__device__ __host__ constexpr int split_start(int len, int split) {
  const int share = (len + cfg::S - 1) / cfg::S;
  if (split >= cfg::S) return len;
  if (share <= cfg::KV_CAP) return split * share < len ? split * share : len;
  return (int)((long long)split * len / (cfg::S * cfg::KV_RUN)) * cfg::KV_RUN;
}

// The tokens of batch row b that split `split` attends to: [t0, t1); of them, [t0, t0 + cached) are
// in the cache and come through the ring. Read from device memory by both roles.
struct SplitRange { int pos, t0, t1, cached; };
__device__ __forceinline__ SplitRange split_range(const Params& p, int b, int split) {
  SplitRange r;
  r.pos = ld_act(p.pos + b);
  const int len = r.pos + 1;
  r.t0 = split_start(len, split);
  r.t1 = min(len, split_start(len, split + 1));
  r.cached = max(0, min(r.t1, r.pos) - r.t0);
  return r;
}

// Ring rounds of a batch row: KV_CAP cached tokens each, and one (empty) round where nothing is
// cached, so that every row takes its slots whatever the position.
__device__ __forceinline__ int kv_rounds(int cached) { return max(1, (cached + cfg::KV_CAP - 1) / cfg::KV_CAP); }
__device__ __forceinline__ int round_tokens(int cached, int round) {
  return max(0, min(cfg::KV_CAP, cached - round * cfg::KV_CAP));
}

// Ring layout of a batch row's cached K (or V): token u of the split's chunk at byte
// u * RB + ((u / R) % 8) * 16 + (u / 8R) * 128 of its region, R = KV_RUN (mirror: trtllm_mk/smem.py
// kv_ring_offset). The 16-byte skew per run of R tokens makes the eight token rows of one ldmatrix
// block ({T, T + R, ..., T + 7R}: attn_compute's tiles) hit eight different bank groups although a
// row is a multiple of 128 bytes long, and keeps a run contiguous: one bulk copy. The skew restarts
// every 8R tokens, 128 bytes further on: the last row of a skew cycle, skewed by 112 bytes, would
// otherwise reach 112 bytes into the next cycle's first.
constexpr int RB = cfg::D * 2;                          // bytes of one bf16 K or V row
__device__ __host__ constexpr int kv_ring_offset(int u) {
  return u * RB + ((u / cfg::KV_RUN) & 7) * 16 + (u / (8 * cfg::KV_RUN)) * 128;
}
constexpr int KV_REGION = kv_ring_offset(cfg::KV_CAP - 1) + RB;   // bytes of one row's K (or V) in the ring
static_assert((3 - cfg::KV_SLOTS) * KV_REGION <= cfg::SLOT_BYTES + cfg::SLOT_PAD,
              "K/V and their skew exceed a ring slot (trtllm_mk/smem.py attention_kv_ring)");

// A round's K (kv = 0) or V: its ring position relative to the round's first slot, and its byte
// offset in that slot. A task takes the batch rows [a.r0, a.r1) (TilePlan.attn_rows), one after
// another, each in kv_rounds rounds.
__device__ __forceinline__ uint32_t kv_slot(int kv) { return kv * (cfg::KV_SLOTS - 1); }
__device__ __forceinline__ int kv_slot_offset(int kv) { return cfg::KV_SLOTS == 1 ? kv * KV_REGION : 0; }

// ------------------------------------------------------------------------------- loader side
// Per batch row and round: wait for its slots, then copy the round's tokens of K and V. A copy is a
// run of tokens contiguous both in the cache (a run ends at a block boundary) and in the ring (it
// ends with KV_RUN tokens: kv_ring_offset's skew), so a 65-token round at KV_RUN 8 takes 9-11 copies
// each for K and V. A row's first round is throttled like any slot the loader requests (it is prefetched while
// other tasks are on the chain); later rounds are the task's own stream, which its consumers wait
// for, so only the ring bounds them.
__device__ void attn_load(Ctx& c, const TaskArgs& a) {
  const Params& p = *c.p;
  const uint64_t evict_first = evict_first_policy();
  for (int b = a.r0; b < a.r1; ++b) {
    const SplitRange r = split_range(p, b, a.split);
    const int rounds = kv_rounds(r.cached);
    for (int round = 0; round < rounds; ++round, c.ring_n += cfg::KV_SLOTS) {
      const int cnt = round_tokens(r.cached, round), t0 = r.t0 + round * cfg::KV_CAP;
      unsigned char* dst[2];
      uint64_t* bar[2];
      for (int kv = 0; kv < 2; ++kv) {
        const uint32_t n = c.ring_n + kv_slot(kv), slot = n % cfg::STAGES, use = n / cfg::STAGES;
        if (kv == 0 && round == 0) c.loader_throttle(n);   // (the V slot's predecessor is the K slot)
        if (kv == 0 || cfg::KV_SLOTS == 2) c.loader_wait(&c.empty()[slot], (use & 1) ^ 1);
        dst[kv] = c.ring() + (size_t)slot * SLOT_STRIDE + kv_slot_offset(kv);
        bar[kv] = &c.full()[slot];
      }
#if defined(MK_USE_BULK_COPY)
      if (c.lane() == 0) {
        if (cfg::KV_SLOTS == 2) {
          mbar_expect_tx(bar[0], cnt * RB);
          mbar_expect_tx(bar[1], cnt * RB);
        } else {
          mbar_expect_tx(bar[0], 2 * cnt * RB);
        }
      }
      __syncwarp();
      const int groups = (cnt + cfg::KV_RUN - 1) / cfg::KV_RUN;
      for (int i = c.lane(); i < 2 * groups; i += 32) {
        const int kv = i / groups, u1 = min(cnt, (i % groups + 1) * cfg::KV_RUN);
        for (int u = (i % groups) * cfg::KV_RUN; u < u1;) {
          const int t = t0 + u, n = min(u1 - u, cfg::TPB - t % cfg::TPB);
          bulk_copy_g2s(dst[kv] + kv_ring_offset(u), p.kv_pool + kv_offset(p, a.layer, b, t, kv, a.group), n * RB,
                        bar[kv], evict_first);
          u += n;
        }
      }
#else
      constexpr int V16 = cfg::D / 8;   // 16-byte vectors per token row
      for (int kv = 0; kv < 2; ++kv) {
        for (int i = c.lane() + 32 * c.loader_index(); i < cnt * V16; i += 32 * cfg::LOADER_WARPS) {
          const int u = i / V16;
          cp_async16(dst[kv] + kv_ring_offset(u) + (i % V16) * 16,
                     p.kv_pool + kv_offset(p, a.layer, b, t0 + u, kv, a.group) + (i % V16) * 8, evict_first);
        }
        if (kv == 1 || cfg::KV_SLOTS == 2) cp_async_arrive(bar[kv]);
      }
#endif
    }
  }
}

// Step-invariant inputs of an ATTN task, gathered before its wait (nothing in them depends on this
// step's producers): per batch row its split range and where the new token's K/V go, the RoPE cos /
// sin at pos, and the QK-norm weights. After the wait only q/k/v are left to load from L2: one round
// trip on the dependency chain instead of four dependent ones (pos, inv_freq, block table, q/k/v),
// each as slow as an L2 round trip queued behind the loaders' streaming copies.
struct AttnRow { int pos, t0, t1, cached; long long kv_new; int pad[2]; };   // 32 bytes
static_assert(sizeof(AttnRow) == 32, "mirror: trtllm_mk/smem.py attention_scratch_bytes");

// Attention scratch in the activation region, in floats (mirror: trtllm_mk/smem.py
// attention_scratch_bytes):
//   [0, (G+2) D)        q heads, k, v of the group, fp32 (prepare_qkv)
//   [(G+2) D, (G+3) D)  this step's k and v as bf16 rows: the ldmatrix source of the new token
//   ATTN_QF             q as the mma's A operand, [KSTEPS][4 G lanes][8] words (attn_tile)
//   [0, ...)            after the tiles, overlapping the above: the warps' partial outputs
//                       [CWARPS][G][D] and their (max, sum) [CWARPS][G][2]
//   ATTN_ROPE           RoPE cos (first D/2) and sin per batch row [B][D]   | gathered by
//   ATTN_NORM           q_norm, k_norm [2][D]                               | attn_prologue
//   ATTN_ROWS           AttnRow [B]                                         | before the wait
constexpr int KSTEPS = cfg::D / 16;   // 16-element k steps of a head (scores)
constexpr int ATTN_FRESH = (cfg::G + 2) * cfg::D;
constexpr int ATTN_QF = (cfg::G + 3) * cfg::D;
constexpr int ATTN_MERGE_ML = cfg::CWARPS * cfg::G * cfg::D;
constexpr int ATTN_ROPE = (max_i(ATTN_QF + KSTEPS * 4 * cfg::G * 8, cfg::CWARPS * cfg::G * (cfg::D + 2)) + 3) / 4 * 4;
constexpr int ATTN_NORM = ATTN_ROPE + cfg::B * cfg::D;
constexpr int ATTN_ROWS = ATTN_NORM + 2 * cfg::D;
static_assert(ATTN_ROWS % 4 == 0, "the AttnRow table must be 16-byte aligned");
static_assert(ATTN_ROWS * 4 + cfg::B * (int)sizeof(AttnRow) <= cfg::ACT_SMEM_BYTES,
              "attention scratch exceeds the activation region (trtllm_mk/smem.py attention_scratch_bytes)");

__device__ void attn_prologue(Ctx& c, const TaskArgs& a) {
  const Params& p = *c.p;
  float* sm = reinterpret_cast<float*>(c.act());
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
    AttnRow row{r.pos, r.t0, r.t1, r.cached, 0, {0, 0}};
    if (r.t0 <= r.pos && r.pos < r.t1) row.kv_new = (long long)kv_offset(p, a.layer, b, r.pos, 0, a.group);
    reinterpret_cast<AttnRow*>(sm + ATTN_ROWS)[b] = row;
  }
  // ordered before the task body by wait_all's consumer barrier
}

// This step's q heads, k and v of group g for one batch row, in registers: a task loads the next
// row's while its consumers compute this row's rounds, so that only the first row's L2 round trip
// (queued behind the loaders' copies) lies on the chain. The words carry QKV's tags (qkv_done is a
// polled event: kinds/qkv.py): each thread loads its words at once, and again while one is not this
// layer's yet.
struct QkvRow {
  static constexpr int N = (cfg::GR + CTHREADS - 1) / CTHREADS;   // values per consumer thread
  float v[N];
  __device__ __forceinline__ void load(const Ctx& c, const TaskArgs& a, int b) {
    const Params& p = *c.p;
    const uint64_t* src = p.qkv + (size_t)b * cfg::QKVR + a.group * cfg::GR;
    const TagPoll poll{data_tag(c.step, a.layer), (uint32_t)(cfg::EV_QKV_DONE + a.layer * cfg::NKV + a.group),
                       (uint32_t)a.layer, (uint32_t)c.task_no, p.error};
    uint64_t w[N];
    const auto reload = [&] {
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const int i = threadIdx.x + k * CTHREADS;
        w[k] = i < cfg::GR ? ld_tagged_word(src + i) : ((uint64_t)poll.tag << 32);
      }
    };
    reload();
    poll.settle(w, reload);
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = tagged_value(w[k]);
  }
  __device__ __forceinline__ void store(float* sm) const {
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const int i = threadIdx.x + k * CTHREADS;
      if (i < cfg::GR) sm[i] = v[k];
    }
  }
};

// q heads, k and v of group g for batch row b (loaded into `qkv`): QK-norm (qwen3), RoPE at the row's
// position; k and v rounded to bf16 exactly as they are stored in the cache, as bf16 rows at
// ATTN_FRESH; q split into three bf16 parts in its mma fragment order at ATTN_QF (attn_tile).
__device__ void prepare_qkv(Ctx& c, const TaskArgs& a, int b, float* sm, const QkvRow& qkv) {
  bf16* fresh = reinterpret_cast<bf16*>(sm + ATTN_FRESH);
  qkv.store(sm);
  consumer_sync(CTHREADS);
  if (diag::ATTN_MARK == 1 && b == a.r0) c.mark();
  const float* rope = sm + ATTN_ROPE + b * cfg::D;
  // one warp per head (q heads 0..G-1, k = head G); v (head G+1) is only rounded
  for (int h = c.warp(); h < cfg::G + 1; h += cfg::CWARPS) {
    float* hv = sm + h * cfg::D;
    if constexpr (cfg::QK_NORM) {
      const float* nw = sm + ATTN_NORM + (h < cfg::G ? 0 : cfg::D);
      float ss = 0.f;
      for (int i = c.lane(); i < cfg::D; i += 32) ss = fmaf(hv[i], hv[i], ss);
      const float rstd = rsqrtf(warp_sum(ss) / cfg::D + cfg::EPS);
      __syncwarp();
      for (int i = c.lane(); i < cfg::D; i += 32) hv[i] = hv[i] * rstd * nw[i];
      __syncwarp();
    }
    for (int i = c.lane(); i < cfg::D / 2; i += 32) {
      const float cs = rope[i], sn = rope[cfg::D / 2 + i];
      const float x1 = hv[i], x2 = hv[i + cfg::D / 2];
      hv[i] = x1 * cs - x2 * sn;
      hv[i + cfg::D / 2] = x2 * cs + x1 * sn;
    }
    __syncwarp();
    if (h == cfg::G) {
      for (int i = c.lane(); i < cfg::D; i += 32) fresh[i] = f_to_bf16(hv[i]);
    } else {
      // lane 4h + t of an mma's A operand, k step ks: rows h (hi, lo) and 8 + h (mid), columns
      // 16 ks + 2t, + 1 and 16 ks + 8 + 2t, + 1: words {hi, mid, hi+8, mid+8, lo, lo+8}
      uint32_t* qf = reinterpret_cast<uint32_t*>(sm + ATTN_QF);
      for (int i = c.lane(); i < KSTEPS * 4; i += 32) {
        const int ks = i / 4, t = i % 4, k = ks * 16 + 2 * t;
        uint32_t* w = qf + ((ks * 4 * cfg::G) + 4 * h + t) * 8;
        split3_bf16x2(hv[k], hv[k + 1], w[0], w[1], w[4]);
        split3_bf16x2(hv[k + 8], hv[k + 9], w[2], w[3], w[5]);
      }
    }
  }
  for (int i = threadIdx.x; i < cfg::D; i += CTHREADS) fresh[cfg::D + i] = f_to_bf16(sm[(cfg::G + 1) * cfg::D + i]);
  consumer_sync(CTHREADS);
  if (diag::ATTN_MARK == 2 && b == a.r0) c.mark();
}

// ------------------------------------------------------------------------------- consumer side
// Attention of one split on the tensor cores (mma.m16n8k16), FlashAttention-2 style per warp. Scores:
// S = Q K^T with the group's heads as the mma's rows (K rows from the ring as B). Then
// P = exp(S - running max) stays in registers: the C fragment of S is, lane for lane, the B fragment
// of P^T, so P V runs as O^T = V^T P^T with V^T (ldmatrix.trans of the same rows) as A, and O^T's
// accumulators take 4 registers per 16 columns of the head. q and p are fp32 and K, V bf16; q and p
// enter as three bf16 parts (split3_bf16x2), so the products keep fp32 accuracy: in S, rows g < G
// carry head g's hi part and rows 8 + g its mid part (an m16n8k16 has 16 rows and a KV group at most
// 8 heads) and a second mma adds the lo part into rows g; in P V each part is one mma.
// A tile is 16 tokens: tile (sb, T) of a round holds tokens sb * 16R + R j + T (j = 0..15, T < R =
// KV_RUN), whose ring rows lie in 8 different bank groups per ldmatrix block (kv_ring_offset). Warp w takes tiles w, w + CWARPS, ... and keeps
// its own running max; the warps' (max, sum, o) meet in shared memory at the end of the batch row.
static_assert(cfg::G <= 8, "a KV group's heads (hi and mid rows) must fit an mma's 16 rows");

struct WarpAttn {          // one warp's running state
  float m, l;              // head g = lane / 4: running max (equal across the quad), this lane's share of the sum
  float o[KSTEPS][4];      // O^T, 16 head columns each: [0], [1] column 16 i + g of heads 2t, 2t + 1; [2], [3] column + 8
};

// The 16 tokens of a tile: K and V rows at k_addr / v_addr (this lane's ldmatrix row and column: both
// operands take token (lane % 8) + 8 (lane / 16), columns 8 ((lane / 8) % 2) onwards),
// `valid` marks the lane's four score tokens (2t, 2t + 1, 8 + 2t, 9 + 2t) inside the round; q's
// fragments at qf (this lane's words of k step 0; zero rows for lanes g >= G).
__device__ __forceinline__ void attn_tile(WarpAttn& st, const uint32_t* qf, bool head_lane, uint32_t k_addr,
                                          uint32_t v_addr, const bool (&valid)[4]) {
  float s0[4] = {0.f, 0.f, 0.f, 0.f}, s1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 2   // fully unrolled, its hoisted loads make the 8B kernels' entry function spill
  for (int ks = 0; ks < KSTEPS; ++ks) {
    uint4 a = make_uint4(0u, 0u, 0u, 0u);
    uint2 lo = make_uint2(0u, 0u);
    if (head_lane) {
      a = *reinterpret_cast<const uint4*>(qf + ks * 4 * cfg::G * 8);
      lo = *reinterpret_cast<const uint2*>(qf + ks * 4 * cfg::G * 8 + 4);
    }
    uint32_t b0, b1, b2, b3;
    ldmatrix_x4(k_addr + ks * 32, b0, b1, b2, b3);
    mma_bf16_16816(s0, a.x, a.y, a.z, a.w, b0, b1);
    mma_bf16_16816(s1, a.x, a.y, a.z, a.w, b2, b3);
    mma_bf16_16816(s0, lo.x, 0u, lo.y, 0u, b0, b1);
    mma_bf16_16816(s1, lo.x, 0u, lo.y, 0u, b2, b3);
  }
  const float scale = rsqrtf((float)cfg::D);
  float s[4] = {(s0[0] + s0[2]) * scale, (s0[1] + s0[3]) * scale, (s1[0] + s1[2]) * scale, (s1[1] + s1[3]) * scale};
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    s[i] = valid[i] ? s[i] : -INFINITY;
    mx = fmaxf(mx, s[i]);
  }
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  const float m_new = fmaxf(st.m, mx);
  const float m_use = m_new == -INFINITY ? 0.f : m_new;   // nothing valid yet: every p and corr is 0
  const float corr = __expf(st.m - m_use);
  float pr[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) pr[i] = __expf(s[i] - m_use);
  st.l = st.l * corr + (pr[0] + pr[1]) + (pr[2] + pr[3]);
  st.m = m_new;
  // p as P^T's B fragment: tokens 2t, 2t + 1 and 2t + 8, 2t + 9 of head g, in three parts
  uint32_t ph0, pm0, pl0, ph1, pm1, pl1;
  split3_bf16x2(pr[0], pr[1], ph0, pm0, pl0);
  split3_bf16x2(pr[2], pr[3], ph1, pm1, pl1);
  // O^T's columns in this lane are heads 2t and 2t + 1: their quads' corrections
  const int t = threadIdx.x & 3;
  const float c0 = __shfl_sync(0xffffffffu, corr, 8 * t), c1 = __shfl_sync(0xffffffffu, corr, 8 * t + 4);
#pragma unroll
  for (int i = 0; i < KSTEPS; ++i) {
    uint32_t a0, a1, a2, a3;
    ldmatrix_x4_trans(v_addr + i * 32, a0, a1, a2, a3);
    st.o[i][0] *= c0; st.o[i][1] *= c1; st.o[i][2] *= c0; st.o[i][3] *= c1;
    mma_bf16_16816(st.o[i], a0, a1, a2, a3, ph0, ph1);
    mma_bf16_16816(st.o[i], a0, a1, a2, a3, pm0, pm1);
    mma_bf16_16816(st.o[i], a0, a1, a2, a3, pl0, pl1);
  }
}

__device__ void attn_compute(Ctx& c, const TaskArgs& a) {
  const Params& p = *c.p;
  float* sm = reinterpret_cast<float*>(c.act());
  const AttnRow* rows = reinterpret_cast<const AttnRow*>(sm + ATTN_ROWS);
  const int g = c.lane() >> 2, t = c.lane() & 3;
  // this lane's ldmatrix row in a tile (K and V): token j at byte column col
  const int j = (c.lane() & 7) + (c.lane() >> 4) * 8, col = ((c.lane() >> 3) & 1) * 16;
  QkvRow qkv;
  qkv.load(c, a, a.r0);
  for (int b = a.r0; b < a.r1; ++b) {
    const AttnRow r = rows[b];
    const bool owns = r.t0 <= r.pos && r.pos < r.t1;   // the new token is this split's last
    prepare_qkv(c, a, b, sm, qkv);
    if (b + 1 < a.r1) qkv.load(c, a, b + 1);            // lands during this row's rounds
    const bf16* fresh = reinterpret_cast<const bf16*>(sm + ATTN_FRESH);
    if (owns) {   // append the new token's K and V to the cache
      bf16* kd = p.kv_pool + r.kv_new;
      bf16* vd = kd + (size_t)cfg::NKV * cfg::TPB * cfg::D;   // kv_offset(.., kv = 1, ..)
      for (int i = threadIdx.x; i < 2 * cfg::D / 8; i += CTHREADS)
        reinterpret_cast<bf16x8*>(i < cfg::D / 8 ? kd : vd)[i % (cfg::D / 8)] = reinterpret_cast<const bf16x8*>(fresh)[i];
    }
    const uint32_t* qf = reinterpret_cast<const uint32_t*>(sm + ATTN_QF) + c.lane() * 8;
    const uint32_t fk = smem_addr(fresh), fv = fk + RB;
    WarpAttn st;
    st.m = -INFINITY;
    st.l = 0.f;
#pragma unroll
    for (int i = 0; i < KSTEPS; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) st.o[i][e] = 0.f;
    // the row's rounds as the loader streams them; the new token is the last round's last token,
    // read from its bf16 row
    const int rounds = kv_rounds(r.cached);
    for (int round = 0; round < rounds; ++round, c.ring_n += cfg::KV_SLOTS) {
      const int cnt = round_tokens(r.cached, round);
      uint32_t slots[2], region[2];
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const uint32_t nr = c.ring_n + kv_slot(k);
        slots[k] = nr % cfg::STAGES;
        if (k == 0 || cfg::KV_SLOTS == 2) c.consumer_wait(&c.full()[slots[k]], (nr / cfg::STAGES) & 1);
        region[k] = smem_addr(c.ring() + (size_t)slots[k] * SLOT_STRIDE + kv_slot_offset(k));
      }
      if (diag::ATTN_MARK == 0 && b == a.r0 && round == 0) c.mark();
      const int total = cnt + (round == rounds - 1 && owns ? 1 : 0);
      auto row = [&](int u, int kv, uint32_t f) -> uint32_t {   // ring row of round token u (or the new one)
        return u < cnt ? region[kv] + kv_ring_offset(u) : f;
      };
      constexpr int R = cfg::KV_RUN;
      for (int tile = c.warp(); tile < R * ((total + 16 * R - 1) / (16 * R)); tile += cfg::CWARPS) {
        const int u0 = (tile / R) * 16 * R + tile % R;   // token j of the tile: u0 + R j
        if (u0 >= total) continue;
        const uint32_t k_addr = row(u0 + R * j, 0, fk) + col, v_addr = row(u0 + R * j, 1, fv) + col;
        const bool valid[4] = {u0 + 2 * R * t < total, u0 + R * (2 * t + 1) < total, u0 + R * (2 * t + 8) < total,
                               u0 + R * (2 * t + 9) < total};
        attn_tile(st, qf, g < cfg::G, k_addr, v_addr, valid);
      }
      // the warp is done with the round's slots (same release protocol as the GEMV consumer)
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        if (k == 1 && cfg::KV_SLOTS == 1) break;
        c.release_slot(slots[k]);
      }
    }
    if (diag::ATTN_MARK == 3 && b == a.r0) c.mark();
    if (b == a.r1 - 1) c.mark_computed();
    consumer_sync(CTHREADS);   // every warp is done with the fresh rows and q
    // the warps' (max, sum, o) meet in shared memory, then merge under their common max
    st.l += __shfl_xor_sync(0xffffffffu, st.l, 1);
    st.l += __shfl_xor_sync(0xffffffffu, st.l, 2);
    if (g < cfg::G && t == 0) *reinterpret_cast<float2*>(sm + ATTN_MERGE_ML + (c.warp() * cfg::G + g) * 2) = make_float2(st.m, st.l);
    float* mo = sm + (c.warp() * cfg::G + 2 * t) * cfg::D + g;   // head 2t, column g
#pragma unroll
    for (int i = 0; i < KSTEPS; ++i) {
      if (2 * t < cfg::G) { mo[i * 16] = st.o[i][0]; mo[i * 16 + 8] = st.o[i][2]; }
      if (2 * t + 1 < cfg::G) { mo[cfg::D + i * 16] = st.o[i][1]; mo[cfg::D + i * 16 + 8] = st.o[i][3]; }
    }
    consumer_sync(CTHREADS);
    const size_t part = (((size_t)b * cfg::NKV + a.group) * cfg::S + a.split) * cfg::G;
    for (int i = threadIdx.x; i < cfg::G * cfg::D; i += CTHREADS) {
      const int h = i / cfg::D, e = i % cfg::D;
      float M = -INFINITY;
#pragma unroll
      for (int w = 0; w < cfg::CWARPS; ++w) M = fmaxf(M, sm[ATTN_MERGE_ML + (w * cfg::G + h) * 2]);
      float O = 0.f, L = 0.f;
#pragma unroll
      for (int w = 0; w < cfg::CWARPS; ++w) {
        const float2 ml = *reinterpret_cast<const float2*>(sm + ATTN_MERGE_ML + (w * cfg::G + h) * 2);
        const float f = ml.x == -INFINITY ? 0.f : __expf(ml.x - M);
        O = fmaf(f, sm[(w * cfg::G + h) * cfg::D + e], O);
        L = fmaf(f, ml.y, L);
      }
      p.part_o[(part + h) * cfg::D + e] = O;
      if (e == 0) { p.part_ml[(part + h) * 2] = M; p.part_ml[(part + h) * 2 + 1] = L; }
    }
    consumer_sync(CTHREADS);
  }
}

template <>
struct KindBody<ATTN> {
  struct Pre {};
  static __device__ __forceinline__ void load(Ctx& c, const TaskArgs& a) { attn_load(c, a); }   // the split's cached K/V
  static __device__ __forceinline__ void prologue(Ctx& c, const TaskArgs& a, Pre&) { attn_prologue(c, a); }
  static __device__ __forceinline__ void compute(Ctx& c, const TaskArgs& a, Pre&) { attn_compute(c, a); }
};

}  // namespace mk
