// The FP8 casts of the MoE expert GEMMs (ops/moe.h, "FP8"): an expert-contiguous [M, K]
// activation to FP8 codes [M, K] plus the PADDED transposed codes [K, P] that the per-expert
// weight-gradient GEMMs read (expert e's rows at column padded[e], a multiple of 16, the
// padding columns zero), and the same cast of the routing-scaled SwiGLU
//   h[r, c] = prob[r] * silu(x[r, c]) * x[r, F + c]        (x [M, 2F])
// computed on the fly from the fc output, so that h is never stored in BF16.
//
// Bytes are those of the CPU reference (quantize_per_tensor of x, or of h computed in float
// as cpu::moe_swiglu_scaled_forward does, then cpu::moe_fp8_transpose_padded): the codes
// come from fp8_cvt.cuh's exact encoder. h itself uses expf, whose last bit may differ from
// the host's in rare elements, so a code of the SwiGLU cast can differ from the CPU one by a
// rounding step in a rare element (the tests allow 1e-4 of the codes); the plain cast is exact.
//
// Delayed scaling passes an amax slot: both kernels fold max |value cast| into it (per-thread
// max, then one atomic per block), so the cast needs no amax pass before it.
//
// Layout: x, data, data_t contiguous; data rows past the split sum are zero codes (a
// memset; no GEMM reads them). Two kernels:
//  - vector (BF16, width % 8, aligned; the FP8 layers' case): tiles of 64 PADDED columns x
//    64 features. Expert boundaries in the padded space are multiples of 16, so each
//    16-column piece of a transposed row belongs to one expert: its source rows are found
//    by a binary search over the experts' offsets (kernel parameters, <= 256 experts), each
//    thread loads 16-byte vectors of those rows (gate and up for the SwiGLU), converts with
//    the hardware cvt, stores its 8 codes row-wise, and after a shared-memory transpose
//    writes one aligned 16-byte piece of data_t; padding columns are written as zeros in
//    the same pass;
//  - scalar (F32, odd widths, misalignment): 32 x 32 tiles over the kept rows, one element
//    per thread, byte stores into data_t, padding zeroed by cudaMemset2DAsync per expert.
//
// Floor (H200, ~4.1 TB/s): plain BF16 cast: 2 B read + 2 B written per element (16384 x
// 4096: 268 MB, ~65 us). SwiGLU cast, per element of h [M, F]: amax pass 4 B read, cast pass
// 4 B read + 2 B written = 10 B, against 12 B for writing h in BF16 (4 + 2), an amax pass
// (2) and a cast with transpose (2 + 2); M = 16384, F = 14336: 2.35 GB, ~0.57 ms. With the
// scale known (delayed scaling) only the cast pass runs: 6 B, 1.41 GB, ~0.34 ms.
// Measured (H200, 2026-12-02, bench_bandwidth moe_swiglu): that one pass 602 us, 62.5% of
// copy (ncu, inside bench_moe: 0.51 ms). 63 registers, 4 blocks of 256 an SM; capping the
// registers for 5 blocks spilled and ran slower (614 us), and so did the next tile copied
// into shared memory by cp.async while this one is worked on (657.6 us against 593.2,
// 2026-12-03): the loads are not what it waits on. A split form (row-wise codes from a flat
// kernel, then a separate transpose of the codes; commit 8f212a6, reverted) ran 595 us: the
// same, its transpose alone at about 45% of copy.
#include "moe_fp8.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "cuda_check.h"
#include "fp8_cvt.cuh"
#include "moe_common.cuh"
#include "moe_fp8_rows.cuh"

namespace tessera::cuda {

namespace {

using moe_detail::AnyPtr;
using moe_detail::any_ptr;
using namespace moe_fp8_detail;

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 8192;
constexpr int kTile = 32;  // scalar kernel: 32 x 32 tiles, block (32, 8)

template <typename T>
__device__ __forceinline__ float load(const T* p) {
  if constexpr (std::is_same_v<T, float>) return *p;
  else return __uint_as_float(uint32_t(*reinterpret_cast<const uint16_t*>(p)) << 16);
}

// The scaled SwiGLU of one element, in the CPU reference's order of operations.
__device__ __forceinline__ float swiglu(float g, float u, float sc) { return g * (1.0f / (1.0f + expf(-g))) * u * sc; }

// Element (r, c) of the cast's input: x itself, or the scaled SwiGLU of x [M, 2 cols].
template <typename T, bool kSwiglu>
__device__ __forceinline__ float value(const T* x, AnyPtr prob, int64_t r, int64_t c, int64_t cols) {
  if constexpr (kSwiglu) return swiglu(load(x + r * 2 * cols + c), load(x + r * 2 * cols + cols + c), prob.load(r));
  else return load(x + r * cols + c);
}

// Any dtype, shape and alignment: rows [0, rows) (the kept ones), one element per thread.
template <typename T, bool kSwiglu, bool kE4M3>
__global__ void __launch_bounds__(kThreads)
    cast_padded_scalar_kernel(const T* x, AnyPtr prob, const float* scale, uint8_t* q, uint8_t* q_t, int64_t rows,
                              int64_t cols, int64_t width, ExpertTable table, int64_t tiles_across, int64_t tiles,
                              uint32_t* amax_bits) {
  __shared__ uint8_t tile[kTile][kTile + 1];
  const float s = *scale;
  const int tx = threadIdx.x, ty = threadIdx.y;
  uint32_t m = 0;  // max |value| cast, for delayed scaling's amax (amax_bits null: unused)
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t r0 = (t / tiles_across) * kTile, c0 = (t % tiles_across) * kTile;
#pragma unroll
    for (int i = 0; i < kTile; i += 8) {
      const int64_t r = r0 + ty + i, c = c0 + tx;
      if (r >= rows || c >= cols) continue;
      const float v = value<T, kSwiglu>(x, prob, r, c, cols);
      m = max(m, fp8cvt::abs_bits(v));
      const uint8_t code = fp8cvt::encode_scaled<kE4M3>(v, s);
      q[r * cols + c] = code;
      tile[ty + i][tx] = code;
    }
    __syncthreads();
    const int64_t col = r0 + tx < rows ? padded_column(table, r0 + tx) : -1;
#pragma unroll
    for (int i = 0; i < kTile; i += 8) {
      const int64_t c = c0 + ty + i;
      if (c < cols && col >= 0) q_t[c * width + col] = tile[tx][ty + i];
    }
    __syncthreads();  // the tile is rewritten by the next iteration
  }
  if (amax_bits) fp8cvt::block_atomic_max(m, amax_bits);
}

// BF16, cols % 8 == 0, x 16-byte and q 8-byte aligned. Tiles of 64 padded columns x 64
// features: each thread loads two 16-byte vectors (four for the SwiGLU: gate and up) of the
// source rows, converts them with the hardware cvt (fp8_cvt.cuh), stores its 8 codes
// row-wise and into the shared tile (padding columns get zeros there), then writes one
// 16-byte piece of a transposed row: 16 padded columns never straddle two experts, so every
// data_t store is aligned and the padding is written in the same pass.
template <bool kSwiglu, bool kE4M3>
__global__ void __launch_bounds__(kThreads)
    cast_padded_vector_kernel(const uint16_t* x, AnyPtr prob, const float* scale, uint8_t* q, uint8_t* q_t,
                              int64_t cols, int64_t width, ExpertTable table, int64_t tiles_across, int64_t tiles,
                              uint32_t* amax_bits) {
  __shared__ __align__(16) CodeTile tile;
  const float s = *scale;
  uint32_t m = 0;  // max |value| cast, for delayed scaling's amax (amax_bits null: unused)
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t p0 = (t / tiles_across) * kVTile, c0 = (t % tiles_across) * kVTile;
    uint4 raw[2], up[2];
    int64_t src[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) {  // all loads first
      const int id = int(threadIdx.x) + k * kThreads, pl = id / 8, v = id % 8;
      const int64_t p = p0 + pl, c = c0 + v * 8;
      src[k] = p < width && c < cols ? source_row(table, p) : -1;
      if (src[k] >= 0) {
        if constexpr (kSwiglu) {
          raw[k] = __ldg(reinterpret_cast<const uint4*>(x + src[k] * 2 * cols + c));
          up[k] = __ldg(reinterpret_cast<const uint4*>(x + src[k] * 2 * cols + cols + c));
        } else {
          raw[k] = __ldg(reinterpret_cast<const uint4*>(x + src[k] * cols + c));
        }
      }
    }
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int id = int(threadIdx.x) + k * kThreads, pl = id / 8, v = id % 8;
      const int64_t c = c0 + v * 8;
      uint32_t words[2] = {0, 0};
      if (src[k] >= 0) {
        float f[8];
        unpack8(raw[k], f);
        if constexpr (kSwiglu) {
          float u[8];
          unpack8(up[k], u);
          const float sc = prob.load(src[k]);
#pragma unroll
          for (int i = 0; i < 8; ++i) f[i] = swiglu(f[i], u[i], sc);
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) m = max(m, fp8cvt::abs_bits(f[i]));
        fp8cvt::quantize_words<kE4M3, 8>(f, s, words);
        *reinterpret_cast<uint2*>(q + src[k] * cols + c) = make_uint2(words[0], words[1]);
      }
      uint32_t* row = reinterpret_cast<uint32_t*>(&tile[pl][v * 8]);
      row[0] = words[0];
      row[1] = words[1];
    }
    __syncthreads();
    store_tile_transposed(tile, q_t, c0, p0, cols, width);
    __syncthreads();  // the tile is rewritten by the next iteration
  }
  if (amax_bits) fp8cvt::block_atomic_max(m, amax_bits);
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    swiglu_amax_scalar_kernel(const T* x, AnyPtr prob, uint32_t* amax_bits, int64_t rows, int64_t cols) {
  uint32_t m = 0;
  const int64_t total = rows * cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x)
    m = max(m, fp8cvt::abs_bits(value<T, true>(x, prob, i / cols, i % cols, cols)));
  fp8cvt::block_atomic_max(m, amax_bits);
}

// BF16, cols % 8 == 0, x 16-byte aligned: 8 elements per thread and step.
__global__ void __launch_bounds__(kThreads)
    swiglu_amax_vector_kernel(const uint16_t* x, AnyPtr prob, uint32_t* amax_bits, int64_t rows, int64_t cols) {
  uint32_t m = 0;
  const int64_t per_row = cols / 8, total = rows * per_row;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / per_row, c = (i % per_row) * 8;
    float g[8], u[8];
    unpack8(__ldg(reinterpret_cast<const uint4*>(x + r * 2 * cols + c)), g);
    unpack8(__ldg(reinterpret_cast<const uint4*>(x + r * 2 * cols + cols + c)), u);
    const float sc = prob.load(r);
#pragma unroll
    for (int k = 0; k < 8; ++k) m = max(m, fp8cvt::abs_bits(swiglu(g[k], u[k], sc)));
  }
  fp8cvt::block_atomic_max(m, amax_bits);
}

bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

void zero_padding(cudaStream_t s, const std::vector<int64_t>& splits, const std::vector<int64_t>& padded, Tensor& data_t) {
  const int64_t k = data_t.size(0), width = data_t.size(1);
  for (size_t e = 0; e < splits.size(); ++e) {
    const int64_t pad = padded[e + 1] - padded[e] - splits[e];
    if (pad == 0 || k == 0) continue;
    TESSERA_CUDA_CHECK(cudaMemset2DAsync(data_t.data<uint8_t>() + padded[e] + splits[e], size_t(width), 0, size_t(pad),
                                         size_t(k), s));
  }
}

template <bool kSwiglu>
void launch_cast(cudaStream_t s, const Tensor& x, const Tensor& prob, const Tensor& scale,
                 const std::vector<int64_t>& splits, const std::vector<int64_t>& padded, Tensor& data, Tensor& data_t,
                 Tensor* amax) {
  uint32_t* amax_bits = amax ? amax->data<uint32_t>() : nullptr;
  const int64_t cols = data.size(1), width = data_t.size(1);
  const int64_t kept = zero_rows_past_splits(s, splits, data);
  if (kept == 0 || cols == 0) return;
  const ExpertTable table = make_table(splits, padded);
  const bool e4m3 = data.dtype() == DType::E4M3;
  const bool vector = x.dtype() == DType::BF16 && cols % 8 == 0 && aligned(x.raw_data(), 16) &&
                      aligned(data.raw_data(), 8) && aligned(data_t.raw_data(), 16);
  if (vector) {
    const int64_t across = (cols + kVTile - 1) / kVTile, tiles = (width + kVTile - 1) / kVTile * across;
    const unsigned blocks = unsigned(std::min(tiles, kMaxBlocks));
    const auto* xp = static_cast<const uint16_t*>(x.raw_data());
    if (e4m3)
      cast_padded_vector_kernel<kSwiglu, true><<<blocks, kThreads, 0, s>>>(
          xp, any_ptr(prob), scale.data<float>(), data.data<uint8_t>(), data_t.data<uint8_t>(), cols, width, table,
          across, tiles, amax_bits);
    else
      cast_padded_vector_kernel<kSwiglu, false><<<blocks, kThreads, 0, s>>>(
          xp, any_ptr(prob), scale.data<float>(), data.data<uint8_t>(), data_t.data<uint8_t>(), cols, width, table,
          across, tiles, amax_bits);
    TESSERA_CUDA_CHECK_LAUNCH();
    return;
  }
  zero_padding(s, splits, padded, data_t);
  const int64_t across = (cols + kTile - 1) / kTile, tiles = (kept + kTile - 1) / kTile * across;
  const unsigned blocks = unsigned(std::min(tiles, kMaxBlocks));
  auto run = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* xp = static_cast<const T*>(x.raw_data());
    if (e4m3)
      cast_padded_scalar_kernel<T, kSwiglu, true><<<blocks, dim3(kTile, 8), 0, s>>>(
          xp, any_ptr(prob), scale.data<float>(), data.data<uint8_t>(), data_t.data<uint8_t>(), kept, cols, width,
          table, across, tiles, amax_bits);
    else
      cast_padded_scalar_kernel<T, kSwiglu, false><<<blocks, dim3(kTile, 8), 0, s>>>(
          xp, any_ptr(prob), scale.data<float>(), data.data<uint8_t>(), data_t.data<uint8_t>(), kept, cols, width,
          table, across, tiles, amax_bits);
  };
  if (x.dtype() == DType::F32) run(static_cast<float*>(nullptr));
  else run(static_cast<uint16_t*>(nullptr));
  TESSERA_CUDA_CHECK_LAUNCH();
}

}  // namespace

bool moe_fp8_cast_supported(const Tensor& x, int64_t experts) {
  return (x.dtype() == DType::F32 || x.dtype() == DType::BF16) && x.is_contiguous() && x.dim() == 2 &&
         x.size(0) < (int64_t{1} << 31) - kVTile && experts <= kMoeFp8MaxExperts;
}

void moe_fp8_cast_rows(void* stream, const Tensor& x, const Tensor& scale, const std::vector<int64_t>& splits,
                       const std::vector<int64_t>& padded, Tensor& data, Tensor& data_t, Tensor* amax) {
  launch_cast<false>(static_cast<cudaStream_t>(stream), x, Tensor(), scale, splits, padded, data, data_t, amax);
}

void moe_swiglu_scaled_cast(void* stream, const Tensor& x, const Tensor& prob, const Tensor& scale,
                            const std::vector<int64_t>& splits, const std::vector<int64_t>& padded, Tensor& data,
                            Tensor& data_t, Tensor* amax) {
  launch_cast<true>(static_cast<cudaStream_t>(stream), x, prob, scale, splits, padded, data, data_t, amax);
}

void moe_swiglu_scaled_amax(void* stream, const Tensor& x, const Tensor& prob, Tensor& amax) {
  auto s = static_cast<cudaStream_t>(stream);
  TESSERA_CUDA_CHECK(cudaMemsetAsync(amax.raw_data(), 0, sizeof(uint32_t), s));
  const int64_t rows = x.size(0), cols = x.size(1) / 2;
  if (rows == 0 || cols == 0) return;
  if (x.dtype() == DType::BF16 && cols % 8 == 0 && aligned(x.raw_data(), 16)) {
    const unsigned blocks = unsigned(std::min((rows * cols / 8 + kThreads - 1) / kThreads, kMaxBlocks));
    swiglu_amax_vector_kernel<<<blocks, kThreads, 0, s>>>(static_cast<const uint16_t*>(x.raw_data()), any_ptr(prob),
                                                          amax.data<uint32_t>(), rows, cols);
  } else if (x.dtype() == DType::F32) {
    const unsigned blocks = unsigned(std::min((rows * cols + kThreads - 1) / kThreads, kMaxBlocks));
    swiglu_amax_scalar_kernel<float><<<blocks, kThreads, 0, s>>>(x.data<float>(), any_ptr(prob), amax.data<uint32_t>(),
                                                                 rows, cols);
  } else {
    const unsigned blocks = unsigned(std::min((rows * cols + kThreads - 1) / kThreads, kMaxBlocks));
    swiglu_amax_scalar_kernel<uint16_t><<<blocks, kThreads, 0, s>>>(static_cast<const uint16_t*>(x.raw_data()),
                                                                    any_ptr(prob), amax.data<uint32_t>(), rows, cols);
  }
  TESSERA_CUDA_CHECK_LAUNCH();
}

}  // namespace tessera::cuda
