// Low-level building blocks of the megakernel: bf16 vectors, mbarriers, bulk copies, event counters.
// Everything here is architecture plumbing; the task bodies live in mk_gemv.cuh (GEMV kinds) and trtllm_mk/kinds/*.cuh.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>
#include <type_traits>

namespace mk {

typedef __nv_bfloat16 bf16;

__device__ __forceinline__ float bf16_to_f(bf16 v) { return __bfloat162float(v); }
__device__ __forceinline__ bf16 f_to_bf16(float v) { return __float2bfloat16(v); }

// 16-byte vector of 8 bf16 values.
struct __align__(16) bf16x8 { __nv_bfloat162 h[4]; };

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// First argmax: the highest value, the lowest index on ties (LMHEAD's tiles, ARGMAX's merge).
__device__ __forceinline__ bool argmax_better(float v, int i, float best, int bi) {
  return v > best || (v == best && i < bi);
}

__device__ __forceinline__ void warp_argmax(float& best, int& bi) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, best, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (argmax_better(ov, oi, best, bi)) { best = ov; bi = oi; }
  }
}

// Activations change during the kernel (other SMs write them), so they are read through L2 only
// (ld.global.cg): a stale L1 line from an earlier layer would otherwise be served.
__device__ __forceinline__ float ld_act(const float* p) { return __ldcg(p); }
__device__ __forceinline__ int ld_act(const int* p) { return __ldcg(p); }

// The residual stream is fixed point, int64 with cfg::RESID_FRAC_BITS fractional bits
// (trtllm_mk/residual.py says why): K-split partial sums add into it in arrival order, and integer
// addition makes that order invisible, so a step gives the same bits on every run.
constexpr float RESID_SCALE = (float)(1ull << cfg::RESID_FRAC_BITS);
constexpr float RESID_UNIT = 1.f / RESID_SCALE;
// A counted residual (cfg::RESID_COUNTED; trtllm_mk/residual.py says why) keeps in each word's top
// RESID_COUNT_BITS bits how many writes it has taken, the value in the rest: resid_value drops the count.
constexpr int RESID_VALUE_BITS = 64 - cfg::RESID_COUNT_BITS;
__device__ __forceinline__ long long resid_value(long long q) {
  if constexpr (cfg::RESID_COUNTED)
    return (long long)((unsigned long long)q << cfg::RESID_COUNT_BITS) >> cfg::RESID_COUNT_BITS;
  else
    return q;
}
__device__ __forceinline__ long long resid_fixed(float v) { return __float2ll_rn(v * RESID_SCALE); }
__device__ __forceinline__ float resid_float(long long q) { return __ll2float_rn(resid_value(q)) * RESID_UNIT; }
// Residual elements 4i .. 4i+3 of one batch row, read through L2 (see ld_act).
__device__ __forceinline__ float4 ld_resid4(const long long* row, int i) {
  const longlong2 lo = __ldcg(reinterpret_cast<const longlong2*>(row) + 2 * i);
  const longlong2 hi = __ldcg(reinterpret_cast<const longlong2*>(row) + 2 * i + 1);
  return make_float4(resid_float(lo.x), resid_float(lo.y), resid_float(hi.x), resid_float(hi.y));
}
// The same for x plus the fixed-point values kept beside it (expert_sum, kinds/router.py): their sum is
// exact, so staging it equals staging x with them added.
__device__ __forceinline__ float4 ld_resid4_sum(const long long* row, const long long* add, int i) {
  const longlong2 lo = __ldcg(reinterpret_cast<const longlong2*>(row) + 2 * i);
  const longlong2 hi = __ldcg(reinterpret_cast<const longlong2*>(row) + 2 * i + 1);
  const longlong2 alo = __ldcg(reinterpret_cast<const longlong2*>(add) + 2 * i);
  const longlong2 ahi = __ldcg(reinterpret_cast<const longlong2*>(add) + 2 * i + 1);
  return make_float4(resid_float(lo.x + alo.x), resid_float(lo.y + alo.y), resid_float(hi.x + ahi.x),
                     resid_float(hi.y + ahi.y));
}
// Add v to a residual element: a fire-and-forget reduction at L2 (no round trip stalls the warp).
__device__ __forceinline__ void add_resid(long long* x, float v) {
  atomicAdd(reinterpret_cast<unsigned long long*>(x), static_cast<unsigned long long>(resid_fixed(v)));
}
// The same into a counted residual: the value and one count in one 64-bit add.
__device__ __forceinline__ void add_resid_counted(long long* x, float v) {
  atomicAdd(reinterpret_cast<unsigned long long*>(x),
            (1ull << RESID_VALUE_BITS) + static_cast<unsigned long long>(resid_fixed(v)));
}
// A counted word's count. A negative value borrows one from the count; adding half the value range
// first gives it back.
__device__ __forceinline__ uint32_t resid_count_of(long long q) {
  return (uint32_t)(((unsigned long long)q + (1ull << (RESID_VALUE_BITS - 1))) >> RESID_VALUE_BITS);
}
// The count every word of x holds in step `step` once layer `layer`'s first `adds` adds have landed
// (EMBED's store is the step's first count; a step takes cfg::RESID_STATES of them).
__device__ __forceinline__ uint32_t resid_count(uint32_t step, int layer, int adds) {
  return (step * (uint32_t)cfg::RESID_STATES + 1u + (uint32_t)(layer * cfg::RESID_LAYER_ADDS + adds)) &
         ((1u << cfg::RESID_COUNT_BITS) - 1u);
}
// EMBED's store of a counted word (single-copy atomic, as the adds and the pollers' loads).
__device__ __forceinline__ void st_resid_counted(long long* x, long long q, uint32_t count) {
  const unsigned long long w = ((unsigned long long)count << RESID_VALUE_BITS) + (unsigned long long)q;
  asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(x), "l"(w) : "memory");
}
// Two residual words for a poll: loaded again on every try (volatile), with no memory clobber, so one
// try's loads of a thread issue together.
__device__ __forceinline__ longlong2 ld_resid2_relaxed(const long long* p) {
  longlong2 v;
  asm volatile("ld.relaxed.gpu.global.v2.b64 {%0, %1}, [%2];" : "=l"(v.x), "=l"(v.y) : "l"(p));
  return v;
}

__device__ __forceinline__ uint64_t globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// ---------------------------------------------------------------- tensor-core GEMV fragments
// The GEMV consumers run on mma.sync m16n8k16 (sm_80+): A = 16 weight rows x 16 k (bf16, from the
// ring via ldmatrix), B = 16 k x 8 batch columns (bf16 activation; columns >= B are zero), fp32 C.
// One mma covers 512 bytes of weights for every batch row at once, so the consumer's cost per byte
// does not grow with the batch, where an fp32-FMA loop's grows with every batch row.
__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

// The same with .trans: thread (g, t) of matrix j gets elements [2t][g] and [2t + 1][g] of the 8x8
// block whose rows lanes 8j..8j+7 address (ATTN's V as the mma's B operand, k = tokens).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                                  uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

// Two fp32 values as a bf16 pair (x in the low half: the element with the smaller k index).
__device__ __forceinline__ uint32_t pack_bf16x2(float x, float y) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// x = hi + mid + lo, each a bf16 (hi = bf16(x), mid = bf16(x - hi), lo = bf16(x - hi - mid); the
// differences are exact in fp32): 24 significant bits, so mmas over the three parts compute an fp32
// operand's products to fp32 accuracy (ATTN's q and p against bf16 K and V). Packed in pairs.
__device__ __forceinline__ void split3_bf16x2(float x, float y, uint32_t& hi, uint32_t& mid, uint32_t& lo) {
  hi = pack_bf16x2(x, y);
  const float2 h = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&hi));
  x -= h.x;
  y -= h.y;
  mid = pack_bf16x2(x, y);
  const float2 m = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&mid));
  lo = pack_bf16x2(x - m.x, y - m.y);
}

__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// ---------------------------------------------------------------- named barrier of consumer warps
// Barrier 0 is __syncthreads (all warps, loader included); barrier 1 syncs only the consumer warps
// so the loader can keep streaming weights while consumers wait on each other.
__device__ __forceinline__ void consumer_sync(int nthreads) {
  asm volatile("bar.sync 1, %0;" ::"r"(nthreads) : "memory");
}

// ---------------------------------------------------------------- mbarrier
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// A 32-bit shared-memory load by shared address (LDS; a generic pointer into shared memory compiles
// to the slower generic LD).
__device__ __forceinline__ uint32_t lds32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(addr));
  return v;
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.shared::cta.b64 st, [%0];\n}" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ bool mbar_try_wait(uint64_t* bar, uint32_t parity) {
  uint32_t ok;
#if __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
      : "=r"(ok)
      : "r"(smem_addr(bar)), "r"(parity)
      : "memory");
#else
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.test_wait.parity.shared.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
      : "=r"(ok)
      : "r"(smem_addr(bar)), "r"(parity)
      : "memory");
#endif
  return ok != 0;
}

// Non-blocking probe (try_wait may suspend the thread for a while before it fails; the trace's wait
// timers probe with this first, so a wait that happens is timed from its start).
__device__ __forceinline__ bool mbar_test_wait(uint64_t* bar, uint32_t parity) {
  uint32_t ok;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
      : "=r"(ok)
      : "r"(smem_addr(bar)), "r"(parity)
      : "memory");
  return ok != 0;
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}

// Everything the ring carries (weights, cached K/V) is read once per step: copied with an L2
// evict-first policy it does not displace what L2 holds for the dependency chain (activations,
// counters, the kernel's code); benchmarks/NOTES.md has the measurements. Both weight rings copy with
// it (createpolicy and the copies' L2::cache_hint arrived with sm_80).
__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}
#if defined(MK_USE_BULK_COPY)
// sm_90: one bulk async copy per weight row segment (or run of cached K/V rows), completing on the
// slot's mbarrier.
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
      ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)), "l"(policy)
      : "memory");
}
#else
// sm_80 / sm_89: the loader warps' lanes issue 16-byte cp.async copies (cp_async16); each lane's
// cp.async.mbarrier.arrive.noinc fires once its copies land (the full barrier counts every loader lane).
__device__ __forceinline__ void cp_async_arrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];" ::"r"(smem_addr(bar)) : "memory");
}
#endif
// Bring `bytes` (a multiple of 16) at `src` into L2 without waiting for them (nothing tracks them): one
// bulk prefetch on sm_90, a prefetch per 128-byte line before it.
__device__ __forceinline__ void prefetch_l2(const void* src, uint32_t bytes) {
#if defined(MK_USE_BULK_COPY)
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
#else
  for (uint32_t off = 0; off < bytes; off += 128)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(static_cast<const char*>(src) + off) : "memory");
#endif
}
// A 16-byte asynchronous copy into shared memory (sm_80 and later) under an L2 policy: no register
// holds the data, so a thread can have many in flight (the sm_80/89 loader).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, uint64_t policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src), "l"(policy)
               : "memory");
}

// ---------------------------------------------------------------- event counters
// Monotonic counters in global memory: a producer adds 1 after its stores (fence + atomic = release),
// a consumer waits until counter >= count * (step + 1) with acquire loads. Wrap-around safe. Under
// tensor parallelism the other ranks' GPUs signal the cross-rank events, so waits acquire at system
// scope (a GPU-scope acquire does not synchronize with another GPU's release).
__device__ __forceinline__ uint32_t ld_acquire(const uint32_t* p) {
  uint32_t v;
  if constexpr (cfg::TP > 1)
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  else
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Called by one thread after a CTA barrier that orders every thread's stores before it; the release
// is cumulative over those stores (the pattern of CUTLASS's generic barrier), so no full fence is needed.
__device__ __forceinline__ void signal_event(uint32_t* p) {
  asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(p) : "memory");
}
// Cross-rank events (tensor parallelism: signalled on every rank, waited on by other GPUs) are
// released by one system-scope fence per task and relaxed adds: a release per add would be a fence per
// add, and each fence after the first waits for the previous add's round trip over the link.
__device__ __forceinline__ void fence_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
__device__ __forceinline__ void add_event_relaxed_sys(uint32_t* p) {
  asm volatile("red.relaxed.sys.global.add.u32 [%0], 1;" ::"l"(p) : "memory");
}

// ErrorInfo and ErrorCode are generated (trtllm_mk/seam.py) ahead of this file.

// A wait unsatisfied for diag::SPIN_TIMEOUT_NS is a schedule or runtime bug: record which event and
// trap, so the host reports an error instead of hanging.
__device__ __noinline__ void wait_timed_out(ErrorInfo* err, uint32_t flat_index, uint32_t target, uint32_t seen,
                                            uint32_t layer, uint32_t task) {
  if (atomicCAS(&err->code, 0u, (uint32_t)ERR_WAIT_TIMEOUT) == 0u) {
    err->sm = blockIdx.x;
    err->event_index = flat_index;
    err->target = target;
    err->seen = seen;
    err->layer = layer;
    err->task = task;
    __threadfence_system();
  }
  __trap();
}

__device__ __forceinline__ void wait_counter(const uint32_t* ctr, uint32_t target, ErrorInfo* err,
                                             uint32_t flat_index, uint32_t layer, uint32_t task) {
  uint32_t v = ld_acquire(ctr);
  if ((int32_t)(v - target) >= 0) return;
  uint64_t t0 = globaltimer();
  uint32_t backoff = 32;
  while (true) {
    __nanosleep(backoff);
    if (backoff < 64) backoff <<= 1;   // short: a chain of dependent tasks waits at every step
    v = ld_acquire(ctr);
    if ((int32_t)(v - target) >= 0) return;
    if (globaltimer() - t0 > diag::SPIN_TIMEOUT_NS) wait_timed_out(err, flat_index, target, v, layer, task);
  }
}

// ---------------------------------------------------------------- tagged words (polled events)
// A polled event (graph.tasks Event.polled) has no counter on the device: its producers store each
// fp32 value with the (step, layer) tag in one 64-bit word, single-copy atomic, and a consumer loads
// the words until every tag is its own. The words carry the ordering themselves, so the producer's
// release (a fence that waits for its SM's stores to be acknowledged) and the consumer's poll of a
// counter before its loads leave the dependency chain. Tags are odd (a zeroed buffer holds none) and
// advance by 2 a layer: the word a consumer can find besides its own is the previous layer's.
__device__ __forceinline__ uint32_t data_tag(uint32_t step, int layer) {
  return 2u * (step * (uint32_t)cfg::L + (uint32_t)layer) + 1u;
}
__device__ __forceinline__ void st_tagged(uint64_t* p, float v, uint32_t tag) {
  const uint64_t w = ((uint64_t)tag << 32) | __float_as_uint(v);
  asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(p), "l"(w) : "memory");
}
__device__ __forceinline__ uint64_t ld_tagged_word(const uint64_t* p) {
  uint64_t w;
  asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(w) : "l"(p) : "memory");
  return w;
}
__device__ __forceinline__ bool has_tag(uint64_t w, uint32_t tag) { return (uint32_t)(w >> 32) == tag; }
__device__ __forceinline__ float tagged_value(uint64_t w) { return __uint_as_float((uint32_t)w); }

// bf16 words: a value its consumer stages as bf16 anyway (GATEUP's act, rounded as DOWN's staging
// rounded it) in the low half of a 32-bit word, the low 16 bits of its tag in the high half: half a
// 64-bit word's bytes. Every step rewrites the words in each layer that has their producer, so what a
// consumer can find besides its own tag is one at most L layers older (tag - 2k, 0 < k <= L < 2^15) or a zeroed word's
// 0, and 16 bits tell those apart.
__device__ __forceinline__ uint32_t data_tag16(uint32_t step, int layer) { return data_tag(step, layer) & 0xFFFFu; }
__device__ __forceinline__ void st_tagged_bf16(uint32_t* p, float v, uint32_t tag16) {
  const uint32_t w = (tag16 << 16) | (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(v));
  asm volatile("st.relaxed.gpu.global.b32 [%0], %1;" ::"l"(p), "r"(w) : "memory");
}
// Four bf16 words (16-byte aligned): each a single-copy atomic 32-bit access of its own.
__device__ __forceinline__ uint4 ld_tagged_bf16x4(const uint32_t* p) {
  uint4 w;
  asm volatile("ld.relaxed.gpu.global.v4.b32 {%0, %1, %2, %3}, [%4];"
               : "=r"(w.x), "=r"(w.y), "=r"(w.z), "=r"(w.w) : "l"(p) : "memory");
  return w;
}
// Whether a loaded word (a 64-bit word, or four bf16 words) lacks `tag`; `seen` gets the tag it has.
__device__ __forceinline__ bool stale_word(uint64_t w, uint32_t tag, uint32_t& seen) {
  if (has_tag(w, tag)) return false;
  seen = (uint32_t)(w >> 32);
  return true;
}
__device__ __forceinline__ bool stale_word(const uint4& w, uint32_t tag16, uint32_t& seen) {
  const uint32_t t[4] = {w.x >> 16, w.y >> 16, w.z >> 16, w.w >> 16};
  bool s = false;
#pragma unroll
  for (int k = 0; k < 4; ++k)
    if (t[k] != tag16) { s = true; seen = t[k]; }
  return s;
}

// What a consumer polls for, and what a poll that times out reports (the polled event's counter
// index, as a counter wait's timeout does).
struct TagPoll {
  uint32_t tag, event, layer, task;   // tag: data_tag (64-bit words) or data_tag16 (bf16 words)
  ErrorInfo* err;
  // Settles the n words a thread loaded with `reload` (which loads them all again): while one of them
  // is not this layer's, the whole batch is loaded again, its loads in flight together (one round
  // trip a try, not one a word).
  template <typename W, int N, typename Reload>
  __device__ __forceinline__ void settle(const W (&w)[N], Reload reload) const {
    if (!stale(w)) return;
    wait(w, reload);
  }
  template <typename W, int N>
  __device__ __forceinline__ bool stale(const W (&w)[N]) const {
    uint32_t seen;
    bool s = false;
#pragma unroll
    for (int k = 0; k < N; ++k) s |= stale_word(w[k], tag, seen);
    return s;
  }
  template <typename W, int N, typename Reload>
  __device__ __forceinline__ void wait(const W (&w)[N], Reload reload) const {
    const uint64_t t0 = globaltimer();
    do {
      __nanosleep(64);
      reload();
      if (globaltimer() - t0 > diag::SPIN_TIMEOUT_NS) {
        uint32_t seen = tag;
#pragma unroll
        for (int k = 0; k < N; ++k) stale_word(w[k], tag, seen);
        wait_timed_out(err, event, tag, seen, layer, task);
      }
    } while (stale(w));
  }
};

}  // namespace mk
