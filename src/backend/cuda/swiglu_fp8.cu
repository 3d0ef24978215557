// SwiGLU with the FP8 cast of its output fused in (the FP8 MLP of a Llama layer):
//  - forward: x = h_pre [rows, 2F] ([gate | up]) -> h = bf16(silu(gate) * up), cast to
//    q [rows, F] = fp8(h * scale) and q_t [F, rows] (= q transposed), optionally amax = max|h|;
//  - backward: x and dy = d_h [rows, F] -> d_h_pre = bf16(swiglu_backward) [rows, 2F], cast to
//    q [rows, 2F], q_t [2F, rows] (E5M2 under the hybrid format), optionally the amax;
//  - for current scaling, whose scale needs the amax before the cast: amax-only passes of
//    the same values (nothing written but the amax), then the cast pass above.
// Each value is computed as elementwise.cu's BF16 SwiGLU kernels compute it (the same float
// expressions, __expf / __fdividef), rounded to BF16 as they store it, then scaled and cast
// with fp8_cvt.cuh (quantize_per_tensor's bytes): the codes of the unfused path exactly.
//
// Layout: contiguous BF16, F % 8 == 0, rows % 8 == 0, 16-byte aligned inputs, 8-byte aligned
// codes (the FP8 MLP's sizes, multiples of 16, always qualify; anything else is composed of
// the unfused ops by ops/activation.cpp). The casting kernels use cast_transpose.cu's tiling:
// tiles of 64 rows x 128 columns of h (of the gate half in the backward, whose block then
// writes the matching tile of the up half too, so x and dy are read once), codes stored
// row-major and into an XOR-swizzled shared tile, then written transposed 8 rows x 4
// columns per thread with __byte_perm.
//
// Bytes per element e of h (N x F) in the forward and per element d of d_h_pre (N x 2F) in
// the backward (BF16 = 2 B, FP8 = 1 B; x read is 4 B per e since it is 2F wide, dy 1 B per d):
//   forward, delayed:  unfused swiglu (4 + 2) + cast_transpose (2 + 2) = 10 B/e;  fused 4 + 2 = 6 B/e
//   forward, current:  unfused swiglu 6 + amax(h) 2 + cast_transpose 4 = 12 B/e; two choices:
//                      swiglu + fused amax (6) then cast_transpose(h) (4) = 10 B/e, or an
//                      amax pass over swiglu(x) (4) then the fused cast (6) = 10 B/e. Equal
//                      bytes: the second is taken (one kernel family for both recipes, no
//                      N x F BF16 temporary; the exponentials are recomputed, memory-bound
//                      either way);
//   backward, delayed: unfused swiglu_backward (2 + 1 + 2) + cast_transpose 4 = 9 B/d;
//                      fused 2 + 1 + 2 = 5 B/d
//   backward, current: unfused 5 + amax 2 + 4 = 11 B/d; amax pass (3) + fused cast (5) = 8 B/d
//                      (against 9 for swiglu_backward with a fused amax then cast_transpose).
// Floor (H200, ~4.1 TB/s), Llama-3.2-1B step (N = 8192, F = 8192, 16 layers): forward fused
// cast 403 MB per layer (~98 us), backward 671 MB (~164 us); saved per step about 1.0 ms
// (forward) + 2.1 ms (backward) under delayed scaling, 0.5 + 1.6 ms under current scaling.
// Not measured yet.
#include "swiglu_fp8.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <type_traits>

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

// elementwise.cu's BF16 sigmoid (hardware exponential), and its SwiGLU expressions written
// the same way so that the compiler forms the same operations.
__device__ __forceinline__ float sigmoid_fast(float g) { return __fdividef(1.0f, 1.0f + __expf(-g)); }

using vec::round_bf16;

// h = silu(g) * up, rounded as swiglu_forward stores it.
__device__ __forceinline__ void swiglu8(const float (&g)[kVec], const float (&up)[kVec], float (&h)[kVec]) {
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    float out = g[e] * sigmoid_fast(g[e]) * up[e];
    h[e] = round_bf16(out);
  }
}

// (dgate, dup), rounded as swiglu_backward stores them.
__device__ __forceinline__ void swiglu_grad8(const float (&g)[kVec], const float (&up)[kVec], const float (&d)[kVec],
                                             float (&dg)[kVec], float (&du)[kVec]) {
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    const float s = sigmoid_fast(g[e]);
    float a = d[e] * up[e] * s * (1.0f + g[e] * (1.0f - s));
    float b = d[e] * g[e] * s;
    dg[e] = round_bf16(a);
    du[e] = round_bf16(b);
  }
}

// Tiles over [rows, F] (of h; of the gate half of d_h_pre). kBackward: dy given, two halves.
template <bool kBackward, bool kE4M3, bool kAmax>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    swiglu_cast_transpose_kernel(const uint16_t* __restrict__ x, const uint16_t* __restrict__ dy,
                                 const float* __restrict__ scale, uint8_t* __restrict__ q, uint8_t* __restrict__ q_t,
                                 uint32_t* amax_bits, int64_t rows, int64_t f, int64_t tiles_across, int64_t tiles) {
  constexpr int kHalves = kBackward ? 2 : 1;
  constexpr int kBatch = kBackward ? 2 : 4;  // vectors in flight per thread (3 or 2 loads each)
  __shared__ uint32_t tile[kHalves][kTileRows][kTileWords];
  const float s = *scale;
  const int64_t q_cols = kHalves * f;  // row length of q
  uint32_t m = 0;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t r0 = (t / tiles_across) * kTileRows, c0 = (t % tiles_across) * kTileCols;
#pragma unroll
    for (int b0 = 0; b0 < kUnits; b0 += kBatch) {
      uint4 rg[kBatch], ru[kBatch], rd[kBatch];
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const int id = int(threadIdx.x) + (b0 + k) * kThreads, row = id / kVecPerRow, vec = id % kVecPerRow;
        const int64_t r = r0 + row, c = c0 + int64_t(vec) * kVec;
        if (r < rows && c < f) {
          const uint16_t* xr = x + r * 2 * f + c;
          rg[k] = __ldg(reinterpret_cast<const uint4*>(xr));
          ru[k] = __ldg(reinterpret_cast<const uint4*>(xr + f));
          if constexpr (kBackward) rd[k] = __ldg(reinterpret_cast<const uint4*>(dy + r * f + c));
        }
      }
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const int id = int(threadIdx.x) + (b0 + k) * kThreads, row = id / kVecPerRow, vec = id % kVecPerRow;
        const int64_t r = r0 + row, c = c0 + int64_t(vec) * kVec;
        if (r >= rows || c >= f) continue;
        float g[kVec], up[kVec], out[kHalves][kVec];
        vec::unpack16<bf16>(rg[k], g);
        vec::unpack16<bf16>(ru[k], up);
        if constexpr (kBackward) {
          float d[kVec];
          vec::unpack16<bf16>(rd[k], d);
          swiglu_grad8(g, up, d, out[0], out[1]);
        } else {
          swiglu8(g, up, out[0]);
        }
#pragma unroll
        for (int h = 0; h < kHalves; ++h) {
          if constexpr (kAmax) {
#pragma unroll
            for (int i = 0; i < kVec; ++i) m = max(m, abs_bits(out[h][i]));
          }
          uint32_t words[2];
          fp8cvt::quantize_words<kE4M3, kVec>(out[h], s, words);
          *reinterpret_cast<uint2*>(q + r * q_cols + h * f + c) = make_uint2(words[0], words[1]);
          tile[h][row][code_tile::swizzle(row, vec * 2)] = words[0];
          tile[h][row][code_tile::swizzle(row, vec * 2 + 1)] = words[1];
        }
      }
    }
    __syncthreads();
#pragma unroll
    for (int h = 0; h < kHalves; ++h) code_tile::store_transposed(tile[h], q_t, rows, r0, h * f + c0, h * f + f);
    __syncthreads();  // the tiles are rewritten by the next iteration
  }
  if constexpr (kAmax) fp8cvt::block_atomic_max(m, amax_bits);
}

// amax of the values above, nothing else written: grid-stride over 8-element vectors of h
// (of the gate half in the backward).
template <bool kBackward>
__global__ void __launch_bounds__(kThreads)
    swiglu_amax_kernel(const uint16_t* __restrict__ x, const uint16_t* __restrict__ dy, uint32_t* amax_bits,
                       int64_t rows, int64_t f) {
  const int64_t per_row = f / kVec, units = rows * per_row;
  uint32_t m = 0;
  for (int64_t u = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; u < units; u += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = u / per_row, c = (u - r * per_row) * kVec;
    const uint16_t* xr = x + r * 2 * f + c;
    float g[kVec], up[kVec];
    vec::unpack16<bf16>(__ldg(reinterpret_cast<const uint4*>(xr)), g);
    vec::unpack16<bf16>(__ldg(reinterpret_cast<const uint4*>(xr + f)), up);
    if constexpr (kBackward) {
      float d[kVec], dg[kVec], du[kVec];
      vec::unpack16<bf16>(__ldg(reinterpret_cast<const uint4*>(dy + r * f + c)), d);
      swiglu_grad8(g, up, d, dg, du);
#pragma unroll
      for (int i = 0; i < kVec; ++i) m = max(m, max(abs_bits(dg[i]), abs_bits(du[i])));
    } else {
      float h[kVec];
      swiglu8(g, up, h);
#pragma unroll
      for (int i = 0; i < kVec; ++i) m = max(m, abs_bits(h[i]));
    }
  }
  fp8cvt::block_atomic_max(m, amax_bits);
}

bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }


bool bf16_rows(const Tensor& x, const Tensor* dy, const Tensor* out) {
  if (x.dtype() != DType::BF16 || x.dim() != 2 || !x.is_contiguous() || x.size(1) % 16 != 0) return false;
  if (!aligned(x.raw_data(), 16)) return false;
  if (dy && (dy->dtype() != DType::BF16 || !dy->is_contiguous() || !aligned(dy->raw_data(), 16))) return false;
  if (out && (out->dtype() != DType::BF16 || !out->is_contiguous() || !aligned(out->raw_data(), 16))) return false;
  return true;
}

template <bool kBackward>
void launch_cast_transpose(void* stream, const Tensor& x, const Tensor* dy, const Tensor& scale, Tensor& q,
                           Tensor& q_t, Tensor& amax_out) {
  auto s = static_cast<cudaStream_t>(stream);
  const int64_t rows = x.size(0), f = x.size(1) / 2;
  uint32_t* amax_bits = amax_out.defined() ? amax_out.data<uint32_t>() : nullptr;
  if (amax_bits) TESSERA_CUDA_CHECK(cudaMemsetAsync(amax_bits, 0, sizeof(uint32_t), s));
  if (rows == 0 || f == 0) return;
  const int64_t across = ceil_div(f, kTileCols), tiles = ceil_div(rows, kTileRows) * across;
  const int64_t wave = int64_t(multiprocessor_count(x.device().index)) * kBlocksPerSm;
  const unsigned grid = unsigned(std::min(tiles, wave));
  const auto* xp = static_cast<const uint16_t*>(x.raw_data());
  const auto* dyp = dy ? static_cast<const uint16_t*>(dy->raw_data()) : nullptr;
  const bool e4m3 = q.dtype() == DType::E4M3;
  auto go = [&](auto e4m3_tag, auto amax_tag) {
    swiglu_cast_transpose_kernel<kBackward, decltype(e4m3_tag)::value, decltype(amax_tag)::value>
        <<<grid, kThreads, 0, s>>>(xp, dyp, scale.data<float>(), q.data<uint8_t>(), q_t.data<uint8_t>(), amax_bits,
                                   rows, f, across, tiles);
  };
  if (e4m3) {
    if (amax_bits) go(std::true_type{}, std::true_type{});
    else go(std::true_type{}, std::false_type{});
  } else {
    if (amax_bits) go(std::false_type{}, std::true_type{});
    else go(std::false_type{}, std::false_type{});
  }
  TESSERA_CUDA_CHECK_LAUNCH();
}

template <bool kBackward>
void launch_amax(void* stream, const Tensor& x, const Tensor* dy, Tensor& amax_out) {
  auto s = static_cast<cudaStream_t>(stream);
  const int64_t rows = x.size(0), f = x.size(1) / 2;
  uint32_t* amax_bits = amax_out.data<uint32_t>();
  TESSERA_CUDA_CHECK(cudaMemsetAsync(amax_bits, 0, sizeof(uint32_t), s));
  const int64_t units = rows * (f / kVec);
  if (units == 0) return;
  // About four resident blocks per SM, each looping: one atomic per block.
  const int64_t blocks = std::min(ceil_div(units, kThreads), int64_t(multiprocessor_count(x.device().index)) * 8);
  swiglu_amax_kernel<kBackward><<<unsigned(blocks), kThreads, 0, s>>>(
      static_cast<const uint16_t*>(x.raw_data()), dy ? static_cast<const uint16_t*>(dy->raw_data()) : nullptr,
      amax_bits, rows, f);
  TESSERA_CUDA_CHECK_LAUNCH();
}

}  // namespace

bool swiglu_cast_transpose_supported(const Tensor& x, const Tensor* dy, const Tensor& q, const Tensor& q_t) {
  return bf16_rows(x, dy, nullptr) && x.size(0) % 8 == 0 && q.is_contiguous() && q_t.is_contiguous() &&
         aligned(q.raw_data(), 8) && aligned(q_t.raw_data(), 8) && (q.dtype() == DType::E4M3 || q.dtype() == DType::E5M2) &&
         q_t.dtype() == q.dtype();
}

bool swiglu_amax_supported(const Tensor& x, const Tensor* dy, const Tensor& out) {
  return bf16_rows(x, dy, nullptr) && out.dtype() == DType::F32 && out.is_contiguous();
}

void swiglu_forward_cast_transpose(void* stream, const Tensor& x, const Tensor& scale, Tensor& q, Tensor& q_t,
                                   Tensor& amax_out) {
  launch_cast_transpose<false>(stream, x, nullptr, scale, q, q_t, amax_out);
}

void swiglu_backward_cast_transpose(void* stream, const Tensor& x, const Tensor& dy, const Tensor& scale, Tensor& q,
                                    Tensor& q_t, Tensor& amax_out) {
  launch_cast_transpose<true>(stream, x, &dy, scale, q, q_t, amax_out);
}

void swiglu_forward_amax(void* stream, const Tensor& x, Tensor& amax_out) {
  launch_amax<false>(stream, x, nullptr, amax_out);
}

void swiglu_backward_amax(void* stream, const Tensor& x, const Tensor& dy, Tensor& amax_out) {
  launch_amax<true>(stream, x, &dy, amax_out);
}

}  // namespace tessera::cuda
