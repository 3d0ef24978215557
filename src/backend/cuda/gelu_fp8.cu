// GELU with the FP8 cast of its output fused in (the FP8 MLP of a GPT-2 layer):
//  - forward: x = h_pre [rows, F] -> h = bf16(gelu(x)), cast to q [rows, F] = fp8(h * scale)
//    and q_t [F, rows] (= q transposed), optionally amax = max |h|;
//  - backward: x and dy = d_h [rows, F] -> d_h_pre = bf16(dy * gelu'(x)), cast the same way
//    (E5M2 under the hybrid format), optionally the amax and fc's bias gradient
//    (dbias[c] += sum over rows of d_h_pre[:, c], F32, accumulating);
//  - for current scaling, whose scale needs the amax before the cast: amax-only passes of
//    the same values (nothing written but the amax), then the cast pass above.
// Each value is computed as elementwise.cu's BF16 GELU kernels compute it (the same float
// expressions: the sigmoid form with __expf / __fdividef), rounded to BF16 as they store it,
// then scaled and cast with fp8_cvt.cuh (quantize_per_tensor's bytes): the codes of the
// unfused path exactly. The bias sums follow cast_transpose.cu's (the same tiles, a thread's
// four rows in float, the 16 row groups in double, the tile rows added in order): the same
// result as the unfused path's cast of d_h_pre with its bias gradient.
//
// Layout: contiguous BF16, F % 8 == 0, rows % 8 == 0, 16-byte aligned inputs, 8-byte aligned
// codes (the FP8 MLP's sizes, multiples of 16, always qualify; anything else is composed of
// the unfused ops by ops/activation.cpp). Tiles of 64 rows x 128 columns as in
// cast_transpose.cu: codes stored row-major and into an XOR-swizzled shared tile, then
// written transposed 8 rows x 4 columns per thread (code_tile.cuh).
//
// Bytes per element (BF16 = 2 B, FP8 = 1 B):
//   forward, delayed:  unfused gelu (2 + 2) + cast_transpose (2 + 2) = 8 B;  fused 2 + 2 = 4 B
//   forward, current:  unfused 4 + amax 2 + 4 = 10 B;  fused amax pass 2 + cast 4 = 6 B
//   backward, delayed: unfused gelu_backward (2 + 2 + 2) + cast_transpose 4 (+ bias_grad 2)
//                      = 10 (12) B;  fused 2 + 2 + 2 = 6 B (+ ~0.1 B of bias partials)
//   backward, current: unfused 6 + amax 2 + 4 (+ 2) = 12 (14) B;  fused amax 4 + cast 6 = 10 B
// Floor (H200, ~4.1 TB/s), GPT-2 124M at 16K tokens (F = 3072): forward fused cast 201 MB
// per layer (~49 us), backward 302 MB (~74 us). Measured (H200, 2026-11-30, bench_bandwidth
// gelufp8, 16384 x 4096 BF16, with amax): forward 134.0 us against 161.3 for gelu_forward then
// the cast (1.20x), backward with the bias gradient 186.1 against 202.0 (1.09x); 52-56% of copy
// by bytes moved, so the kernels themselves have room left. GPT-2 124M FP8 step: +2.1%.
#include "gelu_fp8.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "cast_transpose.h"
#include "code_tile.cuh"
#include "cuda_backend.h"
#include "cuda_check.h"
#include "fp8_cvt.cuh"
#include "vec_io.cuh"
#include "tessera/core/numeric.h"

namespace tessera::cuda {

namespace {

using fp8cvt::abs_bits;

constexpr int kThreads = 256;
constexpr int kBlocksPerSm = 2;
constexpr int kTileRows = code_tile::kRows, kTileCols = code_tile::kCols, kTileWords = code_tile::kWords;
static_assert(kThreads == code_tile::kThreads, "the transposed store maps 256 threads");
using code_tile::kUnits, code_tile::kVec, code_tile::kVecPerRow;
constexpr int kGroups = kThreads / kVecPerRow;             // row groups of a tile's column sums

constexpr float kSqrt2OverPi = 0.7978845608028654f, kCubic = 0.044715f;

// elementwise.cu's BF16 GELU and derivative, written the same way so that the compiler forms
// the same operations.
__device__ __forceinline__ float gelu_fast(float x) {
  const float inner = kSqrt2OverPi * (x + kCubic * x * x * x);
  return __fdividef(x, 1.0f + __expf(-2.0f * inner));
}

__device__ __forceinline__ float gelu_grad_fast(float x) {
  const float inner = kSqrt2OverPi * (x + kCubic * x * x * x);
  const float s = __fdividef(1.0f, 1.0f + __expf(-2.0f * inner));
  const float h = s * (1.0f - s);
  if (h == 0.0f) return s;
  return s + 2.0f * x * h * kSqrt2OverPi * (1.0f + 3.0f * kCubic * x * x);
}

using vec::round_bf16;

// The activation's eight values as the unfused kernel stores them.
template <bool kBackward>
__device__ __forceinline__ void values8(const uint4& rx, const uint4& rd, float (&out)[kVec]) {
  float x[kVec];
  vec::unpack16<bf16>(rx, x);
  if constexpr (kBackward) {
    float d[kVec];
    vec::unpack16<bf16>(rd, d);
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      float v = d[e] * gelu_grad_fast(x[e]);
      out[e] = round_bf16(v);
    }
  } else {
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      float v = gelu_fast(x[e]);
      out[e] = round_bf16(v);
    }
  }
}

template <bool kBackward, bool kE4M3, bool kAmax, bool kBias>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    gelu_cast_transpose_kernel(const uint16_t* __restrict__ x, const uint16_t* __restrict__ dy,
                               const float* __restrict__ scale, uint8_t* __restrict__ q, uint8_t* __restrict__ q_t,
                               uint32_t* amax_bits, int64_t rows, int64_t cols, int64_t tiles_across, int64_t tiles,
                               double* __restrict__ partial) {
  constexpr int kBatch = kBackward ? 2 : 4;  // vectors in flight per thread
  __shared__ uint32_t tile[kTileRows][kTileWords];
  __shared__ double colsum[kBias ? kGroups : 1][kBias ? kTileCols : 1];
  const float s = *scale;
  uint32_t m = 0;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t r0 = (t / tiles_across) * kTileRows, c0 = (t % tiles_across) * kTileCols;
    float acc[kBias ? kVec : 1];
#pragma unroll
    for (int i = 0; i < (kBias ? kVec : 1); ++i) acc[i] = 0.0f;
#pragma unroll
    for (int b0 = 0; b0 < kUnits; b0 += kBatch) {
      uint4 rx[kBatch], rd[kBatch];
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const int id = int(threadIdx.x) + (b0 + k) * kThreads, row = id / kVecPerRow, vec = id % kVecPerRow;
        const int64_t r = r0 + row, c = c0 + int64_t(vec) * kVec;
        if (r < rows && c < cols) {
          rx[k] = __ldg(reinterpret_cast<const uint4*>(x + r * cols + c));
          if constexpr (kBackward) rd[k] = __ldg(reinterpret_cast<const uint4*>(dy + r * cols + c));
          else rd[k] = rx[k];
        }
      }
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const int id = int(threadIdx.x) + (b0 + k) * kThreads, row = id / kVecPerRow, vec = id % kVecPerRow;
        const int64_t r = r0 + row, c = c0 + int64_t(vec) * kVec;
        if (r >= rows || c >= cols) continue;
        float out[kVec];
        values8<kBackward>(rx[k], rd[k], out);
        if constexpr (kAmax) {
#pragma unroll
          for (int i = 0; i < kVec; ++i) m = max(m, abs_bits(out[i]));
        }
        if constexpr (kBias) {
#pragma unroll
          for (int i = 0; i < kVec; ++i) acc[i] += out[i];
        }
        uint32_t words[2];
        fp8cvt::quantize_words<kE4M3, kVec>(out, s, words);
        *reinterpret_cast<uint2*>(q + r * cols + c) = make_uint2(words[0], words[1]);
        tile[row][code_tile::swizzle(row, vec * 2)] = words[0];
        tile[row][code_tile::swizzle(row, vec * 2 + 1)] = words[1];
      }
    }
    if constexpr (kBias) {
      // A thread's vectors share one column vector (id % kVecPerRow == threadIdx.x % kVecPerRow).
      const int group = int(threadIdx.x) / kVecPerRow, vec = int(threadIdx.x) % kVecPerRow;
#pragma unroll
      for (int i = 0; i < kVec; ++i) colsum[group][vec * kVec + i] = double(acc[i]);
    }
    __syncthreads();
    code_tile::store_transposed(tile, q_t, rows, r0, c0, cols);
    if constexpr (kBias) {
      if (threadIdx.x < kTileCols && c0 + threadIdx.x < cols) {
        double sum = colsum[0][threadIdx.x];
        for (int g = 1; g < kGroups; ++g) sum += colsum[g][threadIdx.x];
        partial[(r0 / kTileRows) * cols + c0 + threadIdx.x] = sum;
      }
    }
    __syncthreads();  // the tile (and colsum) are rewritten by the next iteration
  }
  if constexpr (kAmax) fp8cvt::block_atomic_max(m, amax_bits);
}

// amax of the values above, nothing else written: grid-stride over 8-element vectors.
template <bool kBackward>
__global__ void __launch_bounds__(kThreads)
    gelu_amax_kernel(const uint16_t* __restrict__ x, const uint16_t* __restrict__ dy, uint32_t* amax_bits,
                     int64_t units) {
  uint32_t m = 0;
  for (int64_t u = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; u < units; u += int64_t(gridDim.x) * blockDim.x) {
    const uint4 rx = __ldg(reinterpret_cast<const uint4*>(x + u * kVec));
    const uint4 rd = kBackward ? __ldg(reinterpret_cast<const uint4*>(dy + u * kVec)) : rx;
    float out[kVec];
    values8<kBackward>(rx, rd, out);
#pragma unroll
    for (int i = 0; i < kVec; ++i) m = max(m, abs_bits(out[i]));
  }
  fp8cvt::block_atomic_max(m, amax_bits);
}

bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool bf16_rows(const Tensor& x, const Tensor* dy) {
  if (x.dtype() != DType::BF16 || x.dim() != 2 || !x.is_contiguous() || x.size(1) % kVec != 0) return false;
  if (!aligned(x.raw_data(), 16)) return false;
  if (dy && (dy->dtype() != DType::BF16 || !dy->is_contiguous() || dy->shape() != x.shape() ||
             !aligned(dy->raw_data(), 16)))
    return false;
  return true;
}

template <bool kBackward>
void launch_cast_transpose(void* stream, const Tensor& x, const Tensor* dy, const Tensor& scale, Tensor& q,
                           Tensor& q_t, Tensor& amax_out, Tensor* dbias) {
  auto s = static_cast<cudaStream_t>(stream);
  const int64_t rows = x.size(0), cols = x.size(1);
  uint32_t* amax_bits = amax_out.defined() ? amax_out.data<uint32_t>() : nullptr;
  if (amax_bits) TESSERA_CUDA_CHECK(cudaMemsetAsync(amax_bits, 0, sizeof(uint32_t), s));
  if (rows == 0 || cols == 0) return;
  const bool bias = kBackward && dbias != nullptr && dbias->defined();
  const int64_t chunks = ceil_div(rows, kTileRows);
  const int64_t across = ceil_div(cols, kTileCols), tiles = chunks * across;
  const int64_t wave = int64_t(multiprocessor_count(x.device().index)) * kBlocksPerSm;
  const unsigned grid = unsigned(std::min(tiles, wave));
  Tensor partial = bias ? Tensor::empty({chunks, cols}, DType::F64, x.device()) : Tensor();
  double* partial_ptr = bias ? partial.data<double>() : nullptr;
  const auto* xp = static_cast<const uint16_t*>(x.raw_data());
  const auto* dyp = dy ? static_cast<const uint16_t*>(dy->raw_data()) : nullptr;
  auto go = [&](auto e4m3_tag, auto amax_tag, auto bias_tag) {
    gelu_cast_transpose_kernel<kBackward, decltype(e4m3_tag)::value, decltype(amax_tag)::value,
                               decltype(bias_tag)::value>
        <<<grid, kThreads, 0, s>>>(xp, dyp, scale.data<float>(), q.data<uint8_t>(), q_t.data<uint8_t>(), amax_bits,
                                   rows, cols, across, tiles, partial_ptr);
  };
  auto with_bias = [&](auto e4m3_tag, auto amax_tag) {
    if constexpr (kBackward) {
      if (bias) {
        go(e4m3_tag, amax_tag, std::true_type{});
        return;
      }
    }
    go(e4m3_tag, amax_tag, std::false_type{});
  };
  if (q.dtype() == DType::E4M3) {
    if (amax_bits) with_bias(std::true_type{}, std::true_type{});
    else with_bias(std::true_type{}, std::false_type{});
  } else {
    if (amax_bits) with_bias(std::false_type{}, std::true_type{});
    else with_bias(std::false_type{}, std::false_type{});
  }
  TESSERA_CUDA_CHECK_LAUNCH();
  if (bias) add_column_partials(s, partial_ptr, chunks, cols, dbias->data<float>(), "gelu_backward_cast_transpose");
}

template <bool kBackward>
void launch_amax(void* stream, const Tensor& x, const Tensor* dy, Tensor& amax_out) {
  auto s = static_cast<cudaStream_t>(stream);
  uint32_t* amax_bits = amax_out.data<uint32_t>();
  TESSERA_CUDA_CHECK(cudaMemsetAsync(amax_bits, 0, sizeof(uint32_t), s));
  const int64_t units = x.numel() / kVec;  // F % 8 == 0: whole vectors
  if (units == 0) return;
  const int64_t blocks = std::min(ceil_div(units, kThreads), int64_t(multiprocessor_count(x.device().index)) * 8);
  gelu_amax_kernel<kBackward><<<unsigned(blocks), kThreads, 0, s>>>(
      static_cast<const uint16_t*>(x.raw_data()), dy ? static_cast<const uint16_t*>(dy->raw_data()) : nullptr,
      amax_bits, units);
  TESSERA_CUDA_CHECK_LAUNCH();
}

}  // namespace

bool gelu_cast_transpose_supported(const Tensor& x, const Tensor* dy, const Tensor& q, const Tensor& q_t) {
  return bf16_rows(x, dy) && x.size(0) % 8 == 0 && q.is_contiguous() && q_t.is_contiguous() &&
         aligned(q.raw_data(), 8) && aligned(q_t.raw_data(), 8) &&
         (q.dtype() == DType::E4M3 || q.dtype() == DType::E5M2) && q_t.dtype() == q.dtype();
}

bool gelu_amax_supported(const Tensor& x, const Tensor* dy, const Tensor& amax_out) {
  return bf16_rows(x, dy) && amax_out.dtype() == DType::F32 && amax_out.is_contiguous();
}

void gelu_forward_cast_transpose(void* stream, const Tensor& x, const Tensor& scale, Tensor& q, Tensor& q_t,
                                 Tensor& amax_out) {
  launch_cast_transpose<false>(stream, x, nullptr, scale, q, q_t, amax_out, nullptr);
}

void gelu_backward_cast_transpose(void* stream, const Tensor& x, const Tensor& dy, const Tensor& scale, Tensor& q,
                                  Tensor& q_t, Tensor& amax_out, Tensor* dbias) {
  launch_cast_transpose<true>(stream, x, &dy, scale, q, q_t, amax_out, dbias);
}

void gelu_forward_amax(void* stream, const Tensor& x, Tensor& amax_out) {
  launch_amax<false>(stream, x, nullptr, amax_out);
}

void gelu_backward_amax(void* stream, const Tensor& x, const Tensor& dy, Tensor& amax_out) {
  launch_amax<true>(stream, x, &dy, amax_out);
}

}  // namespace tessera::cuda
