// How fast a tagged word (value | tag << 32, the flag-in-data protocol of NCCL's LL) travels between two
// SMs on an idle GPU, per load/store flavour, and the latency of one dependent 16-byte L2 load.
// Standalone: nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/ll benchmarks/micro/ll_poll.cu && /tmp/ll
// Results: benchmarks/results/h100_v7exp_2026-11-23/ll_poll.md; the kernel experiment it served:
// benchmarks/NOTES.md ("tagged activations").
#include <cstdio>
#include <cstdint>
typedef unsigned long long u64;
__device__ __forceinline__ uint64_t gt() { uint64_t t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
template <int LD> __device__ __forceinline__ void ld2(const u64* p, u64& a, u64& b) {
  if (LD == 0) asm volatile("ld.relaxed.gpu.global.v2.b64 {%0, %1}, [%2];" : "=l"(a), "=l"(b) : "l"(p) : "memory");
  else if (LD == 1) asm volatile("ld.global.cg.v2.u64 {%0, %1}, [%2];" : "=l"(a), "=l"(b) : "l"(p) : "memory");
  else asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(a), "=l"(b) : "l"(p) : "memory");
}
template <int ST> __device__ __forceinline__ void st1(u64* p, u64 v) {
  if (ST == 0) asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
  else asm volatile("st.global.b64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}
// rounds: block 0 waits until block 1 acks round r-1 (flag), sleeps, stores 16 words with tag r and
// records the time; block 1 polls (each thread one 16-byte pair, 8 threads) and records when all seen.
template <int LD, int ST, int SLEEP>
__global__ void pingpong(u64* data, unsigned* ack, uint64_t* t, int rounds) {
  for (int r = 1; r <= rounds; ++r) {
    if (blockIdx.x == 0) {
      if (threadIdx.x == 0) { while (atomicAdd(ack, 0) < (unsigned)(r - 1)) {} }
      __syncthreads();
      uint64_t t0 = gt(); while (gt() - t0 < 2000) {}
      if (threadIdx.x < 16) st1<ST>(data + threadIdx.x, ((u64)r << 32) | threadIdx.x);
      if (threadIdx.x == 0) t[2 * r] = gt();
    } else {
      u64 a, b;
      if (threadIdx.x < 8) {
        while (true) {
          ld2<LD>(data + 2 * threadIdx.x, a, b);
          if ((a >> 32) >= (u64)r && (b >> 32) >= (u64)r) break;
          if (SLEEP) __nanosleep(SLEEP);
        }
      }
      __syncthreads();
      if (threadIdx.x == 0) { t[2 * r + 1] = gt(); atomicAdd(ack, 1u); }
    }
  }
}
// single-thread dependent load chain: latency per load
template <int LD> __global__ void chase(u64* data, uint64_t* out, int n) {
  u64 a = 0, b;
  uint64_t t0 = gt();
  for (int i = 0; i < n; ++i) { ld2<LD>(data + ((a & 1) * 2), a, b); a &= 1; }
  out[0] = gt() - t0; out[1] = a;
}
template <int LD, int ST, int SLEEP> void run(const char* name, u64* d, unsigned* ack, uint64_t* t, uint64_t* h) {
  const int R = 200;
  cudaMemset(d, 0, 4096); cudaMemset(ack, 0, 4);
  pingpong<LD, ST, SLEEP><<<2, 64>>>(d, ack, t, R);
  cudaDeviceSynchronize();
  cudaMemcpy(h, t, sizeof(uint64_t) * 2 * (R + 1), cudaMemcpyDeviceToHost);
  double v[R]; int n = 0;
  // signed: the poller may see the words before the storer has read its clock
  for (int r = 1; r <= R; ++r) v[n++] = (double)(int64_t)(h[2 * r + 1] - h[2 * r]);
  for (int i = 0; i < n; ++i) for (int j = i + 1; j < n; ++j) if (v[j] < v[i]) { double x = v[i]; v[i] = v[j]; v[j] = x; }
  printf("%-40s store->seen median %6.0f ns  p10 %6.0f  p90 %6.0f\n", name, v[n / 2], v[n / 10], v[9 * n / 10]);
}
int main() {
  u64* d; unsigned* ack; uint64_t* t; uint64_t h[1024];
  cudaMalloc(&d, 4096); cudaMalloc(&ack, 4); cudaMalloc(&t, 8192);
  run<0, 0, 32>("ld.relaxed.gpu / st.relaxed.gpu / sleep32", d, ack, t, h);
  run<0, 0, 0>("ld.relaxed.gpu / st.relaxed.gpu / spin", d, ack, t, h);
  run<1, 1, 32>("ld.cg / st weak / sleep32", d, ack, t, h);
  run<2, 1, 32>("ld.volatile / st weak / sleep32", d, ack, t, h);
  run<1, 0, 0>("ld.cg / st.relaxed / spin", d, ack, t, h);
  for (int v = 0; v < 3; ++v) {
    cudaMemset(d, 0, 4096);
    if (v == 0) chase<0><<<1, 1>>>(d, t, 1000); else if (v == 1) chase<1><<<1, 1>>>(d, t, 1000); else chase<2><<<1, 1>>>(d, t, 1000);
    cudaMemcpy(h, t, 16, cudaMemcpyDeviceToHost);
    printf("dependent 16-byte load latency, %s: %.0f ns\n", v == 0 ? "ld.relaxed.gpu" : v == 1 ? "ld.cg" : "ld.volatile", h[0] / 1000.0);
  }
  return 0;
}
