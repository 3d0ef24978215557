// Device helpers of the fused FP8 casts (cast_transpose.cu, norm_fp8.cu): values times a
// per-tensor scale to FP8 codes with exactly the bytes of the CPU reference
// (backend/cpu/quantize.cpp), and the amax statistic combined over a thread block. The
// rules are quantize.cu's (which keeps its own copies, tuned with its kernels):
//  - the hardware conversion (cvt.rn.satfinite, two values per instruction) rounds to
//    nearest even and saturates exactly as the reference for every non-NaN product; it
//    writes an unsigned NaN, so a group holding a NaN product is encoded again element by
//    element with the x86 NaN rules (mul_x86_nan, encode_*_bits);
//  - amax is the unsigned max of |v|'s bits with every NaN mapped to 0x7fc00000 (above
//    +Inf): order-free, so the atomics that combine blocks stay deterministic, and its float
//    is the reference's amax, NaN included.
// CUDA-only (included by .cu files).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "quantize.h"

namespace tessera::cuda::fp8cvt {

constexpr uint32_t kNanBits = 0x7fc00000u;

__device__ __forceinline__ uint32_t abs_bits(float v) {
  const uint32_t a = __float_as_uint(v) & 0x7fffffffu;
  return a > 0x7f800000u ? kNanBits : a;
}

// The reference's code for v * s (any v, NaN included): the slow, exact path.
template <bool kE4M3>
__device__ __forceinline__ uint8_t encode_scaled(float v, float s) {
  const float p = mul_x86_nan(v, s);
  return kE4M3 ? encode_e4m3_bits(p) : encode_e5m2_bits(p);
}

// Codes of lo and hi (already scaled), lo in the low byte.
template <bool kE4M3>
__device__ __forceinline__ uint32_t cvt_pair(float lo, float hi) {
  uint16_t pair;
  if constexpr (kE4M3) asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(hi), "f"(lo));
  else asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(hi), "f"(lo));
  return pair;
}

// The codes of v[0..N) * s packed four to a 32-bit word, element 0 in the low byte of
// words[0] (little-endian memory order). N is a multiple of 4.
template <bool kE4M3, int N>
__device__ __forceinline__ void quantize_words(const float* v, float s, uint32_t* words) {
  static_assert(N % 4 == 0, "whole words of four codes");
  bool nan = false;
#pragma unroll
  for (int i = 0; i < N; i += 2) {
    const float lo = v[i] * s, hi = v[i + 1] * s;
    nan |= (lo != lo) | (hi != hi);
    const uint32_t pair = cvt_pair<kE4M3>(lo, hi);
    if (i % 4 == 0) words[i / 4] = pair;
    else words[i / 4] |= pair << 16;
  }
  if (nan) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int shift = 8 * (i % 4);
      words[i / 4] = (words[i / 4] & ~(0xffu << shift)) | (uint32_t(encode_scaled<kE4M3>(v[i], s)) << shift);
    }
  }
}

// Folds every thread's v into *target (zeroed beforehand) with one atomic per block. Every
// thread of the block calls it, once per kernel (the shared buffer is not reused); the block
// is whole warps (its size a multiple of 32), in any 1-, 2- or 3-D shape.
__device__ __forceinline__ void block_atomic_max(uint32_t v, uint32_t* target) {
  __shared__ uint32_t partial[32];
  const unsigned t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const unsigned warps = (blockDim.x * blockDim.y * blockDim.z) / 32;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v = max(v, __shfl_xor_sync(0xffffffffu, v, offset));
  if ((t & 31u) == 0) partial[t >> 5] = v;
  __syncthreads();
  if (t < 32) {
    v = t < warps ? partial[t] : 0u;
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) v = max(v, __shfl_xor_sync(0xffffffffu, v, offset));
    if (t == 0 && v != 0u) atomicMax(target, v);
  }
}

}  // namespace tessera::cuda::fp8cvt
