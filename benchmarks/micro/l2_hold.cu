// Micro-benchmark: do bytes prefetched into L2 stay there while other weights stream past them?
// Every CTA (one per SM) runs three phases separated by grid-wide barriers:
//   1. prefetch: its loader lane issues cp.async.bulk.prefetch.L2 for its A bytes (32 KB at a time),
//      with no cache hint or under an L2::evict_last policy; nothing waits for them;
//   2. stream B: its loader streams B bytes through a 5 x 32 KB mbarrier ring of 2 KB bulk copies
//      under an evict_first policy, as the megakernel's loader streams weights (the consumer warps
//      only release slots): the traffic between a prefetch and its use;
//   3. stream A: the same ring over its A bytes, timed (globaltimer, the slowest CTA's phase).
// Without phase 1, phase 3 reads A from HBM; with it, from L2 as far as A stayed there. Each run reads
// a fresh region (rotating over 4), so nothing is left in L2 from the previous run. Reports the median
// of phase 3 (and the whole kernel) over 40 runs.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o l2_hold benchmarks/micro/l2_hold.cu && ./l2_hold
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <algorithm>
#include <vector>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)

constexpr int SLOT = 32768, COPY = 2048, STAGES = 5;
#include "ring_ptx.cuh"

__device__ __forceinline__ uint64_t policy(int kind) {   // 0 evict_first, 1 evict_last, 2 evict_normal
  uint64_t p;
  if (kind == 0) asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  else if (kind == 1) asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p));
  else asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(p));
  return p;
}
__device__ __forceinline__ void bulk_pol(void* d, const void* s, uint32_t n, uint64_t* b, uint64_t pol) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
               ::"r"(sa(d)), "l"(s), "r"(n), "r"(sa(b)), "l"(pol) : "memory");
}
__device__ __forceinline__ uint64_t now() { uint64_t t; asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t)); return t; }

__device__ void grid_sync(unsigned* arrive, unsigned target) {
  asm volatile("bar.sync 1, 288;" ::: "memory");
  if (threadIdx.x == 0) {
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(arrive) : "memory");
    unsigned v;
    do { asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(arrive) : "memory"); } while (v < target);
  }
  asm volatile("bar.sync 1, 288;" ::: "memory");
}

// the ring over n slots at src; warp 8 loads, warps 0-7 release; `use0` counts the ring's earlier slots
__device__ void stream(unsigned char* smem, uint64_t* full, uint64_t* empty, const char* src, int n, int use0, uint64_t pol) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int i = 0; i < n; ++i) {
    const int k = use0 + i;
    const uint32_t s = k % STAGES, use = k / STAGES;
    if (warp == 8) {
      wait(&empty[s], (use & 1) ^ 1);
      if (lane == 0) expect_tx(&full[s], SLOT);
      __syncwarp();
      for (int r = lane; r < SLOT / COPY; r += 32) bulk_pol(smem + (size_t)s * SLOT + r * COPY, src + (size_t)i * SLOT + r * COPY, COPY, &full[s], pol);
    } else {
      wait(&full[s], use & 1);
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[s]);
    }
  }
}

// pf: -1 no prefetch, else the prefetch's policy (0 / 1 / 2 as policy(), 3 no hint)
__global__ void __launch_bounds__(288, 1) hold(const char* a, int a_slots, const char* b, int b_slots, int pf,
                                               unsigned* arrive, unsigned epoch, unsigned long long* t3) {
  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + (size_t)STAGES * SLOT);
  uint64_t* empty = full + STAGES;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) { mbar_init(&full[s], 1); mbar_init(&empty[s], 8); }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const char* ma = a + (size_t)blockIdx.x * a_slots * SLOT;
  const char* mb = b + (size_t)blockIdx.x * b_slots * SLOT;
  const unsigned g = gridDim.x, base = (epoch - 1) * 2 * g;
  if (pf >= 0 && threadIdx.x == 256) {
    if (pf == 3) {
      for (int i = 0; i < a_slots; ++i) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(ma + (size_t)i * SLOT), "r"(SLOT) : "memory");
    } else {
      const uint64_t pol = policy(pf);
      for (int i = 0; i < a_slots; ++i)
        asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;" ::"l"(ma + (size_t)i * SLOT), "r"(SLOT), "l"(pol) : "memory");
    }
  }
  const uint64_t ef = policy(0);
  stream(smem, full, empty, mb, b_slots, 0, ef);
  grid_sync(arrive, base + g);
  const uint64_t t0 = now();
  stream(smem, full, empty, ma, a_slots, b_slots, ef);
  grid_sync(arrive, base + 2 * g);
  if (threadIdx.x == 0) atomicMax(t3, now() - t0);
}

int main() {
  int dev = 0, sms = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  int l2 = 0;
  CK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev));
  const int ncta = sms;
  const size_t smem = (size_t)STAGES * SLOT + 2 * STAGES * 8;
  CK(cudaFuncSetAttribute(hold, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  const int a_sizes[] = {2, 4, 8}, b_sizes[] = {0, 4, 8, 16};
  const size_t region = (size_t)ncta * (8 + 16) * SLOT;
  char* pool;
  CK(cudaMalloc(&pool, 4 * region));
  CK(cudaMemset(pool, 1, 4 * region));
  unsigned* arrive;
  unsigned long long* t3;
  CK(cudaMalloc(&arrive, 4));
  CK(cudaMalloc(&t3, 8));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  printf("%d SMs, L2 %d MB, %d x %d KB ring, %d B copies (evict_first)\n\n", sms, l2 >> 20, STAGES, SLOT / 1024, COPY);
  printf("| A MB | B MB between | prefetch of A | A phase us | A GB/s | kernel us |\n|---|---|---|---|---|---|\n");
  const char* pf_names[] = {"evict_first", "evict_last", "evict_normal", "no hint"};
  for (int as : a_sizes)
    for (int bs : b_sizes)
      for (int pf = -1; pf <= 3; ++pf) {
        if (pf == 0 || pf == 2) continue;
        std::vector<float> ph, kt;
        unsigned epoch = 0;
        CK(cudaMemset(arrive, 0, 4));
        for (int it = 0; it < 48; ++it) {
          const char* r = pool + (size_t)(it % 4) * region;
          ++epoch;
          CK(cudaMemset(t3, 0, 8));
          CK(cudaEventRecord(e0));
          hold<<<ncta, 288, smem>>>(r, as, r + (size_t)ncta * 8 * SLOT, bs, pf, arrive, epoch, t3);
          CK(cudaEventRecord(e1));
          CK(cudaEventSynchronize(e1));
          unsigned long long ns;
          CK(cudaMemcpy(&ns, t3, 8, cudaMemcpyDeviceToHost));
          float ms;
          CK(cudaEventElapsedTime(&ms, e0, e1));
          if (it >= 8) { ph.push_back(ns * 1e-3f); kt.push_back(ms * 1e3f); }
        }
        CK(cudaGetLastError());
        std::sort(ph.begin(), ph.end());
        std::sort(kt.begin(), kt.end());
        const double abytes = (double)ncta * as * SLOT;
        printf("| %.1f | %.1f | %s | %.2f | %.0f | %.2f |\n", abytes / 1e6, (double)ncta * bs * SLOT / 1e6,
               pf < 0 ? "none" : pf_names[pf], ph[ph.size() / 2], abytes / ph[ph.size() / 2] / 1e3, kt[kt.size() / 2]);
      }
  return 0;
}
