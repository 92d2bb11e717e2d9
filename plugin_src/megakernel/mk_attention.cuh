// Split-KV GQA decode attention over the paged KV cache (TRT-LLM layout, HND inside a block), and
// the combine of the split partials. One ATTN task = one KV group x one split, for every batch row.
#pragma once
#include "mk_gemv.cuh"

namespace mk {

constexpr int EPL = cfg::D / 32;  // head elements per lane

__device__ __forceinline__ size_t kv_offset(const Params& p, int layer, int b, int t, int kv, int g) {
  const int block = p.block_table[(size_t)b * p.block_table_stride + t / cfg::TPB];
  return ((((size_t)layer * p.num_blocks + block) * 2 + kv) * cfg::NKV + g) * (size_t)(cfg::TPB * cfg::D) +
         (size_t)(t % cfg::TPB) * cfg::D;
}

// q heads, k and v of group g for batch row b: QK-norm (qwen3), RoPE at position pos; k and v
// rounded to bf16 exactly as they are stored in the cache. Result in sm: [G+2][D] fp32.
__device__ void prepare_qkv(Ctx& c, const TaskArgs& a, int b, int pos, float* sm) {
  const Params& p = *c.p;
  const float* src = p.qkv + (size_t)b * cfg::QKVR + a.group * cfg::GR;
  for (int i = threadIdx.x; i < cfg::GR; i += CTHREADS) sm[i] = ld_act(src + i);
  consumer_sync(CTHREADS);
  // one warp per head (q heads 0..G-1, k = head G); v (head G+1) is only rounded
  for (int h = c.warp; h < cfg::G + 1; h += cfg::CWARPS) {
    float* hv = sm + h * cfg::D;
    if constexpr (cfg::QK_NORM) {
      const bf16* nw = h < cfg::G ? p.layers[a.layer].q_norm : p.layers[a.layer].k_norm;
      float ss = 0.f;
      for (int i = c.lane; i < cfg::D; i += 32) ss = fmaf(hv[i], hv[i], ss);
      const float rstd = rsqrtf(warp_sum(ss) / cfg::D + cfg::EPS);
      __syncwarp();
      for (int i = c.lane; i < cfg::D; i += 32) hv[i] = hv[i] * rstd * bf16_to_f(nw[i]);
      __syncwarp();
    }
    for (int i = c.lane; i < cfg::D / 2; i += 32) {
      float sn, cs;
      sincosf((float)pos * p.inv_freq[i], &sn, &cs);
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
}

__device__ void attn_compute(Ctx& c, const TaskArgs& a) {
  const Params& p = *c.p;
  float* sm = reinterpret_cast<float*>(c.act);      // [G+2][D] q/k/v, then [CWARPS][G][D+2] merge
  float* merge = sm + (cfg::G + 2) * cfg::D;
  const float scale = rsqrtf((float)cfg::D);
  for (int b = 0; b < cfg::B; ++b) {
    const int pos = ld_act(p.pos + b), len = pos + 1;
    const int chunk = (len + cfg::S - 1) / cfg::S;
    const int t0 = a.split * chunk, t1 = min(len, t0 + chunk);
    prepare_qkv(c, a, b, pos, sm);
    const float* knew = sm + cfg::G * cfg::D;
    const float* vnew = knew + cfg::D;
    if (t0 <= pos && pos < t1) {  // this split owns the new token: append it to the cache
      bf16* kd = p.kv_pool + kv_offset(p, a.layer, b, pos, 0, a.group);
      bf16* vd = p.kv_pool + kv_offset(p, a.layer, b, pos, 1, a.group);
      for (int i = threadIdx.x; i < cfg::D; i += CTHREADS) { kd[i] = f_to_bf16(knew[i]); vd[i] = f_to_bf16(vnew[i]); }
    }
    float q[cfg::G][EPL], o[cfg::G][EPL], m[cfg::G], l[cfg::G];
#pragma unroll
    for (int h = 0; h < cfg::G; ++h) {
      m[h] = -INFINITY; l[h] = 0.f;
#pragma unroll
      for (int e = 0; e < EPL; ++e) { q[h][e] = sm[h * cfg::D + c.lane * EPL + e] * scale; o[h][e] = 0.f; }
    }
    // Each warp walks tokens t0+warp, t0+warp+CWARPS, ...; UNROLL tokens' K/V rows are loaded before
    // any is used so several cache reads are in flight per warp.
    constexpr int UNROLL = 4;
    for (int tb = t0 + c.warp; tb < t1; tb += cfg::CWARPS * UNROLL) {
      float kk[UNROLL][EPL], vv[UNROLL][EPL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int t = tb + u * cfg::CWARPS;
        if (t >= t1) break;
        if (t == pos) {
#pragma unroll
          for (int e = 0; e < EPL; ++e) { kk[u][e] = knew[c.lane * EPL + e]; vv[u][e] = vnew[c.lane * EPL + e]; }
        } else {
          const bf16* kp = p.kv_pool + kv_offset(p, a.layer, b, t, 0, a.group) + c.lane * EPL;
          const bf16* vp = p.kv_pool + kv_offset(p, a.layer, b, t, 1, a.group) + c.lane * EPL;
#pragma unroll
          for (int e = 0; e < EPL; ++e) { kk[u][e] = bf16_to_f(kp[e]); vv[u][e] = bf16_to_f(vp[e]); }
        }
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        if (tb + u * cfg::CWARPS >= t1) break;
#pragma unroll
        for (int h = 0; h < cfg::G; ++h) {
          float s = 0.f;
#pragma unroll
          for (int e = 0; e < EPL; ++e) s = fmaf(q[h][e], kk[u][e], s);
          s = warp_sum(s);
          const float mn = fmaxf(m[h], s), corr = __expf(m[h] - mn), pe = __expf(s - mn);
          l[h] = l[h] * corr + pe;
#pragma unroll
          for (int e = 0; e < EPL; ++e) o[h][e] = o[h][e] * corr + pe * vv[u][e];
          m[h] = mn;
        }
      }
    }
    // merge the warps' running softmax states
    float* mw = merge + c.warp * cfg::G * (cfg::D + 2);
#pragma unroll
    for (int h = 0; h < cfg::G; ++h) {
#pragma unroll
      for (int e = 0; e < EPL; ++e) mw[h * (cfg::D + 2) + c.lane * EPL + e] = o[h][e];
      if (c.lane == 0) { mw[h * (cfg::D + 2) + cfg::D] = m[h]; mw[h * (cfg::D + 2) + cfg::D + 1] = l[h]; }
    }
    consumer_sync(CTHREADS);
    const size_t part = (((size_t)b * cfg::NKV + a.group) * cfg::S + a.split) * cfg::G;
    for (int i = threadIdx.x; i < cfg::G * cfg::D; i += CTHREADS) {
      const int h = i / cfg::D, e = i % cfg::D;
      float M = -INFINITY;
      for (int w = 0; w < cfg::CWARPS; ++w) M = fmaxf(M, merge[(w * cfg::G + h) * (cfg::D + 2) + cfg::D]);
      float O = 0.f, Lsum = 0.f;
      if (M != -INFINITY) {
        for (int w = 0; w < cfg::CWARPS; ++w) {
          const float* mh = merge + (w * cfg::G + h) * (cfg::D + 2);
          const float f = __expf(mh[cfg::D] - M);
          O += f * mh[e];
          Lsum += f * mh[cfg::D + 1];
        }
      }
      p.part_o[(part + h) * cfg::D + e] = O;
      if (e == 0) { p.part_ml[(part + h) * 2] = M; p.part_ml[(part + h) * 2 + 1] = Lsum; }
    }
    consumer_sync(CTHREADS);
  }
}

__device__ void combine_compute(Ctx& c, const TaskArgs& a) {
  const Params& p = *c.p;
  for (int i = threadIdx.x; i < cfg::B * cfg::G * cfg::D; i += CTHREADS) {
    const int b = i / (cfg::G * cfg::D), h = (i / cfg::D) % cfg::G, e = i % cfg::D;
    const size_t base = ((size_t)b * cfg::NKV + a.group) * cfg::S * cfg::G + h;  // + s*G
    float M = -INFINITY;
    for (int s = 0; s < cfg::S; ++s) M = fmaxf(M, ld_act(p.part_ml + (base + s * cfg::G) * 2));
    float num = 0.f, den = 0.f;
    for (int s = 0; s < cfg::S; ++s) {
      const float ms = ld_act(p.part_ml + (base + s * cfg::G) * 2);
      if (ms == -INFINITY) continue;
      const float f = __expf(ms - M);
      num += f * ld_act(p.part_o + (base + s * cfg::G) * cfg::D + e);
      den += f * ld_act(p.part_ml + (base + s * cfg::G) * 2 + 1);
    }
    p.attn_out[(size_t)b * cfg::QD + (a.group * cfg::G + h) * cfg::D + e] = num / den;
  }
  consumer_sync(CTHREADS);
}

}  // namespace mk
