// The machinery every GEMV kind shares: the loader streams weight rows through the shared-memory
// ring; consumers stage the bf16 activation once, then reduce each slot against it with tensor-core
// mma (batch rows are the mma's N columns). What differs between GEMV kinds lives in the kind's own
// device file (trtllm_mk/kinds/<kind>.cuh), as a specialization of GemvKind<KIND> (below).
// Requires the generated namespace cfg (shapes, tile constants) to be defined before inclusion.
#pragma once
#include "mk_params.cuh"

namespace mk {

constexpr int CTHREADS = cfg::CWARPS * 32;
static_assert(cfg::CWARPS * cfg::B <= 128, "scratch holds one partial (and one index) per consumer warp and batch row");

__host__ __device__ constexpr int min_i(int a, int b) { return a < b ? a : b; }
__host__ __device__ constexpr int max_i(int a, int b) { return a > b ? a : b; }

// Ring geometry of a GEMV kind with K range KT (mirror: trtllm_mk/smem.py slot_geometry). A slot
// holds NB blocks of 16 weight rows (the mma M dimension) x KC columns; a row of KT columns takes NKC
// slots when it does not fit one, the last holding KC_LAST <= KC columns. The pieces are as few as one
// 16-row block allows and as even as they go: the loader issues one bulk copy per row piece at a fixed
// cost each, so wider pieces stream faster (a K range with a large odd factor would otherwise stream
// in narrow pieces that divide it). Rows sit ROW_STRIDE = 2*KC +
// 16 bytes apart: the 16-byte skew puts the 8 rows an ldmatrix phase reads in 8 different bank groups.
// The skew lives in SLOT_PAD, the bytes each slot has beyond SLOT_BYTES of weights. PAIR=2 for
// GATEUP: gate and up rows of the same output rows travel together (slot rows [0, RS/2) are gate,
// [RS/2, RS) are up; with one block, rows g and g + 8 of the mma's C fragment are a gate/up pair).
// ROW_PAD, ACT_PAD and MAX_BLOCKS come with the shared-memory layout (trtllm_mk/smem.py, generated).
static_assert(cfg::SLOT_PAD >= 16 * MAX_BLOCKS * ROW_PAD, "slot padding must cover the row skew");

// A row of kt columns (a multiple of unit) in as few pieces of at most `widest` columns as it takes,
// each a whole number of units and as even as they go, the last possibly narrower: the pieces and
// the columns of all but the last (bf16 and quantized weights alike).
constexpr int pieces_for(int kt, int widest) { return (kt + widest - 1) / widest; }
constexpr int chunk_for(int kt, int widest, int unit) {
  const int n = pieces_for(kt, widest), kc = (kt / unit + n - 1) / n * unit;
  return (n - 1) * kc >= kt ? widest : kc;   // even pieces would leave the last empty: full ones
}
constexpr int WIDEST_PIECE = cfg::SLOT_BYTES / (16 * 2) / 16 * 16;   // columns of a 16-row block's slot
constexpr int blocks_for(int kc) {
  int nb = cfg::SLOT_BYTES / (16 * kc * 2);
  nb = nb >= MAX_BLOCKS ? MAX_BLOCKS : nb >= 2 ? 2 : 1;
  return min_i(nb, cfg::CWARPS);
}
template <int KT, int PAIR, int WBITS = 16>
struct Geometry {
  static constexpr int NKC = pieces_for(KT, WIDEST_PIECE);
  static constexpr int KC = chunk_for(KT, WIDEST_PIECE, 16);
  static constexpr int KC_LAST = KT - (NKC - 1) * KC;  // columns of a row's last piece
  static constexpr int NB = blocks_for(KC);            // 16-row mma blocks per slot
  static constexpr int RS = 16 * NB;                   // weight rows per slot
  static constexpr int OUT_ROWS = RS / PAIR;           // output rows per slot group
  static constexpr int ROW_STRIDE = KC * 2 + ROW_PAD;  // bytes between rows in a slot
  static constexpr int NK16 = KC / 16;                 // mma k-steps per slot
  static constexpr int WPB = cfg::CWARPS / NB;         // warps per block: they split the k-steps
  static_assert(KT % 16 == 0 && KC_LAST > 0 && KC_LAST <= KC, "K range must be a multiple of 16");
  static_assert(cfg::CWARPS % NB == 0, "blocks per slot must divide the consumer warps");
  static_assert(RS * ROW_STRIDE <= SLOT_STRIDE, "slot overflow");
};

// Quantized weights, WB = 4 (int4 codes) or 8 (fp8 e4m3) bits (trtllm_mk/quant/kernel_layout.py; mirror:
// smem.py slot_geometry): a slot holds, per 16-row block, KC / QTILE tiles of 16 rows x QTILE columns
// as the layout stores them (one bulk copy each; 16-byte chunks swizzled by row as
// kernel_layout.swizzle, so no row padding), then at SZ_AT the scale words of its blocks,
// [NB][NGS groups][16 rows]. A 16-byte chunk holds one step of STEP_COLS columns (32 for 4-bit: two
// mma k-steps; 16 for 8-bit: one). KC and KC_LAST are multiples of the tile and of the group; a row's
// last piece fills the first tiles and groups of each block's place.
constexpr int Q_UNIT = cfg::QGROUP > cfg::QTILE ? cfg::QGROUP : cfg::QTILE;
constexpr int q_row_bytes(int kc, int wb) { return kc * wb / 8 + 4 * (kc / (cfg::QGROUP > 0 ? cfg::QGROUP : 1)); }
constexpr int q_widest(int pair, int wb) {   // columns of the widest piece: whole units, 16 rows per matrix
  return cfg::SLOT_BYTES / (16 * pair * q_row_bytes(Q_UNIT, wb)) * Q_UNIT;
}
constexpr int q_blocks_for(int kc, int pair, int wb) {
  int nb = cfg::SLOT_BYTES / (16 * q_row_bytes(kc, wb));
  nb = nb >= MAX_BLOCKS ? MAX_BLOCKS : nb >= 2 ? 2 : 1;
  nb = min_i(nb, cfg::CWARPS);
  return nb < pair ? pair : nb;
}
template <int KT, int PAIR, int WB>
struct QGeometry {
  static constexpr int NKC = pieces_for(KT, q_widest(PAIR, WB));
  static constexpr int KC = chunk_for(KT, q_widest(PAIR, WB), Q_UNIT);
  static constexpr int KC_LAST = KT - (NKC - 1) * KC;        // columns of a row's last piece
  static constexpr int NB = q_blocks_for(KC, PAIR, WB);
  static constexpr int RS = 16 * NB;
  static constexpr int OUT_ROWS = RS / PAIR;
  static constexpr int TILE_ROW = cfg::QTILE * WB / 8;        // bytes of one tile row
  static constexpr int TILE_BYTES = 16 * TILE_ROW;            // one tile, one bulk copy
  static constexpr int TPR = KC / cfg::QTILE;                 // tiles per block and slot
  static constexpr int CHUNKS = TILE_ROW / 16;                // 16-byte chunks (steps) per tile row
  static constexpr int STEP_COLS = 128 / WB;                  // columns per chunk
  static constexpr int BLOCK_BYTES = TPR * TILE_BYTES;        // codes of one 16-row block per slot
  static constexpr int NGS = KC / cfg::QGROUP;                // scale groups per row and slot
  static constexpr int SZ_BLOCK = NGS * 16 * 4;               // scale bytes of one block per slot
  static constexpr int SZ_AT = NB * BLOCK_BYTES;              // where the slot's scale words start
  static constexpr int NSTEP = KC / STEP_COLS;                // steps per slot
  static constexpr int NSTEP_LAST = KC_LAST / STEP_COLS;      // steps of a row's last piece
  static constexpr int WPB = cfg::CWARPS / NB;
  static constexpr int ROW_STRIDE = 0;                        // rows are not strided (tiles, swizzled)
  static constexpr int SWZ_SHIFT = TILE_ROW < 128 ? 1 : 0;    // two tile rows per 128-byte line
  static constexpr int SWZ_MASK = (CHUNKS < 8 ? CHUNKS : 8) - 1;
  static_assert(KT < 0 || (cfg::QTILE % 128 == 0 && cfg::QTILE >= 128), "tiles of 128, 256 or 512 columns");
  static_assert(KT % Q_UNIT == 0 && KC % Q_UNIT == 0 && KC_LAST > 0 && KC_LAST <= KC,
                "K range and pieces must hold whole tiles and groups");
  static_assert(cfg::CWARPS % NB == 0, "blocks per slot must divide the consumer warps");
  static_assert(SZ_AT + NB * SZ_BLOCK <= SLOT_STRIDE, "slot overflow");
};
template <int KT, int PAIR> struct Geometry<KT, PAIR, 4> : QGeometry<KT, PAIR, 4> {};
template <int KT, int PAIR> struct Geometry<KT, PAIR, 8> : QGeometry<KT, PAIR, 8> {};

// Where weight row j of a slot group comes from: row `row` of a [*, ld] matrix at `w`, from column
// `col` on; `sz` is that matrix's scale words when its weights are 4-bit. `rowp` is the bf16 row itself.
struct WeightRef {
  const bf16* rowp;
  const bf16* w;
  const uint32_t* sz;
  int row, ld, col;
};
__device__ __forceinline__ WeightRef weight_at(const bf16* w, const uint32_t* sz, int row, int ld, int col) {
  return {w + (size_t)row * ld + col, w, sz, row, ld, col};
}

// A layer's scale table: the real one in a quantized kernel; in a bf16 kernel an all-null one (never read).
__device__ const LayerScales NO_SCALES{};
__device__ __forceinline__ const LayerScales& layer_scales(const Params& p, int layer) {
  if constexpr (cfg::WBITS != 16) return p.layer_scales[layer];
  else return NO_SCALES;
}

// A GEMV kind's device file specializes GemvKind<KIND> with:
//   KT, PAIR                      the K range of one task; weight matrices interleaved per slot (2: gate+up)
//   WBITS                         16 (bf16 weights) or 4 (cfg::WBITS of a quantized kernel's layer kinds)
//   weight_ref(src, a, grp, j)    source of weight row j (0 <= j < RS) of slot group grp of a task;
//                                 src is WeightSource<KIND>::of(c, a) (the Params, or what the kind's
//                                 device file specializes it to)
//   stage(c, a)                   the activation staging into act[] (stage_normed / stage_rows below)
//   epilogue(c, a, r, b, v, v_up) stores one finished output value (row r, batch row b)
//   Tally, tally_begin(c, a), tally(t, r, b, v), tally_reduce(c, a, t), tally_publish(c, a, t)
//                                 a per-thread running reduction over the task's outputs (LMHEAD's
//                                 argmax and log-sum-exp); NoTally is the empty one. tally_reduce may
//                                 use red()'s buffer of parity (groups & 1), which no thread reads then
template <int KIND> struct GemvKind;

// What a kind's weight_ref reads, resolved once per task on the loader's path: the kernel's Params,
// unless the kind's device file specializes WeightSource (the experts: their slot's expert is known
// only at run time, and a lookup per ring slot would put a memory round trip before each slot's copies).
// An expert kind's source also says whether the task's slot is idle (fewer distinct experts than
// slots): its loader then streams nothing, and its consumers, which find the same from their staging
// (GemvKind<KIND>::idle), skip the task's ring slots too.
template <int KIND> struct WeightSource {
  static __device__ __forceinline__ const Params& of(Ctx& c, const TaskArgs&) { return *c.p; }
};
template <int KIND> using GemvGeometry = Geometry<GemvKind<KIND>::KT, GemvKind<KIND>::PAIR, GemvKind<KIND>::WBITS>;

// Whether piece kc of a row is a narrower last one, and its columns.
template <int KIND>
__device__ __forceinline__ bool narrow_last(int kc) {
  using G = GemvGeometry<KIND>;
  return G::KC_LAST != G::KC && kc == G::NKC - 1;
}
template <int KIND>
__device__ __forceinline__ int piece_cols(int kc) {
  return narrow_last<KIND>(kc) ? GemvGeometry<KIND>::KC_LAST : GemvGeometry<KIND>::KC;
}

// Code tiles per 16-row block and scale bytes per block of piece kc (quantized weights).
template <int KIND>
__device__ __forceinline__ int piece_tiles(int kc) { return piece_cols<KIND>(kc) / cfg::QTILE; }
template <int KIND>
__device__ __forceinline__ int piece_scale_bytes(int kc) { return piece_cols<KIND>(kc) / cfg::QGROUP * 16 * 4; }

// Global addresses of a slot's pieces: bf16 row j's KC columns of piece kc; for 4-bit weights, tile m
// of piece kc of the 16-row block that row j starts, and that block's scale words.
template <int KIND>
__device__ __forceinline__ const bf16* row_src(const WeightRef& r, int kc) {
  return r.rowp + kc * GemvGeometry<KIND>::KC;
}
template <int KIND>
__device__ __forceinline__ const void* tile_src(const WeightRef& r, int kc, int m) {
  using G = GemvGeometry<KIND>;
  const size_t tile = (size_t)(r.row / 16) * (r.ld / cfg::QTILE) + (r.col + kc * G::KC) / cfg::QTILE + m;
  return reinterpret_cast<const unsigned char*>(r.w) + tile * G::TILE_BYTES;
}
template <int KIND>
__device__ __forceinline__ const uint32_t* scale_src(const WeightRef& r, int kc) {
  using G = GemvGeometry<KIND>;
  return r.sz + ((size_t)(r.row / 16) * (r.ld / cfg::QGROUP) + (r.col + kc * G::KC) / cfg::QGROUP) * 16;
}

// The epilogue of the kinds whose K-split partials add into the residual stream (OPROJ, DOWN): in
// fixed point, so the sum is the same in every arrival order. Under tensor parallelism the partial
// goes into every rank's residual: the all-reduce, as remote adds that need no agreed order.
struct AddsToResidual {
  static __device__ __forceinline__ void epilogue(const Ctx& c, const TaskArgs&, int r, int b, float v, float) {
    const Params& p = *c.p;
    const size_t at = (size_t)b * cfg::H + r;
    if constexpr (cfg::TP > 1) {
#pragma unroll
      for (int k = 0; k < cfg::TP; ++k) add_resid(p.peers[k].x + at, v);
    } else if constexpr (cfg::RESID_COUNTED) {   // the add is also its readers' signal
      add_resid_counted(p.x + at, v);
    } else {
      add_resid(p.x + at, v);
    }
  }
};

// Layer `layer`'s logit of expert e in batch row b as the chain sums it (TilePlan.expert_fused:
// kinds/router.py), one accumulator a 128-byte line (seam.py ROUTER_ACC_STRIDE).
__device__ __forceinline__ long long* router_acc_at(const Params& p, int layer, int b, int e) {
  return p.router_acc + (((size_t)layer * cfg::B + b) * cfg::E + e) * ROUTER_ACC_STRIDE;
}

// Row `row` of expert_sum ([L + 1][B][H] fixed point): layer row - 1's experts' outputs, kept beside x
// (TilePlan.expert_fused: kinds/router.py).
__device__ __forceinline__ long long* expert_sum_at(const Params& p, int row) {
  return p.expert_sum + (size_t)row * cfg::B * cfg::H;
}

struct NoTally {
  struct Tally {};
  static __device__ __forceinline__ Tally tally_begin(const Ctx&, const TaskArgs&) { return {}; }
  static __device__ __forceinline__ void tally(Tally&, int, int, float) {}
  static __device__ __forceinline__ void tally_reduce(Ctx&, const TaskArgs&, Tally&) {}
  static __device__ __forceinline__ void tally_publish(Ctx&, const TaskArgs&, const Tally&) {}
};

// ------------------------------------------------------------------------------- loader side
// A loader streaming weights that an event decides (LOADER_WAITS: the expert kinds) waits for the
// task's first event first (lane 0, then the warp, which orders the lanes' reads of what the event
// published after the acquire).
__device__ __forceinline__ void loader_wait_first(Ctx& c, const TaskArgs& a) {
  if (c.lane() == 0 && a.nw > 0) {
    const int e = event_counter(a.w[0], a.layer);
    wait_counter(c.p->counters + e, cfg::EV_COUNT[e] * (c.step + 1), c.p->error, e, (uint32_t)a.layer,
                 (uint32_t)c.task_no);
  }
  __syncwarp();
}

// The task's weight rows from `src` (WeightSource<KIND>::of) through the ring, slot by slot.
template <int KIND, class Src>
__device__ void gemv_stream(Ctx& c, const TaskArgs& a, const Src& src) {
  using G = GemvGeometry<KIND>;
  constexpr bool QW = GemvKind<KIND>::WBITS != 16;   // quantized: tiles and scale words
  const int groups = (a.r1 - a.r0 + G::OUT_ROWS - 1) / G::OUT_ROWS;
  const uint64_t evict_first = evict_first_policy();
  for (int grp = 0; grp < groups; ++grp) {
    const int valid = min_i(G::OUT_ROWS, a.r1 - a.r0 - grp * G::OUT_ROWS);   // output rows in this group
    for (int kc = 0; kc < G::NKC; ++kc, ++c.ring_n) {
      const uint32_t slot = c.ring_n % cfg::STAGES, use = c.ring_n / cfg::STAGES;
      if constexpr (LOADER_WAITS[KIND])   // a cold stream after the routing: its own cap
        c.template loader_throttle<cfg::INFLIGHT_EXPERT, cfg::INFLIGHT_EXPERT>(c.ring_n);
      else
        c.loader_throttle(c.ring_n);
      c.loader_wait(&c.empty()[slot], (use & 1) ^ 1);  // first use of a slot passes at once
      unsigned char* dst = c.ring() + (size_t)slot * SLOT_STRIDE;
#if defined(MK_USE_BULK_COPY)
      if constexpr (QW) {
        // per 16-row block with valid rows: the piece's code tiles and its scale words, one copy each
        const int tiles = piece_tiles<KIND>(kc), items = tiles + 1, szb = piece_scale_bytes<KIND>(kc);
        if (c.lane() == 0)
          mbar_expect_tx(&c.full()[slot], GemvKind<KIND>::PAIR * ((valid + 15) / 16) * (tiles * G::TILE_BYTES + szb));
        __syncwarp();
        for (int i = c.lane(); i < G::NB * items; i += 32) {
          const int b = i / items, m = i % items;
          if ((16 * b) % G::OUT_ROWS < valid) {
            const WeightRef r = GemvKind<KIND>::weight_ref(src, a, grp, 16 * b);
            if (m < tiles)
              bulk_copy_g2s(dst + b * G::BLOCK_BYTES + m * G::TILE_BYTES, tile_src<KIND>(r, kc, m), G::TILE_BYTES,
                            &c.full()[slot], evict_first);
            else
              bulk_copy_g2s(dst + G::SZ_AT + b * G::SZ_BLOCK, scale_src<KIND>(r, kc), szb, &c.full()[slot],
                            evict_first);
          }
        }
      } else {
        // lane 0 announces the bytes, then the lanes issue one bulk copy per weight row each
        const int cols = piece_cols<KIND>(kc);
        if (c.lane() == 0) mbar_expect_tx(&c.full()[slot], valid * GemvKind<KIND>::PAIR * cols * 2);
        __syncwarp();
        for (int j = c.lane(); j < G::RS; j += 32) {
          if (j % G::OUT_ROWS < valid)
            bulk_copy_g2s(dst + j * G::ROW_STRIDE, row_src<KIND>(GemvKind<KIND>::weight_ref(src, a, grp, j), kc),
                          cols * 2, &c.full()[slot], evict_first);
        }
      }
#else
      if constexpr (QW) {
        for (int b = 0; b < G::NB; ++b) {
          if ((16 * b) % G::OUT_ROWS >= valid) continue;
          const WeightRef r = GemvKind<KIND>::weight_ref(src, a, grp, 16 * b);
          // the loader warps take every LOADER_WARPS-th 16-byte piece
          const int v0 = c.lane() + 32 * c.loader_index();
          for (int m = 0; m < piece_tiles<KIND>(kc); ++m) {
            const uint4* from = reinterpret_cast<const uint4*>(tile_src<KIND>(r, kc, m));
            uint4* d = reinterpret_cast<uint4*>(dst + b * G::BLOCK_BYTES + m * G::TILE_BYTES);
            for (int v = v0; v < G::TILE_BYTES / 16; v += 32 * cfg::LOADER_WARPS) cp_async16(d + v, from + v, evict_first);
          }
          const uint4* ssrc = reinterpret_cast<const uint4*>(scale_src<KIND>(r, kc));
          uint4* sd = reinterpret_cast<uint4*>(dst + G::SZ_AT + b * G::SZ_BLOCK);
          for (int v = v0; v < piece_scale_bytes<KIND>(kc) / 16; v += 32 * cfg::LOADER_WARPS)
            cp_async16(sd + v, ssrc + v, evict_first);
        }
      } else {
        for (int j = c.loader_index(); j < G::RS; j += cfg::LOADER_WARPS) {   // the loader warps take rows in turn
          if (j % G::OUT_ROWS >= valid) continue;
          const bf16x8* from = reinterpret_cast<const bf16x8*>(row_src<KIND>(GemvKind<KIND>::weight_ref(src, a, grp, j), kc));
          bf16x8* d = reinterpret_cast<bf16x8*>(dst + j * G::ROW_STRIDE);
          for (int v = c.lane(); v < piece_cols<KIND>(kc) / 8; v += 32) cp_async16(d + v, from + v, evict_first);
        }
      }
      cp_async_arrive(&c.full()[slot]);
#endif
    }
  }
}

template <int KIND>
__device__ void gemv_load(Ctx& c, const TaskArgs& a) {
  // a LOADER_WAITS kind's WeightSource waits for the task's first event (loader_wait_first) itself
  const auto& src = WeightSource<KIND>::of(c, a);
  if constexpr (LOADER_WAITS[KIND])
    if (WeightSource<KIND>::idle(src)) return;
  gemv_stream<KIND>(c, a, src);
}

// The next step's head, prefetched into L2 at the end of this one: once an SM's last task is done,
// consumer warp 0 prefetches the weights its loader streams first in the next step (its first GEMV
// task of layer 0, up to a ring's worth), and ARGMAX the next token's embedding row. The step's tail
// (the LM head's uneven end, ARGMAX, the launch gap) leaves HBM mostly idle, and the next step starts
// with an empty ring: its first QKV and EMBED then read L2 (benchmarks/NOTES.md has the measurements).
// The diagnostic switch prefetch_next=0 turns it off.
template <int KIND>
__device__ __noinline__ Ctx prefetch_next_step(Ctx c, TaskArgs a) {
  using G = GemvGeometry<KIND>;
  // an expert's weights are known only once the next step routes: nothing to prefetch
  if constexpr (!LOADER_WAITS[KIND]) {
    if (diag::PREFETCH_NEXT && c.warp() == 0) {
      const auto& src = WeightSource<KIND>::of(c, a);
      const int groups = (a.r1 - a.r0 + G::OUT_ROWS - 1) / G::OUT_ROWS;
      for (int grp = 0, n = 0; grp < groups; ++grp) {
        const int valid = min_i(G::OUT_ROWS, a.r1 - a.r0 - grp * G::OUT_ROWS);
        for (int kc = 0; kc < G::NKC && n < cfg::STAGES; ++kc, ++n) {
          if constexpr (GemvKind<KIND>::WBITS != 16) {
            const int tiles = piece_tiles<KIND>(kc);
            for (int i = c.lane(); i < G::NB * tiles; i += 32)
              if ((16 * (i / tiles)) % G::OUT_ROWS < valid)
                prefetch_l2(tile_src<KIND>(GemvKind<KIND>::weight_ref(src, a, grp, 16 * (i / tiles)), kc, i % tiles),
                            G::TILE_BYTES);
          } else {
            for (int j = c.lane(); j < G::RS; j += 32)
              if (j % G::OUT_ROWS < valid)
                prefetch_l2(row_src<KIND>(GemvKind<KIND>::weight_ref(src, a, grp, j), kc), piece_cols<KIND>(kc) * 2);
          }
        }
      }
    }
  }
  return c;
}

// ------------------------------------------------------------------------------- consumer side
// Stage the task's activation as bf16 in shared memory, rows ACT_STRIDE apart: rmsnorm(x) * w for
// the norm-prologue kinds, a slice of attn_out / act for OPROJ / DOWN. Every load of a pass is
// independent (16-byte vectors, unrolled), so a pass costs about one L2 round trip; when the
// batch's rows fit in registers (B * H / threads <= 64 floats) the norm takes a single pass.
template <int KIND>
__device__ __forceinline__ void store_act4(Ctx& c, int b, int i, float4 v) {
  constexpr int AS = GemvKind<KIND>::KT + ACT_PAD;
  __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
  uint2 out;
  out.x = *reinterpret_cast<uint32_t*>(&lo);
  out.y = *reinterpret_cast<uint32_t*>(&hi);
  *reinterpret_cast<uint2*>(c.act() + b * AS + 4 * i) = out;
}

__device__ __forceinline__ float4 load_norm_w4(const bf16* nw, int i) {
  const uint2 wraw = __ldg(reinterpret_cast<const uint2*>(nw) + i);
  const float2 w01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&wraw.x));
  const float2 w23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&wraw.y));
  return make_float4(w01.x, w01.y, w23.x, w23.y);
}

__device__ __forceinline__ float4 norm4(float4 v, float s, float4 w) {
  return make_float4(v.x * s * w.x, v.y * s * w.y, v.z * s * w.z, v.w * s * w.w);
}

// Block-wide sum of squares of every batch row -> 1 / rms per row (one consumer barrier).
__device__ __forceinline__ void rms_scales(Ctx& c, float (&ss)[cfg::B]) {
#pragma unroll
  for (int b = 0; b < cfg::B; ++b) {
    const float t = warp_sum(ss[b]);
    if (c.lane() == 0) c.scratch()[c.warp() * cfg::B + b] = t;
  }
  consumer_sync(CTHREADS);
#pragma unroll
  for (int b = 0; b < cfg::B; ++b) {
    float tot = 0.f;
    for (int w = 0; w < cfg::CWARPS; ++w) tot += c.scratch()[w * cfg::B + b];
    ss[b] = rsqrtf(tot / cfg::H + cfg::EPS);
  }
}

// Per-task values kept in the skew after batch row b's staged activation (ACT_PAD elements that no
// GEMV reads; they stay with the activation when the next task reuses it): float i of row b. EDOWN's
// routing weights (act_row_scale) and whether its slot is idle; EMLP's rows' 1 / rms.
template <int KIND>
__device__ __forceinline__ float& act_skew(int b, int i) {
  constexpr int KT = GemvKind<KIND>::KT, AS = KT + ACT_PAD;
  static_assert(KT % 2 == 0 && ACT_PAD * 2 >= 2 * 4, "two floats fit the row's skew, aligned");
  return *(reinterpret_cast<float*>(reinterpret_cast<bf16*>(smem + SMEM_ACT_AT) + b * AS + KT) + i);
}
template <int KIND>
__device__ __forceinline__ float& act_row_scale(int b) { return act_skew<KIND>(b, 0); }

// Elements 4i .. 4i + 3 of batch row b of x (its row at xb), plus under PENDING those of the values kept
// beside it ([B][H] at `pending`).
template <bool PENDING>
__device__ __forceinline__ float4 ld_staged4(const long long* xb, const long long* pending, int b, int i) {
  if constexpr (PENDING) return ld_resid4_sum(xb, pending + (size_t)b * cfg::H, i);
  else return ld_resid4(xb, i);
}
// How a norm kind's staging reads x: as it stands (its event was a counter), or under POLL from a
// counted residual (cfg::RESID_COUNTED) until every word holds the poll's count (mk_common.cuh
// resid_count). A try loads the thread's words together; where one falls short the thread tries again.
template <bool POLL>
struct XWords {
  const TagPoll* poll;
  template <bool PENDING>
  __device__ __forceinline__ float4 load4(const long long* xb, const long long* pending, int b, int i) {
    return ld_staged4<PENDING>(xb, pending, b, i);
  }
  __device__ __forceinline__ bool again() { return false; }
};
template <>
struct XWords<true> {
  const TagPoll* poll;
  uint32_t seen = 0;
  bool stale = false;
  uint64_t t0 = 0;
  template <bool PENDING>
  __device__ __forceinline__ float4 load4(const long long* xb, const long long*, int, int i) {
    static_assert(!PENDING, "a counted residual keeps nothing beside x");
    const longlong2 lo = ld_resid2_relaxed(xb + 4 * i), hi = ld_resid2_relaxed(xb + 4 * i + 2);
    const long long w[4] = {lo.x, lo.y, hi.x, hi.y};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t n = resid_count_of(w[k]);
      if (n != poll->tag) { stale = true; seen = n; }
    }
    return make_float4(resid_float(lo.x), resid_float(lo.y), resid_float(hi.x), resid_float(hi.y));
  }
  // Whether to load again: a word fell short (after a pause; a wait past the timeout is reported).
  __device__ __forceinline__ bool again() {
    if (!stale) return false;
    stale = false;
    const uint64_t t = globaltimer();
    if (t0 == 0) t0 = t;
    else if (t - t0 > diag::SPIN_TIMEOUT_NS) wait_timed_out(poll->err, poll->event, poll->tag, seen, poll->layer, poll->task);
    __nanosleep(64);
    return true;
  }
};

// KEEP_RMS: each row's 1 / rms into its skew (act_skew(b, 0)), by thread 0.
template <int KIND, bool KEEP_RMS>
__device__ __forceinline__ void keep_rms(const float (&ss)[cfg::B]) {
  if constexpr (KEEP_RMS) {
    if (threadIdx.x == 0) {
#pragma unroll
      for (int b = 0; b < cfg::B; ++b) act_skew<KIND>(b, 0) = ss[b];
    }
  }
}

// rmsnorm(x) * nw staged for the norm-prologue kinds (QKV, GATEUP, LMHEAD, ROUTER, EMLP). PENDING: of x
// plus the fixed-point values kept beside it at `pending` ([B][H], expert_sum: kinds/router.py);
// KEEP_RMS: each row's 1 / rms also goes into its skew (act_skew(b, 0)); POLL: x is a counted residual
// read once every word holds `poll`'s count (XWords).
template <int KIND, bool PENDING = false, bool KEEP_RMS = false, bool POLL = false>
__device__ void stage_normed(Ctx& c, const bf16* nw, const long long* pending = nullptr, const TagPoll* poll = nullptr) {
  const Params& p = *c.p;
  const int tid = threadIdx.x;  // consumer threads are 0 .. CTHREADS-1
  constexpr int H4 = cfg::H / 4, VPT = (H4 + CTHREADS - 1) / CTHREADS;
  constexpr bool FULL = H4 % CTHREADS == 0;
  float ss[cfg::B];
  if constexpr (cfg::NORM_PASSES == 1) {   // smem.norm_staging_passes
    // one pass: x stays in registers between the sum of squares and the scaling; the norm weights
    // are loaded in the same pass, so staging costs one L2 round trip and one barrier
    float4 xv[cfg::B][VPT], wv[VPT];
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
      const int i = tid + j * CTHREADS;
      wv[j] = (FULL || i < H4) ? load_norm_w4(nw, i) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    XWords<POLL> xw{poll};
    do {
#pragma unroll
      for (int b = 0; b < cfg::B; ++b) {
        ss[b] = 0.f;
        const long long* xb = p.x + (size_t)b * cfg::H;
#pragma unroll
        for (int j = 0; j < VPT; ++j) {
          const int i = tid + j * CTHREADS;
          xv[b][j] = (FULL || i < H4) ? xw.template load4<PENDING>(xb, pending, b, i) : make_float4(0.f, 0.f, 0.f, 0.f);
          const float4 v = xv[b][j];
          ss[b] = fmaf(v.x, v.x, fmaf(v.y, v.y, fmaf(v.z, v.z, fmaf(v.w, v.w, ss[b]))));
        }
      }
    } while (xw.again());
    rms_scales(c, ss);
    keep_rms<KIND, KEEP_RMS>(ss);
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
      const int i = tid + j * CTHREADS;
      if (FULL || i < H4) {
#pragma unroll
        for (int b = 0; b < cfg::B; ++b) store_act4<KIND>(c, b, i, norm4(xv[b][j], ss[b], wv[j]));
      }
    }
  } else {
    // two passes: x is re-read from L2 (cheaper than holding B*H/threads values in registers); a
    // counted residual is polled in the first, which leaves every word the thread reads complete
    XWords<POLL> xw{poll};
    do {
#pragma unroll
      for (int b = 0; b < cfg::B; ++b) {
        ss[b] = 0.f;
        const long long* xb = p.x + (size_t)b * cfg::H;
#pragma unroll
        for (int j = 0; j < VPT; ++j) {
          const int i = tid + j * CTHREADS;
          if (FULL || i < H4) {
            const float4 v = xw.template load4<PENDING>(xb, pending, b, i);
            ss[b] = fmaf(v.x, v.x, fmaf(v.y, v.y, fmaf(v.z, v.z, fmaf(v.w, v.w, ss[b]))));
          }
        }
      }
    } while (xw.again());
    rms_scales(c, ss);
    keep_rms<KIND, KEEP_RMS>(ss);
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
      const int i = tid + j * CTHREADS;
      if (FULL || i < H4) {
        const float4 w = load_norm_w4(nw, i);
#pragma unroll
        for (int b = 0; b < cfg::B; ++b)
          store_act4<KIND>(c, b, i, norm4(xw.template load4<PENDING>(p.x + (size_t)b * cfg::H, pending, b, i), ss[b], w));
      }
    }
  }
  consumer_sync(CTHREADS);   // act complete; scratch free again
}

// rmsnorm(x) * nw staged by a norm kind of layer `layer` (cfg::L: the LM head) whose x follows a polled
// edge of the residual: under a counted residual it waits until every word holds the count of the
// layer's first `adds` adds (`event0`: the polled event's first row; a timed-out poll reports row
// event0 + layer), otherwise x is read as it stands (its event was a counter).
template <int KIND>
__device__ __forceinline__ void stage_normed_resid(Ctx& c, const bf16* nw, int layer, int adds, int event0) {
  if constexpr (cfg::RESID_COUNTED) {
    const TagPoll poll{resid_count(c.step, layer, adds), (uint32_t)(event0 + layer), (uint32_t)layer,
                       (uint32_t)c.task_no, c.p->error};
    stage_normed<KIND, false, false, true>(c, nw, nullptr, &poll);
  } else {
    stage_normed<KIND>(c, nw);
  }
}

// A K slice [k0, k0 + KT) of the fp32 rows of src (ROW floats apart), staged as bf16 (OPROJ, DOWN).
template <int KIND, int ROW>
__device__ void stage_rows(Ctx& c, const TaskArgs& a, const float* src) {
  constexpr int KT = GemvKind<KIND>::KT;
  const int tid = threadIdx.x;
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
      if (i < N4) store_act4<KIND>(c, i / K4, i % K4, v[u]);
    }
  }
  consumer_sync(CTHREADS);
}

// The same for rows of bf16 words (st_tagged_bf16; DOWN's act, a polled event): the words are
// staged as they are, once every one carries `poll`'s tag.
template <int KIND, int ROW>
__device__ void stage_tagged_rows(Ctx& c, const TaskArgs& a, const uint32_t* src, const TagPoll& poll) {
  constexpr int KT = GemvKind<KIND>::KT, AS = KT + ACT_PAD;
  const int tid = threadIdx.x;
  constexpr int K4 = KT / 4, N4 = cfg::B * K4, U = 4;
  const uint4 own = make_uint4(poll.tag << 16, poll.tag << 16, poll.tag << 16, poll.tag << 16);
  for (int base = tid; base < N4; base += CTHREADS * U) {
    uint4 w[U];
    const auto reload = [&] {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i = base + u * CTHREADS;
        w[u] = i < N4 ? ld_tagged_bf16x4(src + (size_t)(i / K4) * ROW + a.k0 + 4 * (i % K4)) : own;
      }
    };
    reload();
    poll.settle(w, reload);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = base + u * CTHREADS;
      if (i < N4)
        *reinterpret_cast<uint2*>(c.act() + (i / K4) * AS + 4 * (i % K4)) =
            make_uint2(__byte_perm(w[u].x, w[u].y, 0x5410), __byte_perm(w[u].z, w[u].w, 0x5410));
    }
  }
  consumer_sync(CTHREADS);
}

// 4-bit codes minus their zero point to mma A fragments. A lane's word of one row and 32-column block
// holds its eight codes (quant/kernel_layout.py BLOCK_ORDER); nibbles j and j + 4 go into one bf16x2
// under the exponent of 128 (lop3: (q >> 4j) & 0x000f000f | 0x43004300 = 128 + code, exact), minus
// 128 + zero (exact: an integer of magnitude below 16): out[0], out[1] are a0 / a2 of the first k-step,
// out[2], out[3] of the second. The scale multiplies a group's sums (q4_fold), not each weight: one
// bf16 multiply per two weights is the larger half of a consumer that is bound by its instruction
// issue. sz: the row's scale word (bf16 scale low, bf16 128 + zero high).
__device__ __forceinline__ uint32_t lop3_and_or(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));   // (a & b) | c
  return d;
}
__device__ __forceinline__ void codes_minus_zero_q4(uint32_t q, uint32_t sz, uint32_t (&out)[4]) {
  const uint32_t z2 = __byte_perm(sz, 0, 0x3232);
  const __nv_bfloat162 z = *reinterpret_cast<const __nv_bfloat162*>(&z2);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t v = lop3_and_or(q >> (4 * j), 0x000f000fu, 0x43004300u);
    const __nv_bfloat162 w = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&v), z);
    out[j] = *reinterpret_cast<const uint32_t*>(&w);
  }
}

// A scale group's sums (C fragment: t[0], t[1] row g, t[2], t[3] row g + 8) into a row's accumulator,
// times the rows' scales (the low halves of their scale words, bf16 = an fp32's top bits): the weights
// enter as (code - zero) x scale, exact in fp32.
__device__ __forceinline__ void q4_fold(float (&acc)[4], const float (&t)[4], uint32_t sz_lo, uint32_t sz_hi) {
  const float s0 = __uint_as_float(sz_lo << 16), s1 = __uint_as_float(sz_hi << 16);
  acc[0] = fmaf(s0, t[0], acc[0]);
  acc[1] = fmaf(s0, t[1], acc[1]);
  acc[2] = fmaf(s1, t[2], acc[2]);
  acc[3] = fmaf(s1, t[3], acc[3]);
}

// 8-bit (fp8 e4m3) weights to mma A fragments. A lane's word of one row and 16-column step holds its
// four codes (quant/kernel_layout.py BLOCK_ORDER8: columns 2t, 2t+1, 2t+8, 2t+9). Each code moves into
// the top of a bf16 with its sign in place and its 4 exponent and 3 mantissa bits 4 lower: the bf16
// of (code's value) * 2^-120, exact (subnormals included); the scale word holds bf16(scale) * 2^120,
// so one bf16 multiply gives bf16(value * scale), rounded once. out[0], out[1]: a0 / a2.
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2_scaled(uint32_t q, uint32_t sel) {
  const uint32_t t = __byte_perm(q, 0, sel);             // [0, code, 0, code] as bytes: code << 8 per half
  return lop3_and_or(t >> 4, 0x07F007F0u, t & 0x80008000u);
}
__device__ __forceinline__ void dequant_fp8(uint32_t q, uint32_t sz, uint32_t (&out)[2]) {
  const uint32_t s2 = __byte_perm(sz, 0, 0x1010);
  const __nv_bfloat162 s = *reinterpret_cast<const __nv_bfloat162*>(&s2);
  const uint32_t lo = e4m3x2_to_bf16x2_scaled(q, 0x1404), hi = e4m3x2_to_bf16x2_scaled(q, 0x3424);
  const __nv_bfloat162 w0 = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&lo), s);
  const __nv_bfloat162 w1 = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&hi), s);
  out[0] = *reinterpret_cast<const uint32_t*>(&w0);
  out[1] = *reinterpret_cast<const uint32_t*>(&w1);
}

// One ring slot of quantized weights against the staged activation. Warp (blk, kw) takes the SPW
// consecutive steps [kw * SPW, (kw + 1) * SPW) of its 16-row block (those that exist), two at a time:
// one ldmatrix.x4 brings the code words of both steps for rows g and g + 8 (matrix i: rows 8 (i & 1) ..,
// step i >> 1; step s is chunk s % CHUNKS of tile s / CHUNKS, and chunk c of row r sits at
// c ^ ((r >> SWZ_SHIFT) & SWZ_MASK): kernel_layout.swizzle), one or two more the activation of their
// k-steps (matrix i: the 8 columns at 8 i; rows beyond the batch read row 0, whose products land only
// in output columns the epilogue ignores).
// 4-bit: a scale group's products sum in two chains (steps s and s + 1), which fold into one of the
// NACC accumulators (groups round-robin) when the group ends, or the warp's steps do (a group a warp
// shares with the next is folded by both, each its part, with the same scale); a group of one step
// (GPK 1) folds each chain with its own step's scale.
// 8-bit: weights dequantized to bf16 per pair of steps (scale words read once per pair, twice when a
// group is one step), the steps alternating over NACC accumulators.
template <int KIND, int NACC, int NSTEP>
__device__ __forceinline__ void q_slot_mma(float (&acc)[NACC][4], uint32_t slot0, uint32_t act0, int blk, int kw, int lane) {
  using G = GemvGeometry<KIND>;
  constexpr int WB = GemvKind<KIND>::WBITS;
  constexpr int SPW = ((NSTEP + G::WPB - 1) / G::WPB + 1) / 2 * 2;     // steps per warp and slot (even)
  constexpr bool EXACT = SPW * G::WPB == NSTEP;                        // else the last warps run short or idle
  constexpr int GPK = cfg::QGROUP / G::STEP_COLS;                       // steps per group
  constexpr int STEP_ACT = G::STEP_COLS * 2;                            // activation bytes per step
  static_assert(NSTEP % 2 == 0, "steps come in pairs");
  static_assert(WB != 4 || GPK == 1 || GPK % 2 == 0, "a pair of 4-bit steps lies in one scale group");
  const int g = lane >> 2, r = lane & 7, mi = lane >> 3, swz = (r >> G::SWZ_SHIFT) & G::SWZ_MASK;
  const uint32_t wl = slot0 + blk * G::BLOCK_BYTES + (r + (mi & 1) * 8) * G::TILE_ROW;   // this lane's ldmatrix row
  const uint32_t z0 = slot0 + G::SZ_AT + blk * G::SZ_BLOCK + g * 4;                      // row g's scale word, group 0
  const uint32_t al = act0 + mi * 16;                                                     // act: column 8 mi
  if constexpr (WB == 4) {
    const int s_end = EXACT ? (kw + 1) * SPW : min_i((kw + 1) * SPW, NSTEP);
    // where a pair falls in its group: known at compile time when every warp's range starts on a group
    constexpr bool ALIGNED = GPK <= 1 || SPW % GPK == 0;
    float t0[4], t1[4];
    uint32_t zs[2], zs1[2];   // scale words of rows g, g + 8: the group's (and, GPK 1, step s + 1's)
#pragma unroll
    for (int p = 0; p < SPW / 2; ++p) {
      const int s = kw * SPW + 2 * p;
      if (!EXACT && s >= NSTEP) break;
      const bool first = GPK <= 2 || (ALIGNED ? (2 * p) % GPK == 0 : p == 0 || s % GPK == 0);
      const bool last = GPK <= 2 || (ALIGNED ? (2 * p + 2) % GPK == 0 : (s + 2) % GPK == 0 || s + 2 >= s_end);
      if (first) {
        zs[0] = lds32(z0 + (s / GPK) * 64);
        zs[1] = lds32(z0 + (s / GPK) * 64 + 32);
        if constexpr (GPK == 1) {
          zs1[0] = lds32(z0 + (s + 1) * 64);
          zs1[1] = lds32(z0 + (s + 1) * 64 + 32);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) t0[i] = t1[i] = 0.f;
      }
      const uint32_t z10 = GPK == 1 ? zs1[0] : zs[0], z11 = GPK == 1 ? zs1[1] : zs[1];
      const int c = s % G::CHUNKS + (mi >> 1);
      uint32_t q[4], fb[8];
      ldmatrix_x4(wl + (s / G::CHUNKS) * G::TILE_BYTES + ((c ^ swz) << 4), q[0], q[1], q[2], q[3]);
      ldmatrix_x4(al + s * STEP_ACT, fb[0], fb[1], fb[2], fb[3]);
      ldmatrix_x4(al + s * STEP_ACT + 64, fb[4], fb[5], fb[6], fb[7]);
      uint32_t a0[4], a1[4], b0[4], b1[4];
      codes_minus_zero_q4(q[0], zs[0], a0);   // row g, step s
      codes_minus_zero_q4(q[1], zs[1], a1);   // row g + 8, step s
      codes_minus_zero_q4(q[2], z10, b0);     // row g, step s + 1
      codes_minus_zero_q4(q[3], z11, b1);     // row g + 8, step s + 1
      mma_bf16_16816(t0, a0[0], a1[0], a0[1], a1[1], fb[0], fb[1]);
      mma_bf16_16816(t1, b0[0], b1[0], b0[1], b1[1], fb[4], fb[5]);
      mma_bf16_16816(t0, a0[2], a1[2], a0[3], a1[3], fb[2], fb[3]);
      mma_bf16_16816(t1, b0[2], b1[2], b0[3], b1[3], fb[6], fb[7]);
      if (last) {
        float (&x)[4] = acc[(2 * p / (GPK > 2 ? GPK : 2)) % NACC];   // groups fold round-robin
        if constexpr (GPK == 1) {
          q4_fold(x, t0, zs[0], zs[1]);
          q4_fold(x, t1, zs1[0], zs1[1]);
        } else {
#pragma unroll
          for (int i = 0; i < 4; ++i) t0[i] += t1[i];
          q4_fold(x, t0, zs[0], zs[1]);
        }
      }
    }
  } else {
#pragma unroll
    for (int p = 0; p < SPW / 2; ++p) {
      const int s = kw * SPW + 2 * p;
      if (!EXACT && s >= NSTEP) break;
      const int c = s % G::CHUNKS + (mi >> 1);
      uint32_t q[4], fb[4], sz0[2], sz1[2];
      ldmatrix_x4(wl + (s / G::CHUNKS) * G::TILE_BYTES + ((c ^ swz) << 4), q[0], q[1], q[2], q[3]);
      ldmatrix_x4(al + s * STEP_ACT, fb[0], fb[1], fb[2], fb[3]);
      sz0[0] = lds32(z0 + (s / GPK) * 64);
      sz0[1] = lds32(z0 + (s / GPK) * 64 + 32);
      if constexpr (GPK == 1) {
        sz1[0] = lds32(z0 + (s + 1) * 64);
        sz1[1] = lds32(z0 + (s + 1) * 64 + 32);
      } else {
        sz1[0] = sz0[0];
        sz1[1] = sz0[1];
      }
      float (&x)[4] = acc[(2 * p) % NACC];
      float (&y)[4] = acc[(2 * p + 1) % NACC];
      uint32_t a0[2], a1[2], b0[2], b1[2];
      dequant_fp8(q[0], sz0[0], a0);
      dequant_fp8(q[1], sz0[1], a1);
      dequant_fp8(q[2], sz1[0], b0);
      dequant_fp8(q[3], sz1[1], b1);
      mma_bf16_16816(x, a0[0], a1[0], a0[1], a1[1], fb[0], fb[1]);
      mma_bf16_16816(y, b0[0], b1[0], b0[1], b1[1], fb[2], fb[3]);
    }
  }
}

// One bf16 slot of NK k-steps: warp kw of a block takes every WPB-th k-step from kw, round-robin
// over the NACC accumulators, loads first, so NACC mma run in flight instead of one dependent chain.
template <int NK, int WPB, int NACC>
__device__ __forceinline__ void bf16_slot_mma(float (&acc)[NACC][4], uint32_t wbase, uint32_t ak, bool bvalid, int kw) {
  constexpr int STEPS = (NK + WPB - 1) / WPB;   // k-steps per warp
#pragma unroll
  for (int j0 = 0; j0 < STEPS; j0 += NACC) {
    uint32_t fa[NACC][4], fb[NACC][2];
#pragma unroll
    for (int j = 0; j < NACC; ++j) {
      const int s = kw + (j0 + j) * WPB;
      fb[j][0] = fb[j][1] = 0u;
      if (j0 + j < STEPS && (NK % WPB == 0 || s < NK)) {
        if (bvalid) {
          fb[j][0] = lds32(ak + s * 32);
          fb[j][1] = lds32(ak + s * 32 + 16);
        }
        ldmatrix_x4(wbase + s * 32, fa[j][0], fa[j][1], fa[j][2], fa[j][3]);
      }
    }
#pragma unroll
    for (int j = 0; j < NACC; ++j) {
      const int s = kw + (j0 + j) * WPB;
      if (j0 + j < STEPS && (NK % WPB == 0 || s < NK))
        mma_bf16_16816(acc[j], fa[j][0], fa[j][1], fa[j][2], fa[j][3], fb[j][0], fb[j][1]);
    }
  }
}

// GEMV consumer. Per slot, warp w takes 16-row block w % NB and every WPB-th k-step from w / NB:
// one ldmatrix (weights) + two 32-bit loads (activation) + one mma per 16x16 weight tile. A group's
// partial sums meet in red[] ([warp][16][B], double-buffered by group) behind one consumer barrier;
// the epilogue threads then add the WPB partials of each (output row, batch row) in a fixed order,
// so results are deterministic. A kind's Tally (LMHEAD: each thread's best logit per batch row) runs
// over the outputs as they are stored and is reduced once at the end (no second pass over them).
template <int KIND>
__device__ void gemv_compute(Ctx& c, const TaskArgs& a) {
  using G = GemvGeometry<KIND>;
  constexpr int AS = GemvKind<KIND>::KT + ACT_PAD;
  constexpr int B = cfg::B;
  constexpr bool QW = GemvKind<KIND>::WBITS != 16;
  // a.stage == 0: the previous task on this SM staged the same input (codegen proves it), so the
  // activation is still resident in act[]
  if (a.stage) GemvKind<KIND>::stage(c, a);
  c.hand_off_staged(a);   // the staged input is read: its guards may go out before the GEMV
  c.mark();
  c.set_chain_hint(0);
  const int lane = c.lane();
  const int blk = c.warp() % G::NB, kw = c.warp() / G::NB;
  const int g = lane >> 2, t = lane & 3;
  const int lrow = (lane & 7) + ((lane >> 3) & 1) * 8, lcol = (lane >> 4) * 8;
  const uint32_t a_lane = (uint32_t)((blk * 16 + lrow) * G::ROW_STRIDE + lcol * 2);
  const bool bvalid = g < B;
  const uint32_t act_lane = smem_addr(c.act() + (bvalid ? g : 0) * AS + t * 2);   // bytes, shared space
  // quantized kinds read the activation with ldmatrix: lane l addresses row l % 8 (row 0 beyond the batch)
  const uint32_t act_ldm = smem_addr(c.act() + ((lane & 7) < B ? (lane & 7) : 0) * AS);
  const uint32_t ring0 = smem_addr(c.ring());
  const int groups = (a.r1 - a.r0 + G::OUT_ROWS - 1) / G::OUT_ROWS;
  typename GemvKind<KIND>::Tally tally = GemvKind<KIND>::tally_begin(c, a);
  bool idle = false;   // an idle expert slot: its loader streams nothing (gemv_load)
  if constexpr (LOADER_WAITS[KIND]) idle = GemvKind<KIND>::idle(c, a);
  if (idle) c.mark_computed();

  for (int grp = 0; grp < (idle ? 0 : groups); ++grp) {
    // NACC independent accumulators: a warp's k-steps of a slot go round-robin over them, loads first,
    // so NACC mma run in flight instead of one dependent chain (the consumer was mma-latency bound at
    // ~65 GB/s per SM with one accumulator; benchmarks/micro/ring_stream.cu)
    constexpr int STEPS = (G::KC / 16 + G::WPB - 1) / G::WPB;   // k-steps per warp per slot
    constexpr int NACC = STEPS >= 4 ? 4 : STEPS;
    float acc[NACC][4];
#pragma unroll
    for (int j = 0; j < NACC; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    for (int kc = 0; kc < G::NKC; ++kc, ++c.ring_n) {
      const uint32_t slot = c.ring_n % cfg::STAGES, use = c.ring_n / cfg::STAGES;
      c.consumer_wait(&c.full()[slot], use & 1);
      const uint32_t wbase = ring0 + slot * SLOT_STRIDE + a_lane;
      const uint32_t ak = act_lane + kc * G::KC * 2;
      if constexpr (QW) {
        const uint32_t at = ring0 + slot * SLOT_STRIDE, act = act_ldm + kc * G::KC * 2;
        if (narrow_last<KIND>(kc))
          q_slot_mma<KIND, NACC, G::NSTEP_LAST>(acc, at, act, blk, kw, lane);
        else
          q_slot_mma<KIND, NACC, G::NSTEP>(acc, at, act, blk, kw, lane);
      } else if (narrow_last<KIND>(kc)) {
        bf16_slot_mma<G::KC_LAST / 16, G::WPB, NACC>(acc, wbase, ak, bvalid, kw);
      } else {
        bf16_slot_mma<G::NK16, G::WPB, NACC>(acc, wbase, ak, bvalid, kw);
      }
      c.release_slot(slot);
      // trace: where "computed" is taken (diag::GEMV_MARK, trtllm_mk/codegen/diagnostics.py)
      if (diag::GEMV_MARK > 0 && grp * G::NKC + kc + 1 == diag::GEMV_MARK) c.mark_computed();
    }
#pragma unroll
    for (int j = 1; j < NACC; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[0][i] += acc[j][i];
    if (diag::GEMV_MARK == 0 && grp == groups - 1) c.mark_computed();
    // C fragment: acc[0], acc[1] = (row g, batch 2t, 2t+1); acc[2], acc[3] = (row g + 8, same batch)
    float* red = c.red() + (grp & 1) * cfg::CWARPS * 16 * B;
    float* mine = red + c.warp() * 16 * B;
    if (2 * t < B) { mine[g * B + 2 * t] = acc[0][0]; mine[(g + 8) * B + 2 * t] = acc[0][2]; }
    if (2 * t + 1 < B) { mine[g * B + 2 * t + 1] = acc[0][1]; mine[(g + 8) * B + 2 * t + 1] = acc[0][3]; }
    consumer_sync(CTHREADS);
    for (int i = threadIdx.x; i < G::OUT_ROWS * B; i += CTHREADS) {
      const int orow = i / B, b = i % B;
      const int r = a.r0 + grp * G::OUT_ROWS + orow;
      if (r >= a.r1) continue;
      float v = 0.f, vu = 0.f;
#pragma unroll
      for (int s = 0; s < G::WPB; ++s) v += red[((s * G::NB + orow / 16) * 16 + orow % 16) * B + b];
      if constexpr (GemvKind<KIND>::PAIR == 2) {
        const int urow = G::OUT_ROWS + orow;
#pragma unroll
        for (int s = 0; s < G::WPB; ++s) vu += red[((s * G::NB + urow / 16) * 16 + urow % 16) * B + b];
      }
      GemvKind<KIND>::epilogue(c, a, r, b, v, vu);
      GemvKind<KIND>::tally(tally, r, b, v);
    }
  }
  GemvKind<KIND>::tally_reduce(c, a, tally);
  consumer_sync(CTHREADS);  // all outputs stored before the task signals (and act/red reuse)
  GemvKind<KIND>::tally_publish(c, a, tally);
}

// The body of every GEMV kind: KindBody<QKV> derives from GemvBody<QKV> in qkv.cuh, and so on.
template <int KIND>
struct GemvBody : NoPrologue {
  static __device__ __forceinline__ void load(Ctx& c, const TaskArgs& a) { gemv_load<KIND>(c, a); }
  static __device__ __forceinline__ void compute(Ctx& c, const TaskArgs& a, Pre&) { gemv_compute<KIND>(c, a); }
};

}  // namespace mk
