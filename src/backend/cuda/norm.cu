// LayerNorm and RMSNorm on the GPU, forward and backward, with the formulas, rounding
// points and gradient rule of the CPU reference (backend/cpu/norm.cpp).
//
// Layout: x, y, dy, dx contiguous [rows, C] of one dtype (F32 or BF16); gamma, beta, dgamma,
// dbeta [C], each F32 or BF16 on its own (read through a runtime flag, not a template, so
// mixed master-weight/activation dtypes cost no extra instantiations); mean, rstd F32.
//
// Kernels: a row is handled by a group of threads (1 to 512, a power of two) and, when it
// fits, kept in registers, so x (and dy) are read from memory once; 16-byte loads when C and
// every pointer allow it, scalar otherwise. Rows too wide for registers take a looping path
// that re-reads them (mostly from L2). Per-row sums are taken in double, as the reference
// does: a degenerate row (C = 1, where RMSNorm's dx = rstd*g*(1 - xhat^2) cancels) then
// gets the reference's rstd bit for bit, and the per-element float math is written with
// explicit round-to-nearest intrinsics so that nvcc does not contract it into FMAs the
// reference does not use. (Double FMAs appear only where the product is of two floats: it is
// exact in double, so the fused form rounds exactly as the reference's multiply-then-add.)
// The cost is a few FP64 operations and float-to-double conversions per element, under the
// memory time on an H200.
//
// dgamma/dbeta: a fixed set of "workers" (row groups, one wave of the GPU) each sums its
// contiguous chunk of rows into a float partial row of a scratch buffer; a second kernel adds
// the partials in worker order in double and accumulates into dgamma/dbeta. No atomics, so
// results are identical from run to run (the worker count depends on the GPU model).
//
// Floor (H200, ~4.1 TB/s): forward reads x and writes y, 2 passes of the activation
// (16384x4096 BF16: 268 MB, ~65 us); backward reads x and dy and writes dx, 3 passes
// (~98 us), plus the partials (workers x C x 4 bytes per parameter, a few MB).
#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>

#include "cuda_check.h"
#include "norm.h"
#include "tessera/core/numeric.h"

namespace tessera::cuda {

namespace {

constexpr int kMaxGroupThreads = 512;  // threads per row group in the register kernels
constexpr int kWideThreads = 1024;     // threads per row in the looping kernels
// Vectors per thread the register kernels hold at most. Backward keeps four arrays per vector
// (xhat, g, the dgamma and dbeta partials), so it stops earlier to stay clear of spills.
constexpr int kMaxForwardVectors = 8, kMaxBackwardVectors = 2;

template <int V>
using Int = std::integral_constant<int, V>;

// ---- Loads and stores of N consecutive elements, converted to and from float ---------------

// kBytes (4, 8 or a multiple of 16) as 32-bit words; p aligned to min(16, kBytes).
template <int kBytes>
__device__ __forceinline__ void load_words(const void* p, uint32_t* w) {
  if constexpr (kBytes % 16 == 0) {
#pragma unroll
    for (int k = 0; k < kBytes / 16; ++k) {
      const uint4 q = static_cast<const uint4*>(p)[k];
      w[4 * k] = q.x, w[4 * k + 1] = q.y, w[4 * k + 2] = q.z, w[4 * k + 3] = q.w;
    }
  } else if constexpr (kBytes == 8) {
    const uint2 q = *static_cast<const uint2*>(p);
    w[0] = q.x, w[1] = q.y;
  } else {
    static_assert(kBytes == 4, "unsupported vector width");
    w[0] = *static_cast<const uint32_t*>(p);
  }
}

template <int kBytes>
__device__ __forceinline__ void store_words(void* p, const uint32_t* w) {
  if constexpr (kBytes % 16 == 0) {
#pragma unroll
    for (int k = 0; k < kBytes / 16; ++k)
      static_cast<uint4*>(p)[k] = make_uint4(w[4 * k], w[4 * k + 1], w[4 * k + 2], w[4 * k + 3]);
  } else if constexpr (kBytes == 8) {
    *static_cast<uint2*>(p) = make_uint2(w[0], w[1]);
  } else {
    static_assert(kBytes == 4, "unsupported vector width");
    *static_cast<uint32_t*>(p) = w[0];
  }
}

// T is float or uint16_t (BF16 bits).
template <typename T, int N>
__device__ __forceinline__ void load_vec(const T* p, float* v) {
  if constexpr (std::is_same_v<T, float>) {
    uint32_t w[N];
    load_words<4 * N>(p, w);
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = __uint_as_float(w[k]);
  } else if constexpr (N == 1) {
    v[0] = bf16_bits_to_float(*p);
  } else {
    uint32_t w[N / 2];
    load_words<2 * N>(p, w);
#pragma unroll
    for (int k = 0; k < N / 2; ++k) {  // little endian: element 2k is the low half
      v[2 * k] = __uint_as_float(w[k] << 16);
      v[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
    }
  }
}

template <typename T, int N>
__device__ __forceinline__ void store_vec(T* p, const float* v) {
  if constexpr (std::is_same_v<T, float>) {
    uint32_t w[N];
#pragma unroll
    for (int k = 0; k < N; ++k) w[k] = __float_as_uint(v[k]);
    store_words<4 * N>(p, w);
  } else if constexpr (N == 1) {
    *p = float_to_bf16_bits(v[0]);
  } else {
    uint32_t w[N / 2];
#pragma unroll
    for (int k = 0; k < N / 2; ++k)
      w[k] = uint32_t(float_to_bf16_bits(v[2 * k])) | (uint32_t(float_to_bf16_bits(v[2 * k + 1])) << 16);
    store_words<2 * N>(p, w);
  }
}

// A [C] parameter (or its gradient) whose dtype is F32 or BF16, chosen at run time.
struct Param {
  void* ptr;  // null: undefined tensor
  bool bf16;
};

template <int N>
__device__ __forceinline__ void load_param(const Param& p, int64_t i, float* v) {
  if (p.bf16) load_vec<uint16_t, N>(static_cast<const uint16_t*>(p.ptr) + i, v);
  else load_vec<float, N>(static_cast<const float*>(p.ptr) + i, v);
}

// ---- Row-group reduction -------------------------------------------------------------------

// Sums v over the blockDim.x threads of a row group; every thread of the group receives the
// same bits. Groups of up to a warp use an xor butterfly (commutative, so all lanes agree);
// a group of several warps is the whole block (blockDim.y == 1) and adds the warp sums in
// warp order. `shared` must not be reused until after the next call's __syncthreads.
template <int K>
__device__ __forceinline__ void group_sum(double (&v)[K], double (*shared)[32]) {
  const int width = blockDim.x < 32 ? blockDim.x : 32;
  for (int offset = width / 2; offset > 0; offset /= 2)
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] += __shfl_xor_sync(0xffffffffu, v[k], offset);
  if (blockDim.x <= 32) return;
  if ((threadIdx.x & 31) == 0)
#pragma unroll
    for (int k = 0; k < K; ++k) shared[k][threadIdx.x >> 5] = v[k];
  __syncthreads();
#pragma unroll
  for (int k = 0; k < K; ++k) {
    double s = 0;
    for (int w = 0; w < int(blockDim.x >> 5); ++w) s += shared[k][w];
    v[k] = s;
  }
}

// ---- Register kernels: NV vectors of VEC elements per thread -------------------------------
//
// Thread t of a group owns vectors t, t + G, t + 2G, ... (G = blockDim.x), so a warp's loads
// are contiguous. Rows are [rows, cols]; a group whose row is past the end still joins the
// shuffles (they need the whole warp) but loads and stores nothing.

template <typename T, int VEC, int NV, bool kLayer>
__global__ void __launch_bounds__(kMaxGroupThreads)
    norm_forward_kernel(const T* x, Param gamma, Param beta, T* y, float* mean, float* rstd, int64_t rows, int64_t cols,
                        double eps) {
  __shared__ double red[2][1][32];
  const int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool live = row < rows;
  const int64_t base = (live ? row : 0) * cols;
  float v[NV][VEC];
  double acc[1] = {0};
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int64_t c = (int64_t(j) * blockDim.x + threadIdx.x) * VEC;
    if (live && c < cols) {
      load_vec<T, VEC>(x + base + c, v[j]);
#pragma unroll
      for (int k = 0; k < VEC; ++k)
        acc[0] = kLayer ? __dadd_rn(acc[0], double(v[j][k])) : fma(double(v[j][k]), double(v[j][k]), acc[0]);
    } else {
#pragma unroll
      for (int k = 0; k < VEC; ++k) v[j][k] = 0.0f;
    }
  }
  group_sum(acc, red[0]);
  double mu = 0, inv_std;
  if constexpr (kLayer) {
    mu = acc[0] / double(cols);
    double squares[1] = {0};  // second pass over the registers: no cancellation
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int64_t c = (int64_t(j) * blockDim.x + threadIdx.x) * VEC;
      if (live && c < cols)
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const double d = __dsub_rn(double(v[j][k]), mu);
          squares[0] = __dadd_rn(squares[0], __dmul_rn(d, d));
        }
    }
    group_sum(squares, red[1]);
    inv_std = 1.0 / sqrt(squares[0] / double(cols) + eps);
  } else {
    inv_std = 1.0 / sqrt(acc[0] / double(cols) + eps);
  }
  // y is computed from the rounded statistics, as the reference does.
  const float mu_t = float(mu), rstd_t = float(inv_std);
  if (!live) return;
  if (threadIdx.x == 0) {
    if (kLayer) mean[row] = mu_t;
    rstd[row] = rstd_t;
  }
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int64_t c = (int64_t(j) * blockDim.x + threadIdx.x) * VEC;
    if (c >= cols) continue;
    float g[VEC], b[VEC], out[VEC];
    load_param<VEC>(gamma, c, g);
    if (kLayer && beta.ptr) load_param<VEC>(beta, c, b);
    else
#pragma unroll
      for (int k = 0; k < VEC; ++k) b[k] = 0.0f;
#pragma unroll
    for (int k = 0; k < VEC; ++k)
      out[k] = kLayer ? __fadd_rn(__fmul_rn(__fmul_rn(__fsub_rn(v[j][k], mu_t), rstd_t), g[k]), b[k])
                      : __fmul_rn(__fmul_rn(v[j][k], rstd_t), g[k]);
    store_vec<T, VEC>(y + base + c, out);
  }
}

// Worker w = blockIdx.x * blockDim.y + threadIdx.y takes rows [rows*w/W, rows*(w+1)/W); all
// workers step the same number of times so that narrow groups sharing a warp stay in step.
// dx is written after every read of its row, so dx may be the same memory as dy or x.
template <typename T, int VEC, int NV, bool kLayer>
__global__ void __launch_bounds__(kMaxGroupThreads, NV == 1 ? 2 : 1)
    norm_backward_kernel(const T* dy, const T* x, Param gamma, const float* mean, const float* rstd, T* dx,
                         float* dgamma_part, float* dbeta_part, int64_t rows, int64_t cols, int64_t workers) {
  __shared__ double red[2][2][32];
  const int64_t worker = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool live_worker = worker < workers;
  const int64_t first = live_worker ? rows * worker / workers : 0;
  const int64_t last = live_worker ? rows * (worker + 1) / workers : 0;
  const int64_t steps = (rows + workers - 1) / workers;
  const double inv_cols = 1.0 / double(cols);

  // gamma is re-read for every row (an L1 hit) rather than held: the registers it would take
  // decide whether two 512-thread blocks fit on a multiprocessor.
  float acc_g[NV][VEC], acc_b[NV][VEC];
#pragma unroll
  for (int j = 0; j < NV; ++j)
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc_g[j][k] = acc_b[j][k] = 0.0f;

#pragma unroll 1
  for (int64_t step = 0; step < steps; ++step) {
    const int64_t row = first + step;
    const bool live = row < last;
    const int64_t base = (live ? row : 0) * cols;
    const float mu = kLayer && live ? mean[row] : 0.0f, r = live ? rstd[row] : 0.0f;
    float xhat[NV][VEC], gd[NV][VEC];  // xhat and g = dy * gamma per element
    double sums[2] = {0, 0};           // sum(g), sum(g * xhat)
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int64_t c = (int64_t(j) * blockDim.x + threadIdx.x) * VEC;
      if (live && c < cols) {
        float d[VEC], g[VEC];
        load_vec<T, VEC>(x + base + c, xhat[j]);
        load_vec<T, VEC>(dy + base + c, d);
        load_param<VEC>(gamma, c, g);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const float xh = kLayer ? __fmul_rn(__fsub_rn(xhat[j][k], mu), r) : __fmul_rn(xhat[j][k], r);
          const float gk = __fmul_rn(d[k], g[k]);
          if (kLayer) sums[0] = __dadd_rn(sums[0], double(gk));
          sums[1] = fma(double(gk), double(xh), sums[1]);
          acc_g[j][k] = fmaf(d[k], xh, acc_g[j][k]);
          acc_b[j][k] += d[k];
          xhat[j][k] = xh;
          gd[j][k] = gk;
        }
      } else {
#pragma unroll
        for (int k = 0; k < VEC; ++k) xhat[j][k] = gd[j][k] = 0.0f;
      }
    }
    group_sum(sums, red[step & 1]);
    const float mean_g = float(sums[0] * inv_cols), mean_g_xhat = float(sums[1] * inv_cols);
    if (!live) continue;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int64_t c = (int64_t(j) * blockDim.x + threadIdx.x) * VEC;
      if (c >= cols) continue;
      float out[VEC];
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float t = __fmul_rn(xhat[j][k], mean_g_xhat);
        out[k] =
            kLayer ? __fmul_rn(r, __fsub_rn(__fsub_rn(gd[j][k], mean_g), t)) : __fmul_rn(r, __fsub_rn(gd[j][k], t));
      }
      store_vec<T, VEC>(dx + base + c, out);
    }
  }

  if (!live_worker) return;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int64_t c = (int64_t(j) * blockDim.x + threadIdx.x) * VEC;
    if (c >= cols) continue;
    store_vec<float, VEC>(dgamma_part + worker * cols + c, acc_g[j]);
    if (kLayer && dbeta_part) store_vec<float, VEC>(dbeta_part + worker * cols + c, acc_b[j]);
  }
}

// ---- Looping kernels for rows too wide for registers: one 1024-thread block per row --------

template <typename T>
__device__ __forceinline__ float load1(const T* p, int64_t i) {
  float v;
  load_vec<T, 1>(p + i, &v);
  return v;
}

__device__ __forceinline__ float load_param1(const Param& p, int64_t i) {
  return p.bf16 ? bf16_bits_to_float(static_cast<const uint16_t*>(p.ptr)[i]) : static_cast<const float*>(p.ptr)[i];
}

template <typename T, bool kLayer>
__global__ void __launch_bounds__(kWideThreads)
    norm_forward_wide_kernel(const T* x, Param gamma, Param beta, T* y, float* mean, float* rstd, int64_t cols,
                             double eps) {
  __shared__ double red[2][1][32];
  const int64_t base = int64_t(blockIdx.x) * cols;
  double acc[1] = {0};
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float v = load1(x, base + c);
    acc[0] = kLayer ? __dadd_rn(acc[0], double(v)) : fma(double(v), double(v), acc[0]);
  }
  group_sum(acc, red[0]);
  double mu = 0, inv_std;
  if constexpr (kLayer) {
    mu = acc[0] / double(cols);
    double squares[1] = {0};
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      const double d = __dsub_rn(double(load1(x, base + c)), mu);
      squares[0] = __dadd_rn(squares[0], __dmul_rn(d, d));
    }
    group_sum(squares, red[1]);
    inv_std = 1.0 / sqrt(squares[0] / double(cols) + eps);
  } else {
    inv_std = 1.0 / sqrt(acc[0] / double(cols) + eps);
  }
  const float mu_t = float(mu), rstd_t = float(inv_std);
  if (threadIdx.x == 0) {
    if (kLayer) mean[blockIdx.x] = mu_t;
    rstd[blockIdx.x] = rstd_t;
  }
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float v = load1(x, base + c), g = load_param1(gamma, c);
    float out[1];
    if (kLayer)
      out[0] = __fadd_rn(__fmul_rn(__fmul_rn(__fsub_rn(v, mu_t), rstd_t), g), beta.ptr ? load_param1(beta, c) : 0.0f);
    else out[0] = __fmul_rn(__fmul_rn(v, rstd_t), g);
    store_vec<T, 1>(y + base + c, out);
  }
}

template <typename T, bool kLayer>
__device__ __forceinline__ float xhat_of(const T* x, int64_t i, float mu, float r) {
  const float v = load1(x, i);
  return kLayer ? __fmul_rn(__fsub_rn(v, mu), r) : __fmul_rn(v, r);
}

// dx only; the parameter gradients come from norm_column_partials_kernel, launched first
// because dx may overwrite dy.
template <typename T, bool kLayer>
__global__ void __launch_bounds__(kWideThreads)
    norm_backward_dx_wide_kernel(const T* dy, const T* x, Param gamma, const float* mean, const float* rstd, T* dx,
                                 int64_t cols) {
  __shared__ double red[1][2][32];
  const int64_t base = int64_t(blockIdx.x) * cols;
  const float mu = kLayer ? mean[blockIdx.x] : 0.0f, r = rstd[blockIdx.x];
  double sums[2] = {0, 0};
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float xh = xhat_of<T, kLayer>(x, base + c, mu, r);
    const float gk = __fmul_rn(load1(dy, base + c), load_param1(gamma, c));
    if (kLayer) sums[0] = __dadd_rn(sums[0], double(gk));
    sums[1] = fma(double(gk), double(xh), sums[1]);
  }
  group_sum(sums, red[0]);
  const double inv_cols = 1.0 / double(cols);
  const float mean_g = float(sums[0] * inv_cols), mean_g_xhat = float(sums[1] * inv_cols);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float xh = xhat_of<T, kLayer>(x, base + c, mu, r);
    const float gk = __fmul_rn(load1(dy, base + c), load_param1(gamma, c));
    const float t = __fmul_rn(xh, mean_g_xhat);
    float out[1] = {kLayer ? __fmul_rn(r, __fsub_rn(__fsub_rn(gk, mean_g), t)) : __fmul_rn(r, __fsub_rn(gk, t))};
    store_vec<T, 1>(dx + base + c, out);
  }
}

// Thread = column, blockIdx.y = worker over rows [rows*w/W, rows*(w+1)/W): coalesced reads
// of each row, one float partial per (worker, column).
template <typename T, bool kLayer>
__global__ void norm_column_partials_kernel(const T* dy, const T* x, const float* mean, const float* rstd,
                                            float* dgamma_part, float* dbeta_part, int64_t rows, int64_t cols) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  const int64_t worker = blockIdx.y, workers = gridDim.y;
  float acc_g = 0.0f, acc_b = 0.0f;
  for (int64_t row = rows * worker / workers; row < rows * (worker + 1) / workers; ++row) {
    const float d = load1(dy, row * cols + c);
    acc_g = fmaf(d, xhat_of<T, kLayer>(x, row * cols + c, kLayer ? mean[row] : 0.0f, rstd[row]), acc_g);
    acc_b += d;
  }
  dgamma_part[worker * cols + c] = acc_g;
  if (dbeta_part) dbeta_part[worker * cols + c] = acc_b;
}

// out[c] += sum over workers of part[w][c]: 8 lanes per column each add a strided subset in
// order, then one lane adds the 8 in order (fixed order: deterministic). Like the reference,
// the sum is in double, added to the old value in double and rounded once to float.
constexpr int kFinalizeLanes = 8;
__global__ void column_finalize_kernel(const float* part, int64_t workers, int64_t cols, Param out) {
  __shared__ double tile[kFinalizeLanes][33];
  const int64_t c = int64_t(blockIdx.x) * 32 + threadIdx.x;
  double s = 0;
  if (c < cols)
    for (int64_t w = threadIdx.y; w < workers; w += kFinalizeLanes) s += double(part[w * cols + c]);
  tile[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y != 0 || c >= cols) return;
  double total = 0;
#pragma unroll
  for (int k = 0; k < kFinalizeLanes; ++k) total += tile[k][threadIdx.x];
  const float old = load_param1(out, c);
  const float v = float(double(old) + total);
  if (out.bf16) static_cast<uint16_t*>(out.ptr)[c] = float_to_bf16_bits(v);
  else static_cast<float*>(out.ptr)[c] = v;
}

// ---- Host side -----------------------------------------------------------------------------

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

Param param_of(const Tensor& t) {
  return {t.defined() ? t.raw_data() : nullptr, t.defined() && t.dtype() == DType::BF16};
}

// A parameter read in vectors of `vec` elements must be aligned to one vector (16 bytes at most).
bool param_aligned(const Tensor& t, int vec) {
  if (!t.defined()) return true;
  const size_t bytes = static_cast<size_t>(vec) * dtype_size(t.dtype());
  return aligned(t.raw_data(), bytes < 16 ? bytes : 16);
}

// Multiprocessors of `device` and resident blocks of `kernel` per multiprocessor, cached.
int device_query(const void* kernel, int threads, int device) {
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int, int>, int> cache;
  std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_tuple(kernel, threads, device);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  int value = 0;
  if (kernel) TESSERA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&value, kernel, threads, 0));
  else TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&value, cudaDevAttrMultiProcessorCount, device));
  value = value > 0 ? value : 1;
  cache.emplace(key, value);
  return value;
}

// Threads per row (tpr, a power of two up to kMaxGroupThreads), rows per block and vectors
// per thread (nv, a power of two; 0 when the row needs more than max_nv). The group is sized
// so each thread holds about target_nv vectors.
struct RowConfig {
  int tpr, rpb, nv;
};
RowConfig row_config(int64_t vectors, int target_nv, int max_nv) {
  int tpr = 1;
  while (tpr < ceil_div(vectors, target_nv) && tpr < kMaxGroupThreads) tpr *= 2;
  int nv = 1;
  while (nv < ceil_div(vectors, tpr)) nv *= 2;
  return {tpr, tpr >= 64 ? 1 : 128 / tpr, nv <= max_nv ? nv : 0};
}

// fn(Int<nv>) for nv in {1, 2, 4, 8} up to kMax (only those get instantiated).
template <int kMax, typename Fn>
void dispatch_nv(int nv, Fn&& fn) {
  if (nv == 1) fn(Int<1>{});
  else if (nv == 2) fn(Int<2>{});
  else if constexpr (kMax >= 4) {
    if (nv == 4) fn(Int<4>{});
    else if constexpr (kMax >= 8) fn(Int<8>{});
  }
}

// fn(tag) with a typed null pointer for x's storage type.
template <typename Fn>
void dispatch_storage(DType t, Fn&& fn) {
  if (t == DType::F32) fn(static_cast<float*>(nullptr));
  else fn(static_cast<uint16_t*>(nullptr));
}

template <bool kLayer>
void norm_forward(void* stream, const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps, Tensor& y,
                  Tensor* mean, Tensor& rstd) {
  const int64_t cols = x.size(-1), rows = x.numel() / cols;
  if (rows == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  const Param g = param_of(gamma), b = param_of(beta);
  float* mean_ptr = mean ? mean->data<float>() : nullptr;
  dispatch_storage(x.dtype(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    constexpr int kVec = 16 / sizeof(T);
    const bool vectorized = cols % kVec == 0 && aligned(x.raw_data(), 16) && aligned(y.raw_data(), 16) &&
                            param_aligned(gamma, kVec) && param_aligned(beta, kVec);
    const RowConfig cfg = row_config(ceil_div(cols, vectorized ? kVec : 1), 4, kMaxForwardVectors);
    if (cfg.nv == 0) {
      TESSERA_CHECK(rows <= 0x7fffffff, "norm forward on CUDA: ", rows, " rows exceed one grid");
      norm_forward_wide_kernel<T, kLayer><<<unsigned(rows), kWideThreads, 0, s>>>(
          x.data<T>(), g, b, y.data<T>(), mean_ptr, rstd.data<float>(), cols, eps);
      return;
    }
    const int64_t blocks = ceil_div(rows, cfg.rpb);
    TESSERA_CHECK(blocks <= 0x7fffffff, "norm forward on CUDA: ", rows, " rows exceed one grid");
    auto launch = [&](auto vec_tag) {
      constexpr int VEC = decltype(vec_tag)::value;
      dispatch_nv<kMaxForwardVectors>(cfg.nv, [&](auto nv_tag) {
        constexpr int NV = decltype(nv_tag)::value;
        norm_forward_kernel<T, VEC, NV, kLayer><<<unsigned(blocks), dim3(cfg.tpr, cfg.rpb), 0, s>>>(
            x.data<T>(), g, b, y.data<T>(), mean_ptr, rstd.data<float>(), rows, cols, eps);
      });
    };
    if (vectorized) launch(Int<kVec>{});
    else launch(Int<1>{});
  });
  TESSERA_CUDA_CHECK_LAUNCH();
}

template <bool kLayer>
void norm_backward(void* stream, const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor* mean,
                   const Tensor& rstd, Tensor& dx, Tensor& dgamma, Tensor* dbeta) {
  const int64_t cols = x.size(-1), rows = x.numel() / cols;
  if (rows == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  const int device = x.device().index;
  const Param g = param_of(gamma);
  const float* mean_ptr = mean ? mean->data<float>() : nullptr;
  const bool has_dbeta = dbeta && dbeta->defined();
  const int sms = device_query(nullptr, 0, device);
  int64_t workers = 0;
  Tensor partials;  // [workers, cols] for dgamma, then (if any) the same for dbeta
  auto make_partials = [&] {
    partials = Tensor::empty({(has_dbeta ? 2 : 1) * workers * cols}, DType::F32, x.device());
  };
  float* dbeta_part = nullptr;
  dispatch_storage(x.dtype(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    constexpr int kVec = 16 / sizeof(T);
    const bool vectorized = cols % kVec == 0 && aligned(x.raw_data(), 16) && aligned(dy.raw_data(), 16) &&
                            aligned(dx.raw_data(), 16) && param_aligned(gamma, kVec);
    const RowConfig cfg = row_config(ceil_div(cols, vectorized ? kVec : 1), 1, kMaxBackwardVectors);
    if (cfg.nv == 0) {
      TESSERA_CHECK(rows <= 0x7fffffff, "norm backward on CUDA: ", rows, " rows exceed one grid");
      const int64_t col_blocks = ceil_div(cols, 256);
      workers = std::min<int64_t>({rows, std::max<int64_t>(1, 8 * sms / col_blocks), 65535});
      make_partials();
      dbeta_part = has_dbeta ? partials.data<float>() + workers * cols : nullptr;
      norm_column_partials_kernel<T, kLayer><<<dim3(unsigned(col_blocks), unsigned(workers)), 256, 0, s>>>(
          dy.data<T>(), x.data<T>(), mean_ptr, rstd.data<float>(), partials.data<float>(), dbeta_part, rows, cols);
      TESSERA_CUDA_CHECK_LAUNCH();
      norm_backward_dx_wide_kernel<T, kLayer><<<unsigned(rows), kWideThreads, 0, s>>>(
          dy.data<T>(), x.data<T>(), g, mean_ptr, rstd.data<float>(), dx.data<T>(), cols);
      return;
    }
    auto launch = [&](auto vec_tag) {
      constexpr int VEC = decltype(vec_tag)::value;
      dispatch_nv<kMaxBackwardVectors>(cfg.nv, [&](auto nv_tag) {
        constexpr int NV = decltype(nv_tag)::value;
        auto kernel = norm_backward_kernel<T, VEC, NV, kLayer>;
        const int threads = cfg.tpr * cfg.rpb;
        // One wave of workers: each resident row group is a worker.
        const int64_t resident = int64_t(sms) * device_query(reinterpret_cast<const void*>(kernel), threads, device);
        workers = std::min<int64_t>(rows, resident * cfg.rpb);
        make_partials();
        dbeta_part = has_dbeta ? partials.data<float>() + workers * cols : nullptr;
        kernel<<<unsigned(ceil_div(workers, cfg.rpb)), dim3(cfg.tpr, cfg.rpb), 0, s>>>(
            dy.data<T>(), x.data<T>(), g, mean_ptr, rstd.data<float>(), dx.data<T>(), partials.data<float>(),
            dbeta_part, rows, cols, workers);
      });
    };
    if (vectorized) launch(Int<kVec>{});
    else launch(Int<1>{});
  });
  TESSERA_CUDA_CHECK_LAUNCH();
  // The partials go back to the caching allocator when this returns; reuse is ordered on the
  // stream, as for every temporary of the CUDA backend.
  const dim3 finalize_grid(unsigned(ceil_div(cols, 32)));
  column_finalize_kernel<<<finalize_grid, dim3(32, kFinalizeLanes), 0, s>>>(partials.data<float>(), workers, cols,
                                                                            param_of(dgamma));
  TESSERA_CUDA_CHECK_LAUNCH();
  if (has_dbeta) {
    column_finalize_kernel<<<finalize_grid, dim3(32, kFinalizeLanes), 0, s>>>(dbeta_part, workers, cols,
                                                                              param_of(*dbeta));
    TESSERA_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace

bool norm_supported(std::initializer_list<const Tensor*> activations, std::initializer_list<const Tensor*> params,
                    std::initializer_list<const Tensor*> stats) {
  const DType first = (*activations.begin())->dtype();
  if (first != DType::F32 && first != DType::BF16) return false;
  for (const Tensor* t : activations)
    if (t->dtype() != first) return false;
  for (const Tensor* t : params)
    if (t->defined() && t->dtype() != DType::F32 && t->dtype() != DType::BF16) return false;
  for (const Tensor* t : stats)
    if (t->defined() && t->dtype() != DType::F32) return false;
  return true;
}

void layernorm_forward(void* stream, const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps, Tensor& y,
                       Tensor& mean, Tensor& rstd) {
  norm_forward<true>(stream, x, gamma, beta, eps, y, &mean, rstd);
}

void layernorm_backward(void* stream, const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                        const Tensor& rstd, Tensor& dx, Tensor& dgamma, Tensor& dbeta) {
  norm_backward<true>(stream, dy, x, gamma, &mean, rstd, dx, dgamma, &dbeta);
}

void rmsnorm_forward(void* stream, const Tensor& x, const Tensor& gamma, float eps, Tensor& y, Tensor& rstd) {
  norm_forward<false>(stream, x, gamma, Tensor(), eps, y, nullptr, rstd);
}

void rmsnorm_backward(void* stream, const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& rstd,
                      Tensor& dx, Tensor& dgamma) {
  norm_backward<false>(stream, dy, x, gamma, nullptr, rstd, dx, dgamma, nullptr);
}

}  // namespace tessera::cuda
