// The persistent decode-step kernel: one CTA per SM, CWARPS consumer warps, 1 loader warp (it fills the
// ring with GEMV weights and ATTN's cached K/V) and 1 signaller warp (it publishes finished tasks' events).
// The generated source defines namespace cfg (shapes, tile plan, event counts) and
// `run_program(Ctx)`, each SM's static task list; this header supplies everything else. The layout of
// shared memory and the per-thread context are in mk_params.cuh.
#pragma once
#include "mk_gemv.cuh"
// (codegen inlines the kinds' device files, trtllm_mk/kinds/*.cuh, before this header: each one
// specializes KindBody, mk_params.cuh)

namespace mk {

// Arrivals that free a ring slot: one per consumer warp (lane 0 after __syncwarp, which orders the
// other lanes' reads before its release). compute-sanitizer's racecheck does not credit __syncwarp to
// lane 0's mbarrier release and reports the loader's next bulk copy into the slot as a race with
// the warp's ldmatrix reads; a build with the diagnostic switch all_lanes_release (scripts/mk_smoke.py
// under the sanitizer) has every lane arrive, so racecheck can check the rest of the kernel.
constexpr uint32_t EMPTY_ARRIVALS = diag::ALL_LANES_RELEASE ? cfg::CWARPS * 32 : cfg::CWARPS;

__device__ __forceinline__ void wait_all(Ctx& c, const TaskArgs& a) {
  if (threadIdx.x == 0) {
#pragma unroll   // constant indices keep TaskArgs in registers (a dynamic index puts it in local memory)
    for (int i = 0; i < cfg::MAX_REFS; ++i)
      if (i < a.nw) {
        const int e = event_counter(a.w[i], a.layer);
        wait_counter(c.p->counters + e, cfg::EV_COUNT[e] * (c.step + 1), c.p->error, e, (uint32_t)a.layer,
                     (uint32_t)c.task_no);
      }
  }
  consumer_sync(CTHREADS);
}

// Signals [i0, i1) of a finished task (or of its staged group). Its local events go first, each a
// GPU-scope release: a waiter on this GPU (ATTN on QKV's group, DOWN on GATEUP's chunk) needs no
// system-scope fence, which waits for this SM's remote adds to land on the other GPUs. Under tensor
// parallelism the cross-rank events follow, signalled on every rank after one system-scope fence for
// all of them.
__device__ __forceinline__ void signal_task(const Ctx& c, const TaskArgs& a, int i0, int i1) {
  bool cross = false;
#pragma unroll
  for (int i = 0; i < cfg::MAX_REFS; ++i) {
    if ((cfg::STAGED_SIGNALS && i < i0) || i >= i1) continue;
    const int e = event_counter(a.s[i], a.layer);
    if (cfg::TP > 1 && cfg::EV_CROSS[e]) cross = true;
    else signal_event(c.p->counters + e);
  }
  if (cfg::TP == 1 || !cross) return;
  fence_sys();
#pragma unroll
  for (int i = 0; i < cfg::MAX_REFS; ++i) {
    if (i < i0 || i >= i1) continue;
    const int e = event_counter(a.s[i], a.layer);
    if (!cfg::EV_CROSS[e]) continue;
#pragma unroll
    for (int r = 0; r < cfg::TP; ++r) add_event_relaxed_sys(c.p->peers[r].counters + e);
  }
}

// Signaller side: publish a group of the task's signals once the consumers have handed it over.
__device__ __forceinline__ void publish(Ctx& c, const TaskArgs& a, int i0, int i1) {
  const uint32_t slot = c.sig_n % SIG_SLOTS, use = c.sig_n / SIG_SLOTS;
  ++c.sig_n;
  if (c.lane() == 0) {
    mbar_wait(&c.sig_full()[slot], use & 1);
    signal_task(c, a, i0, i1);
    mbar_arrive(&c.sig_empty()[slot]);
  }
}

// The task's staged signals (handed over after its staging), then the rest (after its body): the
// same groups, in the same order, as the consumers' hand_off_staged / hand_off_done.
// Kernels without staged signals keep one group a task and no range tests (cfg::STAGED_SIGNALS).
__device__ __forceinline__ void publish_signals(Ctx& c, const TaskArgs& a) {
  if constexpr (cfg::STAGED_SIGNALS) {
    if (a.nss > 0) publish(c, a, 0, a.nss);
    if (a.ns > a.nss) publish(c, a, a.nss, a.ns);
  } else {
    if (a.ns > 0) publish(c, a, 0, a.ns);
  }
}

// One task of the SM's list, in every role. Not inlined (the list has hundreds of calls); the context
// goes in and comes back by value, so it stays in registers across the call (mk_params.cuh Ctx).
template <int KIND>
__device__ __noinline__ Ctx run_task(Ctx c, TaskArgs a) {
  if (c.loader()) {
    if (c.tracing && c.loader_lead()) {
      c.trace_row()[TW_LOADER_START] = globaltimer();
      c.trace_acc()[TA_LOADER_TASK_NS] = 0;
    }
    KindBody<KIND>::load(c, a);
    if (c.tracing && c.loader_lead()) {
      uint64_t* r = c.trace_row();
      const uint64_t blocked = c.trace_acc()[TA_LOADER_TASK_NS];
      r[TW_LOADER_ISSUED] = globaltimer(); r[TW_LOADER_WAIT_NS] = blocked;
      c.trace_acc()[TA_LOADER_TOTAL_NS] += blocked;
    }
    ++c.task_no;
    return c;
  }
  if (c.signaller()) {
    publish_signals(c, a);
    if (c.tracing && c.lane() == 0 && a.ns > 0) c.trace_row()[TW_PUBLISHED] = globaltimer();
    ++c.task_no;
    return c;
  }
  const bool traced = c.tracing && threadIdx.x == 0;
  if (traced) {
    uint64_t* r = c.trace_row();
    r[TW_START] = globaltimer(); r[TW_COMPUTED] = 0;
    c.trace_acc()[TA_FULL_WAIT_NS] = 0;
  }
  c.set_chain_hint(1);
  typename KindBody<KIND>::Pre pre;
  KindBody<KIND>::prologue(c, a, pre);   // step-invariant inputs, gathered before the wait
  wait_all(c, a);
  if (traced) {
    const uint64_t t = globaltimer();
    c.trace_row()[TW_WAITED] = t; c.trace_row()[TW_STAGED] = t;   // a kind's mark() moves TW_STAGED
  }
  KindBody<KIND>::compute(c, a, pre);
  if (traced) {
    uint64_t* r = c.trace_row();
    const uint64_t t = globaltimer();
    r[TW_HANDED] = t;
    if (r[TW_COMPUTED] == 0) r[TW_COMPUTED] = t;   // the kind marked no earlier point
  }
  c.hand_off_done(a);
  if (traced) {
    uint64_t* r = c.trace_row();
    r[TW_SIGNALLED] = globaltimer(); r[TW_FULL_WAIT_NS] = c.trace_acc()[TA_FULL_WAIT_NS];
  }
  ++c.task_no;
  return c;
}

}  // namespace mk

__device__ mk::Ctx run_program(mk::Ctx c);  // generated: this SM's static task list

extern "C" __global__ void __launch_bounds__((cfg::CWARPS + cfg::LOADER_WARPS + 1) * 32, 1)
mk_decode_step(const __grid_constant__ mk::Params p) {
  mk::Ctx c;
  c.p = &p;
  c.sig_n = 0;
  c.ring_n = 0;
  c.task_no = 0;
  c.step = *reinterpret_cast<volatile uint32_t*>(&p.control[0]);   // advanced by the last step's ARGMAX
  c.tracing = p.trace != nullptr;
  if (threadIdx.x == 0) {
    for (int s = 0; s < cfg::STAGES; ++s) {
#if defined(MK_USE_BULK_COPY)
      mk::mbar_init(&c.full()[s], 1);
#else
      mk::mbar_init(&c.full()[s], 32 * cfg::LOADER_WARPS);   // every lane of every loader warp arrives
#endif
      mk::mbar_init(&c.empty()[s], mk::EMPTY_ARRIVALS);
    }
    for (int s = 0; s < mk::SIG_SLOTS; ++s) {
      mk::mbar_init(&c.sig_full()[s], 1);
      mk::mbar_init(&c.sig_empty()[s], 1);
    }
    *c.chain_hint() = 0;
    for (int i = 0; i < mk::TRACE_ACCS; ++i) c.trace_acc()[i] = 0;
#if __CUDA_ARCH__ >= 900
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
  }
  __syncthreads();
  c = run_program(c);
  if (c.tracing && (threadIdx.x == 0 || c.loader_lead())) {
    uint64_t* r = p.trace + (size_t)gridDim.x * cfg::TRACE_TASKS * mk::TRACE_WORDS + (size_t)blockIdx.x * mk::TRACE_SM_WORDS;
    if (c.loader()) { r[mk::TS_LOADER_BLOCKED_NS] = c.trace_acc()[mk::TA_LOADER_TOTAL_NS]; r[mk::TS_LOADER_DONE] = mk::globaltimer(); }
    else { r[mk::TS_CONSUMERS_DONE] = mk::globaltimer(); r[mk::TS_UNUSED] = 0; }
  }
}
