// Micro-benchmark: how fast can one loader warp per SM stream weights through an mbarrier ring?
// It isolates the megakernel's weight path (trtllm_mk/device/mk_gemv.cuh gemv_load) from the task
// graph: every CTA streams its own rows of a large matrix (larger than L2) through STAGES x SLOT ring
// slots, one copy per row piece of C bytes, as the kernel does; consumer warps only release slots.
// Three tables: (1) what copy size, ring shape and issue scheme reach the HBM read bandwidth, and what
// one SM can pull when others are idle; (2) the GEMV consumer alone (bytes per second per SM); (3) what a
// GPU-scope release (the kernel's event signal) costs while the SM streams. H100 results and how they
// shaped the kernel: benchmarks/results/h100_v6_2026-11-23/ring_stream.md, benchmarks/NOTES.md (v6).
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o ring_stream benchmarks/micro/ring_stream.cu && ./ring_stream
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <algorithm>
#include <vector>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)

#include "ring_ptx.cuh"

__device__ __forceinline__ void cp16(void* d, const void* s) { asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(sa(d)), "l"(s) : "memory"); }
__device__ __forceinline__ void cp_arrive(uint64_t* b) { asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];" ::"r"(sa(b)) : "memory"); }

// How a consumer signals an event (release of its stores): 0 none, 1 red.release.gpu (the kernel's
// signal_event), 2 fence.acq_rel.gpu + relaxed red, 3 st.release.gpu of a flag, 4 relaxed red only
// (no ordering: the floor).
__device__ __forceinline__ void signal(int how, uint32_t* ctr) {
  if (how == 1) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(ctr) : "memory");
  else if (how == 2) asm volatile("fence.acq_rel.gpu;\n red.relaxed.gpu.global.add.u32 [%0], 1;" ::"l"(ctr) : "memory");
  else if (how == 3) asm volatile("st.release.gpu.global.u32 [%0], 1;" ::"l"(ctr) : "memory");
  else if (how == 4) asm volatile("red.relaxed.gpu.global.add.u32 [%0], 1;" ::"l"(ctr) : "memory");
}

// mode 0: bulk copies, lanes issue in parallel; 1: bulk copies, lane 0 issues all; 2: 16-byte cp.async;
// 3: 16-byte cp.async issued by two warps (8 and 9, alternate rows of a slot): is one warp's issue the limit?
// sig: consumer warp 0 stores a value and signals after every slot (`signal` above); its mean time per
// signal (ns) lands in sig_ns[blockIdx.x]
__global__ void __launch_bounds__(320, 1) stream(const char* src, size_t bytes_per_sm, int row_bytes, int copy, int stages,
                                                int slot, int mode, int sig, float* scratch, uint32_t* ctrs,
                                                unsigned long long* sig_ns) {
  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + (size_t)stages * slot);
  uint64_t* empty = full + stages;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) { mbar_init(&full[s], mode == 2 ? 32 : mode == 3 ? 64 : 1); mbar_init(&empty[s], 8); }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const char* base = src + (size_t)blockIdx.x * bytes_per_sm;
  const int rows_per_slot = slot / copy, pieces = row_bytes / copy;
  const size_t nslots = bytes_per_sm / slot;
  // slot n covers row group n / pieces (rows_per_slot rows) and piece n % pieces of each of its rows
  if (warp == 9 && mode != 3) return;   // the second loader warp of mode 3 only
  if (warp >= 8) {
    for (size_t n = 0; n < nslots; ++n) {
      const uint32_t s = n % stages, use = n / stages;
      wait(&empty[s], (use & 1) ^ 1);
      const char* g = base + (n / pieces) * (size_t)rows_per_slot * row_bytes + (n % pieces) * (size_t)copy;
      unsigned char* d = smem + (size_t)s * slot;
      if (mode == 3) {
        for (int r = warp - 8; r < rows_per_slot; r += 2)
          for (int v = lane; v < copy / 16; v += 32) cp16(d + r * copy + v * 16, g + (size_t)r * row_bytes + v * 16);
        cp_arrive(&full[s]);
      } else if (mode == 2) {
        for (int r = 0; r < rows_per_slot; ++r)
          for (int v = lane; v < copy / 16; v += 32) cp16(d + r * copy + v * 16, g + (size_t)r * row_bytes + v * 16);
        cp_arrive(&full[s]);
      } else {
        if (lane == 0) expect_tx(&full[s], slot);
        __syncwarp();
        if (mode == 0) {
          for (int r = lane; r < rows_per_slot; r += 32) bulk(d + r * copy, g + (size_t)r * row_bytes, copy, &full[s]);
        } else if (lane == 0) {
          for (int r = 0; r < rows_per_slot; ++r) bulk(d + r * copy, g + (size_t)r * row_bytes, copy, &full[s]);
        }
      }
    }
  } else {
    unsigned long long total = 0;
    for (size_t n = 0; n < nslots; ++n) {
      const uint32_t s = n % stages, use = n / stages;
      wait(&full[s], use & 1);
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[s]);
      if (sig && threadIdx.x == 0) {
        scratch[blockIdx.x * 32] = (float)n;
        unsigned long long t0;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
        signal(sig, ctrs + blockIdx.x * 32);
        unsigned long long t1;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
        total += t1 - t0;
      }
    }
    if (sig && threadIdx.x == 0) sig_ns[blockIdx.x] = total / (nslots ? nslots : 1);
  }
}

// The GEMV consumer alone (no copies: the loader marks each slot full at once): per slot of 16*NB rows x
// KC columns (rows 2*KC+16 bytes apart, as mk_gemv.cuh lays them out), warp w takes 16-row block w % NB and
// every WPB-th 16-column step, one ldmatrix.x4 + one mma.m16n8k16 each, as gemv_compute does. ACCS
// independent accumulators break the mma dependency chain. Measures the consumer's bytes per second.
// MODE 0: as gemv_compute (volatile ldmatrix / mma asm); 1: non-volatile asm, the slot address passed
// through a volatile mov after the wait (so the loads cannot move above it, but may overlap each other);
// 2: like 1 with no ring handshake at all (the compute rate alone); 3: as 0 with ACCS independent
// accumulators (k-steps unrolled by ACCS, loads first), so the mma dependency chain is ACCS times shorter;
// 4: as 3 with no ring handshake.
template <int KC, int NB, int ACCS, int MODE>
__global__ void __launch_bounds__(288, 1) consume(int nslots, int stages, float* out) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int STRIDE = KC * 2 + 16, SLOT = 16 * NB * STRIDE, NK16 = KC / 16, WPB = 8 / NB;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + (size_t)stages * SLOT + (KC + 8) * 2 * 8);
  uint64_t* empty = full + stages;
  const unsigned char* act = smem + (size_t)stages * SLOT;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) { mbar_init(&full[s], 1); mbar_init(&empty[s], 8); }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp == 8) {
    if (MODE == 2 || MODE == 4) return;
    for (int n = 0; n < nslots; ++n) {
      const uint32_t s = n % stages, use = n / stages;
      wait(&empty[s], (use & 1) ^ 1);
      if (lane == 0) mbar_arrive(&full[s]);
    }
    return;
  }
  const int blk = warp % NB, kw = warp / NB, g = lane >> 2, t = lane & 3;
  const int lrow = (lane & 7) + ((lane >> 3) & 1) * 8, lcol = (lane >> 4) * 8;
  const uint32_t a_lane = (uint32_t)((blk * 16 + lrow) * STRIDE + lcol * 2);
  const uint32_t ring0 = sa(smem);
  float acc[ACCS][4] = {};
  for (int n = 0; n < nslots; ++n) {
    const uint32_t s = n % stages, use = n / stages;
    if (MODE != 2 && MODE != 4) wait(&full[s], use & 1);
    uint32_t wbase = ring0 + s * SLOT + a_lane;
    if (MODE >= 1) asm volatile("mov.u32 %0, %0;" : "+r"(wbase));
    if constexpr (MODE >= 3) {
      static_assert(NK16 % (WPB * ACCS) == 0, "k-steps must split evenly over the accumulators");
#pragma unroll 2
      for (int k0 = kw; k0 < NK16; k0 += WPB * ACCS) {
        uint32_t a[ACCS][4], b[ACCS][2];
#pragma unroll
        for (int j = 0; j < ACCS; ++j) {
          const int k = k0 + j * WPB;
          b[j][0] = *reinterpret_cast<const uint32_t*>(act + (g * (KC + 8) + t * 2 + k * 16) * 2);
          b[j][1] = *reinterpret_cast<const uint32_t*>(act + (g * (KC + 8) + t * 2 + k * 16 + 8) * 2);
          asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];" : "=r"(a[j][0]), "=r"(a[j][1]), "=r"(a[j][2]), "=r"(a[j][3]) : "r"(wbase + k * 32));
        }
#pragma unroll
        for (int j = 0; j < ACCS; ++j)
          asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                       : "+f"(acc[j][0]), "+f"(acc[j][1]), "+f"(acc[j][2]), "+f"(acc[j][3]) : "r"(a[j][0]), "r"(a[j][1]), "r"(a[j][2]), "r"(a[j][3]), "r"(b[j][0]), "r"(b[j][1]));
      }
    } else
#pragma unroll 4
    for (int k = kw; k < NK16; k += WPB) {
      const uint32_t b0 = *reinterpret_cast<const uint32_t*>(act + (g * (KC + 8) + t * 2 + k * 16) * 2 % ((KC + 8) * 2 * 8));
      const uint32_t b1 = *reinterpret_cast<const uint32_t*>(act + (g * (KC + 8) + t * 2 + k * 16 + 8) * 2 % ((KC + 8) * 2 * 8));
      uint32_t a0, a1, a2, a3;
      float* d = acc[0];
      if (MODE == 0) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];" : "=r"(a0), "=r"(a1), "=r"(a2), "=r"(a3) : "r"(wbase + k * 32));
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
      } else {
        asm("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];" : "=r"(a0), "=r"(a1), "=r"(a2), "=r"(a3) : "r"(wbase + k * 32));
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
      }
    }
    if (MODE != 2 && MODE != 4) {
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[s]);
    }
  }
  float v = 0.f;
  for (int a = 0; a < ACCS; ++a) v += acc[a][0] + acc[a][1] + acc[a][2] + acc[a][3];
  if (v == 12345.f) out[threadIdx.x] = v;   // keep the work
}

// Median time (ms) of `reps` launches after `warm` unmeasured ones (the caller checks for errors).
template <class Launch>
float median_ms(cudaEvent_t e0, cudaEvent_t e1, int warm, int reps, Launch launch) {
  std::vector<float> ms;
  for (int r = 0; r < warm + reps; ++r) {
    cudaEventRecord(e0);
    launch();
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float t = 0.f;
    cudaEventElapsedTime(&t, e0, e1);
    if (r >= warm) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

template <int KC, int NB, int ACCS, int MODE>
int time_consume(cudaEvent_t e0, cudaEvent_t e1, int nsm, float* out) {
  constexpr int SLOT = 16 * NB * (KC * 2 + 16);
  const int stages = 4, nslots = 4096;
  const size_t smem = (size_t)stages * SLOT + (KC + 8) * 2 * 8 + 2 * stages * 8;
  CK(cudaFuncSetAttribute(consume<KC, NB, ACCS, MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024));
  const float ms = median_ms(e0, e1, 0, 5, [&] { consume<KC, NB, ACCS, MODE><<<nsm, 288, smem>>>(nslots, stages, out); });
  CK(cudaGetLastError());
  const double bytes = (double)nslots * 16 * NB * KC * 2;
  printf("| %d x %d | %d | %d | %.1f | %.3f |\n", 16 * NB, KC, MODE, ACCS, bytes / (ms * 1e-3) / 1e9, ms * 1e3 / nslots);
  return 0;
}

int main() {
  int nsm;
  CK(cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, 0));
  const size_t per_sm = 8u << 20;   // 8 MB per SM: 1.06 GB for 132 SMs, far beyond L2
  char* src;
  CK(cudaMalloc(&src, per_sm * nsm));
  CK(cudaMemset(src, 1, per_sm * nsm));
  float* scratch;
  uint32_t* ctrs;
  unsigned long long* sig_ns;
  CK(cudaMalloc(&scratch, nsm * 32 * 4));
  CK(cudaMalloc(&ctrs, nsm * 32 * 4));
  CK(cudaMalloc(&sig_ns, nsm * 8));
  CK(cudaFuncSetAttribute(stream, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024));
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  struct Cfg { int sms, row, copy, stages, slot, mode; };
  std::vector<Cfg> cfgs;
  const char* mname[] = {"bulk/lanes", "bulk/lane0", "cp.async16", "cp.async16 x2 warps"};
  for (int mode : {0, 2, 3})
    for (int copy : {256, 512, 1024, 2048, 4096})
      cfgs.push_back({nsm, 4096, copy, 4, 32768, mode});
  for (int copy : {1024, 2048}) cfgs.push_back({nsm, 8192, copy, 6, 32768, 3});
  for (int copy : {1024, 4096, 8192}) cfgs.push_back({nsm, 8192, copy, 4, 32768, 1});
  for (int copy : {1024, 2048, 8192}) cfgs.push_back({nsm, 8192, copy, 6, 32768, 0});
  for (int copy : {1024, 2048, 8192}) cfgs.push_back({nsm, 8192, copy, 3, 65536, 0});
  for (int copy : {1024, 2048, 8192}) cfgs.push_back({nsm, 8192, copy, 2, 32768, 0});
  for (int copy : {1024, 2048, 8192}) cfgs.push_back({nsm, 8192, copy, 8, 16384, 0});
  for (int sms : {1, 8, 33, 66, 99})
    for (int copy : {1024, 4096}) cfgs.push_back({sms, 4096, copy, 4, 32768, 0});
  printf("| SMs | row B | copy B | ring | issue | GB/s total | GB/s per SM | us per copy per SM |\n|---|---|---|---|---|---|---|---|\n");
  for (const Cfg& c : cfgs) {
    const size_t smem = (size_t)c.stages * c.slot + 2 * c.stages * 8;
    const double t = 1e-3 * median_ms(e0, e1, 2, 6, [&] {
      stream<<<c.sms, 320, smem>>>(src, per_sm, c.row, c.copy, c.stages, c.slot, c.mode, 0, scratch, ctrs, sig_ns);
    });
    CK(cudaGetLastError());
    const double gbs = (double)per_sm * c.sms / t / 1e9, per = gbs / c.sms;
    printf("| %d | %d | %d | %d x %d KB | %s | %.0f | %.1f | %.4f |\n", c.sms, c.row, c.copy, c.stages, c.slot / 1024,
           mname[c.mode], gbs, per, (double)c.copy / (per * 1e3));
  }
  printf("\n| slot rows x cols | mode | accumulators | consumer GB/s per SM | us per slot |\n|---|---|---|---|---|\n");
  time_consume<1024, 1, 1, 0>(e0, e1, nsm, scratch);
  time_consume<1024, 1, 1, 2>(e0, e1, nsm, scratch);
  time_consume<1024, 1, 2, 3>(e0, e1, nsm, scratch);
  time_consume<1024, 1, 4, 3>(e0, e1, nsm, scratch);
  time_consume<1024, 1, 8, 3>(e0, e1, nsm, scratch);
  time_consume<1024, 1, 4, 4>(e0, e1, nsm, scratch);
  time_consume<1024, 1, 8, 4>(e0, e1, nsm, scratch);
  time_consume<512, 2, 4, 3>(e0, e1, nsm, scratch);
  time_consume<512, 2, 4, 4>(e0, e1, nsm, scratch);
  // Signal cost while the SM's loader streams (ring of S x 32 KB, 2 KB copies) and with a ring of 1 x
  // 4 KB slots (almost nothing in flight): does a release wait for the SM's in-flight bulk copies?
  printf("\n| ring | signal | ns per signal (median SM) | GB/s total |\n|---|---|---|---|\n");
  const char* sname[] = {"none", "red.release.gpu", "fence.acq_rel + red", "st.release.gpu", "red.relaxed"};
  struct Sg { int stages, slot, copy, sig; };
  std::vector<Sg> sgs;
  for (int sig : {1, 2, 3, 4}) {
    sgs.push_back({4, 32768, 2048, sig});
    sgs.push_back({2, 32768, 2048, sig});
    sgs.push_back({1, 4096, 2048, sig});
  }
  for (const Sg& g : sgs) {
    const size_t smem = (size_t)g.stages * g.slot + 2 * g.stages * 8;
    const size_t bytes = g.slot == 4096 ? (1u << 20) : per_sm;
    const float ms = median_ms(e0, e1, 0, 5, [&] {
      stream<<<nsm, 288, smem>>>(src, bytes, 8192, g.copy, g.stages, g.slot, 0, g.sig, scratch, ctrs, sig_ns);
    });
    CK(cudaGetLastError());
    std::vector<unsigned long long> ns(nsm);
    CK(cudaMemcpy(ns.data(), sig_ns, nsm * 8, cudaMemcpyDeviceToHost));
    std::sort(ns.begin(), ns.end());
    printf("| %d x %d KB | %s | %llu | %.0f |\n", g.stages, g.slot / 1024, sname[g.sig], ns[nsm / 2],
           (double)bytes * nsm / (ms * 1e-3) / 1e9);
  }
  return 0;
}
