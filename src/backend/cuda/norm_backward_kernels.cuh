// The LayerNorm/RMSNorm backward kernels, split from norm_kernels.cuh (which has the rules
// they follow: layout, reduction order, rounding, the dgamma/dbeta worker scheme) and built
// on its loads, stores and group_sum. Included through norm_kernels.cuh only; everything sits
// in the same anonymous namespace, so each including .cu file instantiates what it launches.
// Since the split: the fused RMSNorm backward loads its residual gradient before the row's
// reduction (kEarlyResidual; same bits): 75% -> 98% of copy at 16384 x 4096 BF16 (H200,
// ninth session). The LayerNorm backwards (80%, 70% with the residual) did not change.
// Since (after the ninth session): the fused LayerNorm backward's dbeta partial moves from
// registers to shared memory (norm_backward_kernel), which lets it load its residual
// gradient early too; same bits. Measured (H200, twelfth session, 16384 x 4096 BF16):
// LayerNorm backward + residual 70.3% -> 85.2% of copy. The plain LayerNorm backward keeps
// its partial in registers: in shared memory it measured 74.9% against 80.1%. sm_90 registers (ptxas) at the
// default 4096 BF16 shape (two vectors a thread, 128 at most): LayerNorm 128 -> 128, fused
// 128 -> 128 with the early residual (it spilled 40 bytes with the partial in registers);
// one vector a thread (64 at most) spills 40 bytes instead of 108.
// The finalize kernel is launched as a programmatic dependent of the kernel that writes the
// partials (the register kernel below lets it be scheduled once its rows are done): +1 to 3 points of copy on every norm
// backward (H200, twentieth session). Tried and dropped there: the partials added across
// clusters of 2-8 blocks through distributed shared memory before being written (6-9 points
// slower: fewer resident blocks), and dx through two FMAs an element (the fused LayerNorm
// backward spills: 84.5% -> 71.3%).
// Tried and dropped (fourteenth session, H200, same shape; bench/RESULTS.md): the plain
// LayerNorm backward (77-79% of copy; 16 warps an SM, 0.66 instructions issued a cycle per
// scheduler under ncu) with the next 1-3 rows' x and dy staged in shared memory by cp.async
// instead of one row in registers: 65-66%; with xhat and dy * gamma recomputed after the
// reduction to fit three blocks an SM in 80 registers: it spills, 50%.
#pragma once

#include "norm_kernels.cuh"
#include "pdl.cuh"

namespace tessera::cuda {

namespace {

// Worker w = blockIdx.x * blockDim.y + threadIdx.y takes rows [rows*w/W, rows*(w+1)/W); all
// workers step the same number of times so that narrow groups sharing a warp stay in step.
// The next row's x, dy and statistics are loaded (as raw words) before the current row is
// reduced and written, so each worker keeps two rows of loads in flight: with one, the loads
// stall behind every row's reduction and the GPU runs well below its bandwidth.
// dx is written after every read of its row, so dx may be the same memory as dy or x.
// kAdd: dx = (the norm's dx rounded to T) + d_residual (null otherwise), read just before the
// store by the same thread, so dx may also be d_residual.
//
// The fused LayerNorm backward's dbeta partial (a sum of dy per column; two or more vectors a
// thread) lives in shared memory, not registers: dynamic, NV * VEC floats per thread of the
// block (norm_launch.cuh sizes it), each thread its own slots (no barrier). In registers it took 16 of the 128 a thread may have (BF16,
// two vectors a thread), which left no room for loading the residual gradient early (it
// spilled); a read-add-write of four 16-byte words a row costs little beside that.
template <typename T, int VEC, int NV, bool kLayer, bool kAdd>
__global__ void __launch_bounds__(kMaxGroupThreads, NV == 1 ? 2 : 1)
    norm_backward_kernel(const T* dy, const T* x, Param gamma, const float* mean, const float* rstd,
                         const T* d_residual, T* dx, float* dgamma_part, float* dbeta_part, int64_t rows, int64_t cols,
                         int64_t workers) {
  __shared__ double red[2][2][32];
  constexpr int W = kRawWords<T, VEC>;
  const int64_t worker = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool live_worker = worker < workers;
  const int64_t first = live_worker ? rows * worker / workers : 0;
  const int64_t last = live_worker ? rows * (worker + 1) / workers : 0;
  const int64_t steps = (rows + workers - 1) / workers;
  const double inv_cols = 1.0 / double(cols);

  // gamma is re-read for every row (an L1 hit) rather than held: the registers it would take
  // decide whether two 512-thread blocks fit on a multiprocessor.
  // kDbetaShared: the fused LayerNorm backward of two or more vectors a thread keeps its dbeta
  // partial in shared memory (below) to make room for the early residual load; the plain
  // one keeps it in registers (measured: 80% of copy in registers, 75% in shared memory).
  constexpr bool kDbetaShared = kLayer && kAdd && NV > 1;
  float acc_g[NV][VEC], acc_b[kLayer && !kDbetaShared ? NV : 1][VEC];
#pragma unroll
  for (int j = 0; j < NV; ++j)
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      acc_g[j][k] = 0.0f;
      if constexpr (kLayer && !kDbetaShared) acc_b[j][k] = 0.0f;
    }
  // This thread's dbeta slots: vector j's VEC floats as VEC / 4 float4 units (one float for
  // VEC = 1), unit u of the block's thread t at [u][t], so a warp's accesses are contiguous.
  static_assert(VEC == 1 || VEC % 4 == 0, "dbeta slots are float4 units or single floats");
  extern __shared__ float4 dbeta_slots[];
  const bool has_dbeta = kLayer && dbeta_part != nullptr;
  const bool dbeta_shared = kDbetaShared && has_dbeta;
  const int block_threads = int(blockDim.x * blockDim.y), block_thread = int(threadIdx.y * blockDim.x + threadIdx.x);
  // fn(slot, first): each unit of vector j, with the index of its first element.
  auto for_dbeta_units = [&](int j, auto&& fn) {
    if constexpr (VEC == 1) {
      fn(reinterpret_cast<float*>(dbeta_slots)[j * block_threads + block_thread], 0);
    } else {
#pragma unroll
      for (int q = 0; q < VEC / 4; ++q) fn(dbeta_slots[(j * (VEC / 4) + q) * block_threads + block_thread], 4 * q);
    }
  };
  if (dbeta_shared)
#pragma unroll
    for (int j = 0; j < NV; ++j) for_dbeta_units(j, [](auto& slot, int) { slot = {}; });

  // The prefetched row: raw x and dy words, and its statistics.
  uint32_t raw_x[NV][W] = {}, raw_dy[NV][W] = {};
  float next_mu = 0.0f, next_r = 0.0f;
  auto fetch = [&](int64_t row) {
    if (row >= last) return;
    const int64_t base = row * cols;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int64_t c = (int64_t(j) * blockDim.x + threadIdx.x) * VEC;
      if (c < cols) {
        load_raw<T, VEC>(x + base + c, raw_x[j]);
        load_raw<T, VEC>(dy + base + c, raw_dy[j]);
      }
    }
    if (kLayer) next_mu = mean[row];
    next_r = rstd[row];
  };
  fetch(first);

#pragma unroll 1
  for (int64_t step = 0; step < steps; ++step) {
    const int64_t row = first + step;
    const bool live = row < last;
    const int64_t base = (live ? row : 0) * cols;
    const float mu = kLayer && live ? next_mu : 0.0f, r = live ? next_r : 0.0f;
    float xhat[NV][VEC], d[NV][VEC];
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      unpack_raw<T, VEC>(raw_x[j], xhat[j]);
      unpack_raw<T, VEC>(raw_dy[j], d[j]);
    }
    fetch(row + 1);
    float gd[NV][VEC];       // g = dy * gamma per element; xhat overwrites x
    double sums[2] = {0, 0};  // sum(g), sum(g * xhat)
    // F32 adds every term in double, as the reference; BF16 adds a unit's terms in float
    // first and converts once per unit (as the forward does).
    constexpr bool kUnitPartials = !std::is_same_v<T, float> && VEC > 1;
    with_param_kind<false>(gamma, gamma, [&](auto kind) {
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        const int64_t c = (int64_t(j) * blockDim.x + threadIdx.x) * VEC;
        if (live && c < cols) {
          float g[VEC];
          [[maybe_unused]] float p0 = 0.0f, p1 = 0.0f;  // kUnitPartials only
          load_param_as<decltype(kind)::value, VEC>(gamma, c, g);
#pragma unroll
          for (int k = 0; k < VEC; ++k) {
            const float xh = kLayer ? __fmul_rn(__fsub_rn(xhat[j][k], mu), r) : __fmul_rn(xhat[j][k], r);
            const float gk = __fmul_rn(d[j][k], g[k]);
            if constexpr (kUnitPartials) {
              if (kLayer) p0 += gk;
              p1 = fmaf(gk, xh, p1);
            } else {
              if (kLayer) sums[0] = __dadd_rn(sums[0], double(gk));
              sums[1] = fma(double(gk), double(xh), sums[1]);
            }
            acc_g[j][k] = fmaf(d[j][k], xh, acc_g[j][k]);
            if constexpr (kLayer && !kDbetaShared) acc_b[j][k] += d[j][k];
            xhat[j][k] = xh;
            gd[j][k] = gk;
          }
          if (dbeta_shared)
            for_dbeta_units(j, [&](auto& slot, int k) {
              if constexpr (VEC == 1) {
                slot += d[j][0];
              } else {
                float4 v = slot;
                v.x += d[j][k], v.y += d[j][k + 1], v.z += d[j][k + 2], v.w += d[j][k + 3];
                slot = v;
              }
            });
          if constexpr (kUnitPartials) {
            if (kLayer) sums[0] = __dadd_rn(sums[0], double(p0));
            sums[1] = __dadd_rn(sums[1], double(p1));
          }
        } else {
#pragma unroll
          for (int k = 0; k < VEC; ++k) xhat[j][k] = gd[j][k] = 0.0f;
        }
      }
    });
    // kEarlyResidual: this row's residual gradient, loaded before the reduction so that its
    // latency overlaps the barrier instead of standing between the reduction and the store
    // (the only load of a step not issued ahead). Two or more vectors a thread only: one
    // vector a thread is at the 64 registers of two blocks an SM, where the words would
    // spill (sm_90: 16 to 24 bytes). LayerNorm too since its dbeta partial left the registers.
    constexpr bool kEarlyResidual = kAdd && NV > 1;
    uint32_t raw_dr[kEarlyResidual ? NV : 1][W];
    if constexpr (kEarlyResidual) {
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        const int64_t c = (int64_t(j) * blockDim.x + threadIdx.x) * VEC;
        if (live && c < cols) load_raw<T, VEC>(d_residual + base + c, raw_dr[j]);
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
      if constexpr (kAdd) {
        float dr[VEC];
        if constexpr (kEarlyResidual) unpack_raw<T, VEC>(raw_dr[j], dr);
        else load_vec<T, VEC>(d_residual + base + c, dr);
        round_vec_to_storage<T, VEC>(out);
#pragma unroll
        for (int k = 0; k < VEC; ++k) out[k] = __fadd_rn(out[k], dr[k]);
      }
      store_vec<T, VEC>(dx + base + c, out);
    }
  }

  // The finalize kernel (a programmatic dependent) may be scheduled as blocks leave; it waits
  // for this grid to end before it reads the partials.
  pdl_launch_dependents();
  if (!live_worker) return;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int64_t c = (int64_t(j) * blockDim.x + threadIdx.x) * VEC;
    if (c >= cols) continue;
    store_vec<float, VEC>(dgamma_part + worker * cols + c, acc_g[j]);
    if constexpr (kLayer && !kDbetaShared) {
      if (has_dbeta) store_vec<float, VEC>(dbeta_part + worker * cols + c, acc_b[j]);
    } else if (dbeta_shared) {
      float b[VEC];
      for_dbeta_units(j, [&](const auto& slot, int k) {
        if constexpr (VEC == 1) {
          b[0] = slot;
        } else {
          b[k] = slot.x, b[k + 1] = slot.y, b[k + 2] = slot.z, b[k + 3] = slot.w;
        }
      });
      store_vec<float, VEC>(dbeta_part + worker * cols + c, b);
    }
  }
}

// ---- Looping backward and the parameter-gradient columns ----------------------------------

template <typename T, bool kLayer>
__device__ __forceinline__ float xhat_of(const T* x, int64_t i, float mu, float r) {
  const float v = load1(x, i);
  return kLayer ? __fmul_rn(__fsub_rn(v, mu), r) : __fmul_rn(v, r);
}

// dx only; the parameter gradients come from norm_column_partials_kernel, launched first
// because dx may overwrite dy.
template <typename T, bool kLayer, bool kAdd>
__global__ void __launch_bounds__(kWideThreads)
    norm_backward_dx_wide_kernel(const T* dy, const T* x, Param gamma, const float* mean, const float* rstd,
                                 const T* d_residual, T* dx, int64_t cols) {
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
    if constexpr (kAdd) out[0] = __fadd_rn(round_to_storage<T>(out[0]), load1(d_residual, base + c));
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

// out[c] += sum over workers of part[w][c], for the parameter blockIdx.y (0: dgamma from
// part, 1: dbeta from part + workers * cols): kFinalizeLanes lanes per column each add a
// strided subset in order (four loads in flight), then one lane adds the lanes' sums in
// order (a fixed order: deterministic). Like the reference, the sum is in double, added to
// the old value in double and rounded once to float.
constexpr int kFinalizeLanes = 16;
__global__ void __launch_bounds__(32 * kFinalizeLanes)
    column_finalize_kernel(const float* part, int64_t workers, int64_t cols, Param out0, Param out1) {
  __shared__ double tile[kFinalizeLanes][33];
  pdl_wait();  // launched as a programmatic dependent of the kernel that wrote the partials
  const Param out = blockIdx.y == 0 ? out0 : out1;
  const float* p = part + int64_t(blockIdx.y) * workers * cols;
  const int64_t c = int64_t(blockIdx.x) * 32 + threadIdx.x;
  double s = 0;
  if (c < cols) {
    constexpr int L = kFinalizeLanes;
    int64_t w = threadIdx.y;
    for (; w + 3 * L < workers; w += 4 * L) {
      const float a = p[w * cols + c], b = p[(w + L) * cols + c], e = p[(w + 2 * L) * cols + c],
                  f = p[(w + 3 * L) * cols + c];
      s += double(a);
      s += double(b);
      s += double(e);
      s += double(f);
    }
    for (; w < workers; w += L) s += double(p[w * cols + c]);
  }
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

}  // namespace

}  // namespace tessera::cuda
