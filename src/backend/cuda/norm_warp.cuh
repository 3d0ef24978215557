// The warp-row LayerNorm/RMSNorm kernels (the default forward; backward with NormTuning::kernel = 2): a second kernel family
// beside the row-group kernels of norm_kernels.cuh, launched from norm_launch.cuh when the
// row is vectorizable and fits in registers; otherwise the row-group kernels run. Same
// formulas, gradient rule, output sinks and in-place guarantees as those kernels; different
// statistics arithmetic (below). Included by norm_launch.cuh only (anonymous namespace).
//
// Layout: as norm_kernels.cuh, and only the 16-byte-vector case: C a multiple of VEC
// (8 BF16 or 4 F32 elements), every activation pointer and the parameters aligned to it.
//
// Threading: a row is held by a "row group" of one to eight warps (blockDim.x = 32 * warps),
// blockDim.y groups per block. The row lives in registers as raw 16-byte words (packed BF16
// pairs): lane l of warp w of the group holds vectors (j * warps + w) * 32 + l for j < NV,
// so each warp's loads are contiguous 512-byte runs. All loads of a row are issued before
// its reduction; the statistics are taken in FP32 from those registers, in ONE reduction
// for both norms (LayerNorm's forward merges (count, mean, M2) partial moments, below);
// a group of one warp reduces with shuffles only, wider groups combine the warp results
// through shared memory (in warp order) behind a named barrier of the group alone.
// Forward holds up to 16 words a lane by default (C = 4096 BF16: four warps, 32 BF16 a
// lane; NormTuning::warp_words = 64 puts it on one warp, 128 registers, no barrier at all);
// backward 8 words of x and of dy (eight warps at 4096). Persistent forward groups and
// backward workers of small rows load the next row before reducing the current one.
//
// Numerics: FP32 sums of at most NV * VEC terms per lane, then a butterfly over lanes and
// an ordered sum over warps: relative error ~1e-7 against the reference's double sums,
// well inside the DESIGN.md tolerances (statistics 1e-5, BF16 outputs 1e-2), but not the
// reference's bits: the row-group kernels stay for the C = 1 style exactness tests.
// LayerNorm's forward: each 16-byte vector's mean and M2 (sum of squared deviations from
// that mean) exactly, two passes over its 8 or 4 values in registers; merged into the
// thread's, then over lanes and warps, by Chan et al.'s rule (mean_a + d * n_b / n and
// M2_a + M2_b + d^2 n_a n_b / n, d = mean_b - mean_a): never E[x^2] - E[x]^2, which loses
// the variance of rows far from zero (test: GpuNormWarp.LargeRowOffsetKeepsTheVariance).
// Lanes past the end of a row count 0 and leave the other part as it is. A fixed merge
// order, so deterministic, and every thread of the group ends with the same bits.
// rstd = 1/sqrt(var + eps) is formed in double once per row, as the reference rounds it.
//
// Backward: dx = rstd * (g*dy - mean(g*dy) - xhat * mean(g*dy*xhat)) with x and dy in
// registers and both row sums in one two-float reduction. dgamma/dbeta: each group is a
// worker over a contiguous chunk of rows (one wave of workers), accumulating its columns in
// FP32 registers; the groups of a block add theirs in group order in shared memory and the
// block writes one partial row; column_finalize_kernel (norm_kernels.cuh) sums the
// partials in block order in double: no atomics, deterministic.
//
// Floor (H200, ~4.1 TB/s copy), 16384 x 4096 BF16: forward 2 activation passes (268 MB,
// ~65 us), backward 3 (403 MB, ~98 us) plus one partial row per block per parameter
// (264 blocks x 4096 x 4 B = 4.3 MB each way at the default shape), the add forms 4 passes
// (537 MB, ~130 us). Measured on the H200 (bench_bandwidth 20 norm --sweep-norm, % of
// cudaMemcpy in the same run; row-group kernels in brackets): forward at 16 words LayerNorm
// 71% (59), add+LayerNorm 86% (71), RMSNorm 90% (82), add+RMSNorm 96% (82); backward at its
// default LayerNorm 68% (67), with the residual 64% (64), RMSNorm 81% (81), with the residual
// 71% (70): the backward is held by x, dy and the column partials all in registers.
// Since (ninth session): BF16 stores through the hardware conversion (one
// instruction a pair, numeric.h) and the parameter dtype fixed per row (with_param_kind),
// ~8 fewer instructions per element in the forward's row path (SASS); same bits. Then: the
// forward's mean and mean square divided by C through div_cols (a multiplication when C is
// a power of two, same bits). Measured after (H200, same shape and bench, 2026-11-30 ninth
// session): LayerNorm forward 72.5% -> 81.4%, RMSNorm forward 96%, LayerNorm backward 80%.
// Since (twelfth session; LayerNorm forward only: 81.4% -> 90.6-90.9% of copy, H200,
// bench_bandwidth 20 norm, 16384 x 4096 BF16, two runs): one
// reduction of merged moments instead of two dependent ones (the mean, then the centred
// squares: two butterflies and two barriers before any output); y's formula and rstd's
// double unchanged, the mean's and rstd's bits change with the summation order. sm_90
// registers (ptxas), before -> after: 4 vectors a lane (the default at 4096 BF16) 64 -> 48
// (five blocks an SM instead of four), add+LayerNorm 64 -> 62, 1/2/8/16 vectors 48/48/80/128
// -> 32/40/61/108; persistent 79 -> 76 at 4, 113 -> 102 at 8, 48 -> 60 at 2; no spills
// (without the two measures noted at the code, 4 vectors a lane took 94).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "norm_kernels.cuh"

namespace tessera::cuda {

namespace {

constexpr int kWarpRowThreads = 256;  // threads per block of the warp-row kernels
constexpr int kWarpRowMaxGroups = 8;  // row groups per block (blockDim.y)
constexpr int kWarpRowMaxWarps = 8;   // warps per row group

// A 16-byte vector of T as floats and back (the values are representable in T).
template <typename T>
__device__ __forceinline__ void unpack16(const uint4& q, float* v) {
  const uint32_t w[4] = {q.x, q.y, q.z, q.w};
  unpack_raw<T, 16 / int(sizeof(T))>(w, v);
}

template <typename T>
__device__ __forceinline__ uint4 pack16(const float* v) {
  if constexpr (std::is_same_v<T, float>) {
    return make_uint4(__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]), __float_as_uint(v[3]));
  } else {
    uint32_t w[4];
    floats_to_bf16_pairs<8>(v, w);
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// Barrier of the row group threadIdx.y alone (ids 1..8; 0 is __syncthreads).
__device__ __forceinline__ void group_barrier() {
  asm volatile("bar.sync %0, %1;" ::"r"(1 + int(threadIdx.y)), "r"(int(blockDim.x)) : "memory");
}

// Sums v over the row group; every thread receives the same bits. shared: this group's
// [2][K][kWarpRowMaxWarps] slots, alternating by call (phase): a call writes the buffer of
// two calls back, which every thread of the group has read before it reached the barrier
// of the call in between, so one barrier per call suffices.
template <int K>
__device__ __forceinline__ void warp_row_sum(float (&v)[K], float (*shared)[K][kWarpRowMaxWarps], int& phase) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2)
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] += __shfl_xor_sync(0xffffffffu, v[k], offset);
  const int warps = int(blockDim.x >> 5);
  if (warps == 1) return;
  float(*slot)[kWarpRowMaxWarps] = shared[phase];
  phase ^= 1;
  if ((threadIdx.x & 31) == 0)
#pragma unroll
    for (int k = 0; k < K; ++k) slot[k][threadIdx.x >> 5] = v[k];
  group_barrier();
#pragma unroll
  for (int k = 0; k < K; ++k) {
    float s = slot[k][0];
    for (int w = 1; w < warps; ++w) s += slot[k][w];
    v[k] = s;
  }
}

// Count, mean and M2 (sum of squared deviations from that mean) of part of a row: what
// LayerNorm's forward reduces, so that the mean and the centred sum of squares come out of
// ONE reduction instead of two dependent ones, without the cancellation of E[x^2] - E[x]^2.
struct RowMoments {
  float n, mean, m2;
};

// Chan et al.'s merge of two disjoint parts. kEqual: both parts count the same (a row that
// fills every lane alike), so n_b / n = 1/2: no division, and the mean is written as
// (mean_a + mean_b) / 2, symmetric in a and b (bit for bit: the two lanes of a butterfly pair
// call it with a and b swapped and must agree) and correctly rounded. Otherwise the caller
// passes the parts in a fixed order, and a part of no values (lanes past the end of the row:
// mean and M2 0) leaves the other as it is (n_b / n = 1 when a is empty, 0 when b is).
template <bool kEqual>
__device__ __forceinline__ RowMoments merge_moments(const RowMoments& a, const RowMoments& b) {
  const float d = __fsub_rn(b.mean, a.mean), d2 = __fmul_rn(d, d), m2 = __fadd_rn(a.m2, b.m2);
  const float n = __fadd_rn(a.n, b.n);
  if constexpr (kEqual) {
    return {n, __fmul_rn(__fadd_rn(a.mean, b.mean), 0.5f), fmaf(d2, __fmul_rn(a.n, 0.5f), m2)};
  } else {
    // n_b / n (a.n * wb = n_a n_b / n); an approximate quotient (a reciprocal and a product)
    // is deterministic too, and its ~2 ulp move the mean by far less than its own rounding.
    const float wb = a.n == 0.0f ? 1.0f : __fdividef(b.n, n);
    return {n, fmaf(d, wb, a.mean), fmaf(d2, __fmul_rn(a.n, wb), m2)};
  }
}

// Merges the moments of lanes within aligned blocks of `width` lanes (a power of two up to
// 32) by an xor butterfly, so every lane of a block ends with the same bits: kEqual's merge
// is symmetric; otherwise the lower lane of each pair is a.
template <bool kEqual>
__device__ __forceinline__ void butterfly_moments(RowMoments& m, int width) {
  const int lane = int(threadIdx.x) & 31;
#pragma unroll
  for (int offset = 1; offset < 32; offset *= 2) {
    if (offset >= width) break;
    RowMoments o;
    o.mean = __shfl_xor_sync(0xffffffffu, m.mean, offset);
    o.m2 = __shfl_xor_sync(0xffffffffu, m.m2, offset);
    if constexpr (kEqual) {
      o.n = m.n;
      m = merge_moments<true>(m, o);
    } else {
      o.n = __shfl_xor_sync(0xffffffffu, m.n, offset);
      m = lane & offset ? merge_moments<false>(o, m) : merge_moments<false>(m, o);
    }
  }
}

// Merges every thread's moments over the row group; every thread receives the same bits.
// Lanes, then warps: lane 0 of each warp stores its warp's moments in `shared` (this group's
// [2][3][kWarpRowMaxWarps], alternating by phase as warp_row_sum's), and after the barrier
// lane l takes warp l % warps's and the same butterfly runs over blocks of `warps` lanes: a
// tree in warp order (adjacent pairs first), each block computing it alike. With equal
// counts every merge is again of two equal parts (the warps are a power of two).
template <bool kEqual>
__device__ __forceinline__ void warp_row_moments(RowMoments& m, float (*shared)[3][kWarpRowMaxWarps], int& phase) {
  butterfly_moments<kEqual>(m, 32);
  const int warps = int(blockDim.x >> 5);
  if (warps == 1) return;
  float(*slot)[kWarpRowMaxWarps] = shared[phase];
  phase ^= 1;
  if ((threadIdx.x & 31) == 0) {
    slot[0][threadIdx.x >> 5] = m.mean;
    slot[1][threadIdx.x >> 5] = m.m2;
    if (!kEqual) slot[2][threadIdx.x >> 5] = m.n;
  }
  group_barrier();
  const int w = int(threadIdx.x) & (warps - 1);
  m = {kEqual ? m.n : slot[2][w], slot[0][w], slot[1][w]};
  butterfly_moments<kEqual>(m, warps);
}

// Column of vector j of this thread (32-bit: a row that fits in registers is short).
__device__ __forceinline__ int warp_row_col(int j, int vec) { return (j * int(blockDim.x) + int(threadIdx.x)) * vec; }

// rstd from a float mean square, in double as the reference (once per row); inv_cols from
// pow2_reciprocal (the division becomes a multiplication, same bits, when it is exact).
__device__ __forceinline__ float rstd_of(float sum_squares, int64_t cols, double inv_cols, double eps) {
  return float(1.0 / sqrt(div_cols(double(sum_squares), cols, inv_cols) + eps));
}

// Vectors of row `row` this thread holds (zeros past the end of the row).
template <typename T, int NV>
__device__ __forceinline__ void warp_row_load(const T* p, int64_t row, int64_t cols, uint4 (&dst)[NV]) {
  constexpr int VEC = 16 / int(sizeof(T));
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int c = warp_row_col(j, VEC);
    dst[j] = c < int(cols) ? *reinterpret_cast<const uint4*>(p + row * cols + c) : make_uint4(0, 0, 0, 0);
  }
}

template <typename Sink>
constexpr bool kStoresY = false;
template <typename T>
constexpr bool kStoresY<StoreY<T>> = true;

// Row group g = blockIdx.x * blockDim.y + threadIdx.y normalizes rows g, g + G, ... (G =
// groups in the grid: one row each, or with kPersistent a wave looping over the rows; its
// groups of up to 8 words a lane per operand load the next row before reducing this one,
// so two rows of loads are in flight). kAdd: the row normalized is sum = x + residual
// rounded to T, stored (each thread stores only what it read).
template <typename T, int NV, bool kLayer, bool kAdd, bool kPersistent, typename Sink>
__global__ void __launch_bounds__(kWarpRowThreads)
    warp_norm_forward_kernel(const T* x, const T* residual, T* sum, Param gamma, Param beta, Sink sink, float* mean,
                             float* rstd, int64_t rows, int64_t cols, double eps) {
  constexpr int VEC = 16 / int(sizeof(T));
  constexpr bool kPrefetch = kPersistent && NV * (kAdd ? 2 : 1) <= 8;
  constexpr int NP = kPrefetch ? NV : 1;
  __shared__ float red[kWarpRowMaxGroups][2][kLayer ? 3 : 1][kWarpRowMaxWarps];
  const int ncols = int(cols);
  const int64_t groups = int64_t(gridDim.x) * blockDim.y;
  // LayerNorm: whether every thread of the group holds as many of a row's values (its vectors
  // a multiple of the group's threads, a power of two): then every merge is of equal halves.
  const bool equal_counts = ((ncols / VEC) & (int(blockDim.x) - 1)) == 0;
  // The divisions by C as multiplications only where that costs no occupancy (sm_90 SASS:
  // at 1 and 2 vectors a lane 40-48 registers became 45-63, one block an SM fewer; at 16,
  // in the persistent loop and with norm_fp8.cu's sink, a spill or a block fewer): 4 to 8
  // vectors a lane, one row a group, y stored.
  constexpr bool kExactReciprocal = !kPersistent && NV >= 4 && NV <= 8 && kStoresY<Sink>;
  const double inv_cols = kExactReciprocal ? pow2_reciprocal(cols) : 0.0;
  int phase = 0;
  uint4 next_x[NP], next_r[kAdd ? NP : 1];
  int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  if constexpr (kPrefetch) {
    if (row < rows) {
      warp_row_load<T, NP>(x, row, cols, next_x);
      if constexpr (kAdd) warp_row_load<T, NP>(residual, row, cols, next_r);
    }
  }
  sink.begin();
#pragma unroll 1
  for (; row < rows; row += groups) {
    const int64_t base = row * cols;
    uint4 raw[NV], res[kAdd ? NV : 1];
    if constexpr (kPrefetch) {
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        raw[j] = next_x[j];
        if constexpr (kAdd) res[j] = next_r[j];
      }
      if (row + groups < rows) {
        warp_row_load<T, NP>(x, row + groups, cols, next_x);
        if constexpr (kAdd) warp_row_load<T, NP>(residual, row + groups, cols, next_r);
      }
    } else {
      warp_row_load<T, NV>(x, row, cols, raw);
      if constexpr (kAdd) warp_row_load<T, NV>(residual, row, cols, res);
    }
    if constexpr (kAdd) {
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        const int c = warp_row_col(j, VEC);
        if (c >= ncols) continue;
        float a[VEC], b[VEC];
        unpack16<T>(raw[j], a);
        unpack16<T>(res[j], b);
#pragma unroll
        for (int k = 0; k < VEC; ++k) a[k] = __fadd_rn(a[k], b[k]);
        raw[j] = pack16<T>(a);  // rounds to T: the later passes read the rounded sum
        *reinterpret_cast<uint4*>(sum + base + c) = raw[j];  // after this thread's reads of it
      }
    }
    float mu = 0.0f, r;
    if constexpr (kLayer) {
      // This thread's moments, built a vector at a time: each vector's mean and M2 exactly
      // (two passes over its eight or four values), merged into the thread's in order (the
      // vectors in the row are a prefix of j, so vector j always joins j equal parts: weights
      // fixed at compile time). Then one merge over the group.
      RowMoments m{0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        if (warp_row_col(j, VEC) >= ncols) continue;
        float v[VEC], sv = 0.0f, q = 0.0f;
        unpack16<T>(raw[j], v);
#pragma unroll
        for (int k = 0; k < VEC; ++k) sv = __fadd_rn(sv, v[k]);
        const float vm = __fmul_rn(sv, 1.0f / VEC);  // exact: VEC is a power of two
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const float d = __fsub_rn(v[k], vm);
          q = fmaf(d, d, q);
        }
        if (j == 0) {
          m = {float(VEC), vm, q};
        } else {
          const float d = __fsub_rn(vm, m.mean);
          m.n = float((j + 1) * VEC);
          m.mean = fmaf(d, 1.0f / float(j + 1), m.mean);
          m.m2 = fmaf(__fmul_rn(d, d), float(j * VEC) / float(j + 1), __fadd_rn(m.m2, q));
        }
      }
      if (equal_counts) warp_row_moments<true>(m, red[threadIdx.y], phase);
      else warp_row_moments<false>(m, red[threadIdx.y], phase);
      mu = m.mean;
      r = rstd_of(m.m2, cols, inv_cols, eps);
    } else {
      // Vectors past the end hold zeros: they add nothing to the sum.
      float s[1] = {0.0f};
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        float v[VEC], p = 0.0f;
        unpack16<T>(raw[j], v);
#pragma unroll
        for (int k = 0; k < VEC; ++k) p = fmaf(v[k], v[k], p);
        s[0] += p;
      }
      warp_row_sum(s, red[threadIdx.y], phase);
      r = rstd_of(s[0], cols, inv_cols, eps);
    }
    if (threadIdx.x == 0) {
      if (kLayer) mean[row] = mu;
      rstd[row] = r;
    }
    // A fixed parameter dtype where it costs no occupancy (sm_90 registers: RMSNorm at 4
    // vectors a lane would go from 48 to 64, one block an SM fewer).
    with_param_kind<kLayer, (NV <= (kLayer ? 4 : 2))>(gamma, beta, [&](auto kind) {
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        int c = warp_row_col(j, VEC);
        // LayerNorm's persistent loop: the column made opaque, so nvcc computes the parameter
        // addresses here instead of hoisting them all out of the loop (8 vectors a lane: 180
        // registers with them hoisted, 102 without).
        if constexpr (kLayer && kPersistent) asm volatile("" : "+r"(c));
        if (c >= ncols) continue;
        float v[VEC], out[VEC];
        unpack16<T>(raw[j], v);
        // y from the rounded statistics
        normalize_vec<VEC, kLayer, decltype(kind)::value>(v, mu, r, gamma, beta, c, out);
        sink.template store<VEC>(base + c, out);
      }
    });
    // One row a group unless persistent (the launcher's grid): for LayerNorm no loop, so nvcc
    // has nothing to hoist out of one (it kept every parameter address of the row live
    // across it: 4 vectors a lane took 94 registers, 48 without). RMSNorm's stays as measured.
    if constexpr (kLayer && !kPersistent) break;
  }
  sink.finish();
}

// Worker w = blockIdx.x * blockDim.y + threadIdx.y takes rows [rows*w/W, rows*(w+1)/W).
// dx is stored after every read of its row by the same thread, so dx may be dy, x or
// d_residual. kAdd: dx = (the norm's dx rounded to T) + d_residual.
// The parameter-gradient partials are one row per BLOCK: with several groups a block, they
// add their columns in group order in shared memory (dynamic, [cols] per parameter), so
// the scratch traffic (written here, read by column_finalize_kernel) shrinks by the groups
// per block (at C = 4096 BF16 with 528 workers it was ~17 MB each way, ~8% of the pass).
template <typename T, int NV, bool kLayer, bool kAdd>
__global__ void __launch_bounds__(kWarpRowThreads, 2)
    warp_norm_backward_kernel(const T* dy, const T* x, Param gamma, const float* mean, const float* rstd,
                              const T* d_residual, T* dx, float* dgamma_part, float* dbeta_part, int64_t rows,
                              int64_t cols, int64_t workers) {
  constexpr int VEC = 16 / int(sizeof(T));
  __shared__ float red[kWarpRowMaxGroups][2][2][kWarpRowMaxWarps];
  const int ncols = int(cols);
  const int64_t worker = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  // A group past the last worker takes no rows (it still joins the block's column sums).
  const bool live_worker = worker < workers;
  const int64_t first = live_worker ? rows * worker / workers : 0;
  const int64_t last = live_worker ? rows * (worker + 1) / workers : 0;
  const float inv_cols = 1.0f / float(cols);
  float acc_g[NV][VEC], acc_b[kLayer ? NV : 1][VEC];
#pragma unroll
  for (int j = 0; j < NV; ++j)
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      acc_g[j][k] = 0.0f;
      if (kLayer) acc_b[j][k] = 0.0f;
    }
  int phase = 0;
  // Up to 2 vectors a lane, the next row's x and dy are loaded before this row is reduced
  // (two rows of loads in flight); wider rows have no registers left for it.
  constexpr bool kPrefetch = NV <= 2;
  constexpr int NP = kPrefetch ? NV : 1;
  uint4 next_x[NP], next_dy[NP];
  float next_mu = 0.0f, next_r = 0.0f;
  auto fetch = [&](int64_t row) {
    warp_row_load<T, NP>(x, row, cols, next_x);
    warp_row_load<T, NP>(dy, row, cols, next_dy);
    if (kLayer) next_mu = mean[row];
    next_r = rstd[row];
  };
  if constexpr (kPrefetch)
    if (first < last) fetch(first);
#pragma unroll 1
  for (int64_t row = first; row < last; ++row) {
    const int64_t base = row * cols;
    uint4 raw_x[NV], raw_dy[NV];
    float mu, r;
    if constexpr (kPrefetch) {
#pragma unroll
      for (int j = 0; j < NV; ++j) raw_x[j] = next_x[j], raw_dy[j] = next_dy[j];
      mu = next_mu, r = next_r;
      if (row + 1 < last) fetch(row + 1);
    } else {
      warp_row_load<T, NV>(x, row, cols, raw_x);
      warp_row_load<T, NV>(dy, row, cols, raw_dy);
      mu = kLayer ? mean[row] : 0.0f, r = rstd[row];
    }
    float sums[2] = {0.0f, 0.0f};  // sum(g), sum(g * xhat), g = dy * gamma
    with_param_kind<false>(gamma, gamma, [&](auto kind) {
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        const int c = warp_row_col(j, VEC);
        if (c >= ncols) continue;
        float xv[VEC], d[VEC], g[VEC], p0 = 0.0f, p1 = 0.0f;
        unpack16<T>(raw_x[j], xv);
        unpack16<T>(raw_dy[j], d);
        load_param_as<decltype(kind)::value, VEC>(gamma, c, g);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const float xh = kLayer ? __fmul_rn(__fsub_rn(xv[k], mu), r) : __fmul_rn(xv[k], r);
          const float gk = __fmul_rn(d[k], g[k]);
          if (kLayer) p0 += gk;
          p1 = fmaf(gk, xh, p1);
          acc_g[j][k] = fmaf(d[k], xh, acc_g[j][k]);
          if (kLayer) acc_b[j][k] += d[k];
        }
        sums[0] += p0;
        sums[1] += p1;
      }
    });
    warp_row_sum(sums, red[threadIdx.y], phase);
    const float mean_g = sums[0] * inv_cols, mean_g_xhat = sums[1] * inv_cols;
    with_param_kind<false>(gamma, gamma, [&](auto kind) {
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        const int c = warp_row_col(j, VEC);
        if (c >= ncols) continue;
        float xv[VEC], d[VEC], g[VEC], out[VEC];
        unpack16<T>(raw_x[j], xv);
        unpack16<T>(raw_dy[j], d);
        load_param_as<decltype(kind)::value, VEC>(gamma, c, g);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const float xh = kLayer ? __fmul_rn(__fsub_rn(xv[k], mu), r) : __fmul_rn(xv[k], r);
          const float gk = __fmul_rn(d[k], g[k]);
          const float t = __fmul_rn(xh, mean_g_xhat);
          out[k] = kLayer ? __fmul_rn(r, __fsub_rn(__fsub_rn(gk, mean_g), t)) : __fmul_rn(r, __fsub_rn(gk, t));
        }
        if constexpr (kAdd) {
          float dr[VEC];
          unpack16<T>(*reinterpret_cast<const uint4*>(d_residual + base + c), dr);
          round_vec_to_storage<T, VEC>(out);
#pragma unroll
          for (int k = 0; k < VEC; ++k) out[k] = __fadd_rn(out[k], dr[k]);
        }
        store_vec<T, VEC>(dx + base + c, out);
      }
    });
  }
  float* out_g = dgamma_part + int64_t(blockIdx.x) * cols;
  float* out_b = kLayer && dbeta_part ? dbeta_part + int64_t(blockIdx.x) * cols : nullptr;
  if (blockDim.y > 1) {
    extern __shared__ float columns[];  // [cols] dgamma, then [cols] dbeta
    // Group 0 stores, the others add in turn (a group without rows adds its zeros).
    // compute-sanitizer racecheck reports hazards here when the block's groups took different
    // numbers of rows, i.e. passed their named barriers (warp_row_sum) a different number of
    // times. A false report (thirteenth session): a minimal probe, whose groups pass their own
    // named barrier once or twice and then fold as below between __syncthreads, is reported
    // the same way and gives the right sums; with every group on the same row count (or the
    // same number of named barriers) both this kernel and the probe report nothing.
    auto fold = [&](float* column, const float (&acc)[VEC], bool first_group) {
#pragma unroll
      for (int q = 0; q < VEC / 4; ++q) {
        float4 v = first_group ? make_float4(0.0f, 0.0f, 0.0f, 0.0f) : reinterpret_cast<const float4*>(column)[q];
        v.x += acc[4 * q], v.y += acc[4 * q + 1], v.z += acc[4 * q + 2], v.w += acc[4 * q + 3];
        reinterpret_cast<float4*>(column)[q] = v;
      }
    };
#pragma unroll 1
    for (int g = 0; g < int(blockDim.y); ++g) {
      if (int(threadIdx.y) == g) {
#pragma unroll
        for (int j = 0; j < NV; ++j) {
          const int c = warp_row_col(j, VEC);
          if (c >= ncols) continue;
          fold(columns + c, acc_g[j], g == 0);
          if (out_b) fold(columns + ncols + c, acc_b[j], g == 0);
        }
      }
      __syncthreads();
    }
    // The block's sums, written by all its threads (cols is a multiple of 4).
    const int threads = int(blockDim.x * blockDim.y), t = int(threadIdx.y * blockDim.x + threadIdx.x);
    for (int c = 4 * t; c < ncols; c += 4 * threads) {
      *reinterpret_cast<float4*>(out_g + c) = *reinterpret_cast<const float4*>(columns + c);
      if (out_b) *reinterpret_cast<float4*>(out_b + c) = *reinterpret_cast<const float4*>(columns + ncols + c);
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int c = warp_row_col(j, VEC);
    if (c >= ncols) continue;
    store_vec<float, VEC>(out_g + c, acc_g[j]);
    if (out_b) store_vec<float, VEC>(out_b + c, acc_b[j]);
  }
}

}  // namespace

}  // namespace tessera::cuda
