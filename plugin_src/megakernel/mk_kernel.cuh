// The persistent decode-step kernel: one CTA per SM, CWARPS consumer warps + 1 loader warp (it fills the
// ring with GEMV weights and ATTN's cached K/V).
// The generated source defines namespace cfg (shapes, tile plan, event counts) and
// `run_program(Ctx&)`, each SM's static task list; this header supplies everything else.
#pragma once
#include "mk_attention.cuh"
#include "mk_misc.cuh"

namespace mk {

// Shared-memory layout (dynamic): [ring][activation / attention scratch][red][scratch][mbarriers]
constexpr size_t SMEM_RING = (size_t)cfg::STAGES * SLOT_STRIDE;
constexpr size_t SMEM_ACT = ((size_t)cfg::ACT_SMEM_BYTES + 127) / 128 * 128;
constexpr size_t SMEM_RED = (size_t)2 * cfg::CWARPS * 16 * cfg::B * sizeof(float);
constexpr size_t SMEM_SCRATCH = 256 * sizeof(float);   // values [0, 128) and indices [128, 256)
constexpr size_t SMEM_BARS = 2 * cfg::STAGES * sizeof(uint64_t);
// Arrivals that free a ring slot: one per consumer warp (lane 0 after __syncwarp, which orders the
// other lanes' reads before its release). compute-sanitizer's racecheck does not credit __syncwarp to
// lane 0's mbarrier release and reports the loader's next bulk copy into the slot as a race with
// the warp's ldmatrix reads; a build with MK_EMPTY_ARRIVE_ALL_LANES (scripts/mk_smoke.py under the
// sanitizer) has every lane arrive, so racecheck can check the rest of the kernel.
#if defined(MK_EMPTY_ARRIVE_ALL_LANES)
constexpr uint32_t EMPTY_ARRIVALS = cfg::CWARPS * 32;
#else
constexpr uint32_t EMPTY_ARRIVALS = cfg::CWARPS;
#endif
constexpr size_t SMEM_TOTAL = SMEM_RING + SMEM_ACT + SMEM_RED + SMEM_SCRATCH + SMEM_BARS;

__device__ __forceinline__ void wait_all(Ctx& c, const TaskArgs& a) {
  if (threadIdx.x == 0) {
    for (int i = 0; i < a.nw; ++i)
      wait_counter(c.p->counters + a.w[i], cfg::EV_COUNT[a.w[i]] * (c.step + 1), c.p->error, a.w[i],
                   (uint32_t)a.layer, (uint32_t)c.task_no);
  }
  consumer_sync(CTHREADS);
}

__device__ __forceinline__ void signal_all(Ctx& c, const TaskArgs& a) {
  // every consumer thread's stores precede this point (each task body ends with consumer_sync)
  if (threadIdx.x == 0)
    for (int i = 0; i < a.ns; ++i) signal_event(c.p->counters + a.s[i]);
}

template <int KIND>
__device__ __noinline__ void run_task(Ctx& c, TaskArgs a) {
  if (c.loader) {
    if constexpr (KIND == QKV || KIND == OPROJ || KIND == GATEUP || KIND == DOWN || KIND == LMHEAD) gemv_load<KIND>(c, a);
    else if constexpr (KIND == ATTN) attn_load(c, a);    // the cached K/V of the task's split
    return;
  }
  uint64_t t0 = 0, t1 = 0;
  if (c.tracing && threadIdx.x == 0) t0 = globaltimer();
  wait_all(c, a);
  if (c.tracing && threadIdx.x == 0) c.t_mark = t1 = globaltimer();
  if constexpr (KIND == EMBED) embed_compute(c, a);
  else if constexpr (KIND == ATTN) attn_compute(c, a);
  else if constexpr (KIND == COMBINE) combine_compute(c, a);
  else if constexpr (KIND == ARGMAX) argmax_compute(c, a);
  else gemv_compute<KIND>(c, a);
  signal_all(c, a);
  if (c.tracing && threadIdx.x == 0) {
    uint64_t* r = c.p->trace + ((size_t)blockIdx.x * cfg::TRACE_TASKS + c.task_no) * 4;
    r[0] = t0; r[1] = t1; r[2] = c.t_mark; r[3] = globaltimer();
  }
  ++c.task_no;
}

}  // namespace mk

__device__ void run_program(mk::Ctx& c);  // generated: this SM's static task list

extern "C" __global__ void __launch_bounds__((cfg::CWARPS + 1) * 32, 1)
mk_decode_step(const __grid_constant__ mk::Params p) {
  extern __shared__ __align__(128) unsigned char smem[];
  mk::Ctx c;
  c.p = &p;
  c.warp = threadIdx.x / 32;
  c.lane = threadIdx.x % 32;
  c.loader = c.warp == cfg::CWARPS;
  c.ring = smem;
  c.act = reinterpret_cast<mk::bf16*>(smem + mk::SMEM_RING);
  c.red = reinterpret_cast<float*>(smem + mk::SMEM_RING + mk::SMEM_ACT);
  c.scratch = c.red + 2 * cfg::CWARPS * 16 * cfg::B;   // after both red buffers (SMEM_RED)
  c.full = reinterpret_cast<uint64_t*>(smem + mk::SMEM_RING + mk::SMEM_ACT + mk::SMEM_RED + mk::SMEM_SCRATCH);
  c.empty = c.full + cfg::STAGES;
  c.ring_n = 0;
  c.task_no = 0;
  c.step = *reinterpret_cast<volatile uint32_t*>(&p.control[0]);
  c.tracing = p.trace != nullptr;
  c.t_mark = 0;
  c.loader_blocked = 0;
  if (threadIdx.x == 0) {
    for (int s = 0; s < cfg::STAGES; ++s) {
#if defined(MK_USE_BULK_COPY)
      mk::mbar_init(&c.full[s], 1);
#else
      mk::mbar_init(&c.full[s], 32);
#endif
      mk::mbar_init(&c.empty[s], mk::EMPTY_ARRIVALS);
    }
#if __CUDA_ARCH__ >= 900
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
  }
  __syncthreads();
  run_program(c);
  if (c.tracing && (threadIdx.x == 0 || (c.loader && c.lane == 0))) {
    uint64_t* r = p.trace + ((size_t)gridDim.x * cfg::TRACE_TASKS + blockIdx.x) * 4;
    if (c.loader) { r[0] = c.loader_blocked; r[1] = mk::globaltimer(); }
    else { r[2] = mk::globaltimer(); r[3] = 0; }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    // The last CTA to finish advances the step state; every CTA has read pos/step by then.
    __threadfence();
    const uint32_t done = atomicAdd(&p.control[1], 1u);
    if (done == (c.step + 1) * gridDim.x - 1) {
      for (int b = 0; b < cfg::B; ++b) p.pos[b] += 1;
      __threadfence();
      atomicExch(&p.control[0], c.step + 1);
    }
  }
}
