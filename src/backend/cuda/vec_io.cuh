// Device-side helpers shared by the embedding, loss, optimizer, reduction, transpose and
// FP8 cast kernels: F32/BF16 element access in float, 16-byte words unpacked to floats, and
// 8-element vectors moved as 16-byte loads and stores (two for F32, one for BF16).
// CUDA-only (included by .cu files).
//
// Eight elements is the one vector width for both storage types, so a kernel with mixed
// operands (BF16 in, F32 out) still moves every operand in whole 16-byte transactions;
// the precondition is that each operand's pointer is 16-byte aligned at the vector start.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "tessera/core/dtype.h"
#include "tessera/core/error.h"
#include "tessera/core/numeric.h"

namespace tessera::cuda::vec {

constexpr int kWidth = 8;  // elements per vector

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(bf16 v) { return v.to_float(); }
template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ bf16 from_float<bf16>(float v) {
  return bf16::from_float(v);
}

template <typename T>
__device__ __forceinline__ float load(const T* p, int64_t i) {
  return to_float(p[i]);
}
template <typename T>
__device__ __forceinline__ void store(T* p, int64_t i, float v) {
  p[i] = from_float<T>(v);
}

__host__ __device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// A 16-byte word as floats, element 0 first (little endian: element 2k of BF16 is the low
// half of word k): 4 F32 values (T = float) or 8 BF16 ones (T = bf16, or uint16_t for a
// kernel that keeps BF16 as its bits).
template <typename T>
__device__ __forceinline__ void unpack16(const uint4& raw, float* f) {
  static_assert(std::is_same_v<T, float> || sizeof(T) == 2, "F32 or BF16 (as bf16 or its uint16_t bits)");
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
  if constexpr (std::is_same_v<T, float>) {
#pragma unroll
    for (int k = 0; k < 4; ++k) f[k] = __uint_as_float(w[k]);
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      f[2 * k] = __uint_as_float(w[k] << 16);
      f[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
    }
  }
}

// One element of a kernel that keeps BF16 as its bits (T = uint16_t) or F32 (T = float).
template <typename T>
__device__ __forceinline__ float bits_to_float(T v) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, uint16_t>, "F32 or BF16 bits");
  if constexpr (std::is_same_v<T, float>) return v;
  else return __uint_as_float(uint32_t(v) << 16);
}

// v rounded to BF16 (nearest even, NaN kept) and back: the value a BF16 store keeps.
__device__ __forceinline__ float round_bf16(float v) { return bits_float(uint32_t(float_to_bf16_bits(v)) << 16); }

// v[0..7] = p[0..7]; p 16-byte aligned.
__device__ __forceinline__ void load8(const float* p, float (&v)[kWidth]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
__device__ __forceinline__ void load8(const bf16* p, float (&v)[kWidth]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);  // one 16-byte load, then unpacked
  unpack16<bf16>(raw, v);
}

// p[0..7] = v[0..7] rounded to T; p 16-byte aligned.
__device__ __forceinline__ void store8(float* p, const float (&v)[kWidth]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}
__device__ __forceinline__ void store8(bf16* p, const float (&v)[kWidth]) {
  uint32_t w[4];
  floats_to_bf16_pairs<kWidth>(v, w);
  *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
}

// An 8-element vector kept as loaded (16 bytes of BF16 in 4 registers, 32 bytes of F32 in
// 8): a kernel that holds a row in registers and unpacks it on each pass keeps BF16 rows in
// half the registers, so more rows stay in flight per SM.
template <typename T>
struct Packed8;
template <>
struct Packed8<float> {
  float4 a, b;
};
template <>
struct Packed8<bf16> {
  uint4 w;
};

__device__ __forceinline__ void load_packed(const float* p, Packed8<float>& r) {
  r.a = reinterpret_cast<const float4*>(p)[0];
  r.b = reinterpret_cast<const float4*>(p)[1];
}
__device__ __forceinline__ void load_packed(const bf16* p, Packed8<bf16>& r) { r.w = *reinterpret_cast<const uint4*>(p); }

__device__ __forceinline__ void unpack(const Packed8<float>& r, float (&v)[kWidth]) {
  v[0] = r.a.x, v[1] = r.a.y, v[2] = r.a.z, v[3] = r.a.w, v[4] = r.b.x, v[5] = r.b.y, v[6] = r.b.z, v[7] = r.b.w;
}
__device__ __forceinline__ void unpack(const Packed8<bf16>& r, float (&v)[kWidth]) { unpack16<bf16>(r.w, v); }

// All eight elements -inf (padding that adds exp(-inf) = 0 to a sum and nothing to a max).
__device__ __forceinline__ void fill_neg_inf(Packed8<float>& r) {
  r.a = r.b = make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
}
__device__ __forceinline__ void fill_neg_inf(Packed8<bf16>& r) {
  r.w = make_uint4(0xff80ff80u, 0xff80ff80u, 0xff80ff80u, 0xff80ff80u);
}

// max that returns NaN when either operand is NaN (fmaxf drops NaN): one instruction on sm_80+.
__device__ __forceinline__ float max_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// Elements to skip from p before it is 16-byte aligned (p is aligned to its element size).
template <typename T>
__device__ __forceinline__ int64_t misalignment_head(const T* p) {
  const uintptr_t off = reinterpret_cast<uintptr_t>(p) & 15u;
  return off == 0 ? 0 : static_cast<int64_t>((16u - off) / sizeof(T));
}

// Grid-stride range of the whole grid, one thread per element.
#define TESSERA_VEC_GRID_STRIDE(i, n) \
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < (n); i += int64_t(gridDim.x) * blockDim.x)

// Runs fn with a typed null pointer for an F32 (float) or BF16 (bf16) tensor dtype.
template <typename Fn>
void dispatch(DType t, const char* op, Fn&& fn) {
  if (t == DType::F32) fn(static_cast<float*>(nullptr));
  else if (t == DType::BF16) fn(static_cast<bf16*>(nullptr));
  else TESSERA_FAIL(op, " on CUDA: dtype ", dtype_name(t), " has no kernel (F32, BF16)");
}

inline bool is_f32_or_bf16(DType t) { return t == DType::F32 || t == DType::BF16; }

// Blocks for n elements at `per_block` elements each, at least 1, capped for grid-stride loops.
inline unsigned blocks_for(int64_t n, int64_t per_block, int64_t cap = 65535) {
  int64_t b = (n + per_block - 1) / per_block;
  if (b < 1) b = 1;
  if (b > cap) b = cap;
  return static_cast<unsigned>(b);
}

}  // namespace tessera::cuda::vec
