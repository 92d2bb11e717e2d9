// OPROJ's device part: a K chunk of the attention output times the o-projection rows, added into
// the residual. Under TilePlan.o_merge it merges ATTN's split partials itself while staging (no
// COMBINE tasks). The GEMV machinery is mk_gemv.cuh; inlined by codegen after the shared headers.
#pragma once

namespace mk {

// Under TilePlan.expert_fused, the router's share of the chain (kinds/router.py): the task keeps its
// partial sums in a stash after its staged input (at cfg::OPROJ_STASH_AT: kinds/oproj.py stash_at), then
// adds the logits of ln2 * them into router_acc; a first K-chunk task also adds its rows of the experts'
// outputs kept beside x into x and zeroes the same rows for this layer's experts.

// N floats from shared memory, in 16- or 8-byte loads where N allows (the stash's rows are 16-byte aligned
// when N is a multiple of 4)
template <int N>
__device__ __forceinline__ void load_row(const float* s, float (&v)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      const float4 q = *reinterpret_cast<const float4*>(s + i);
      v[i] = q.x; v[i + 1] = q.y; v[i + 2] = q.z; v[i + 3] = q.w;
    }
  } else if constexpr (N % 2 == 0) {
#pragma unroll
    for (int i = 0; i < N; i += 2) {
      const float2 q = *reinterpret_cast<const float2*>(s + i);
      v[i] = q.x; v[i + 1] = q.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = s[i];
  }
}

template <bool CHAIN> struct OprojTally : NoTally {};
template <> struct OprojTally<true> {
  // (a dense kernel compiles this unused: its activation region has no stash)
  static_assert(!cfg::EXPERT_FUSED || cfg::OPROJ_STASH_AT + cfg::O_ROWS * cfg::B * 4 <= cfg::ACT_SMEM_BYTES,
                "OPROJ stash exceeds act[]");
  // the layer's router and ln2 are looked up as the task starts: their pointers' round trip then
  // overlaps the GEMV instead of preceding the reduction's loads
  struct Tally { float* stash; int r0; const bf16* wr; const bf16* g; };
  static __device__ __forceinline__ Tally tally_begin(const Ctx& c, const TaskArgs& a) {
    return {reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(c.act()) + cfg::OPROJ_STASH_AT), a.r0,
            c.p->routers[a.layer] + a.r0, c.p->layers[a.layer].ln2 + a.r0};
  }
  static __device__ __forceinline__ void tally(Tally& t, int r, int b, float v) { t.stash[(r - t.r0) * cfg::B + b] = v; }
  // The router's weights are in L2 (ROUTER read them all at the layer's start). Every load of the
  // reduction (the experts' outputs to fold in, the rows' ln2, the router's columns) is issued before the
  // barrier that completes the stash: one round trip. A row's ln2 then scales its stash.
  static __device__ __forceinline__ void tally_reduce(Ctx& c, const TaskArgs& a, Tally& t) {
    constexpr int PER = (cfg::O_ROWS * cfg::B + CTHREADS - 1) / CTHREADS;   // stash entries a thread scales
    // two threads (adjacent lanes) an expert, each half of the rows' columns: 16-byte weight loads
    constexpr int WV = (cfg::O_ROWS / 8 + 1) / 2;
    // experts a thread pair reduces (1 in a dense kernel, which compiles this unused)
    constexpr int EPT = cfg::E > 0 ? (2 * cfg::E + CTHREADS - 1) / CTHREADS : 1;
    static_assert(CTHREADS % 2 == 0, "thread pairs");
    const Params& p = *c.p;
    const int rows = a.r1 - a.r0;   // a multiple of 8
    const bool fold = a.k0 == 0;
    const long long* kept = expert_sum_at(p, a.layer);
    long long kv[PER];
    float gv[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) {   // stash entry i: row i / B, batch row i % B
      const int i = threadIdx.x + j * CTHREADS, r = i / cfg::B, b = i % cfg::B;
      const bool in = i < rows * cfg::B;
      kv[j] = fold && in ? __ldcg(kept + (size_t)b * cfg::H + a.r0 + r) : 0ll;
      gv[j] = in ? bf16_to_f(t.g[r]) : 0.f;
    }
    const int half = threadIdx.x & 1;
    uint4 wv[EPT][WV];
#pragma unroll
    for (int q = 0; q < EPT; ++q) {
      const int e = (threadIdx.x >> 1) + q * (CTHREADS / 2);
      const bf16* w = t.wr + (size_t)(e < cfg::E ? e : 0) * cfg::H;
#pragma unroll
      for (int k = 0; k < WV; ++k) {
        const int r = 8 * (2 * k + half);
        if (e < cfg::E && r < rows) wv[q][k] = __ldg(reinterpret_cast<const uint4*>(w + r));
      }
    }
    consumer_sync(CTHREADS);   // every partial sum is in the stash
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      const int i = threadIdx.x + j * CTHREADS;
      if (i < rows * cfg::B) t.stash[i] *= gv[j];
    }
    consumer_sync(CTHREADS);
#pragma unroll
    for (int q = 0; q < EPT; ++q) {
      const int e = (threadIdx.x >> 1) + q * (CTHREADS / 2);
      float acc[cfg::B];
#pragma unroll
      for (int b = 0; b < cfg::B; ++b) acc[b] = 0.f;
#pragma unroll
      for (int k = 0; k < WV; ++k) {
        const int r = 8 * (2 * k + half);
        if (e >= cfg::E || r >= rows) continue;
        const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&wv[q][k]);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 wf = __bfloat1622float2(w2[j]);
          float x0[cfg::B], x1[cfg::B];
          load_row<cfg::B>(t.stash + (r + 2 * j) * cfg::B, x0);
          load_row<cfg::B>(t.stash + (r + 2 * j + 1) * cfg::B, x1);
#pragma unroll
          for (int b = 0; b < cfg::B; ++b) acc[b] = fmaf(wf.y, x1[b], fmaf(wf.x, x0[b], acc[b]));
        }
      }
#pragma unroll
      for (int b = 0; b < cfg::B; ++b) {
        const float v = acc[b] + __shfl_xor_sync(0xffffffffu, acc[b], 1);   // the pair's halves, in a fixed order
        if (half == 0 && e < cfg::E) add_resid(router_acc_at(p, a.layer, b, e), v);
      }
    }
    if (fold) {   // this layer's experts add into the next row: zero where this task folded
      long long* next = expert_sum_at(p, a.layer + 1);
#pragma unroll
      for (int j = 0; j < PER; ++j) {
        const int i = threadIdx.x + j * CTHREADS;
        if (i >= rows * cfg::B) continue;
        const size_t at = (size_t)(i % cfg::B) * cfg::H + a.r0 + i / cfg::B;
        if (kv[j] != 0) atomicAdd(reinterpret_cast<unsigned long long*>(p.x + at), static_cast<unsigned long long>(kv[j]));
        next[at] = 0;
      }
    }
  }
  static __device__ __forceinline__ void tally_publish(Ctx&, const TaskArgs&, const Tally&) {}
};

template <>
struct GemvKind<OPROJ> : OprojTally<cfg::EXPERT_FUSED>, AddsToResidual {
  static constexpr int KT = cfg::QD / cfg::O_KSPLIT;
  static constexpr int PAIR = 1;
  static constexpr int WBITS = cfg::WBITS;
  using G = Geometry<KT, PAIR, WBITS>;

  static __device__ __forceinline__ WeightRef weight_ref(const Params& p, const TaskArgs& a, int grp, int j) {
    return weight_at(p.layers[a.layer].o, layer_scales(p, a.layer).o, a.r0 + grp * G::OUT_ROWS + j, cfg::QD, a.k0);
  }

  static __device__ __forceinline__ void stage(Ctx& c, const TaskArgs& a) {
    if constexpr (cfg::O_MERGE) {
      // attn_out of the chunk's heads, merged here from the split partials; the merge factors sit
      // after the staged rows (trtllm_mk/smem.py activation_bytes)
      constexpr int AS = KT + ACT_PAD;
      // (a discarded branch of a non-template function is still checked: hence the !O_MERGE ||)
      static_assert(!cfg::O_MERGE || KT % cfg::D == 0, "an OPROJ K chunk holds whole heads");
      static_assert(!cfg::O_MERGE || cfg::B * AS * 2 + cfg::B * (KT / cfg::D) * (cfg::S + 1) * 4 <= cfg::ACT_SMEM_BYTES,
                    "merge factors exceed the activation region");
      bf16* act = c.act();
      merge_heads<KT / cfg::D>(*c.p, a.k0 / cfg::D, reinterpret_cast<float*>(act + cfg::B * AS),
                               [&](int i, float v) { act[(i / KT) * AS + i % KT] = f_to_bf16(v); });
      consumer_sync(CTHREADS);
    } else {
      stage_rows<OPROJ, cfg::QD>(c, a, c.p->attn_out);
    }
  }
};

template <> struct KindBody<OPROJ> : GemvBody<OPROJ> {};

}  // namespace mk
