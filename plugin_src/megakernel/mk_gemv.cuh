// GEMV tasks (QKV, OPROJ, GATEUP, DOWN, LMHEAD): the loader streams weight rows through the
// shared-memory ring; consumers stage the bf16 activation once, then reduce each slot against it.
// Requires the generated namespace cfg (shapes, tile constants) to be defined before inclusion.
#pragma once
#include "mk_params.cuh"

namespace mk {

enum Kind { EMBED = 0, QKV = 1, ATTN = 2, COMBINE = 3, OPROJ = 4, GATEUP = 5, DOWN = 6, LMHEAD = 7, ARGMAX = 8 };

constexpr int CTHREADS = cfg::CWARPS * 32;
static_assert(cfg::CWARPS * cfg::B <= 256, "scratch holds one partial per consumer warp and batch row");

constexpr int floor_pow2(int v) { return v >= 16 ? 16 : v >= 8 ? 8 : v >= 4 ? 4 : v >= 2 ? 2 : 1; }
constexpr int min_i(int a, int b) { return a < b ? a : b; }

// Ring geometry of a GEMV kind with K range KT: a slot holds RS weight rows of KC columns; a row
// of KT columns takes NKC slots when it does not fit one. PAIR=2 for GATEUP (gate and up rows of the
// same output row travel together: slot rows [0, RS/2) are gate, [RS/2, RS) are up).
constexpr int pieces_for(int kt, int pair) {
  int n = 1;
  while (!(kt % n == 0 && (kt / n) % 8 == 0 && pair * (kt / n) * 2 <= cfg::SLOT_BYTES)) ++n;
  return n;
}
template <int KT, int PAIR>
struct Geometry {
  static constexpr int NKC = pieces_for(KT, PAIR);
  static constexpr int KC = KT / NKC;
  static constexpr int RS_FIT = cfg::SLOT_BYTES / (KC * 2);
  static constexpr int RS = floor_pow2(min_i(min_i(RS_FIT, cfg::CWARPS), 8)) < PAIR ? PAIR
                                                                                    : floor_pow2(min_i(min_i(RS_FIT, cfg::CWARPS), 8));
  static constexpr int OUT_ROWS = RS / PAIR;     // output rows per slot
  static constexpr int WPR = cfg::CWARPS / RS;   // warps per weight row
  static constexpr int NVEC = KC / 8;            // 16-byte vectors per row piece
  static_assert(cfg::CWARPS % RS == 0, "rows per slot must divide the consumer warps");
  static_assert(KT % 8 == 0, "K range must be a multiple of 8");
};

template <int KIND> struct KindTraits;
template <> struct KindTraits<QKV>    { static constexpr int KT = cfg::H; static constexpr int PAIR = 1; };
template <> struct KindTraits<OPROJ>  { static constexpr int KT = cfg::QD / cfg::O_KSPLIT; static constexpr int PAIR = 1; };
template <> struct KindTraits<GATEUP> { static constexpr int KT = cfg::H; static constexpr int PAIR = 2; };
template <> struct KindTraits<DOWN>   { static constexpr int KT = cfg::I / cfg::DOWN_KSPLIT; static constexpr int PAIR = 1; };
template <> struct KindTraits<LMHEAD> { static constexpr int KT = cfg::H; static constexpr int PAIR = 1; };

// Source pointer of weight row j (0 <= j < RS) of slot group `grp` of a task.
template <int KIND>
__device__ __forceinline__ const bf16* weight_row(const Params& p, const TaskArgs& a, int grp, int j) {
  using G = Geometry<KindTraits<KIND>::KT, KindTraits<KIND>::PAIR>;
  if constexpr (KIND == QKV) {
    const LayerWeights& w = p.layers[a.layer];
    int r = a.r0 + grp * G::OUT_ROWS + j;           // grouped row: [q heads of group g, k_g, v_g]
    int g = r / cfg::GR, within = r % cfg::GR, h = within / cfg::D, i = within % cfg::D;
    if (h < cfg::G) return w.q + (size_t)((g * cfg::G + h) * cfg::D + i) * cfg::H;
    if (h == cfg::G) return w.k + (size_t)(g * cfg::D + i) * cfg::H;
    return w.v + (size_t)(g * cfg::D + i) * cfg::H;
  } else if constexpr (KIND == OPROJ) {
    return p.layers[a.layer].o + (size_t)(a.r0 + grp * G::OUT_ROWS + j) * cfg::QD + a.k0;
  } else if constexpr (KIND == GATEUP) {
    const LayerWeights& w = p.layers[a.layer];
    int half = G::OUT_ROWS;
    int r = a.r0 + grp * half + (j % half);
    return (j < half ? w.gate : w.up) + (size_t)r * cfg::H;
  } else if constexpr (KIND == DOWN) {
    return p.layers[a.layer].down + (size_t)(a.r0 + grp * G::OUT_ROWS + j) * cfg::I + a.k0;
  } else {
    return p.lm_head + (size_t)(a.r0 + grp * G::OUT_ROWS + j) * cfg::H;
  }
}

// ------------------------------------------------------------------------------- loader side
template <int KIND>
__device__ void gemv_load(Ctx& c, const TaskArgs& a) {
  using G = Geometry<KindTraits<KIND>::KT, KindTraits<KIND>::PAIR>;
  const int groups = (a.r1 - a.r0) / G::OUT_ROWS;
  for (int grp = 0; grp < groups; ++grp) {
    for (int kc = 0; kc < G::NKC; ++kc, ++c.ring_n) {
      const uint32_t slot = c.ring_n % cfg::STAGES, use = c.ring_n / cfg::STAGES;
      mbar_wait(&c.empty[slot], (use & 1) ^ 1);  // first use of a slot passes at once
      unsigned char* dst = c.ring + (size_t)slot * cfg::SLOT_BYTES;
#if defined(MK_USE_BULK_COPY)
      if (c.lane == 0) {
        mbar_expect_tx(&c.full[slot], G::RS * G::KC * 2);
        for (int j = 0; j < G::RS; ++j)
          bulk_copy_g2s(dst + j * G::KC * 2, weight_row<KIND>(*c.p, a, grp, j) + kc * G::KC, G::KC * 2, &c.full[slot]);
      }
#else
      for (int j = 0; j < G::RS; ++j) {
        const bf16x8* src = reinterpret_cast<const bf16x8*>(weight_row<KIND>(*c.p, a, grp, j) + kc * G::KC);
        bf16x8* d = reinterpret_cast<bf16x8*>(dst + j * G::KC * 2);
        for (int v = c.lane; v < G::NVEC; v += 32) cp_async16(d + v, src + v);
      }
      cp_async_arrive(&c.full[slot]);
#endif
    }
  }
}

// ------------------------------------------------------------------------------- consumer side
// Stage the task's activation as bf16 in shared memory: rmsnorm(x) * w for the norm-prologue kinds,
// a slice of attn_out / act for OPROJ / DOWN. Every load of a pass is independent (16-byte vectors,
// unrolled), so staging costs about one L2 round trip per pass instead of one per element.
template <int KIND>
__device__ void stage_activation(Ctx& c, const TaskArgs& a) {
  constexpr int KT = KindTraits<KIND>::KT;
  const Params& p = *c.p;
  const int tid = threadIdx.x;  // consumer threads are 0 .. CTHREADS-1
  if constexpr (KIND == QKV || KIND == GATEUP || KIND == LMHEAD) {
    constexpr int H4 = cfg::H / 4, VPT = (H4 + CTHREADS - 1) / CTHREADS;
    const bf16* nw = KIND == QKV ? p.layers[a.layer].ln1 : KIND == GATEUP ? p.layers[a.layer].ln2 : p.final_norm;
    // pass 1: sum of squares of every batch row (all loads in flight at once)
    float ss[cfg::B];
#pragma unroll
    for (int b = 0; b < cfg::B; ++b) {
      ss[b] = 0.f;
      const float4* xb = reinterpret_cast<const float4*>(p.x + (size_t)b * cfg::H);
#pragma unroll
      for (int j = 0; j < VPT; ++j) {
        const int i = tid + j * CTHREADS;
        if (H4 % CTHREADS == 0 || i < H4) {
          const float4 v = __ldcg(xb + i);
          ss[b] = fmaf(v.x, v.x, fmaf(v.y, v.y, fmaf(v.z, v.z, fmaf(v.w, v.w, ss[b]))));
        }
      }
    }
#pragma unroll
    for (int b = 0; b < cfg::B; ++b) {
      const float t = warp_sum(ss[b]);
      if (c.lane == 0) c.scratch[c.warp * cfg::B + b] = t;
    }
    consumer_sync(CTHREADS);
#pragma unroll
    for (int b = 0; b < cfg::B; ++b) {
      float tot = 0.f;
      for (int w = 0; w < cfg::CWARPS; ++w) tot += c.scratch[w * cfg::B + b];
      ss[b] = rsqrtf(tot / cfg::H + cfg::EPS);
    }
    // pass 2: normalise (x is re-read from L2: cheaper than holding B*H/threads values in registers)
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
      const int i = tid + j * CTHREADS;
      if (H4 % CTHREADS == 0 || i < H4) {
        const uint2 wraw = __ldg(reinterpret_cast<const uint2*>(nw) + i);
        const float2 w01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&wraw.x));
        const float2 w23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&wraw.y));
#pragma unroll
        for (int b = 0; b < cfg::B; ++b) {
          const float4 v = __ldcg(reinterpret_cast<const float4*>(p.x + (size_t)b * cfg::H) + i);
          __nv_bfloat162 lo = __floats2bfloat162_rn(v.x * ss[b] * w01.x, v.y * ss[b] * w01.y);
          __nv_bfloat162 hi = __floats2bfloat162_rn(v.z * ss[b] * w23.x, v.w * ss[b] * w23.y);
          uint2 out;
          out.x = *reinterpret_cast<uint32_t*>(&lo);
          out.y = *reinterpret_cast<uint32_t*>(&hi);
          reinterpret_cast<uint2*>(c.act + b * KT)[i] = out;
        }
      }
    }
    consumer_sync(CTHREADS);   // act complete; scratch free again
  } else {
    const float* src = KIND == OPROJ ? p.attn_out : p.act;
    constexpr int ROW = KIND == OPROJ ? cfg::QD : cfg::I;
    constexpr int K4 = KT / 4, N4 = cfg::B * K4, U = 4;
    for (int base = tid; base < N4; base += CTHREADS * U) {
      float4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i = base + u * CTHREADS;
        if (i < N4) v[u] = __ldcg(reinterpret_cast<const float4*>(src + (size_t)(i / K4) * ROW + a.k0) + i % K4);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i = base + u * CTHREADS;
        if (i < N4) {
          __nv_bfloat162 lo = __floats2bfloat162_rn(v[u].x, v[u].y), hi = __floats2bfloat162_rn(v[u].z, v[u].w);
          uint2 out;
          out.x = *reinterpret_cast<uint32_t*>(&lo);
          out.y = *reinterpret_cast<uint32_t*>(&hi);
          reinterpret_cast<uint2*>(c.act)[i] = out;   // [b][k] with k contiguous, as i = b*K4 + k/4
        }
      }
    }
    consumer_sync(CTHREADS);
  }
}

__device__ __forceinline__ float silu(float g) { return g / (1.f + __expf(-g)); }

// Write one finished output value (row r of the task's output space, batch row b).
template <int KIND>
__device__ __forceinline__ void gemv_epilogue(const Params& p, const TaskArgs& a, int r, int b, float v, float v_up) {
  if constexpr (KIND == QKV) {
    if constexpr (cfg::QKV_BIAS) {
      const LayerWeights& w = p.layers[a.layer];
      int g = r / cfg::GR, within = r % cfg::GR, h = within / cfg::D, i = within % cfg::D;
      const bf16* bias = h < cfg::G ? w.q_bias + (g * cfg::G + h) * cfg::D : h == cfg::G ? w.k_bias + g * cfg::D : w.v_bias + g * cfg::D;
      v += bf16_to_f(bias[i]);
    }
    p.qkv[(size_t)b * cfg::QKVR + r] = v;
  } else if constexpr (KIND == OPROJ || KIND == DOWN) {
    // A fire-and-forget reduction at L2: no round trip stalls the warp (a load-add-store would), and
    // K-split partials accumulate in place. With one writer per element the result is deterministic.
    atomicAdd(p.x + (size_t)b * cfg::H + r, v);
  } else if constexpr (KIND == GATEUP) {
    p.act[(size_t)b * cfg::I + r] = silu(v) * v_up;
  } else {
    p.logits[(size_t)b * cfg::V + r] = v;
  }
}

// First argmax (highest value, lowest index on ties) over the consumer threads' candidates; the
// result is valid in consumer thread 0. Used by the LM-head tiles and by the final ARGMAX task.
__device__ __forceinline__ bool argmax_better(float v, int i, float best, int bi) {
  return v > best || (v == best && i < bi);
}

__device__ void block_argmax(Ctx& c, float& best, int& bi) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, best, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (argmax_better(ov, oi, best, bi)) { best = ov; bi = oi; }
  }
  if (c.lane == 0) { c.scratch[c.warp] = best; reinterpret_cast<int*>(c.scratch)[32 + c.warp] = bi; }
  consumer_sync(CTHREADS);
  if (threadIdx.x == 0) {
    for (int w = 1; w < cfg::CWARPS; ++w) {
      const float ov = c.scratch[w];
      const int oi = reinterpret_cast<int*>(c.scratch)[32 + w];
      if (argmax_better(ov, oi, best, bi)) { best = ov; bi = oi; }
    }
  }
}

// First-argmax of logits[b, r0:r1] for every b -> lm_val / lm_idx[b, tile].
__device__ void lm_tile_argmax(Ctx& c, const TaskArgs& a) {
  const Params& p = *c.p;
  for (int b = 0; b < cfg::B; ++b) {
    float best = -INFINITY;
    int bi = 0x7fffffff;
    for (int r = a.r0 + threadIdx.x; r < a.r1; r += CTHREADS) {
      const float v = ld_act(p.logits + (size_t)b * cfg::V + r);
      if (argmax_better(v, r, best, bi)) { best = v; bi = r; }
    }
    block_argmax(c, best, bi);
    if (threadIdx.x == 0) {
      p.lm_val[b * cfg::N_LM_TILES + a.tile] = best;
      p.lm_idx[b * cfg::N_LM_TILES + a.tile] = bi;
    }
    consumer_sync(CTHREADS);   // scratch is reused by the next batch row
  }
}

template <int KIND>
__device__ void gemv_compute(Ctx& c, const TaskArgs& a) {
  using G = Geometry<KindTraits<KIND>::KT, KindTraits<KIND>::PAIR>;
  constexpr int KT = KindTraits<KIND>::KT;
  const Params& p = *c.p;
  stage_activation<KIND>(c, a);
  const int row_in_slot = c.warp / G::WPR, seg = c.warp % G::WPR;
  const int vbeg = seg * G::NVEC / G::WPR, vend = (seg + 1) * G::NVEC / G::WPR;
  const bf16x8* actv = reinterpret_cast<const bf16x8*>(c.act);
  const int groups = (a.r1 - a.r0) / G::OUT_ROWS;
  for (int grp = 0; grp < groups; ++grp) {
    float acc[cfg::B];
#pragma unroll
    for (int b = 0; b < cfg::B; ++b) acc[b] = 0.f;
    for (int kc = 0; kc < G::NKC; ++kc, ++c.ring_n) {
      const uint32_t slot = c.ring_n % cfg::STAGES, use = c.ring_n / cfg::STAGES;
      mbar_wait(&c.full[slot], use & 1);
      const bf16x8* wrow = reinterpret_cast<const bf16x8*>(c.ring + (size_t)slot * cfg::SLOT_BYTES + row_in_slot * G::KC * 2);
#pragma unroll 4
      for (int v = vbeg + c.lane; v < vend; v += 32) {
        const bf16x8 w = wrow[v];
#pragma unroll
        for (int b = 0; b < cfg::B; ++b) acc[b] += dot8(w, actv[(b * KT + kc * G::KC) / 8 + v]);
      }
      __syncwarp();
      if (c.lane == 0) mbar_arrive(&c.empty[slot]);
    }
#pragma unroll
    for (int b = 0; b < cfg::B; ++b) acc[b] = warp_sum(acc[b]);
    if constexpr (G::WPR == 1 && KindTraits<KIND>::PAIR == 1) {
      if (c.lane == 0) {
        const int r = a.r0 + grp * G::OUT_ROWS + row_in_slot;
#pragma unroll
        for (int b = 0; b < cfg::B; ++b) gemv_epilogue<KIND>(p, a, r, b, acc[b], 0.f);
      }
    } else {
      float* red = c.red + (grp & 1) * cfg::CWARPS * cfg::B;   // [RS][WPR][B]
      if (c.lane == 0) {
#pragma unroll
        for (int b = 0; b < cfg::B; ++b) red[c.warp * cfg::B + b] = acc[b];
      }
      consumer_sync(CTHREADS);
      for (int i = threadIdx.x; i < G::OUT_ROWS * cfg::B; i += CTHREADS) {
        const int orow = i / cfg::B, b = i % cfg::B;
        float v = 0.f, vu = 0.f;
        for (int s = 0; s < G::WPR; ++s) v += red[(orow * G::WPR + s) * cfg::B + b];
        if constexpr (KindTraits<KIND>::PAIR == 2)
          for (int s = 0; s < G::WPR; ++s) vu += red[((orow + G::OUT_ROWS) * G::WPR + s) * cfg::B + b];
        gemv_epilogue<KIND>(p, a, a.r0 + grp * G::OUT_ROWS + orow, b, v, vu);
      }
    }
  }
  consumer_sync(CTHREADS);  // all outputs stored before the task signals (and act/red reuse)
  if constexpr (KIND == LMHEAD) lm_tile_argmax(c, a);
}

}  // namespace mk
