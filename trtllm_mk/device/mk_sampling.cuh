// Token sampling on the device: the function trtllm_mk/sampling.py defines, computed in the step
// (LMHEAD perturbs its logits, ARGMAX picks the token), so a sampled step costs no extra launch and
// no host round trip. Per batch row, a SamplingSlot (generated from trtllm_mk/seam.py) selects:
//   temperature 0              greedy: the first argmax of the logits (bit for bit the unsampled path)
//   temperature > 0, no filter the first argmax of z + g over the vocabulary, z = l / T, g Gumbel noise
//                              from a 32-bit hash of (seed, position, index): LMHEAD tiles do it
//   top_k / top_p              the candidate set (the CANDIDATES largest logits, logit descending, index
//                              ascending) is selected by ARGMAX (radix select over the row's logits),
//                              cut by top-k then top-p, and the token is the first argmax of z + g there
//   logprobs > 0               the chosen token's log-probability at temperature 1 (from the tiles'
//                              log-sum-exp partials), and logprobs - 1 top candidates with theirs
#pragma once
#include "mk_params.cuh"

namespace mk {

// CANDIDATES and MAX_TOP_LOGPROBS are generated with SamplingSlot (trtllm_mk/seam.py).
constexpr int LSE_WORDS = 4;          // per LM-head tile and row: (max, sum) of l and of l / T

__device__ __forceinline__ uint32_t fmix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  x ^= x >> 16;
  return x;
}

// Once per row and step: the key of (seed, n), n the position of the token being chosen.
__device__ __forceinline__ uint32_t gumbel_row_key(const SamplingSlot& s, int n) {
  return fmix32(fmix32(fmix32(s.seed_lo ^ 0x9E3779B9u) ^ s.seed_hi) ^ (uint32_t)n);
}

// Gumbel(0, 1) noise of vocabulary index i: u = ((h >> 9) + 0.5) * 2^-23 is exact in fp32.
__device__ __forceinline__ float gumbel(uint32_t row_key, uint32_t i) {
  const uint32_t h = fmix32(fmix32(row_key ^ i) + 0x632BE5ABu);
  const float u = ((float)(h >> 9) + 0.5f) * 1.1920928955078125e-07f;
  return -logf(-logf(u));
}

__device__ __forceinline__ bool samples(const SamplingSlot& s) { return s.temperature > 0.f; }
__device__ __forceinline__ bool filters(const SamplingSlot& s) {
  return samples(s) && (s.top_k > 0 || (s.top_p > 0.f && s.top_p < 1.f));
}
// top_p without top_k normalizes over the whole vocabulary: the tiles' (max, sum) of z
__device__ __forceinline__ bool needs_lse_z(const SamplingSlot& s) {
  return filters(s) && s.top_k == 0 && s.top_p > 0.f && s.top_p < 1.f;
}
__device__ __forceinline__ bool needs_lse(const SamplingSlot& s) { return s.logprobs > 0; }
// rows that need the sorted candidate set (ARGMAX's radix select)
__device__ __forceinline__ int candidates_needed(const SamplingSlot& s) {
  if (filters(s)) return CANDIDATES;
  return s.logprobs > 1 ? s.logprobs - 1 : 0;
}

// Online (max, sum of exp(v - max)); -inf and NaN add nothing.
__device__ __forceinline__ void lse_add(float& m, float& sum, float v) {
  if (!(v > -INFINITY)) return;
  if (v > m) {
    sum = sum * __expf(m - v) + 1.f;
    m = v;
  } else {
    sum += __expf(v - m);
  }
}

__device__ __forceinline__ void lse_merge(float& m, float& sum, float m2, float s2) {
  if (m2 == -INFINITY) return;
  if (m == -INFINITY) { m = m2; sum = s2; return; }
  const float M = fmaxf(m, m2);
  sum = sum * __expf(m - M) + s2 * __expf(m2 - M);
  m = M;
}

// Order-preserving 32-bit key of a float (NaN counts as -inf); with the complemented index below it,
// a 64-bit key whose descending order is (logit descending, index ascending): unique per entry.
__device__ __forceinline__ uint64_t candidate_key(float v, uint32_t i) {
  if (v != v) v = -INFINITY;
  uint32_t u = __float_as_uint(v);
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return ((uint64_t)u << 32) | (uint64_t)(0xFFFFFFFFu - i);
}
__device__ __forceinline__ uint32_t candidate_index(uint64_t key) { return 0xFFFFFFFFu - (uint32_t)key; }
// The cand_hist bin of a logit: its key's top 12 bits.
__device__ __forceinline__ uint32_t candidate_bin(float v) { return (uint32_t)(candidate_key(v, 0) >> 52); }

}  // namespace mk
