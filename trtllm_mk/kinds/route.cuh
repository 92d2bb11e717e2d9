// ROUTE's device body (kinds/route.py): per batch row, one warp takes the softmax of the E router
// logits and the k most probable experts (k rounds of a warp argmax: the highest probability, the lowest
// expert index on ties, as model/moe.py route; each round two warp reductions, redux.sync, of the
// probability's bits and then of the index), then warp 0 lays the rows' choices out as the step's
// expert slots: the union of the selected experts in ascending order, then idle slots (-1), and each
// slot's routing weight per row (0 where the row did not select it). Inlined by codegen after the
// shared device headers.
#pragma once

namespace mk {

template <>
struct KindBody<ROUTE> : NoLoad, NoPrologue {
  static constexpr int EPL = cfg::E > 32 ? (cfg::E + 31) / 32 : 1;   // logits per lane
  static constexpr int K = cfg::TOPK > 0 ? cfg::TOPK : 1;

  static __device__ __forceinline__ void compute(Ctx& c, const TaskArgs& a, Pre&) {
    const Params& p = *c.p;
    // the rows' choices, in the activation region (free between GEMVs): experts, then their weights
    int* sel = reinterpret_cast<int*>(c.act());
    float* wsel = reinterpret_cast<float*>(sel + cfg::B * K);
    for (int b = c.warp(); b < cfg::B; b += cfg::CWARPS) {
      float v[EPL];
      float m = -INFINITY;
#pragma unroll
      for (int i = 0; i < EPL; ++i) {
        const int e = c.lane() + 32 * i;
        v[i] = e < cfg::E ? ld_act(p.router_logits + (size_t)b * cfg::E + e) : -INFINITY;
        m = fmaxf(m, v[i]);
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
      float s = 0.f;
#pragma unroll
      for (int i = 0; i < EPL; ++i) {
        v[i] = c.lane() + 32 * i < cfg::E ? expf(v[i] - m) : 0.f;
        s += v[i];
      }
      s = warp_sum(s);
      // ranking keys: a probability's bits + 1 (a non-negative float's bits order as it does), 0 for
      // no expert or one already taken, so a probability of 0 still outranks them
      uint32_t key[EPL];
#pragma unroll
      for (int i = 0; i < EPL; ++i) key[i] = c.lane() + 32 * i < cfg::E ? __float_as_uint(v[i] / s) + 1u : 0u;
      float total = 0.f;
      for (int j = 0; j < cfg::TOPK; ++j) {   // descending probability, the lowest index on ties
        uint32_t lk = 0u, le = 0xffffffffu;    // this lane's best: the first of its highest keys
#pragma unroll
        for (int i = 0; i < EPL; ++i)
          if (key[i] > lk) { lk = key[i]; le = c.lane() + 32 * i; }
        const uint32_t kmax = __reduce_max_sync(0xffffffffu, lk);
        const uint32_t bi = __reduce_min_sync(0xffffffffu, lk == kmax ? le : 0xffffffffu);
        if (bi % 32 == (uint32_t)c.lane()) {   // the winner leaves the race
#pragma unroll
          for (int i = 0; i < EPL; ++i)
            if (bi / 32 == (uint32_t)i) key[i] = 0u;
        }
        const float best = __uint_as_float(kmax - 1u);
        total += best;   // in rank order, as the reference sums the top-k weights
        if (c.lane() == 0) { sel[b * K + j] = (int)bi; wsel[b * K + j] = best; }
      }
      if (cfg::NORM_TOPK && c.lane() == 0)
        for (int j = 0; j < cfg::TOPK; ++j) wsel[b * K + j] /= total;
    }
    consumer_sync(CTHREADS);
    if (c.warp() == 0) {
      int n = 0;   // slots filled so far (the experts below this chunk that some row selected)
      for (int i = 0; i < EPL; ++i) {
        const int e = c.lane() + 32 * i;
        bool chosen = false;
        for (int q = 0; q < cfg::B * cfg::TOPK; ++q) chosen |= e < cfg::E && sel[q] == e;
        const uint32_t mask = __ballot_sync(0xffffffffu, chosen);
        if (chosen) {
          const int s = n + __popc(mask & ((1u << c.lane()) - 1u));
          p.moe_slot[s] = e;
          for (int b = 0; b < cfg::B; ++b) {
            float w = 0.f;
            for (int j = 0; j < cfg::TOPK; ++j)
              if (sel[b * K + j] == e) w = wsel[b * K + j];
            p.moe_w[s * cfg::B + b] = w;
          }
        }
        n += __popc(mask);
      }
      for (int s = n + c.lane(); s < cfg::NSLOT; s += 32) {   // idle slots: expert 0 at weight 0
        p.moe_slot[s] = -1;
        for (int b = 0; b < cfg::B; ++b) p.moe_w[s * cfg::B + b] = 0.f;
      }
    }
    consumer_sync(CTHREADS);
  }
};

}  // namespace mk
