// The per-CTA execution context and the shared-memory layout. The interface declarations (Kind,
// LayerWeights, Params, TaskArgs, TRACE_WORDS) are generated from trtllm_mk/seam.py ahead of this file.
#pragma once
#include "mk_common.cuh"

namespace mk {

// The shared-memory layout (SLOT_STRIDE, SIG_SLOTS, SMEM_<region>_AT / SMEM_<region>) is generated from
// trtllm_mk/smem.py smem_layout ahead of this file. The consumers hand each finished task to the
// signaller warp through a queue of SIG_SLOTS mbarrier pairs and go on with their next task at once:
// publishing an event is a GPU-scope release, which waits until the SM's stores are acknowledged.
static_assert(SMEM_RING == (size_t)cfg::STAGES * SLOT_STRIDE && SMEM_ACT >= (size_t)cfg::ACT_SMEM_BYTES &&
                  SMEM_RED == (size_t)2 * cfg::CWARPS * 16 * cfg::B * sizeof(float) &&
                  SMEM_BARS == (2 * cfg::STAGES + 2 * SIG_SLOTS + 1 + TRACE_ACCS) * sizeof(uint64_t),
              "shared-memory layout and cfg disagree");

extern __shared__ __align__(128) unsigned char smem[];   // the kernel's dynamic shared memory

// The trace's shared accumulators (Ctx::trace_acc, after the chain hint): ns consumer thread 0 waited for
// ring slots in the current task, ns the loader waited for a free slot in its current task, and in all.
enum TraceAcc { TA_FULL_WAIT_NS = 0, TA_LOADER_TASK_NS = 1, TA_LOADER_TOTAL_NS = 2 };
static_assert(TA_LOADER_TOTAL_NS + 1 == TRACE_ACCS, "trace accumulators: smem.py TRACE_ACCS");

// Per-thread execution context, passed by value into each task and returned (mk_kernel.cuh run_task),
// so it lives in registers: a Ctx in memory (a reference into a non-inlined task) sits in local memory,
// whose loads and stores take the L1 that deeper rings need (benchmarks/NOTES.md). What is fixed per
// thread (role, lane, shared-memory regions) is derived, not stored.
// The loader warp and the consumer warps walk the same static task list and count ring slots
// identically, so no slot bookkeeping crosses roles.
// The trace's timestamps go to the task's trace row when they are taken and its wait times
// accumulate in shared memory (trace_acc), so nothing of the trace is live in registers across a
// task body.
struct Ctx {
  const Params* p;
  uint32_t step;
  uint32_t ring_n;   // slots used so far on this SM
  uint32_t sig_n;    // signal groups handed over (consumers) / published (signaller) so far
  int task_no;       // running task number (diagnostics, trace row)
  bool tracing;      // p->trace != nullptr

  __device__ __forceinline__ int warp() const { return threadIdx.x / 32; }
  __device__ __forceinline__ int lane() const { return threadIdx.x % 32; }
  // the ring's loader warps (LOADER_WARPS: codegen/source.py loader_warps_for), then the signaller
  __device__ __forceinline__ bool loader() const { return warp() >= cfg::CWARPS && warp() < cfg::CWARPS + cfg::LOADER_WARPS; }
  __device__ __forceinline__ int loader_index() const { return warp() - cfg::CWARPS; }
  // lane 0 of loader warp 0: keeps the loader's trace
  __device__ __forceinline__ bool loader_lead() const { return warp() == cfg::CWARPS && lane() == 0; }
  __device__ __forceinline__ bool signaller() const { return warp() == cfg::CWARPS + cfg::LOADER_WARPS; }  // publishes events
  // the weight ring: STAGES slots of SLOT_STRIDE bytes
  __device__ __forceinline__ unsigned char* ring() const { return smem; }
  // resident bf16 activation of the current GEMV (also attention scratch)
  __device__ __forceinline__ bf16* act() const { return reinterpret_cast<bf16*>(smem + SMEM_ACT_AT); }
  // [2][CWARPS][B] cross-warp partial sums (double-buffered by row group)
  __device__ __forceinline__ float* red() const { return reinterpret_cast<float*>(smem + SMEM_RED_AT); }
  __device__ __forceinline__ float* scratch() const {   // small reductions
    return reinterpret_cast<float*>(smem + SMEM_SCRATCH_AT);
  }
  // [STAGES] loader -> consumers: slot holds its weights
  __device__ __forceinline__ uint64_t* full() const { return reinterpret_cast<uint64_t*>(smem + SMEM_BARS_AT); }
  // [STAGES] consumers -> loader: slot may be overwritten
  __device__ __forceinline__ uint64_t* empty() const { return full() + cfg::STAGES; }
  // [SIG_SLOTS] consumers -> signaller: a finished task's events may be published
  __device__ __forceinline__ uint64_t* sig_full() const { return full() + 2 * cfg::STAGES; }
  // [SIG_SLOTS] signaller -> consumers: published, the queue entry is free
  __device__ __forceinline__ uint64_t* sig_empty() const { return sig_full() + SIG_SLOTS; }
  // shared word: the consumers are on the dependency chain (loader_throttle)
  __device__ __forceinline__ uint32_t* chain_hint() const { return reinterpret_cast<uint32_t*>(sig_empty() + SIG_SLOTS); }
  // [TRACE_ACCS] shared trace accumulators (ns): see TraceAcc
  __device__ __forceinline__ uint64_t* trace_acc() const { return sig_empty() + SIG_SLOTS + 1; }
  // this task's row of the trace (tracing only)
  __device__ __forceinline__ uint64_t* trace_row() const {
    return p->trace + ((size_t)blockIdx.x * cfg::TRACE_TASKS + task_no) * TRACE_WORDS;
  }

  // Loader wait for a free slot; with tracing on, the time the ring was full is accumulated.
  __device__ __forceinline__ void loader_wait(uint64_t* bar, uint32_t parity) {
    timed_wait(bar, parity, TA_LOADER_TASK_NS, loader_lead());
  }
  // Bytes in flight: before requesting ring slot n the loader waits until slot n - cap has landed.
  // Every outstanding copy lengthens the queue that the dependency chain's L2 round trips (polls,
  // staging loads, releases) wait in, and beyond the few slots per SM that saturate the read
  // bandwidth more copies in flight add no bandwidth; so cap = INFLIGHT while the consumers stream
  // weights and INFLIGHT_CHAIN while they are on the chain (chain_hint); the measurements are in
  // benchmarks/NOTES.md. A LOADER_WAITS kind's stream
  // (the experts) passes its own cap, CAP = CHAIN = INFLIGHT_EXPERT (TilePlan.expert_inflight, default the whole
  // ring). The cp.async path (sm_80 / sm_89) is not throttled.
  template <int CAP = cfg::INFLIGHT, int CHAIN = cfg::INFLIGHT_CHAIN>
  __device__ __forceinline__ void loader_throttle(uint32_t n) {
#if defined(MK_USE_BULK_COPY)
    uint32_t cap = CAP;
    if constexpr (CHAIN < CAP) {
      uint32_t on_chain = 0;
      if (lane() == 0) on_chain = atomicOr(chain_hint(), 0u);   // atomics: a hint, read without ordering
      if (__shfl_sync(0xffffffffu, on_chain, 0)) cap = CHAIN;
    }
    if (cap < (uint32_t)cfg::STAGES && n >= cap) {
      const uint32_t m = n - cap;   // slot m's next use is m + STAGES > n: its fill phase is current or done
      timed_wait(&full()[m % cfg::STAGES], (m / cfg::STAGES) & 1, TA_LOADER_TASK_NS, lane() == 0);
    }
#endif
  }
  // Consumer side of the hint: 1 from a task's start (its wait, staging, or an ATTN / COMBINE body)
  // until a GEMV starts consuming ring slots.
  __device__ __forceinline__ void set_chain_hint(uint32_t v) {
#if defined(MK_USE_BULK_COPY)
    if constexpr (cfg::INFLIGHT_CHAIN < cfg::INFLIGHT)
      if (threadIdx.x == 0) atomicExch(chain_hint(), v);
#endif
  }
  // Consumer side: the warp is done reading ring slot `slot` (mk_kernel.cuh EMPTY_ARRIVALS: lane 0
  // after __syncwarp, which orders the other lanes' reads before its release; every lane in the
  // sanitizer builds).
  __device__ __forceinline__ void release_slot(uint32_t slot) const {
    if constexpr (diag::ALL_LANES_RELEASE) {
      mbar_arrive(&empty()[slot]);
    } else {
      __syncwarp();
      if (lane() == 0) mbar_arrive(&empty()[slot]);
    }
  }
  // Consumer wait for a slot's bytes; with tracing on, thread 0 accumulates the time it waited.
  __device__ __forceinline__ void consumer_wait(uint64_t* bar, uint32_t parity) {
    timed_wait(bar, parity, TA_FULL_WAIT_NS, threadIdx.x == 0);
  }
  // mbarrier wait; with tracing on, the time it blocked is added to accumulator `acc` where `counts`.
  __device__ __forceinline__ void timed_wait(uint64_t* bar, uint32_t parity, int acc, bool counts) {
    if (!tracing) { mbar_wait(bar, parity); return; }
    if (mbar_test_wait(bar, parity)) return;
    const uint64_t t0 = globaltimer();
    mbar_wait(bar, parity);
    if (counts) trace_acc()[acc] += globaltimer() - t0;
  }
  // trace: the task's activation is staged (a kind may mark a later point of its body)
  __device__ __forceinline__ void mark() {
    if (tracing && threadIdx.x == 0) trace_row()[TW_STAGED] = globaltimer();
  }
  __device__ __forceinline__ void mark_computed() {   // trace: the task's weights / tokens are reduced
    if (tracing && threadIdx.x == 0) trace_row()[TW_COMPUTED] = globaltimer();
  }
  // Consumer side: hand a group of the task's signals to the signaller (publish_signals,
  // mk_kernel.cuh). Every consumer thread's accesses the group orders precede this point (a consumer
  // barrier ends the staging and each task body), and thread 0's mbarrier arrive releases them at CTA
  // scope; the signaller acquires them with its wait, and its GPU-scope release (signal_event) is
  // cumulative over them. Thread 0 waits only when SIG_SLOTS groups are still being published.
  __device__ __forceinline__ void hand_off() {
    const uint32_t slot = sig_n % SIG_SLOTS, use = sig_n / SIG_SLOTS;
    ++sig_n;
    if (threadIdx.x == 0) {
      mbar_wait(&sig_empty()[slot], (use & 1) ^ 1);   // first use of a slot passes at once
      mbar_arrive(&sig_full()[slot]);
    }
  }
  // The task's staged signals (the first nss of its signals), once its input is staged (gemv_compute).
  __device__ __forceinline__ void hand_off_staged(const TaskArgs& a) {
    if constexpr (cfg::STAGED_SIGNALS)
      if (a.nss > 0) hand_off();
  }
  // The rest, once the task is done (run_task).
  __device__ __forceinline__ void hand_off_done(const TaskArgs& a) {
    if (a.ns > (cfg::STAGED_SIGNALS ? a.nss : 0)) hand_off();
  }
};

// A task kind as the kernel runs it (mk_kernel.cuh run_task). Each kind's device file
// (trtllm_mk/kinds/<kind>.cuh) specializes KindBody<KIND> with
//   load(c, a)            the loader warp's part (weights or cached K/V into the ring)
//   Pre, prologue(c, a, pre)  what the consumers gather before the task's wait (step-invariant inputs)
//   compute(c, a, pre)    the consumers' part, after the wait; it ends with a consumer barrier
// NoLoad and NoPrologue are the empty parts.
template <int KIND> struct KindBody;

struct NoLoad {
  static __device__ __forceinline__ void load(Ctx&, const TaskArgs&) {}
};

struct NoPrologue {
  struct Pre {};
  static __device__ __forceinline__ void prologue(Ctx&, const TaskArgs&, Pre&) {}
};

}  // namespace mk
