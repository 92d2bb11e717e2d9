// OPROJ's device part: a K chunk of the attention output times the o-projection rows, added into
// the residual. Under TilePlan.o_merge it merges ATTN's split partials itself while staging (no
// COMBINE tasks). The GEMV machinery is mk_gemv.cuh; inlined by codegen after the shared headers.
#pragma once

namespace mk {

template <>
struct GemvKind<OPROJ> : NoTally, AddsToResidual {
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
