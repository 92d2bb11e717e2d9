// OPROJ's device part: a K chunk of the attention output times the o-projection rows, added into
// the residual. Under TilePlan.o_merge it merges ATTN's split partials itself while staging (no
// COMBINE tasks). The GEMV machinery is mk_gemv.cuh; inlined by codegen after the shared headers.
#pragma once

namespace mk {

// Under TilePlan.expert_fused (kinds/router.py) OPROJ's rows from H on are the router through o
// (Params::router_o, [E][QD] bf16): their partial sums add into router_acc as the o-projection's add into
// x. A first K-chunk task also adds its rows of the experts' outputs kept beside x into x and zeroes
// the same rows for this layer's experts (after its GEMV: the loads' round trip then ends the task
// instead of delaying its first slot).
template <bool CHAIN> struct OprojFold : NoTally {};
template <> struct OprojFold<true> : NoTally {
  static __device__ __forceinline__ void tally_reduce(Ctx& c, const TaskArgs& a, Tally&) {
    constexpr int PER = (cfg::O_ROWS * cfg::B + CTHREADS - 1) / CTHREADS;   // rows x batch rows a thread folds
    const int rows = min_i(a.r1, cfg::H) - a.r0;
    if (a.k0 != 0 || rows <= 0) return;
    const Params& p = *c.p;
    const long long* kept = expert_sum_at(p, a.layer);
    long long* next = expert_sum_at(p, a.layer + 1);
    long long kv[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) {   // entry i: row i / B, batch row i % B
      const int i = threadIdx.x + j * CTHREADS;
      kv[j] = i < rows * cfg::B ? __ldcg(kept + (size_t)(i % cfg::B) * cfg::H + a.r0 + i / cfg::B) : 0ll;
    }
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      const int i = threadIdx.x + j * CTHREADS;
      if (i >= rows * cfg::B) continue;
      const size_t at = (size_t)(i % cfg::B) * cfg::H + a.r0 + i / cfg::B;
      if (kv[j] != 0) atomicAdd(reinterpret_cast<unsigned long long*>(p.x + at), static_cast<unsigned long long>(kv[j]));
      next[at] = 0;
    }
  }
};

template <>
struct GemvKind<OPROJ> : OprojFold<cfg::EXPERT_FUSED>, AddsToResidual {
  static constexpr int KT = cfg::QD / cfg::O_KSPLIT;
  static constexpr int PAIR = 1;
  static constexpr int WBITS = cfg::WBITS;
  using G = Geometry<KT, PAIR, WBITS>;
  static_assert(!cfg::EXPERT_FUSED || cfg::WBITS == 16, "the router through o is bf16, as the o-projection");

  static __device__ __forceinline__ WeightRef weight_ref(const Params& p, const TaskArgs& a, int grp, int j) {
    if constexpr (cfg::EXPERT_FUSED) {
      const int r = a.r0 + grp * G::OUT_ROWS + j;
      if (r >= cfg::H) return weight_at(p.router_o[a.layer], nullptr, r - cfg::H, cfg::QD, a.k0);
    }
    return weight_at(p.layers[a.layer].o, layer_scales(p, a.layer).o, a.r0 + grp * G::OUT_ROWS + j, cfg::QD, a.k0);
  }

  static __device__ __forceinline__ void epilogue(const Ctx& c, const TaskArgs& a, int r, int b, float v, float vu) {
    const Params& p = *c.p;
    if constexpr (cfg::EXPERT_FUSED)
      if (r >= cfg::H) return add_resid(router_acc_at(p, a.layer, b, r - cfg::H), v);
    AddsToResidual::epilogue(c, a, r, b, v, vu);
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
      // a pair of merged elements lies in one staged row (KT holds whole heads): one bf16x2 store
      merge_heads<KT / cfg::D>(*c.p, a.k0 / cfg::D, reinterpret_cast<float*>(act + cfg::B * AS), [&](int i, const auto& v) {
        if constexpr (std::is_same_v<std::decay_t<decltype(v)>, float2>)
          *reinterpret_cast<__nv_bfloat162*>(act + (i / KT) * AS + i % KT) = __floats2bfloat162_rn(v.x, v.y);
        else
          act[(i / KT) * AS + i % KT] = f_to_bf16(v);
      });
      consumer_sync(CTHREADS);
    } else {
      stage_rows<OPROJ, cfg::QD>(c, a, c.p->attn_out);
    }
  }
};

template <> struct KindBody<OPROJ> : GemvBody<OPROJ> {};

}  // namespace mk
