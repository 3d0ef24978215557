// Helpers shared by the MoE kernels (moe_router.cu, moe_permute.cu, moe_swiglu.cu):
// F32/BF16 loads and stores with a runtime dtype flag, and block reductions in a fixed order
// (so results do not change from run to run).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "tessera/core/tensor.h"

namespace tessera::cuda::moe_detail {

// A pointer to F32 or BF16 data; the flag is uniform across a launch.
struct AnyPtr {
  void* p = nullptr;
  bool bf16 = false;
  __device__ __forceinline__ float load(int64_t i) const {
    return bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]) : static_cast<const float*>(p)[i];
  }
  __device__ __forceinline__ void store(int64_t i, float v) const {
    if (bf16) static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16(v);
    else static_cast<float*>(p)[i] = v;
  }
  __device__ __forceinline__ bool defined() const { return p != nullptr; }
};

inline AnyPtr any_ptr(const Tensor& t) {
  if (!t.defined()) return {};
  return {t.raw_data(), t.dtype() == DType::BF16};
}

inline bool f32_or_bf16(const Tensor& t) { return t.dtype() == DType::F32 || t.dtype() == DType::BF16; }

// Element i of F32 or BF16 data as float, and v stored rounded to the element type.
template <typename T>
__device__ __forceinline__ float ld(const T* p, int64_t i);
template <>
__device__ __forceinline__ float ld<float>(const float* p, int64_t i) {
  return p[i];
}
template <>
__device__ __forceinline__ float ld<__nv_bfloat16>(const __nv_bfloat16* p, int64_t i) {
  return __bfloat162float(p[i]);
}
__device__ __forceinline__ void st(float* p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void st(__nv_bfloat16* p, int64_t i, float v) { p[i] = __float2bfloat16(v); }

// Calls fn(float{}) or fn(__nv_bfloat16{}) by the dtype of t.
template <typename Fn>
void by_dtype(const Tensor& t, Fn&& fn) {
  if (t.dtype() == DType::BF16) fn(__nv_bfloat16{});
  else fn(float{});
}

// Block-wide sum / max of one value per thread (blockDim.x a multiple of 32, at most 1024).
// The tree has a fixed shape, so the result depends on the inputs only.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  __syncthreads();
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  float total = 0;
  for (int w = 0; w < warps; ++w) total += partial[w];
  return total;
}

__device__ __forceinline__ float block_max(float v) {
  __shared__ float partial[32];
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  __syncthreads();
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  float m = partial[0];
  for (int w = 1; w < warps; ++w) m = fmaxf(m, partial[w]);
  return m;
}

// (value, index) with the larger value, ties to the lower index; index -1 is "none".
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
  if (i < 0) return false;
  if (bi < 0) return true;
  return v > bv || (v == bv && i < bi);
}

__device__ __forceinline__ int block_argmax(float v, int i) {
  __shared__ float pv[32];
  __shared__ int pi[32];
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (better(ov, oi, v, i)) {
      v = ov;
      i = oi;
    }
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  __syncthreads();
  if (lane == 0) {
    pv[warp] = v;
    pi[warp] = i;
  }
  __syncthreads();
  float bv = pv[0];
  int bi = pi[0];
  for (int w = 1; w < warps; ++w)
    if (better(pv[w], pi[w], bv, bi)) {
      bv = pv[w];
      bi = pi[w];
    }
  return bi;
}

}  // namespace tessera::cuda::moe_detail
