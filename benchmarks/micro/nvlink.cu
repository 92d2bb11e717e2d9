// The cross-GPU primitives of the tensor-parallel kernel, between the GPUs of one host (one process,
// CUDA peer access), for the link constants of the cost model (benchmarks/calibrate.py --from-links):
//   sync        the cross-rank event: fence.acq_rel.sys, a relaxed system-scope add on every rank's
//               counter, an acquire poll until every rank's add arrived (a barrier round = one sync);
//   one_shot    all-reduce of S bytes of fp32 per rank: every rank stores its partial into every rank's
//               buffer, one sync, each rank adds the partials in rank order (all SMs);
//   two_shot    reduce-scatter (slice r of every partial to rank r), sync, rank r adds its slice and
//               stores it into every rank, sync (all SMs);
//   remote_add  the OPROJ / DOWN epilogue: fixed-point 64-bit adds (red.add) into every rank's
//               buffer, then the task's fence.acq_rel.sys, issued by one SM (what one task pays) and by
//               all SMs (the links' rate).
// Every variant is checked against the host's sum before it is timed. Timing: CUDA events on rank 0
// around `rounds` back-to-back rounds inside one launch per GPU (every GPU's kernel spins on the
// others', so all run concurrently), median of repeats.
// Build and run: nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/nvlink benchmarks/micro/nvlink.cu
//                /tmp/nvlink [--gpus N] [--json FILE]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#define CK(x)                                                                                   \
  do {                                                                                          \
    cudaError_t e_ = (x);                                                                       \
    if (e_ != cudaSuccess) {                                                                    \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));        \
      exit(1);                                                                                  \
    }                                                                                           \
  } while (0)

constexpr int MAXR = 8;
constexpr int THREADS = 512;
constexpr unsigned long long SPIN_LIMIT_NS = 2000000000ull;   // a rank that never arrives: give up

struct Peers {                  // the same allocation on every rank, indexed by rank
  unsigned* ctr[MAXR];          // one monotonic counter per rank
  float* recv[MAXR];            // [2 parities][tp][n] partials received
  float* out[MAXR];             // [n] reduced result
  unsigned long long* acc[MAXR];  // [n] fixed-point accumulators of the remote adds
  int* err[MAXR];               // set when a wait timed out
};

__device__ __forceinline__ unsigned long long gt() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void fence_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
__device__ __forceinline__ void add_relaxed_sys(unsigned* p) {
  asm volatile("red.relaxed.sys.global.add.u32 [%0], 1;" ::"l"(p) : "memory");
}
__device__ __forceinline__ unsigned ld_acquire_sys(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// One thread per CTA, after a CTA barrier: publish this CTA's stores to every rank, then wait until
// every CTA of every rank has published `target` times (the kernel's cross-rank event, signal + wait).
__device__ void cross_barrier(const Peers& P, int rank, int tp, unsigned target) {
  __syncthreads();
  if (threadIdx.x == 0) {
    fence_sys();
    for (int k = 0; k < tp; ++k) add_relaxed_sys(P.ctr[k]);
    const unsigned long long t0 = gt();
    while ((int)(ld_acquire_sys(P.ctr[rank]) - target) < 0) {
      if (gt() - t0 > SPIN_LIMIT_NS) { *P.err[rank] = 1; break; }
    }
  }
  __syncthreads();
}

__global__ void k_sync(Peers P, int rank, int tp, int rounds, unsigned base) {
  for (int r = 1; r <= rounds; ++r) cross_barrier(P, rank, tp, base + (unsigned)(r * tp * gridDim.x));
}

// The same barrier between the CTAs of one GPU: with the cross-rank operations (SYS: system-scope fence,
// add and poll) or with a local event's (red.release.gpu, ld.acquire.gpu). Against the cross-GPU round
// this isolates what the link adds to an event.
template <bool SYS>
__global__ void k_sync_local(unsigned* ctr, int* err, int rounds) {
  for (int r = 1; r <= rounds; ++r) {
    if (threadIdx.x == 0) {
      if (SYS) { fence_sys(); add_relaxed_sys(ctr); }
      else asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(ctr) : "memory");
      const unsigned target = (unsigned)(r * gridDim.x);
      const unsigned long long t0 = gt();
      while (true) {
        unsigned v;
        if (SYS) v = ld_acquire_sys(ctr);
        else asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(ctr) : "memory");
        if ((int)(v - target) >= 0) break;
        if (gt() - t0 > SPIN_LIMIT_NS) { *err = 1; break; }
      }
    }
    __syncthreads();
  }
}

// Rank `rank`'s partial at element i; the host's check sums the same values.
__host__ __device__ __forceinline__ float partial_value(int rank, size_t i) {
  return (float)((i * 2654435761u + 97u * (unsigned)rank) % 1021u) * (1.0f / 1024.0f) - 0.5f;
}

__global__ void k_one_shot(Peers P, int rank, int tp, size_t n, int rounds, unsigned base) {
  const size_t n4 = n / 4, stride = (size_t)gridDim.x * blockDim.x;
  unsigned cnt = base;
  for (int r = 1; r <= rounds; ++r) {
    const int par = r & 1;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n4; i += stride) {
      float4 v;
      v.x = partial_value(rank, 4 * i); v.y = partial_value(rank, 4 * i + 1);
      v.z = partial_value(rank, 4 * i + 2); v.w = partial_value(rank, 4 * i + 3);
      for (int k = 0; k < tp; ++k)
        reinterpret_cast<float4*>(P.recv[k] + ((size_t)par * tp + rank) * n)[i] = v;
    }
    cnt += tp * gridDim.x;
    cross_barrier(P, rank, tp, cnt);
    const float* mine = P.recv[rank] + (size_t)par * tp * n;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n4; i += stride) {
      float4 s = __ldcg(reinterpret_cast<const float4*>(mine) + i);
      for (int k = 1; k < tp; ++k) {
        const float4 v = __ldcg(reinterpret_cast<const float4*>(mine + (size_t)k * n) + i);
        s.x += v.x; s.y += v.y; s.z += v.z; s.w += v.w;
      }
      reinterpret_cast<float4*>(P.out[rank])[i] = s;
    }
  }
}

__global__ void k_two_shot(Peers P, int rank, int tp, size_t n, int rounds, unsigned base) {
  const size_t slice = n / tp, s4 = slice / 4, stride = (size_t)gridDim.x * blockDim.x;
  unsigned cnt = base;
  for (int r = 1; r <= rounds; ++r) {
    const int par = r & 1;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n / 4; i += stride) {
      const int dst = (int)(4 * i / slice);
      float4 v;
      v.x = partial_value(rank, 4 * i); v.y = partial_value(rank, 4 * i + 1);
      v.z = partial_value(rank, 4 * i + 2); v.w = partial_value(rank, 4 * i + 3);
      reinterpret_cast<float4*>(P.recv[dst] + ((size_t)par * tp + rank) * n)[i] = v;
    }
    cnt += tp * gridDim.x;
    cross_barrier(P, rank, tp, cnt);
    const float* mine = P.recv[rank] + (size_t)par * tp * n + (size_t)rank * slice;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < s4; i += stride) {
      float4 s = __ldcg(reinterpret_cast<const float4*>(mine) + i);
      for (int k = 1; k < tp; ++k) {
        const float4 v = __ldcg(reinterpret_cast<const float4*>(mine + (size_t)k * n) + i);
        s.x += v.x; s.y += v.y; s.z += v.z; s.w += v.w;
      }
      for (int k = 0; k < tp; ++k) reinterpret_cast<float4*>(P.out[k] + (size_t)rank * slice)[i] = s;
    }
    cnt += tp * gridDim.x;
    cross_barrier(P, rank, tp, cnt);
  }
}

// The epilogue's adds, then one barrier so that every add has landed when a round ends.
__global__ void k_remote_add(Peers P, int rank, int tp, size_t n, int rounds, unsigned base) {
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  unsigned cnt = base;
  for (int r = 1; r <= rounds; ++r) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += stride) {
      const unsigned long long v = (unsigned long long)(i % 7 + 1 + rank);
      for (int k = 0; k < tp; ++k) atomicAdd(P.acc[k] + i, v);
    }
    cnt += tp * gridDim.x;
    cross_barrier(P, rank, tp, cnt);
  }
}

// HBM traffic beside a measurement (the kernel's events are waited on while the loaders stream): every
// SM streams reads until the host sets *stop (a flag in mapped host memory), or for at most 10 s.
__global__ void k_stream(const int4* buf, size_t n, const int* stop, int* sink) {
  int acc = 0;
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  const unsigned long long t0 = gt();
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;; i += stride) {
    if (i >= n) {
      i -= n;
      if (ld_acquire_sys(reinterpret_cast<const unsigned*>(stop)) || gt() - t0 > 5 * SPIN_LIMIT_NS) break;
    }
    const int4 v = __ldcs(buf + i);
    acc ^= v.x ^ v.w;
  }
  if (acc == 0x7fffffff) *sink = acc;   // keeps the loads
}

struct Rig {
  int tp, sms;
  size_t cap;          // floats per buffer
  Peers P;
  std::vector<unsigned> launched;   // barrier arrivals so far, per rank (counters are monotonic)
  std::vector<cudaStream_t> st;
  cudaEvent_t e0, e1;
};

enum Variant { SYNC, ONE_SHOT, TWO_SHOT, REMOTE_ADD };

// Arrivals one round adds to each rank's counter.
static unsigned per_round(const Rig& R, Variant v, int grid) {
  return (unsigned)(R.tp * grid * (v == TWO_SHOT ? 2 : 1));
}

static float launch(Rig& R, Variant v, size_t n, int grid, int rounds) {
  CK(cudaSetDevice(0));
  CK(cudaEventRecord(R.e0, R.st[0]));
  for (int r = 0; r < R.tp; ++r) {
    CK(cudaSetDevice(r));
    const unsigned base = R.launched[r];
    switch (v) {
      case SYNC: k_sync<<<grid, 32, 0, R.st[r]>>>(R.P, r, R.tp, rounds, base); break;
      case ONE_SHOT: k_one_shot<<<grid, THREADS, 0, R.st[r]>>>(R.P, r, R.tp, n, rounds, base); break;
      case TWO_SHOT: k_two_shot<<<grid, THREADS, 0, R.st[r]>>>(R.P, r, R.tp, n, rounds, base); break;
      case REMOTE_ADD: k_remote_add<<<grid, THREADS, 0, R.st[r]>>>(R.P, r, R.tp, n, rounds, base); break;
    }
    CK(cudaGetLastError());
    R.launched[r] += per_round(R, v, grid) * rounds;
  }
  CK(cudaSetDevice(0));
  CK(cudaEventRecord(R.e1, R.st[0]));
  for (int r = 0; r < R.tp; ++r) { CK(cudaSetDevice(r)); CK(cudaStreamSynchronize(R.st[r])); }
  for (int r = 0; r < R.tp; ++r) {
    int e = 0;
    CK(cudaMemcpy(&e, R.P.err[r], sizeof(int), cudaMemcpyDeviceToHost));
    if (e) { fprintf(stderr, "rank %d: a cross-rank wait timed out\n", r); exit(1); }
  }
  float ms = 0;
  CK(cudaSetDevice(0));
  CK(cudaEventElapsedTime(&ms, R.e0, R.e1));
  return ms;
}

// The reduced result of one round on every rank against the host's sum in rank order.
static void check_reduce(Rig& R, Variant v, size_t n) {
  for (int r = 0; r < R.tp; ++r) { CK(cudaSetDevice(r)); CK(cudaMemset(R.P.out[r], 0xff, n * 4)); }
  launch(R, v, n, R.sms, 1);
  std::vector<float> h(n);
  for (int r = 0; r < R.tp; ++r) {
    CK(cudaSetDevice(r));
    CK(cudaMemcpy(h.data(), R.P.out[r], n * 4, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n; ++i) {
      float s = partial_value(0, i);
      for (int k = 1; k < R.tp; ++k) s += partial_value(k, i);
      if (h[i] != s) {
        fprintf(stderr, "%s n=%zu: rank %d element %zu is %g, expected %g\n", v == ONE_SHOT ? "one_shot" : "two_shot",
                n, r, i, h[i], s);
        exit(1);
      }
    }
  }
}

static void check_adds(Rig& R, size_t n, int grid) {
  for (int r = 0; r < R.tp; ++r) { CK(cudaSetDevice(r)); CK(cudaMemset(R.P.acc[r], 0, n * 8)); }
  launch(R, REMOTE_ADD, n, grid, 3);
  std::vector<unsigned long long> h(n);
  for (int r = 0; r < R.tp; ++r) {
    CK(cudaSetDevice(r));
    CK(cudaMemcpy(h.data(), R.P.acc[r], n * 8, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n; ++i) {
      unsigned long long s = 0;
      for (int k = 0; k < R.tp; ++k) s += 3 * (i % 7 + 1 + k);
      if (h[i] != s) { fprintf(stderr, "remote_add: rank %d element %zu is %llu, expected %llu\n", r, i, h[i], s); exit(1); }
    }
  }
}

// Microseconds per round: median over repeats of a launch of `rounds` rounds.
static double time_us(Rig& R, Variant v, size_t n, int grid, int rounds, int repeats = 7) {
  launch(R, v, n, grid, rounds);   // warm-up
  std::vector<double> t;
  for (int i = 0; i < repeats; ++i) t.push_back(1e3 * launch(R, v, n, grid, rounds) / rounds);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IONBF, 0);   // each line as it is measured, should a later part hang
  int tp = 0;
  std::string json;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--gpus") && i + 1 < argc) tp = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--json") && i + 1 < argc) json = argv[++i];
    else { fprintf(stderr, "usage: %s [--gpus N] [--json FILE]\n", argv[0]); return 2; }
  }
  int ndev = 0;
  CK(cudaGetDeviceCount(&ndev));
  if (tp == 0) tp = ndev;
  if (tp < 2 || tp > ndev || tp > MAXR) {
    fprintf(stderr, "needs 2..%d GPUs, %d visible, %d asked for\n", MAXR, ndev, tp);
    return 2;
  }
  Rig R;
  R.tp = tp;
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  R.sms = prop.multiProcessorCount;
  R.cap = (size_t)4 << 20;           // 16 MB of fp32 per partial
  R.launched.assign(tp, 0);
  R.st.resize(tp);
  memset(&R.P, 0, sizeof(R.P));
  for (int r = 0; r < tp; ++r) {
    CK(cudaSetDevice(r));
    for (int k = 0; k < tp; ++k) {
      if (k == r) continue;
      int ok = 0;
      CK(cudaDeviceCanAccessPeer(&ok, r, k));
      if (!ok) { fprintf(stderr, "GPU %d cannot access GPU %d (no peer access)\n", r, k); return 2; }
      CK(cudaDeviceEnablePeerAccess(k, 0));
    }
    CK(cudaStreamCreateWithFlags(&R.st[r], cudaStreamNonBlocking));
    CK(cudaMalloc(&R.P.ctr[r], 256));
    CK(cudaMemset(R.P.ctr[r], 0, 256));
    CK(cudaMalloc(&R.P.recv[r], 2 * tp * R.cap * 4));
    CK(cudaMalloc(&R.P.out[r], R.cap * 4));
    CK(cudaMalloc(&R.P.acc[r], R.cap * 8));
    CK(cudaMalloc(&R.P.err[r], sizeof(int)));
    CK(cudaMemset(R.P.err[r], 0, sizeof(int)));
  }
  CK(cudaSetDevice(0));
  CK(cudaEventCreate(&R.e0));
  CK(cudaEventCreate(&R.e1));

  for (size_t n : {(size_t)4096, (size_t)65536 + 4 * tp}) {   // one size that does not split evenly by 16 B
    size_t m = n - n % (4 * tp);
    check_reduce(R, ONE_SHOT, m);
    check_reduce(R, TWO_SHOT, m);
    check_adds(R, m, 1);
    check_adds(R, m, R.sms);
  }
  printf("%d x %s, %d SMs: one-shot, two-shot and remote adds checked against the host's sums\n", tp, prop.name, R.sms);

  FILE* js = json.empty() ? nullptr : fopen(json.c_str(), "w");
  if (!json.empty() && !js) { fprintf(stderr, "cannot write %s\n", json.c_str()); return 2; }
  if (js) fprintf(js, "{\"gpu\": \"%s\", \"tp\": %d, \"sms\": %d", prop.name, tp, R.sms);

  const double s1 = time_us(R, SYNC, 0, 1, 2000), sall = time_us(R, SYNC, 0, R.sms, 500);
  printf("sync (barrier round, fence + add to every rank + acquire poll): one CTA per GPU %.2f us, %d CTAs %.2f us\n",
         s1, R.sms, sall);
  // the one-GPU rounds: tp CTAs of GPU 0, like the tp participants of the cross-GPU round
  auto local_round = [&](int sys) {
    std::vector<double> t;
    CK(cudaSetDevice(0));
    for (int i = 0; i < 8; ++i) {
      CK(cudaMemset(R.P.ctr[0], 0, 4));
      const int rounds = 2000;
      CK(cudaEventRecord(R.e0, R.st[0]));
      if (sys) k_sync_local<true><<<tp, 32, 0, R.st[0]>>>(R.P.ctr[0], R.P.err[0], rounds);
      else k_sync_local<false><<<tp, 32, 0, R.st[0]>>>(R.P.ctr[0], R.P.err[0], rounds);
      CK(cudaEventRecord(R.e1, R.st[0]));
      CK(cudaStreamSynchronize(R.st[0]));
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, R.e0, R.e1));
      if (i) t.push_back(1e3 * ms / rounds);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  };
  double local[2] = {local_round(0), local_round(1)};
  // the same rounds while every GPU's SMs stream from HBM
  std::vector<int4*> big(tp);
  std::vector<cudaStream_t> ld(tp);
  int* stop = nullptr;
  int* sink = nullptr;
  CK(cudaHostAlloc(&stop, sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable));
  const size_t n16 = (size_t)1 << 24;   // 256 MB per GPU, far beyond L2
  for (int r = 0; r < tp; ++r) {
    CK(cudaSetDevice(r));
    CK(cudaMalloc(&big[r], n16 * 16));
    CK(cudaMemset(big[r], 1, n16 * 16));
    CK(cudaStreamCreateWithFlags(&ld[r], cudaStreamNonBlocking));
    if (!sink) CK(cudaMalloc(&sink, sizeof(int)));
  }
  auto loaded = [&](auto&& measure) {
    *(volatile int*)stop = 0;
    for (int r = 0; r < tp; ++r) {
      CK(cudaSetDevice(r));
      int* dstop = nullptr;
      CK(cudaHostGetDevicePointer(&dstop, stop, 0));
      k_stream<<<R.sms, 512, 0, ld[r]>>>(big[r], n16, dstop, r == 0 ? sink : nullptr);
      CK(cudaGetLastError());
    }
    const double us = measure();
    *(volatile int*)stop = 1;
    for (int r = 0; r < tp; ++r) { CK(cudaSetDevice(r)); CK(cudaStreamSynchronize(ld[r])); }
    return us;
  };
  auto reset_counters = [&] {   // the one-GPU rounds restart GPU 0's counter: restart every rank's
    for (int r = 0; r < tp; ++r) { CK(cudaSetDevice(r)); CK(cudaMemset(R.P.ctr[r], 0, 4)); R.launched[r] = 0; }
  };
  reset_counters();
  const double s1_loaded = loaded([&] { return time_us(R, SYNC, 0, 1, 2000); });
  const double local_loaded = loaded([&] { return local_round(0); });
  printf("while every SM streams from HBM: the cross-GPU round %.2f us, the one-GPU round (local event) %.2f us\n",
         s1_loaded, local_loaded);
  int timed_out = 0;
  CK(cudaMemcpy(&timed_out, R.P.err[0], sizeof(int), cudaMemcpyDeviceToHost));
  if (timed_out) { fprintf(stderr, "the one-GPU barrier timed out\n"); return 1; }
  reset_counters();
  if (js) fprintf(js, ", \"sync_us\": %.4f, \"sync_all_sms_us\": %.4f, \"sync_one_gpu_sys_us\": %.4f, "
                  "\"sync_one_gpu_us\": %.4f, \"sync_loaded_us\": %.4f, \"sync_one_gpu_loaded_us\": %.4f",
                  s1, sall, local[1], local[0], s1_loaded, local_loaded);

  const std::vector<size_t> bytes = {4096, 16384, 65536, 262144, 1 << 20, 4 << 20, 16 << 20};
  for (Variant v : {ONE_SHOT, TWO_SHOT}) {
    const char* name = v == ONE_SHOT ? "one_shot" : "two_shot";
    printf("%s all-reduce (fp32, %d CTAs):", name, R.sms);
    if (js) fprintf(js, ", \"%s\": [", name);
    for (size_t i = 0; i < bytes.size(); ++i) {
      const size_t n = bytes[i] / 4;
      const double us = time_us(R, v, n, R.sms, n < 65536 ? 400 : 40);
      printf(" %zu B %.2f us;", bytes[i], us);
      if (js) fprintf(js, "%s[%zu, %.4f]", i ? ", " : "", bytes[i], us);
    }
    printf("\n");
    if (js) fprintf(js, "]");
  }
  for (int grid : {1, R.sms}) {
    const char* name = grid == 1 ? "remote_add_one_sm" : "remote_add_all_sms";
    printf("%s (64-bit adds into every rank, then fence + barrier):", name);
    if (js) fprintf(js, ", \"%s\": [", name);
    const std::vector<size_t> ab = grid == 1 ? std::vector<size_t>{1024, 4096, 16384, 65536, 262144}
                                             : std::vector<size_t>{16384, 65536, 262144, 1 << 20, 4 << 20, 16 << 20};
    for (size_t i = 0; i < ab.size(); ++i) {
      const size_t n = ab[i] / 8;
      const double us = time_us(R, REMOTE_ADD, n, grid, ab[i] < 262144 ? 400 : 40);
      printf(" %zu B %.2f us;", ab[i], us);
      if (js) fprintf(js, "%s[%zu, %.4f]", i ? ", " : "", ab[i], us);
    }
    printf("\n");
    if (js) fprintf(js, "]");
  }
  if (js) { fprintf(js, "}\n"); fclose(js); }
  return 0;
}
