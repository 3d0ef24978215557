// Two reductions on the GPU with the CPU reference's rules (backend/cpu/gemm.cpp):
//   bias_grad:      dbias[n] += sum_m dy[m, n]      (a parameter gradient: accumulates)
//   sum_of_squares: out[0] = sum_i x[i]^2           (overwritten; for the gradient norm)
// Both accumulate in double, as the CPU does, and are deterministic: every partial sum
// covers a range fixed by the tensor's shape alone (not by the GPU or by timing) and is
// combined in a fixed order; no atomics.
//
// bias_grad, layout dy [M, N] row-major: a 32 x 8 block owns a tile of 32 column vectors
// (8 columns each when N % 8 == 0 and dy is 16-byte aligned, else single columns) and a
// chunk of rows; its 8 row groups are summed in group order into partial[chunk, column];
// a second kernel adds the chunks in order and adds the result to dbias. The chunk count
// (at most 256) depends only on M. Floor: M * N * dy bytes / 4.1 TB/s, e.g. 16K x 768
// BF16 = 25 MB -> 6 us (the partials add under 1 MB).
// sum_of_squares: a fixed number of blocks (a function of numel only, at most 1024) each
// reduce a grid-stride share of 16-byte vectors, then one block adds their sums in a
// fixed tree and writes out[0] on the device. Floor: numel * bytes / 4.1 TB/s.
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda_check.h"
#include "reduce.h"
#include "vec_io.cuh"

namespace tessera::cuda {

namespace {

using vec::kWidth;

constexpr int kLanes = 32, kGroups = 8;  // bias_grad block: 32 column vectors x 8 row groups
constexpr int kChunkMin = 128, kMaxChunks = 256;
constexpr int kThreads = 256;            // sum_of_squares blocks
constexpr int kMaxBlocks = 1024;

template <typename T, int W>
__global__ void __launch_bounds__(kLanes * kGroups)
    column_partials_kernel(const T* dy, int64_t rows, int64_t cols, int64_t rows_per_chunk, double* partial) {
  __shared__ double shared[W * kGroups * kLanes];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t col0 = (blockIdx.x * int64_t(kLanes) + tx) * W;  // W == 8 implies cols % 8 == 0
  const int64_t r0 = blockIdx.y * rows_per_chunk, r1 = min(rows, r0 + rows_per_chunk);
  double acc[W];
#pragma unroll
  for (int w = 0; w < W; ++w) acc[w] = 0.0;
  if (col0 < cols) {
    for (int64_t r = r0 + ty; r < r1; r += kGroups) {
      if constexpr (W == kWidth) {
        float v[kWidth];
        vec::load8(dy + r * cols + col0, v);
#pragma unroll
        for (int w = 0; w < W; ++w) acc[w] += static_cast<double>(v[w]);
      } else {
        acc[0] += static_cast<double>(vec::load(dy, r * cols + col0));
      }
    }
  }
#pragma unroll
  for (int w = 0; w < W; ++w) shared[(w * kGroups + ty) * kLanes + tx] = acc[w];
  __syncthreads();
  if (ty != 0 || col0 >= cols) return;
#pragma unroll
  for (int w = 0; w < W; ++w) {
    double s = shared[w * kGroups * kLanes + tx];
    for (int g = 1; g < kGroups; ++g) s += shared[(w * kGroups + g) * kLanes + tx];
    partial[blockIdx.y * cols + col0 + w] = s;
  }
}

// dbias[c] = dbias[c] + sum over chunks, in double, rounded once (via float, as the CPU's
// store_element does).
template <typename D>
__global__ void add_partials_kernel(const double* partial, int64_t chunks, int64_t cols, D* dbias) {
  TESSERA_VEC_GRID_STRIDE(c, cols) {
    double s = 0;
    for (int64_t k = 0; k < chunks; ++k) s += partial[k * cols + c];
    vec::store(dbias, c, static_cast<float>(static_cast<double>(vec::load(dbias, c)) + s));
  }
}

__device__ double block_sum(double v) {
  __shared__ double shared[kMaxBlocks];
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {  // blockDim.x is a power of two
    if (threadIdx.x < stride) shared[threadIdx.x] += shared[threadIdx.x + stride];
    __syncthreads();
  }
  return shared[0];
}

template <typename T, bool Vectorised>
__global__ void __launch_bounds__(kThreads) squares_kernel(const T* x, int64_t n, double* partial) {
  double s = 0;
  int64_t done = 0;
  if constexpr (Vectorised) {
    const int64_t vectors = n / kWidth;
    TESSERA_VEC_GRID_STRIDE(u, vectors) {
      float v[kWidth];
      vec::load8(x + u * kWidth, v);
#pragma unroll
      for (int k = 0; k < kWidth; ++k) s += static_cast<double>(v[k]) * static_cast<double>(v[k]);
    }
    done = vectors * kWidth;
  }
  TESSERA_VEC_GRID_STRIDE(j, n - done) {
    const double v = vec::load(x, done + j);
    s += v * v;
  }
  s = block_sum(s);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

__global__ void __launch_bounds__(kMaxBlocks) squares_total_kernel(const double* partial, int blocks, void* out,
                                                                    bool out_f64) {
  const double s = block_sum(threadIdx.x < blocks ? partial[threadIdx.x] : 0.0);
  if (threadIdx.x != 0) return;
  if (out_f64) *static_cast<double*>(out) = s;
  else *static_cast<float*>(out) = static_cast<float>(s);
}

}  // namespace

bool bias_grad_supported(const Tensor& dy, const Tensor& dbias) {
  return vec::is_f32_or_bf16(dy.dtype()) && vec::is_f32_or_bf16(dbias.dtype());
}

void bias_grad(void* stream, const Tensor& dy, Tensor& dbias) {
  const int64_t rows = dy.size(0), cols = dy.size(1);
  if (rows == 0 || cols == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  // Rows per chunk: a function of M only, so the summation order is too.
  const int64_t per_chunk = std::max<int64_t>(kChunkMin, (rows + kMaxChunks - 1) / kMaxChunks);
  const int64_t chunks = (rows + per_chunk - 1) / per_chunk;
  Tensor partial = Tensor::empty({chunks, cols}, DType::F64, dy.device());
  const bool vectorised = cols % kWidth == 0 && vec::aligned16(dy.raw_data());
  const int64_t tile = kLanes * (vectorised ? kWidth : 1);
  const int64_t tiles = (cols + tile - 1) / tile;
  TESSERA_CHECK(tiles <= 0x7fffffff, "bias_grad on CUDA: ", cols, " columns exceed one grid");
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(chunks)), block(kLanes, kGroups);
  vec::dispatch(dy.dtype(), "bias_grad", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if (vectorised)
      column_partials_kernel<T, kWidth><<<grid, block, 0, s>>>(dy.data<T>(), rows, cols, per_chunk,
                                                               partial.data<double>());
    else
      column_partials_kernel<T, 1><<<grid, block, 0, s>>>(dy.data<T>(), rows, cols, per_chunk, partial.data<double>());
  });
  TESSERA_CUDA_CHECK_LAUNCH();
  vec::dispatch(dbias.dtype(), "bias_grad", [&](auto* tag) {
    using D = std::remove_pointer_t<decltype(tag)>;
    add_partials_kernel<D><<<vec::blocks_for(cols, kThreads), kThreads, 0, s>>>(partial.data<double>(), chunks, cols,
                                                                                dbias.data<D>());
  });
  TESSERA_CUDA_CHECK_LAUNCH();
}

bool sum_of_squares_supported(const Tensor& x, const Tensor& out) {
  return vec::is_f32_or_bf16(x.dtype()) && (out.dtype() == DType::F32 || out.dtype() == DType::F64);
}

void sum_of_squares(void* stream, const Tensor& x, Tensor& out) {
  auto s = static_cast<cudaStream_t>(stream);
  const int64_t n = x.numel();
  const bool vectorised = vec::aligned16(x.raw_data());
  // Blocks: a function of numel only (4 vectors per thread before the grid strides).
  const int blocks = static_cast<int>(vec::blocks_for(n, int64_t(kThreads) * kWidth * 4, kMaxBlocks));
  Tensor partial = Tensor::empty({blocks}, DType::F64, x.device());
  if (n > 0) {
    vec::dispatch(x.dtype(), "sum_of_squares", [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      if (vectorised) squares_kernel<T, true><<<blocks, kThreads, 0, s>>>(x.data<T>(), n, partial.data<double>());
      else squares_kernel<T, false><<<blocks, kThreads, 0, s>>>(x.data<T>(), n, partial.data<double>());
    });
    TESSERA_CUDA_CHECK_LAUNCH();
  }
  squares_total_kernel<<<1, kMaxBlocks, 0, s>>>(partial.data<double>(), n > 0 ? blocks : 0, out.raw_data(),
                                                out.dtype() == DType::F64);
  TESSERA_CUDA_CHECK_LAUNCH();
}

}  // namespace tessera::cuda
