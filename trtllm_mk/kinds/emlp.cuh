// EMLP's device part (kinds/emlp.py): one expert tile's whole MLP. The gate/up half is a GEMV kind
// like EGATEUP (its loader and consumers route the rows themselves, from the logits the chain summed;
// an idle slot streams and computes nothing) whose epilogue keeps silu(gate) * up in shared memory; the
// down half then streams rows [r0, r1) of the expert's transposed down matrix ([I][H], 16 rows of
// EMLP_DKC columns a slot) and adds each batch row's partial of every hidden row, times its routing
// weight, into the layer's expert_sum (beside x: kinds/router.py). In the down
// half warp w owns 16-column blocks w, w + CWARPS, ... of a slot's columns: its mma reads the slot
// through ldmatrix.trans (A = 16 hidden rows x 16 intermediate rows, stored k-major) against the
// activation, and no partial sum crosses warps. Inlined by codegen after the shared device headers.
#pragma once

namespace mk {

constexpr int EMLP_ROWS_PER_SLOT = 16;                 // intermediate rows of a down slot: one mma k-step
constexpr int EMLP_DOWN_STRIDE = cfg::EMLP_DKC * 2 + ROW_PAD;   // bytes between a down slot's rows (bank skew)
constexpr int EMLP_NHC = cfg::H / cfg::EMLP_DKC;       // down slots per 16 intermediate rows
constexpr int EMLP_MB = cfg::EMLP_DKC / 16;            // 16-column blocks of a down slot
constexpr int EMLP_MBW = (EMLP_MB + cfg::CWARPS - 1) / cfg::CWARPS;   // of them per warp
constexpr int EMLP_AS = cfg::EMLP_ROWS + ACT_PAD;      // the tile's activation row stride (bf16)
static_assert(cfg::H % cfg::EMLP_DKC == 0 && cfg::EMLP_DKC % 16 == 0 && cfg::EMLP_ROWS % 16 == 0, "EMLP down geometry");
static_assert(EMLP_ROWS_PER_SLOT * EMLP_DOWN_STRIDE <= SLOT_STRIDE, "EMLP down slot overflow");
static_assert(EMLP_MBW <= 8, "EMLP: at most 8 accumulator blocks a warp");
static_assert((ROUTE_MASK_WORDS + 2 * cfg::B * ROUTE_K) * 4 <= SMEM_SCRATCH, "the rows' routing fits the scratch");

// the tile's activation, after the staged normed rows: [B][EMLP_AS] bf16, row b's routing weight in its skew
__device__ __forceinline__ bf16* emlp_act() {
  return reinterpret_cast<bf16*>(smem + SMEM_ACT_AT) + cfg::B * (cfg::H + ACT_PAD);
}
__device__ __forceinline__ float& emlp_row_weight(int b) {
  return *reinterpret_cast<float*>(emlp_act() + b * EMLP_AS + cfg::EMLP_ROWS);
}
static_assert(cfg::B * (cfg::H + ACT_PAD + EMLP_AS) * 2 <= cfg::ACT_SMEM_BYTES, "EMLP activation fits act[]");

template <>
struct GemvKind<EMLP> : NoTally {
  static constexpr int KT = cfg::H;
  static constexpr int PAIR = 2;
  static constexpr int WBITS = 16;
  using G = Geometry<KT, PAIR, WBITS>;

  static __device__ __forceinline__ WeightRef weight_ref(const ExpertWeights& w, const TaskArgs& a, int grp, int j) {
    return expert_gateup_ref(w, a, G::OUT_ROWS, grp, j);
  }

  // x normed (ln2) with each row's 1 / rms kept for the routing weights, then the rows' routing from the
  // logits the chain summed (kinds/router.py), which the barrier after it publishes
  static __device__ __forceinline__ void stage(Ctx& c, const TaskArgs& a) {
    stage_normed<EMLP, false, true>(c, c.p->layers[a.layer].ln2);
    route_rows_by_warp_fixed(c, a.layer, [](int b) { return act_skew<EMLP>(b, 0); }, scratch_masks(), scratch_sel(),
                             scratch_wsel());
    consumer_sync(CTHREADS);
  }

  static __device__ __forceinline__ bool idle(const Ctx&, const TaskArgs& a) { return a.tile >= union_count(scratch_masks()); }

  static __device__ __forceinline__ void epilogue(const Ctx&, const TaskArgs& a, int r, int b, float v, float v_up) {
    emlp_act()[b * EMLP_AS + (r - a.r0)] = __float2bfloat16_rn(silu(v) * v_up);
  }
};

template <> struct WeightSource<EMLP> : ExpertSource {};

// The column chunk a task's k-th down pass covers: tiles start at different chunks, so the adds that
// end the tasks (which end together) spread over x instead of all meeting in its last chunk.
__device__ __forceinline__ int emlp_chunk(const TaskArgs& a, int k) {
  return (k + a.r0 / cfg::EMLP_ROWS + a.tile) % EMLP_NHC;
}

// Loader: rows [r0, r1) of the transposed down matrix, for each column chunk 16 rows a slot.
__device__ __forceinline__ void emlp_down_load(Ctx& c, const TaskArgs& a, const ExpertWeights& w) {
  const uint64_t evict_first = evict_first_policy();
  for (int k = 0; k < EMLP_NHC; ++k) {
    const int hc = emlp_chunk(a, k);
    for (int i0 = a.r0; i0 < a.r1; i0 += EMLP_ROWS_PER_SLOT, ++c.ring_n) {
      const uint32_t slot = c.ring_n % cfg::STAGES, use = c.ring_n / cfg::STAGES;
      c.template loader_throttle<cfg::INFLIGHT_EXPERT, cfg::INFLIGHT_EXPERT>(c.ring_n);
      c.loader_wait(&c.empty()[slot], (use & 1) ^ 1);  // first use of a slot passes at once
      unsigned char* dst = c.ring() + (size_t)slot * SLOT_STRIDE;
      const bf16* src = w.down + (size_t)i0 * cfg::H + hc * cfg::EMLP_DKC;
#if defined(MK_USE_BULK_COPY)
      if (c.lane() == 0) mbar_expect_tx(&c.full()[slot], EMLP_ROWS_PER_SLOT * cfg::EMLP_DKC * 2);
      __syncwarp();
      if (c.lane() < EMLP_ROWS_PER_SLOT)
        bulk_copy_g2s(dst + c.lane() * EMLP_DOWN_STRIDE, src + (size_t)c.lane() * cfg::H, cfg::EMLP_DKC * 2,
                      &c.full()[slot], evict_first);
#else
      for (int j = c.loader_index(); j < EMLP_ROWS_PER_SLOT; j += cfg::LOADER_WARPS) {   // the loader warps take rows in turn
        const bf16x8* from = reinterpret_cast<const bf16x8*>(src + (size_t)j * cfg::H);
        bf16x8* d = reinterpret_cast<bf16x8*>(dst + j * EMLP_DOWN_STRIDE);
        for (int v = c.lane(); v < cfg::EMLP_DKC / 8; v += 32) cp_async16(d + v, from + v, evict_first);
      }
      cp_async_arrive(&c.full()[slot]);
#endif
    }
  }
}

// Consumers: the down half, after the gate/up half's last barrier (its activation is complete).
__device__ __forceinline__ void emlp_down_compute(Ctx& c, const TaskArgs& a) {
  if (GemvKind<EMLP>::idle(c, a)) return;
  if (threadIdx.x < cfg::B)   // row b's routing weight of the slot's expert (0: the row did not choose it)
    emlp_row_weight(threadIdx.x) = row_weight(scratch_sel(), scratch_wsel(), threadIdx.x,
                                              union_slot_expert(scratch_masks(), a.tile));
  consumer_sync(CTHREADS);
  const Params& p = *c.p;
  long long* sum = expert_sum_at(p, a.layer + 1);   // beside x (kinds/router.py)
  const int lane = c.lane(), warp = c.warp(), g = lane >> 2, t = lane & 3;
  // ldmatrix.trans of a 16 x 16 A block from k-major rows: lanes 0-7 / 8-15 read rows k 0-7 at
  // columns m 0-7 / 8-15, lanes 16-31 the same for rows k 8-15 (a0..a3 of the mma's A fragment)
  const uint32_t a_lane = (uint32_t)(((lane & 7) + ((lane >> 4) & 1) * 8) * EMLP_DOWN_STRIDE + ((lane >> 3) & 1) * 16);
  const bool bvalid = g < cfg::B;
  const uint32_t act_lane = smem_addr(emlp_act() + (bvalid ? g : 0) * EMLP_AS + t * 2);
  const uint32_t ring0 = smem_addr(c.ring());
  for (int k = 0; k < EMLP_NHC; ++k) {
    const int hc = emlp_chunk(a, k);
    float acc[EMLP_MBW][4];
#pragma unroll
    for (int j = 0; j < EMLP_MBW; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    for (int i0 = 0; i0 < a.r1 - a.r0; i0 += EMLP_ROWS_PER_SLOT, ++c.ring_n) {
      const uint32_t slot = c.ring_n % cfg::STAGES, use = c.ring_n / cfg::STAGES;
      c.consumer_wait(&c.full()[slot], use & 1);
      uint32_t fb0 = 0u, fb1 = 0u;
      if (bvalid) {
        fb0 = lds32(act_lane + i0 * 2);
        fb1 = lds32(act_lane + i0 * 2 + 16);
      }
      const uint32_t wbase = ring0 + slot * SLOT_STRIDE + a_lane;
      uint32_t fa[EMLP_MBW][4];
#pragma unroll
      for (int j = 0; j < EMLP_MBW; ++j)
        if (EMLP_MB % cfg::CWARPS == 0 || warp + j * cfg::CWARPS < EMLP_MB)
          ldmatrix_x4_trans(wbase + (warp + j * cfg::CWARPS) * 32, fa[j][0], fa[j][1], fa[j][2], fa[j][3]);
#pragma unroll
      for (int j = 0; j < EMLP_MBW; ++j)
        if (EMLP_MB % cfg::CWARPS == 0 || warp + j * cfg::CWARPS < EMLP_MB)
          mma_bf16_16816(acc[j], fa[j][0], fa[j][1], fa[j][2], fa[j][3], fb0, fb1);
      c.release_slot(slot);
    }
    // C fragment: acc[j][0], [1] = (hidden row h, batch 2t, 2t+1); [2], [3] = (h + 8, same batch)
#pragma unroll
    for (int j = 0; j < EMLP_MBW; ++j) {
      if (!(EMLP_MB % cfg::CWARPS == 0 || warp + j * cfg::CWARPS < EMLP_MB)) continue;
      const int h = hc * cfg::EMLP_DKC + (warp + j * cfg::CWARPS) * 16 + g;
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int b = 2 * t + q;
        if (b >= cfg::B) continue;
        const float w = emlp_row_weight(b);
        if (w == 0.f) continue;   // the row did not choose the slot's expert
        add_resid(sum + (size_t)b * cfg::H + h, w * acc[j][q]);
        add_resid(sum + (size_t)b * cfg::H + h + 8, w * acc[j][2 + q]);
      }
    }
  }
  c.mark_computed();
  consumer_sync(CTHREADS);   // every add is issued before the task hands its signal over
}

template <>
struct KindBody<EMLP> : NoPrologue {
  static __device__ __forceinline__ void load(Ctx& c, const TaskArgs& a) {
    const ExpertWeights w = ExpertSource::of(c, a);   // waits for oproj_done, then routes the rows
    if (ExpertSource::idle(w)) return;
    gemv_stream<EMLP>(c, a, w);
    emlp_down_load(c, a, w);
  }
  static __device__ __forceinline__ void compute(Ctx& c, const TaskArgs& a, Pre&) {
    gemv_compute<EMLP>(c, a);
    emlp_down_compute(c, a);
  }
};

}  // namespace mk
