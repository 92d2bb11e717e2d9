// Micro-benchmark: an expert MLP tile's weight stream, split in two dependent tasks or as one.
// Every CTA (one per SM, NCTA of them) streams G bytes (its gate/up tile) and then D bytes (its down
// tile) through a STAGES x 32 KB mbarrier ring of 2 KB bulk copies, as the megakernel's loader does;
// the consumer warps only release slots.
//   split: after its G slots every CTA's consumers wait for all CTAs' G slots (a grid-wide counter,
//          the EGATEUP -> EDOWN event), then consume D; the loader runs ahead as far as the ring allows;
//          at the end each CTA adds ADDS_SPLIT values into the residual (64-bit reductions);
//   fused: the consumers take G and D in one run, then each CTA adds ADDS_FUSED values (every row of
//          the residual: the down tile's partial sum for all hidden rows).
// Reports the median kernel time of each variant (CUDA events, 50 runs after warm-up) and the
// reductions alone. Answers: what the phase boundary costs and what the fused tile's adds cost.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o expert_stream benchmarks/micro/expert_stream.cu && ./expert_stream
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <algorithm>
#include <vector>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)

constexpr int SLOT = 32768, COPY = 2048;
#include "ring_ptx.cuh"

// mode 0 split, 1 fused, 2 adds only (no stream)
__global__ void __launch_bounds__(288, 1) tile(const char* src, int g_slots, int d_slots, int stages, int mode, int adds,
                                               int hidden, unsigned* arrive, unsigned epoch, long long* x) {
  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + (size_t)stages * SLOT);
  uint64_t* empty = full + stages;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) { mbar_init(&full[s], 1); mbar_init(&empty[s], 8); }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int nslots = mode == 2 ? 0 : g_slots + d_slots;
  const char* base = src + (size_t)blockIdx.x * nslots * SLOT;
  if (warp == 8) {
    for (int n = 0; n < nslots; ++n) {
      const uint32_t s = n % stages, use = n / stages;
      wait(&empty[s], (use & 1) ^ 1);
      if (lane == 0) expect_tx(&full[s], SLOT);
      __syncwarp();
      for (int r = lane; r < SLOT / COPY; r += 32) bulk(smem + (size_t)s * SLOT + r * COPY, base + (size_t)n * SLOT + r * COPY, COPY, &full[s]);
    }
    return;
  }
  for (int n = 0; n < nslots; ++n) {
    if (mode == 0 && n == g_slots) {   // the EGATEUP -> EDOWN event: every CTA's gate/up slots are done
      asm volatile("bar.sync 1, 256;" ::: "memory");
      if (threadIdx.x == 0) {
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(arrive) : "memory");
        unsigned v;
        do { asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(arrive) : "memory"); } while (v < epoch * gridDim.x);
      }
      asm volatile("bar.sync 1, 256;" ::: "memory");
    }
    const uint32_t s = n % stages, use = n / stages;
    wait(&full[s], use & 1);
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[s]);
  }
  // the residual adds: thread i adds rows i, i + 256, ... (fixed point, as add_resid)
  for (int i = threadIdx.x; i < adds; i += 256)
    atomicAdd(reinterpret_cast<unsigned long long*>(x + (i + blockIdx.x * 16) % hidden), 1ull << 20);
}

int main() {
  int dev = 0, sms = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const int ncta = 128, stages = 5, hidden = 2048;
  // per CTA slots of gate/up and of down: batch 1 (48-row tiles) and batch 4 (192-row tiles) of a 2048 x 768 expert
  const int shapes[][2] = {{12, 6}, {48, 24}};
  const size_t smem = (size_t)stages * SLOT + 2 * stages * 8;
  CK(cudaFuncSetAttribute(tile, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  const size_t max_bytes = (size_t)ncta * 72 * SLOT;
  const size_t pool_bytes = 4 * max_bytes;   // rotate over 4 regions: no run finds its bytes in L2
  char* src;
  CK(cudaMalloc(&src, pool_bytes));
  CK(cudaMemset(src, 1, pool_bytes));
  unsigned* arrive;
  long long* x;
  CK(cudaMalloc(&arrive, 4));
  CK(cudaMalloc(&x, hidden * 8 * 4));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  printf("%d SMs, %d CTAs, %d x %d KB ring, %d B copies\n\n", sms, ncta, stages, SLOT / 1024, COPY);
  printf("| G KB | D KB | variant | adds per CTA | median us | GB/s of weights |\n|---|---|---|---|---|---|\n");
  for (auto& sh : shapes) {
    const int g = sh[0], d = sh[1];
    struct V { const char* name; int mode, adds; } vs[] = {
      {"split, 128 adds", 0, 128}, {"split, no adds", 0, 0}, {"fused, 2048 adds", 1, 2048}, {"fused, 8192 adds", 1, 8192},
      {"fused, no adds", 1, 0}, {"adds only 2048", 2, 2048}, {"adds only 8192", 2, 8192}};
    for (auto& v : vs) {
      std::vector<float> ts;
      unsigned epoch = 0;
      CK(cudaMemset(arrive, 0, 4));
      for (int it = 0; it < 60; ++it) {
        const char* s = src + (size_t)(it % 4) * max_bytes;
        ++epoch;
        CK(cudaEventRecord(e0));
        tile<<<ncta, 288, smem>>>(s, g, d, stages, v.mode, v.adds, hidden, arrive, epoch, x);
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (it >= 10) ts.push_back(ms * 1e3f);
      }
      CK(cudaGetLastError());
      std::sort(ts.begin(), ts.end());
      const float med = ts[ts.size() / 2];
      const double bytes = v.mode == 2 ? 0.0 : (double)ncta * (g + d) * SLOT;
      printf("| %d | %d | %s | %d | %.2f | %.0f |\n", g * 32, d * 32, v.name, v.adds, med, bytes / med / 1e3);
    }
  }
  return 0;
}
