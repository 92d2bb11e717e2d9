// ROUTE's device part (kinds/route.py) and the routing it shares with the experts' loaders.
// route_logits: one batch row's softmax of the E router logits and its k most probable experts (k rounds
// of a warp argmax: the highest probability, the lowest expert index on ties, as model/moe.py route;
// each round two warp reductions, redux.sync, of the probability's bits and then of the index).
// The step's expert slots are the union of the rows' choices in ascending expert order, then idle
// slots. ROUTE writes them with each slot's routing weight per row (EDOWN's scale); the loaders of
// EGATEUP / EDOWN find their own slot's expert with the same functions as soon as the logits land
// (ExpertSource), so the expert streams do not wait for ROUTE. Inlined by codegen after the shared
// device headers.
#pragma once

namespace mk {

constexpr int ROUTE_EPL = cfg::E > 32 ? (cfg::E + 31) / 32 : 1;   // logits per lane: expert lane + 32 i
constexpr int ROUTE_K = cfg::TOPK > 0 ? cfg::TOPK : 1;

// This lane's logits of one row (expert lane + 32 i in v[i]).
__device__ __forceinline__ void route_load(const float* logits, int lane, float (&v)[ROUTE_EPL]) {
#pragma unroll
  for (int i = 0; i < ROUTE_EPL; ++i) {
    const int e = lane + 32 * i;
    v[i] = e < cfg::E ? ld_act(logits + e) : -INFINITY;
  }
}
// k rounds of a warp argmax over the lanes' ranking keys (key[i]: expert lane + 32 i; 0: no expert, or
// one already chosen): the highest key, the lowest expert index on ties. pick(j, expert, key) runs in
// every lane for round j. Returns this lane's chosen experts as bits (bit i: expert lane + 32 i).
template <class Pick>
__device__ __forceinline__ uint32_t route_topk(uint32_t (&key)[ROUTE_EPL], int lane, Pick&& pick) {
  uint32_t mine = 0u;
#pragma unroll 1
  for (int j = 0; j < cfg::TOPK; ++j) {
    uint32_t lk = 0u, le = 0xffffffffu;    // this lane's best: the first of its highest keys
#pragma unroll
    for (int i = 0; i < ROUTE_EPL; ++i)
      if (key[i] > lk) { lk = key[i]; le = lane + 32 * i; }
    const uint32_t kmax = __reduce_max_sync(0xffffffffu, lk);
    const uint32_t bi = __reduce_min_sync(0xffffffffu, lk == kmax ? le : 0xffffffffu);
    if (bi % 32 == (uint32_t)lane) {   // the winner leaves the race
#pragma unroll
      for (int i = 0; i < ROUTE_EPL; ++i)
        if (bi / 32 == (uint32_t)i) { key[i] = 0u; mine |= 1u << i; }
    }
    pick(j, (int)bi, kmax);
  }
  return mine;
}

// One row's routing by one warp, from its logits (route_load). Returns this lane's chosen experts as
// bits (bit i: expert lane + 32 i). With sel != nullptr lane 0 writes the choices in rank order:
// sel[j] the expert, wsel[j] its weight (renormalised over the k when the family says so).
__device__ __forceinline__ uint32_t route_logits(float (&v)[ROUTE_EPL], int lane, int* sel, float* wsel) {
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < ROUTE_EPL; ++i) m = fmaxf(m, v[i]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < ROUTE_EPL; ++i) {
    v[i] = lane + 32 * i < cfg::E ? expf(v[i] - m) : 0.f;
    s += v[i];
  }
  s = warp_sum(s);
  // ranking keys: a probability's bits + 1 (a non-negative float's bits order as it does), 0 for no
  // expert or one already taken, so a probability of 0 still outranks them
  uint32_t key[ROUTE_EPL];
#pragma unroll
  for (int i = 0; i < ROUTE_EPL; ++i) key[i] = lane + 32 * i < cfg::E ? __float_as_uint(v[i] / s) + 1u : 0u;
  float total = 0.f;
  const uint32_t mine = route_topk(key, lane, [&](int j, int bi, uint32_t kmax) {
    const float best = __uint_as_float(kmax - 1u);
    total += best;   // in rank order, as the reference sums the top-k weights
    if (sel != nullptr && lane == 0) { sel[j] = bi; wsel[j] = best; }
  });
  if (cfg::NORM_TOPK && sel != nullptr && lane == 0)
    for (int j = 0; j < cfg::TOPK; ++j) wsel[j] /= total;
  return mine;
}
__device__ __forceinline__ uint32_t route_row(const float* logits, int lane, int* sel, float* wsel) {
  float v[ROUTE_EPL];
  route_load(logits, lane, v);
  return route_logits(v, lane, sel, wsel);
}

// Every row's choices by one warp, as this lane's union bits, from the rows' values of type T (ROUTE_EPL
// a lane a row): load(b, v) fetches row b's, route(v) routes it. The rows load a chunk at a time, all of
// a chunk's loads before its routing: one memory round trip per chunk, not per row (on a loader's path,
// before its expert's first copy); a chunk holds at most 16 registers a lane.
template <class T, class Load, class Route>
__device__ __forceinline__ uint32_t route_rows_chunked(Load&& load, Route&& route) {
  constexpr int WORDS = (int)sizeof(T) / 4 * ROUTE_EPL;   // registers one row's values take
  constexpr int PER = 16 / WORDS > 0 ? 16 / WORDS : 1;
  constexpr int CHUNK = cfg::B < PER ? cfg::B : PER;
  uint32_t chosen = 0u;
  for (int b0 = 0; b0 < cfg::B; b0 += CHUNK) {
    T v[CHUNK][ROUTE_EPL];
#pragma unroll
    for (int j = 0; j < CHUNK; ++j)
      if (b0 + j < cfg::B) load(b0 + j, v[j]);
#pragma unroll
    for (int j = 0; j < CHUNK; ++j)
      if (b0 + j < cfg::B) chosen |= route(v[j]);
  }
  return chosen;
}
// ... from the router's logits
__device__ __forceinline__ uint32_t route_all_rows(const float* logits, int lane) {
  return route_rows_chunked<float>(
      [&](int b, float (&v)[ROUTE_EPL]) { route_load(logits + (size_t)b * cfg::E, lane, v); },
      [&](float (&v)[ROUTE_EPL]) { return route_logits(v, lane, nullptr, nullptr); });
}

// Routing from the logits the attention chain sums in fixed point (TilePlan.expert_fused: kinds/router.py,
// route.py route_fixed). The rank of an expert is that of its logit's fp32 value, which the row's norm
// (1 / rms: the same factor for every logit) leaves as it is, so the loaders route before any norm;
// the weights are the softmax of the logits times 1 / rms. fixed_key: the fp32 value's bits, ordered
// as the values are (negatives flipped), never 0.
__device__ __forceinline__ uint32_t fixed_key(long long q) {
  const uint32_t u = __float_as_uint(__ll2float_rn(q));
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ void fixed_load(const Params& p, int layer, int b, int lane, long long (&q)[ROUTE_EPL]) {
#pragma unroll
  for (int i = 0; i < ROUTE_EPL; ++i) q[i] = lane + 32 * i < cfg::E ? __ldcg(router_acc_at(p, layer, b, lane + 32 * i)) : 0ll;
}
// One row's routing by one warp from its E fixed-point logits (fixed_load) and its 1 / rms; with sel !=
// nullptr lane 0 writes the choices in rank order with their weights, as route_logits.
__device__ __forceinline__ uint32_t route_fixed(const long long (&q)[ROUTE_EPL], float inv_rms, int lane, int* sel,
                                                float* wsel) {
  uint32_t key[ROUTE_EPL];
#pragma unroll
  for (int i = 0; i < ROUTE_EPL; ++i) key[i] = lane + 32 * i < cfg::E ? fixed_key(q[i]) : 0u;
  if (sel == nullptr) return route_topk(key, lane, [](int, int, uint32_t) {});
  float l[ROUTE_EPL], m = -INFINITY;
#pragma unroll
  for (int i = 0; i < ROUTE_EPL; ++i) {
    l[i] = lane + 32 * i < cfg::E ? resid_float(q[i]) * inv_rms : -INFINITY;
    m = fmaxf(m, l[i]);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < ROUTE_EPL; ++i) s += lane + 32 * i < cfg::E ? expf(l[i] - m) : 0.f;
  s = warp_sum(s);
  float total = 0.f;
  const uint32_t mine = route_topk(key, lane, [&](int j, int bi, uint32_t) {
    float lw = 0.f;   // the winner's logit, from its lane
#pragma unroll
    for (int i = 0; i < ROUTE_EPL; ++i)
      if (bi / 32 == i) lw = l[i];
    const float pw = expf(__shfl_sync(0xffffffffu, lw, bi % 32) - m) / s;
    total += pw;   // in rank order, as the reference sums the top-k weights
    if (lane == 0) { sel[j] = bi; wsel[j] = pw; }
  });
  if (cfg::NORM_TOPK && lane == 0)
    for (int j = 0; j < cfg::TOPK; ++j) wsel[j] /= total;
  return mine;
}
// Every row's choices by one warp (a loader's), from the chain's logits of `layer` (route_rows_chunked).
__device__ __forceinline__ uint32_t route_all_rows_fixed(const Params& p, int layer, int lane) {
  return route_rows_chunked<long long>(
      [&](int b, long long (&q)[ROUTE_EPL]) { fixed_load(p, layer, b, lane, q); },
      [&](const long long (&q)[ROUTE_EPL]) { return route_fixed(q, 0.f, lane, nullptr, nullptr); });
}

// The expert of slot `slot` given every lane's union bits over the rows: the slot-th chosen expert in
// ascending order, -1 for an idle slot (fewer distinct experts than slots).
__device__ __forceinline__ int slot_expert_of(uint32_t chosen, int slot) {
  int n = 0;
#pragma unroll
  for (int i = 0; i < ROUTE_EPL; ++i) {
    const uint32_t mask = __ballot_sync(0xffffffffu, (chosen >> i) & 1u);
    const int cnt = __popc(mask);
    if (slot < n + cnt) return 32 * i + (int)__fns(mask, 0, slot - n + 1);
    n += cnt;
  }
  return -1;
}

// The consumers' routing of the step's rows (ROUTE, and EGATEUP for its idle slots): warp w routes
// rows w, w + CWARPS, ... (with sel != nullptr writing row b's choices at sel / wsel + b * ROUTE_K) and
// leaves its rows' union as E bits in masks[w][] (ROUTE_MASK_WORDS words in all). After a consumer
// barrier union_mask(masks, i) is word i of every row's union (bit l: expert 32 i + l).
constexpr int ROUTE_WARPS = cfg::B < cfg::CWARPS ? cfg::B : cfg::CWARPS;   // warps that route a row
constexpr int ROUTE_MASK_WORDS = ROUTE_WARPS * ROUTE_EPL;
// route(b, sel, wsel) routes row b by the calling warp (route_row, route_fixed).
template <class RouteRow>
__device__ __forceinline__ void route_rows_by_warp(const Ctx& c, uint32_t* masks, int* sel, float* wsel,
                                                   RouteRow&& route) {
  uint32_t chosen = 0u;
  for (int b = c.warp(); b < cfg::B; b += cfg::CWARPS)
    chosen |= route(b, sel ? sel + b * ROUTE_K : nullptr, wsel ? wsel + b * ROUTE_K : nullptr);
#pragma unroll
  for (int i = 0; i < ROUTE_EPL; ++i) {
    const uint32_t m = __ballot_sync(0xffffffffu, (chosen >> i) & 1u);
    if (c.warp() < ROUTE_WARPS && c.lane() == 0) masks[c.warp() * ROUTE_EPL + i] = m;
  }
}
// ... from the router's logits (ROUTE, EGATEUP)
__device__ __forceinline__ void route_rows_by_warp(const Ctx& c, uint32_t* masks, int* sel, float* wsel) {
  route_rows_by_warp(c, masks, sel, wsel, [&](int b, int* s, float* w) {
    return route_row(c.p->router_logits + (size_t)b * cfg::E, c.lane(), s, w);
  });
}
// ... from the chain's fixed-point logits of `layer` and each row's 1 / rms, inv_rms(b) (EMLP)
template <class InvRms>
__device__ __forceinline__ void route_rows_by_warp_fixed(const Ctx& c, int layer, InvRms&& inv_rms, uint32_t* masks,
                                                         int* sel, float* wsel) {
  route_rows_by_warp(c, masks, sel, wsel, [&](int b, int* s, float* w) {
    long long q[ROUTE_EPL];
    fixed_load(*c.p, layer, b, c.lane(), q);
    return route_fixed(q, inv_rms(b), c.lane(), s, w);
  });
}
__device__ __forceinline__ uint32_t union_mask(const uint32_t* masks, int i) {
  uint32_t m = 0u;
  for (int w = 0; w < ROUTE_WARPS; ++w) m |= masks[w * ROUTE_EPL + i];
  return m;
}
// how many distinct experts the rows chose: slots from there on are idle
__device__ __forceinline__ int union_count(const uint32_t* masks) {
  int n = 0;
#pragma unroll
  for (int i = 0; i < ROUTE_EPL; ++i) n += __popc(union_mask(masks, i));
  return n;
}
// The expert of slot `slot` from the union masks, in one thread (slot_expert_of takes a warp's union
// bits): the slot-th chosen expert in ascending order, -1 for an idle slot.
__device__ __forceinline__ int union_slot_expert(const uint32_t* masks, int slot) {
  int n = 0;
  for (int i = 0; i < ROUTE_EPL; ++i) {
    const uint32_t m = union_mask(masks, i);
    const int cnt = __popc(m);
    if (slot < n + cnt) return 32 * i + (int)__fns(m, 0, slot - n + 1);
    n += cnt;
  }
  return -1;
}
// Row b's routing weight of expert e from route_rows_by_warp's choices (0: the row did not choose it).
__device__ __forceinline__ float row_weight(const int* sel, const float* wsel, int b, int e) {
  float w = 0.f;
  for (int j = 0; j < cfg::TOPK; ++j)
    if (sel[b * ROUTE_K + j] == e) w = wsel[b * ROUTE_K + j];
  return w;
}

// The routing the expert kinds' consumers keep in the scratch for the layer's later tasks on the SM
// (no other task runs between them, and they reuse the staged rows): the routing warps' union masks,
// then (EMLP) every row's k experts and weights (kinds/emlp.py scratch_words).
__device__ __forceinline__ uint32_t* scratch_masks() { return reinterpret_cast<uint32_t*>(smem + SMEM_SCRATCH_AT); }
__device__ __forceinline__ int* scratch_sel() { return reinterpret_cast<int*>(scratch_masks() + ROUTE_MASK_WORDS); }
__device__ __forceinline__ float* scratch_wsel() { return reinterpret_cast<float*>(scratch_sel() + cfg::B * ROUTE_K); }

// Weight row j of slot group grp of an expert tile's gate/up (EGATEUP, EMLP): a group's first `half`
// rows are gate rows, the next `half` the same rows of up.
__device__ __forceinline__ WeightRef expert_gateup_ref(const ExpertWeights& w, const TaskArgs& a, int half, int grp,
                                                       int j) {
  const int r = a.r0 + grp * half + (j % half);
  return j < half ? weight_at(w.gate, nullptr, r, cfg::H, 0) : weight_at(w.up, nullptr, r, cfg::H, 0);
}

// The weight source of an expert kind's loader (mk_gemv.cuh WeightSource), once per task: each lane
// reads the weight pointers of its experts (lane + 32 i) while the task waits for its first event
// (router_done; EMLP's oproj_done), then the warp routes every row itself and takes its slot's expert's pointers from the
// lane that holds them. An idle slot gets null pointers: its loader streams nothing (idle).
struct ExpertSource {
  static __device__ __forceinline__ ExpertWeights of(Ctx& c, const TaskArgs& a) {
    const ExpertWeights* layer = c.p->experts + (size_t)a.layer * cfg::E;
    ExpertWeights mine[ROUTE_EPL];
#pragma unroll
    for (int i = 0; i < ROUTE_EPL; ++i) mine[i] = layer[min_i(c.lane() + 32 * i, cfg::E - 1)];
    loader_wait_first(c, a);
    uint32_t chosen;
    if constexpr (cfg::EXPERT_FUSED)
      chosen = route_all_rows_fixed(*c.p, a.layer, c.lane());
    else
      chosen = route_all_rows(c.p->router_logits, c.lane());
    const int e = slot_expert_of(chosen, a.tile);   // the same in every lane
    if (e < 0) return {nullptr, nullptr, nullptr};
    ExpertWeights w = mine[0];
#pragma unroll
    for (int i = 0; i < ROUTE_EPL; ++i)
      if (e / 32 == i) w = shfl_expert(mine[i], e % 32);
    return w;
  }
  static __device__ __forceinline__ bool idle(const ExpertWeights& w) { return w.down == nullptr; }
  // every lane gets lane `from`'s pointers
  static __device__ __forceinline__ const bf16* shfl_ptr(const bf16* v, int from) {
    return reinterpret_cast<const bf16*>(__shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(v), from));
  }
  static __device__ __forceinline__ ExpertWeights shfl_expert(const ExpertWeights& v, int from) {
    static_assert(sizeof(ExpertWeights) == 3 * sizeof(const bf16*), "ExpertWeights: gate, up, down");
    return {shfl_ptr(v.gate, from), shfl_ptr(v.up, from), shfl_ptr(v.down, from)};
  }
};

template <>
struct KindBody<ROUTE> : NoLoad, NoPrologue {
  static __device__ __forceinline__ void compute(Ctx& c, const TaskArgs& a, Pre&) {
    const Params& p = *c.p;
    // the rows' choices, in the activation region (free between GEMVs): experts, then their weights;
    // then the warps' union masks
    int* sel = reinterpret_cast<int*>(c.act());
    float* wsel = reinterpret_cast<float*>(sel + cfg::B * ROUTE_K);
    uint32_t* masks = reinterpret_cast<uint32_t*>(wsel + cfg::B * ROUTE_K);
    route_rows_by_warp(c, masks, sel, wsel);
    consumer_sync(CTHREADS);
    if (c.warp() == 0) {
      for (int s = 0; s < cfg::NSLOT; ++s) {
        const int e = union_slot_expert(masks, s);
        for (int b = c.lane(); b < cfg::B; b += 32) p.moe_w[s * cfg::B + b] = row_weight(sel, wsel, b, e);
        if (c.lane() == 0) p.moe_slot[s] = e;
      }
    }
    consumer_sync(CTHREADS);
  }
};

}  // namespace mk
