// The LayerNorm/RMSNorm kernels, shared by norm.cu (the plain ops) and add_norm.cu (the same
// ops with a residual add fused in) through norm_launch.cuh. Every kernel is a template on
// kLayer (LayerNorm or RMSNorm) and kAdd (the fused variant); kAdd = false is exactly the
// plain kernel. Included by those two .cu files only: everything sits in an anonymous
// namespace, so each file instantiates just the variants it launches. The backward kernels
// (register and looping dx, column partials, finalize) are in norm_backward_kernels.cuh,
// included at the end of this file.
//
// Layout: x, y, dy, dx (and the residual, its sum, the residual gradient) contiguous
// [rows, C] of one dtype (F32 or BF16); gamma, beta, dgamma, dbeta [C], each F32 or BF16 on
// its own (read through a runtime flag, not a template, so mixed master-weight/activation
// dtypes cost no extra instantiations); mean, rstd F32.
//
// Kernels: a row is handled by a group of threads (1 to 512, a power of two) and, when it
// fits, kept in registers, so x (and dy) are read from memory once; 16-byte loads when C and
// every pointer allow it, scalar otherwise. Groups loop over rows and load the next row (as
// raw words) before reducing the current one, so two rows of loads are in flight per group:
// with one, every row's loads waited behind its reductions and the kernels ran at half the
// copy bandwidth. Rows too wide for registers take a looping path that re-reads them
// (mostly from L2). Per-row sums are taken in double, as the reference does: a degenerate
// row (C = 1, where RMSNorm's dx = rstd*g*(1 - xhat^2) cancels) then gets the reference's
// rstd bit for bit, and the per-element float math is written with explicit round-to-nearest
// intrinsics so that nvcc does not contract it into FMAs the reference does not use. (Double
// FMAs appear only where the product is of two floats: it is exact in double, so the fused
// form rounds exactly as the reference's multiply-then-add.) F32 rows add every element in
// double. BF16 rows of 16-byte vectors add each vector's eight terms in float first and
// convert once per vector (a BF16 value and its square are exact in float; the sum of eight
// rounds by ~1e-7 relative, far below the float rounding of the statistic): an SM converts
// float to double at 16 per clock, and one conversion per element took as long as the
// memory traffic.
//
// Measured (bench_bandwidth, H200, 16384 x 4096 BF16, % of cudaMemcpy D2D in the same run,
// before -> after): layernorm fwd 55 -> 59, bwd 47 -> 68; rmsnorm fwd 72 -> 84,
// bwd 60 -> 83; layernorm_backward_add 54 -> 65, rmsnorm_backward_add 65 -> 72;
// add_layernorm / add_rmsnorm fwd 77 / 94 before (see add_norm.cu). Below the 85% goal:
// the LayerNorm kernels (two row reductions forward, FP64 shuffles on the critical path) and
// the backward (128 registers a thread for the row plus the dgamma/dbeta partials: 16 warps
// per SM), see bench/RESULTS.md. Since (ninth session): BF16 stores through the
// hardware conversion and the parameter dtype fixed per row (fewer instructions, same bits);
// the fused RMSNorm backward's residual gradient loaded before the row's reduction instead
// of after it (norm_backward_kernels.cuh: same bits). Measured after (ninth session):
// layernorm bwd 80%, rmsnorm bwd 90%, layernorm_backward_add 70%, rmsnorm_backward_add 98%.
// Since (twelfth session): the fused LayerNorm backward's dbeta partial in shared memory and
// its residual gradient loaded early, as RMSNorm's (norm_backward_kernels.cuh): 70.3% ->
// 87.0% of copy; the plain LayerNorm backward unchanged (78.9-80.1%).
//
// Output sinks: the forward kernels hand each computed vector of y (in float, before the
// rounding to the storage type) to a sink, a template parameter: StoreY stores it in x's
// dtype (the plain ops); norm_fp8.cu's sink casts it to FP8 and takes its amax instead, so
// the normalized activation need not be written at all. A sink is called as sink.begin()
// once per thread, sink.store<N>(i, v) per vector (elements i..i+N-1, i a multiple of N),
// and sink.finish() once at the end by every thread of the block (it may reduce over it).
//
// Fused residual add (kAdd): forward forms sum = x + residual in float, rounds it to the
// storage dtype exactly as the add kernel does, stores it and normalizes the ROUNDED value,
// so the result equals add() followed by the plain norm. Backward rounds the norm's dx to
// the storage dtype (as the plain op's store would), then adds the residual gradient in
// float and rounds again: again exactly the plain op followed by add(). Each thread reads
// every element it writes before writing it, and no thread reads an element another thread
// writes, so the sum may be x or the residual, and dx may be dy or the residual gradient.
//
// dgamma/dbeta: a fixed set of "workers" (row groups, one wave of the GPU) each sums its
// contiguous chunk of rows into a float partial row of a scratch buffer; a second kernel adds
// the partials in worker order in double and accumulates into dgamma/dbeta. No atomics, so
// results are identical from run to run (the worker count depends on the GPU model).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

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
    floats_to_bf16_pairs<N>(v, w);
    store_words<2 * N>(p, w);
  }
}

// N consecutive elements kept as raw 32-bit words (a BF16 pair per word; a lone BF16 in the
// low half), so a load can be issued a row ahead and converted only when the row is used.
template <typename T, int N>
constexpr int kRawWords = (N * int(sizeof(T)) + 3) / 4;

template <typename T, int N>
__device__ __forceinline__ void load_raw(const T* p, uint32_t* w) {
  if constexpr (N * sizeof(T) >= 4) load_words<N * int(sizeof(T))>(p, w);
  else w[0] = *p;  // one BF16
}

template <typename T, int N>
__device__ __forceinline__ void unpack_raw(const uint32_t* w, float* v) {
  if constexpr (std::is_same_v<T, float>) {
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = __uint_as_float(w[k]);
  } else if constexpr (N == 1) {
    v[0] = __uint_as_float(w[0] << 16);
  } else {
#pragma unroll
    for (int k = 0; k < N / 2; ++k) {
      v[2 * k] = __uint_as_float(w[k] << 16);
      v[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
    }
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

// How a kernel's inner loops read the parameters: kParamAny through the run-time flags, or,
// when every parameter read is defined and of one dtype, with that dtype fixed at compile
// time. The flag test costs little itself, but the loads and conversions of both dtypes are
// issued (one predicated off) for every vector; a kernel picks the kind once (uniform
// branch) and runs its row loop specialized for it.
constexpr int kParamAny = 0, kParamF32 = 1, kParamBF16 = 2;

template <int kKind, int N>
__device__ __forceinline__ void load_param_as(const Param& p, int64_t i, float* v) {
  if constexpr (kKind == kParamBF16) load_vec<uint16_t, N>(static_cast<const uint16_t*>(p.ptr) + i, v);
  else if constexpr (kKind == kParamF32) load_vec<float, N>(static_cast<const float*>(p.ptr) + i, v);
  else load_param<N>(p, i, v);
}

// fn(Int<kind>) for gamma and, with kUsesBeta (LayerNorm's forward), beta; a missing beta
// (its + 0) or one of another dtype than gamma keeps the flag path, and so does every call
// with kSpecialize = false: a fixed kind lets nvcc hoist the parameter loads of all of a
// thread's vectors, which costs registers (the warp-row forward at 8 and 16 vectors a lane
// went from 77 and 128 to 128 and 214).
template <bool kUsesBeta, bool kSpecialize = true, typename Fn>
__device__ __forceinline__ void with_param_kind(const Param& gamma, const Param& beta, Fn&& fn) {
  if (!kSpecialize || (kUsesBeta && (!beta.ptr || beta.bf16 != gamma.bf16))) fn(Int<kParamAny>{});
  else if (gamma.bf16) fn(Int<kParamBF16>{});
  else fn(Int<kParamF32>{});
}

// The normalized values of VEC columns from c: (x - mean) * rstd * gamma + beta for LayerNorm
// (no beta: + 0), x * rstd * gamma for RMSNorm, with the reference's operations in its order,
// each rounded (no fused multiply-add), so every kernel family gives the same y from the same
// statistics. kKind: see with_param_kind (a fixed kind implies LayerNorm's beta is there).
template <int VEC, bool kLayer, int kKind = kParamAny>
__device__ __forceinline__ void normalize_vec(const float* v, float mu, float rstd, const Param& gamma,
                                              const Param& beta, int64_t c, float* out) {
  float g[VEC], b[VEC];
  load_param_as<kKind, VEC>(gamma, c, g);
  if (kLayer && (kKind != kParamAny || beta.ptr)) load_param_as<kKind, VEC>(beta, c, b);
  else
#pragma unroll
    for (int k = 0; k < VEC; ++k) b[k] = 0.0f;
#pragma unroll
  for (int k = 0; k < VEC; ++k)
    out[k] = kLayer ? __fadd_rn(__fmul_rn(__fmul_rn(__fsub_rn(v[k], mu), rstd), g[k]), b[k])
                    : __fmul_rn(__fmul_rn(v[k], rstd), g[k]);
}

// v rounded to the storage type T and back: what a store to T followed by a load gives.
template <typename T>
__device__ __forceinline__ float round_to_storage(float v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else return bf16_bits_to_float(float_to_bf16_bits(v));
}

// round_to_storage of N consecutive values in place (BF16: one conversion a pair).
template <typename T, int N>
__device__ __forceinline__ void round_vec_to_storage(float* v) {
  if constexpr (std::is_same_v<T, float>) {
    return;
  } else if constexpr (N == 1) {
    v[0] = round_to_storage<T>(v[0]);
  } else {
    uint32_t w[N / 2];
    floats_to_bf16_pairs<N>(v, w);
    unpack_raw<T, N>(w, v);
  }
}

// store_vec, with v replaced by the values stored (what a load of p gives back): a single
// conversion for the store and the rounded values.
template <typename T, int N>
__device__ __forceinline__ void store_vec_rounded(T* p, float* v) {
  if constexpr (std::is_same_v<T, float> || N == 1) {
    round_vec_to_storage<T, N>(v);
    store_vec<T, N>(p, v);
  } else {
    uint32_t w[N / 2];
    floats_to_bf16_pairs<N>(v, w);
    store_words<2 * N>(p, w);
    unpack_raw<T, N>(w, v);
  }
}

// The plain ops' sink: y in the storage type T.
template <typename T>
struct StoreY {
  T* y;
  __device__ __forceinline__ void begin() {}
  template <int N>
  __device__ __forceinline__ void store(int64_t i, const float* v) {
    store_vec<T, N>(y + i, v);
  }
  __device__ __forceinline__ void finish() {}
  // Whether vectors of `vec` elements can be stored (the launcher's alignment check).
  bool aligned_for(int /*vec*/) const { return reinterpret_cast<uintptr_t>(y) % 16 == 0; }
};

// 1 / cols when cols is a power of two, else 0. With it, x / cols becomes x * (1 / cols): the
// reciprocal is exact, so the product is the same correctly rounded quotient (subnormal
// results included), while a division is a ~15-instruction sequence with a slow-path test
// run once per row by every warp of the group.
__device__ __forceinline__ double pow2_reciprocal(int64_t cols) {
  return cols > 0 && (cols & (cols - 1)) == 0 ? 1.0 / double(cols) : 0.0;
}

__device__ __forceinline__ double div_cols(double x, int64_t cols, double inv) {
  return inv != 0.0 ? __dmul_rn(x, inv) : x / double(cols);
}

__device__ __forceinline__ float div_cols(float x, int64_t cols, double inv) {
  return inv != 0.0 ? __fmul_rn(x, float(inv)) : __fdiv_rn(x, float(cols));
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

// Group g = blockIdx.x * blockDim.y + threadIdx.y normalizes rows g, g + G, g + 2G, ...
// (G = groups in the grid, about one wave: the launcher sizes the grid). The next row's x
// (and residual) is loaded as raw words before the current row is reduced and written, so a
// group keeps two rows of loads in flight; every group steps the same number of times (the
// shuffles of narrow groups sharing a warp need the whole warp).
// kAdd: the row normalized is sum = x + residual, rounded to T and stored (residual and sum
// are null otherwise).
template <typename T, int VEC, int NV, bool kLayer, bool kAdd, typename Sink>
__global__ void __launch_bounds__(kMaxGroupThreads)
    norm_forward_kernel(const T* x, const T* residual, T* sum, Param gamma, Param beta, Sink sink, float* mean,
                        float* rstd, int64_t rows, int64_t cols, double eps) {
  // Two buffers per reduction, alternating by step: a step's reduction reuses the buffer of
  // two steps back, which every thread has left (it passed the barrier of the step between).
  __shared__ double red[2][2][1][32];
  constexpr int W = kRawWords<T, VEC>;
  const int64_t groups = int64_t(gridDim.x) * blockDim.y;
  const int64_t group = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  const int64_t steps = (rows + groups - 1) / groups;
  uint32_t raw_x[NV][W] = {}, raw_r[kAdd ? NV : 1][W] = {};
  auto fetch = [&](int64_t row) {
    if (row >= rows) return;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int64_t c = (int64_t(j) * blockDim.x + threadIdx.x) * VEC;
      if (c < cols) {
        load_raw<T, VEC>(x + row * cols + c, raw_x[j]);
        if constexpr (kAdd) load_raw<T, VEC>(residual + row * cols + c, raw_r[j]);
      }
    }
  };
  // The widest rows (8 vectors a thread) load at the top of their step instead: their
  // prefetched words would not fit in registers next to the row.
  constexpr bool kPrefetch = NV * VEC * int(sizeof(T)) <= 64;
  if (kPrefetch) fetch(group);
  sink.begin();

#pragma unroll 1
  for (int64_t step = 0; step < steps; ++step) {
    const int64_t row = group + step * groups;
    const bool live = row < rows;
    const int64_t base = (live ? row : 0) * cols;
    float v[NV][VEC];
    double acc[1] = {0};
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int64_t c = (int64_t(j) * blockDim.x + threadIdx.x) * VEC;
      if (live && c < cols) {
        if constexpr (!kPrefetch) {  // loaded here, one unit at a time
          load_raw<T, VEC>(x + base + c, raw_x[j]);
          if constexpr (kAdd) load_raw<T, VEC>(residual + base + c, raw_r[j]);
        }
        unpack_raw<T, VEC>(raw_x[j], v[j]);
        if constexpr (kAdd) {
          float r[VEC];
          unpack_raw<T, VEC>(raw_r[j], r);
#pragma unroll
          for (int k = 0; k < VEC; ++k) v[j][k] = __fadd_rn(v[j][k], r[k]);
          store_vec_rounded<T, VEC>(sum + base + c, v[j]);  // after this thread's reads of the same elements
        }
      } else {
#pragma unroll
        for (int k = 0; k < VEC; ++k) v[j][k] = 0.0f;
      }
    }
    if (kPrefetch) fetch(row + groups);
    // F32 storage adds each element in double, as the reference. BF16 storage first adds a
    // unit's VEC terms in float (a BF16 value and its square are exact in float; their sum of
    // eight rounds by ~1e-7, far below the float rounding of the final statistic) and converts
    // once per unit: the float-to-double conversions, 16 per clock on an SM, otherwise take
    // as long as the memory traffic. With VEC = 1 (odd widths) both are the reference's sum.
    constexpr bool kUnitPartials = !std::is_same_v<T, float> && VEC > 1;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      if constexpr (kUnitPartials) {
        float p = 0.0f;
#pragma unroll
        for (int k = 0; k < VEC; ++k) p = kLayer ? __fadd_rn(p, v[j][k]) : fmaf(v[j][k], v[j][k], p);
        acc[0] = __dadd_rn(acc[0], double(p));
      } else {
#pragma unroll
        for (int k = 0; k < VEC; ++k)
          acc[0] = kLayer ? __dadd_rn(acc[0], double(v[j][k])) : fma(double(v[j][k]), double(v[j][k]), acc[0]);
      }
    }
    group_sum(acc, red[step & 1][0]);
    double mu = 0, inv_std;
    if constexpr (kLayer) {
      mu = acc[0] / double(cols);
      const float mu_f = float(mu);
      double squares[1] = {0};  // second pass over the registers: no cancellation
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        const int64_t c = (int64_t(j) * blockDim.x + threadIdx.x) * VEC;
        if (live && c < cols) {
          if constexpr (!kUnitPartials) {
#pragma unroll
            for (int k = 0; k < VEC; ++k) {
              const double d = __dsub_rn(double(v[j][k]), mu);
              squares[0] = __dadd_rn(squares[0], __dmul_rn(d, d));
            }
          } else {  // BF16: centred on the float mean, squared and summed in float per unit
            float p = 0.0f;
#pragma unroll
            for (int k = 0; k < VEC; ++k) {
              const float d = __fsub_rn(v[j][k], mu_f);
              p = fmaf(d, d, p);
            }
            squares[0] = __dadd_rn(squares[0], double(p));
          }
        }
      }
      group_sum(squares, red[step & 1][1]);
      inv_std = 1.0 / sqrt(squares[0] / double(cols) + eps);
    } else {
      inv_std = 1.0 / sqrt(acc[0] / double(cols) + eps);
    }
    // y is computed from the rounded statistics, as the reference does.
    const float mu_t = float(mu), rstd_t = float(inv_std);
    if (!live) continue;
    if (threadIdx.x == 0) {
      if (kLayer) mean[row] = mu_t;
      rstd[row] = rstd_t;
    }
    with_param_kind<kLayer>(gamma, beta, [&](auto kind) {
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        const int64_t c = (int64_t(j) * blockDim.x + threadIdx.x) * VEC;
        if (c >= cols) continue;
        float out[VEC];
        normalize_vec<VEC, kLayer, decltype(kind)::value>(v[j], mu_t, rstd_t, gamma, beta, c, out);
        sink.template store<VEC>(base + c, out);
      }
    });
  }
  sink.finish();
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

// kAdd: the first pass forms and stores sum = x + residual; the later passes re-read the row
// from sum, each thread only the elements it wrote itself.
template <typename T, bool kLayer, bool kAdd, typename Sink>
__global__ void __launch_bounds__(kWideThreads)
    norm_forward_wide_kernel(const T* x, const T* residual, T* sum, Param gamma, Param beta, Sink sink, float* mean,
                             float* rstd, int64_t cols, double eps) {
  __shared__ double red[2][1][32];
  sink.begin();
  const int64_t base = int64_t(blockIdx.x) * cols;
  double acc[1] = {0};
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    float v = load1(x, base + c);
    if constexpr (kAdd) {
      v = round_to_storage<T>(__fadd_rn(v, load1(residual, base + c)));
      store_vec<T, 1>(sum + base + c, &v);
    }
    acc[0] = kLayer ? __dadd_rn(acc[0], double(v)) : fma(double(v), double(v), acc[0]);
  }
  group_sum(acc, red[0]);
  if constexpr (kAdd) x = sum;
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
    sink.template store<1>(base + c, out);
  }
  sink.finish();
}

}  // namespace

}  // namespace tessera::cuda

// The backward kernels (dx and the dgamma/dbeta partials) build on the helpers above.
#include "norm_backward_kernels.cuh"
