"""Micro-benchmark generator: how much straight-line code an SM runs from its instruction caches.

The megakernel's task kinds are separate device functions of 16-37 KB of SASS each (a decoder layer's
five run 106-133 KB), and the chain kinds run once a layer on each SM: if a layer's code did not fit the
SM's instruction cache, each task would start by fetching its code from L2. This writes icache.cu:
kernels of 4..256 KB of straight-line code (a volatile shared-memory load and an add per 32 bytes, which
ptxas cannot fold), each run 200 times by 1 or 8 warps of one CTA per SM; it prints the time of a pass
per KB of code. Where the code stops fitting, the time per KB steps up. Results and what they decided:
benchmarks/NOTES.md (v45).

    python benchmarks/micro/icache.py /tmp/icache.cu && nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/icache /tmp/icache.cu && /tmp/icache
"""
import sys
SIZES_KB = [4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 144, 160, 192, 256]
out = ['#include <cstdio>', '#include <cstdint>', '#include <vector>', '#include <algorithm>',
       '__device__ __forceinline__ uint64_t gt() { uint64_t t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }']
# one "unit" = LDS.volatile + IADD = 2 SASS instructions = 32 bytes
for kb in SIZES_KB:
    units = kb * 1024 // 32
    out.append(f'__global__ void __launch_bounds__(320) k{kb}(uint32_t* res, uint64_t* t, int iters) {{')
    out.append('  __shared__ uint32_t s[96]; if (threadIdx.x < 96) s[threadIdx.x] = threadIdx.x; __syncthreads();')
    out.append('  uint32_t a = threadIdx.x, v; const uint32_t p = (uint32_t)__cvta_generic_to_shared(&s[threadIdx.x % 64]);')
    out.append('  uint64_t t0 = gt();')
    out.append('  for (int it = 0; it < iters; ++it) {')
    out.append('    asm volatile(')
    for u in range(units):
        out.append(f'      "ld.volatile.shared.u32 %1, [%2+{(u % 16) * 4}]; add.u32 %0, %0, %1;\\n"')
    out.append('      : "+r"(a), "=r"(v) : "r"(p) : "memory");')
    out.append('  }')
    out.append('  uint64_t t1 = gt();')
    out.append('  res[blockIdx.x * blockDim.x + threadIdx.x] = a;')
    out.append('  if (threadIdx.x == 0) t[blockIdx.x] = t1 - t0;')
    out.append('}')
out.append('int main() {')
out.append('  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);')
out.append('  uint32_t* res; uint64_t* t; cudaMalloc(&res, sms * 320 * 4); cudaMalloc(&t, sms * 8);')
out.append('  std::vector<uint64_t> h(sms); const int iters = 200;')
for kb in SIZES_KB:
    out.append('  for (int warps : {1, 8}) {')
    out.append(f'    k{kb}<<<sms, warps * 32>>>(res, t, 2); cudaDeviceSynchronize();')
    out.append('    std::vector<double> med;')
    out.append('    for (int r = 0; r < 5; ++r) {')
    out.append(f'      k{kb}<<<sms, warps * 32>>>(res, t, iters); cudaMemcpy(h.data(), t, sms * 8, cudaMemcpyDeviceToHost);')
    out.append('      std::sort(h.begin(), h.end()); med.push_back(h[sms / 2] / (double)iters); }')
    out.append('    std::sort(med.begin(), med.end());')
    out.append(f'    printf("%4d KB code, %d warps: %9.1f ns a pass, %6.2f ns a KB, %s\\n", {kb}, warps, med[2], med[2] / {kb}, cudaGetErrorString(cudaGetLastError()));')
    out.append('  }')
out.append('  return 0; }')
open(sys.argv[1] if len(sys.argv) > 1 else 'icache.cu', 'w').write('\n'.join(out) + '\n')
