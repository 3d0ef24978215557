// Softmax over the last dimension on the GPU, forward and backward; the same rules as the
// CPU reference (backend/cpu/softmax.cpp): stable (row max subtracted), a fully masked
// row (all -inf) gives zeros, a NaN makes its row NaN. F32 or BF16 storage, float
// arithmetic (row sums in float, in a fixed order: deterministic).
//
// Layout: contiguous [rows, cols]. A row is held in registers by a group of threads (1 to
// 1024, a power of two; narrow rows share a 128-thread block, one warp or less each), so
// it is read from memory once: forward reads x and writes y, backward reads y and dy and
// writes dx. Loads are 16 bytes wide when cols and the pointers allow, else one element.
// The forward keeps the row as loaded (BF16 packed two to a register: a thread holds 8
// vectors in 32 registers, so twice the rows of the float version are in flight per SM),
// with two group reductions: a NaN-propagating max (which also finds a NaN row) and the sum
// of exp2((x - max) * log2 e); the output recomputes the exponential instead of keeping a
// float row. Rows too wide for registers take a looping kernel, one 256-thread block per
// row, that re-reads the row (mostly from L2).
//
// Floor: 2 (forward) or 3 (backward) passes of the activation over ~4.1 TB/s
// (16384 x 4096 BF16: 65 / 98 us). Measured on the H200 against cudaMemcpy D2D (3.8 TB/s)
// in the same run (bench_bandwidth), before -> after the register kernels: forward 48 ->
// 63%, backward 81 -> 89%. The forward was then one 128-thread row per block holding 32
// floats a thread, with three reductions (max, NaN flag, sum); with the packed row (64
// threads a row, 64 registers: 16 rows per SM instead of 8) and two reductions (2026-11-30):
// forward 70%, backward 88% (16384 x 768: 67% / 95%).
//
// Forward, warp-row kernel (the default where it applies; softmax_tuning.h selects): rows of
// cols % 8 == 0, 16-byte aligned, up to 4096 BF16 / 2048 F32 (64 registers of packed row a
// thread) are held by 4 to 32 lanes of one warp (row_lse.cuh), several rows per warp when
// narrow: every load issued first, a thread-local max and sum from the registers, one merged
// shuffle butterfly for the row's (max, sum), no barrier; the output recomputes exp2 from the
// packed row. Floor as above (16384 x 4096 BF16: 65 us). Measured (H200, 2026-11-30): 88.9% of
// copy bandwidth at 16384 x 4096 (the row-group kernel: 70.2%), 84.3% at x 768.
#include <cuda_runtime.h>

#include <cstdlib>
#include <type_traits>

#include "cuda_backend.h"
#include "cuda_check.h"
#include "row_lse.cuh"
#include "softmax_tuning.h"
#include "tessera/core/numeric.h"
#include "vec_io.cuh"

namespace tessera::cuda {

namespace {

using warprow::group_reduce;

constexpr int kLoopThreads = 256;   // the looping kernel's block
constexpr int kMaxGroup = 1024;     // threads per row in the register kernels
constexpr int kMaxVectors = 8;      // units per thread in the register kernels
constexpr int kBlockThreads = 128;  // narrow rows: groups packed into blocks of this size

// The most threads a register kernel holding `floats` values per thread may have in a block
// (its launch bound): registers for the row, about 32 more for the rest, 64K per SM.
constexpr int max_threads_for(int floats) { return floats <= 16 ? 1024 : floats <= 32 ? 512 : 256; }

template <int V>
using Int = std::integral_constant<int, V>;

// N consecutive elements <-> float; N is 8 (16-byte aligned vectors) or 1.
template <int N, typename T>
__device__ __forceinline__ void load_n(const T* p, float (&v)[N]) {
  if constexpr (N == vec::kWidth) vec::load8(p, v);
  else v[0] = vec::load(p, 0);
}
template <int N, typename T>
__device__ __forceinline__ void store_n(T* p, const float (&v)[N]) {
  if constexpr (N == vec::kWidth) vec::store8(p, v);
  else vec::store(p, 0, v[0]);
}

struct Max {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct Sum {
  __device__ float operator()(float a, float b) const { return a + b; }
};

// ---- Register kernels: NV units of VEC elements per thread --------------------------------
//
// Thread t of a group owns units t, t + G, t + 2G, ... (G = blockDim.x): a warp's accesses
// are contiguous. A group past the last row still joins the shuffles but touches no memory.

// A unit of VEC elements as kept in registers: a packed 16/32-byte vector (VEC = 8) or one
// element in a float (VEC = 1), and the 32-bit registers it takes.
template <typename T, int VEC>
using Unit = std::conditional_t<VEC == vec::kWidth, vec::Packed8<T>, float>;
template <typename T, int VEC>
constexpr int unit_regs() {
  return VEC == vec::kWidth ? int(sizeof(vec::Packed8<T>) / 4) : 1;
}
template <int VEC, typename T>
__device__ __forceinline__ void load_unit(const T* p, Unit<T, VEC>& u) {
  if constexpr (VEC == vec::kWidth) vec::load_packed(p, u);
  else u = vec::load(p, 0);
}
template <int VEC, typename T>
__device__ __forceinline__ void unpack_unit(const Unit<T, VEC>& u, float (&v)[VEC]) {
  if constexpr (VEC == vec::kWidth) vec::unpack(u, v);
  else v[0] = u;
}
template <int VEC, typename T>
__device__ __forceinline__ void fill_unit_neg_inf(Unit<T, VEC>& u) {
  if constexpr (VEC == vec::kWidth) vec::fill_neg_inf(u);
  else u = -INFINITY;
}

struct MaxNan {
  __device__ float operator()(float a, float b) const { return vec::max_nan(a, b); }
};

constexpr float kLog2e = 1.4426950408889634f;

// The row is kept as loaded (BF16 packed: half the registers of floats, so more rows are in
// flight per SM) and unpacked on each of three passes: the max (NaN-propagating, so one
// reduction also finds a NaN row), the sum of exponentials, and the output, which recomputes
// each exponential rather than holding a row of floats (the SFU has the spare throughput;
// the registers are what bound the bytes in flight). exp2f((x - max) * log2e): x - max is
// exact near the max, where the terms matter.
template <typename T, int VEC, int NV>
__global__ void __launch_bounds__(max_threads_for(NV * unit_regs<T, VEC>()))
    softmax_forward_kernel(const T* x, T* y, int64_t rows, int64_t cols) {
  __shared__ float red[2][32];
  const int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool live = row < rows;
  const T* xr = x + (live ? row : 0) * cols;
  T* yr = y + (live ? row : 0) * cols;
  const int width = int(cols);  // at most kMaxGroup * kMaxVectors * VEC: 32-bit column offsets
  Unit<T, VEC> u[NV];
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int c = (j * int(blockDim.x) + int(threadIdx.x)) * VEC;
    if (live && c < width) load_unit<VEC>(xr + c, u[j]);
    else fill_unit_neg_inf<VEC, T>(u[j]);  // adds nothing to the max, exp(-inf) = 0 to the sum
  }
  float local_max = -INFINITY;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    float v[VEC];
    unpack_unit<VEC, T>(u[j], v);
#pragma unroll
    for (int k = 0; k < VEC; ++k) local_max = vec::max_nan(local_max, v[k]);
  }
  const float row_max = group_reduce(local_max, red[0], MaxNan{});
  // A NaN row is all NaN, a fully masked one (max -inf) all zeros; both skip the sum, the
  // branch is uniform over the group. A +inf max gives NaN through inf - inf, as on the CPU.
  const bool special = row_max != row_max || row_max == -INFINITY;
  float local_sum = 0.0f;
  if (!special) {
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      float v[VEC];
      unpack_unit<VEC, T>(u[j], v);
#pragma unroll
      for (int k = 0; k < VEC; ++k) local_sum += exp2f((v[k] - row_max) * kLog2e);
    }
  }
  const float sum = group_reduce(local_sum, red[1], Sum{});
  if (!live) return;
  const float inv = 1.0f / sum, fill = row_max != row_max ? NAN : 0.0f;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int c = (j * int(blockDim.x) + int(threadIdx.x)) * VEC;
    if (c >= width) continue;
    float v[VEC];
    unpack_unit<VEC, T>(u[j], v);
#pragma unroll
    for (int k = 0; k < VEC; ++k) v[k] = special ? fill : exp2f((v[k] - row_max) * kLog2e) * inv;
    store_n<VEC>(yr + c, v);
  }
}

// dx may be dy: each element is read before it is written, by the same thread.
template <typename T, int VEC, int NV>
__global__ void __launch_bounds__(max_threads_for(2 * NV * VEC))
    softmax_backward_kernel(const T* y, const T* dy, T* dx, int64_t rows, int64_t cols) {
  __shared__ float red[32];
  const int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool live = row < rows;
  const int64_t base = (live ? row : 0) * cols;
  float p[NV][VEC], g[NV][VEC];
  float local = 0.0f;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int64_t c = (int64_t(j) * blockDim.x + threadIdx.x) * VEC;
    if (live && c < cols) {
      load_n<VEC>(y + base + c, p[j]);
      load_n<VEC>(dy + base + c, g[j]);
#pragma unroll
      for (int k = 0; k < VEC; ++k) local += g[j][k] * p[j][k];
    }
  }
  const float dot = group_reduce(local, red, Sum{});
  if (!live) return;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int64_t c = (int64_t(j) * blockDim.x + threadIdx.x) * VEC;
    if (c >= cols) continue;
    float out[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) out[k] = p[j][k] * (g[j][k] - dot);
    store_n<VEC>(dx + base + c, out);
  }
}

// ---- Warp-row forward (the default): G lanes of a warp per row, see row_lse.cuh -----------
//
// Rows of cols % 8 == 0 elements, 16-byte aligned; 128-thread blocks of 128 / G rows. The
// row's (max, sum) comes from one merged butterfly; the output recomputes each exponential
// from the packed row (the registers, not the SFU, bound the bytes in flight).
template <typename T, int NV>
__global__ void __launch_bounds__(warprow::kThreads, (warprow::min_blocks<T, NV>()))
    softmax_forward_warp_kernel(const T* x, T* y, int64_t nrows, int cols, int g) {
  const int lane = int(threadIdx.x) & (g - 1);
  const int64_t row = int64_t(blockIdx.x) * (warprow::kThreads / g) + threadIdx.x / g;
  const bool live = row < nrows;
  const int64_t base = (live ? row : 0) * int64_t(cols);
  warprow::RegRow<T, NV> r;
  r.load(x + base, live, lane, g, cols);
  float m, s;
  r.lse(g, m, s);
  if (!live) return;
  // NaN row: all NaN; fully masked (max -inf): all 0; a +inf max has s = NaN: all NaN.
  // The branch is uniform over the row's lanes (they hold the same m), and keeps the select
  // out of the per-element work.
  if (m != m || m == -INFINITY) {
    const float fill = m != m ? NAN : 0.0f;
    float v[vec::kWidth];
#pragma unroll
    for (int k = 0; k < vec::kWidth; ++k) v[k] = fill;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int c = (j * g + lane) * vec::kWidth;
      if (c < cols) warprow::store8(y + base + c, v);
    }
    return;
  }
  const float inv = 1.0f / s;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int c = (j * g + lane) * vec::kWidth;
    if (c >= cols) continue;
    float v[vec::kWidth];
    vec::unpack(r.u[j], v);
#pragma unroll
    for (int k = 0; k < vec::kWidth; ++k) v[k] = warprow::ex2((v[k] - m) * warprow::kLog2e) * inv;
    warprow::store8(y + base + c, v);
  }
}

// ---- Looping kernels for rows too wide for registers: one block per row -------------------

template <typename T>
__global__ void __launch_bounds__(kLoopThreads) softmax_forward_wide_kernel(const T* x, T* y, int64_t cols) {
  __shared__ float red[3][32];
  const T* xr = x + blockIdx.x * cols;
  T* yr = y + blockIdx.x * cols;
  float local_max = -INFINITY;
  bool nan_seen = false;
  for (int64_t c = threadIdx.x; c < cols; c += kLoopThreads) {
    const float v = vec::load(xr, c);
    nan_seen |= v != v;
    local_max = fmaxf(local_max, v);
  }
  const float row_max = group_reduce(local_max, red[0], Max{});
  const bool any_nan = group_reduce(nan_seen ? 1.0f : 0.0f, red[1], Max{}) > 0.0f;
  if (any_nan || row_max == -INFINITY) {
    for (int64_t c = threadIdx.x; c < cols; c += kLoopThreads) vec::store(yr, c, any_nan ? NAN : 0.0f);
    return;
  }
  float local_sum = 0.0f;
  for (int64_t c = threadIdx.x; c < cols; c += kLoopThreads) local_sum += expf(vec::load(xr, c) - row_max);
  const float inv = 1.0f / group_reduce(local_sum, red[2], Sum{});
  for (int64_t c = threadIdx.x; c < cols; c += kLoopThreads) vec::store(yr, c, expf(vec::load(xr, c) - row_max) * inv);
}

template <typename T>
__global__ void __launch_bounds__(kLoopThreads)
    softmax_backward_wide_kernel(const T* y, const T* dy, T* dx, int64_t cols) {
  __shared__ float red[32];
  const int64_t base = blockIdx.x * cols;
  float local = 0.0f;
  for (int64_t c = threadIdx.x; c < cols; c += kLoopThreads) local += vec::load(dy, base + c) * vec::load(y, base + c);
  const float dot = group_reduce(local, red, Sum{});
  for (int64_t c = threadIdx.x; c < cols; c += kLoopThreads)
    vec::store(dx, base + c, vec::load(y, base + c) * (vec::load(dy, base + c) - dot));
}

// ---- Launch -------------------------------------------------------------------------------

// Threads per row (a power of two up to kMaxGroup, each holding about `per_thread` units),
// rows per block (several only for groups of a warp or less: group_reduce needs a
// several-warp group to be the whole block), and units per thread (a power of two; 0 when
// the row needs the looping kernel: too many units, or a group larger than the kernel's
// launch bound). `regs`: the 32-bit registers one unit takes in the kernel's row arrays.
struct RowConfig {
  int tpr, rpb, nv;
};
RowConfig row_config(int64_t units, int regs, int per_thread) {
  int tpr = 1;
  while (tpr < (units + per_thread - 1) / per_thread && tpr < kMaxGroup) tpr *= 2;
  int nv = 1;
  while (nv < (units + tpr - 1) / tpr) nv *= 2;
  const bool fits = nv <= kMaxVectors && tpr <= max_threads_for(regs * nv);
  return {tpr, tpr > 32 ? 1 : kBlockThreads / tpr, fits ? nv : 0};
}

template <typename Fn>
void dispatch_nv(int nv, Fn&& fn) {
  if (nv == 1) fn(Int<1>{});
  else if (nv == 2) fn(Int<2>{});
  else if (nv == 4) fn(Int<4>{});
  else fn(Int<8>{});
}

// fn(Int<VEC>, cfg, blocks) for the register kernels, or wide() for the looping one.
// `arrays`: the row-long float arrays the kernel keeps (2 in the backward), or 0 for the
// forward, which keeps the row packed (unit_regs). A packed BF16 unit is half an F32 one,
// so a thread holds 8 of them (32 registers) where it would hold 4 float units.
template <typename T, typename Fn, typename Wide>
void launch_rows(int64_t rows, int64_t cols, bool aligned, int arrays, Fn&& fn, Wide&& wide) {
  TESSERA_CHECK(rows <= 0x7fffffff, "softmax on CUDA: ", rows, " rows exceed one grid");
  const bool vectorised = aligned && cols % vec::kWidth == 0;
  const int unit = vectorised ? vec::kWidth : 1;
  const int regs = arrays > 0 ? arrays * unit : (vectorised ? unit_regs<T, vec::kWidth>() : unit_regs<T, 1>());
  const int per_thread = arrays == 0 && vectorised && sizeof(T) == 2 ? 8 : 4;
  const RowConfig cfg = row_config(vectorised ? cols / vec::kWidth : cols, regs, per_thread);
  if (cfg.nv == 0) {
    wide();
    return;
  }
  const unsigned blocks = unsigned((rows + cfg.rpb - 1) / cfg.rpb);
  if (vectorised) fn(Int<vec::kWidth>{}, cfg, blocks);
  else fn(Int<1>{}, cfg, blocks);
}

// TESSERA_CROSS_ENTROPY_FUSED=1 (or 0) starts with the cross-entropy fusion on (or off):
// an A/B of whole training steps without rebuilding.
RowTuning initial_row_tuning() {
  RowTuning t;
  if (const char* v = std::getenv("TESSERA_CROSS_ENTROPY_FUSED")) t.cross_entropy_fused = std::atoi(v) == 0 ? 1 : 0;
  return t;
}
RowTuning g_row_tuning = initial_row_tuning();

}  // namespace

void set_row_tuning(const RowTuning& tuning) { g_row_tuning = tuning; }
RowTuning row_tuning() { return g_row_tuning; }
void set_softmax_kernel(int kernel) { g_row_tuning.softmax_forward = kernel; }

void softmax_forward(void* stream, const Tensor& x, Tensor& y) {
  const int64_t cols = x.size(-1), rows = cols ? x.numel() / cols : 0;
  if (rows == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  vec::dispatch(x.dtype(), "softmax_forward", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* xp = x.data<T>();
    T* yp = y.data<T>();
    if (g_row_tuning.softmax_forward == 0 && cols % vec::kWidth == 0 && vec::aligned16(xp) && vec::aligned16(yp)) {
      const warprow::Shape shape = warprow::shape_for(cols / vec::kWidth, unit_regs<T, vec::kWidth>(), g_row_tuning.group);
      const int64_t per_block = shape.nv > 0 ? warprow::kThreads / shape.group : 1;
      if (shape.nv > 0 && (rows + per_block - 1) / per_block <= 0x7fffffff) {
        const unsigned blocks = unsigned((rows + per_block - 1) / per_block);
        warprow::dispatch_nv<warprow::max_nv<T>()>(shape.nv, [&](auto nv_tag) {
          softmax_forward_warp_kernel<T, decltype(nv_tag)::value>
              <<<blocks, warprow::kThreads, 0, s>>>(xp, yp, rows, int(cols), shape.group);
        });
        return;
      }
    }
    launch_rows<T>(
        rows, cols, vec::aligned16(xp) && vec::aligned16(yp), 0,
        [&](auto vec_tag, RowConfig cfg, unsigned blocks) {
          dispatch_nv(cfg.nv, [&](auto nv_tag) {
            softmax_forward_kernel<T, decltype(vec_tag)::value, decltype(nv_tag)::value>
                <<<blocks, dim3(cfg.tpr, cfg.rpb), 0, s>>>(xp, yp, rows, cols);
          });
        },
        [&] { softmax_forward_wide_kernel<T><<<unsigned(rows), kLoopThreads, 0, s>>>(xp, yp, cols); });
  });
  TESSERA_CUDA_CHECK_LAUNCH();
}

void softmax_backward(void* stream, const Tensor& y, const Tensor& dy, Tensor& dx) {
  const int64_t cols = y.size(-1), rows = cols ? y.numel() / cols : 0;
  if (rows == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  vec::dispatch(y.dtype(), "softmax_backward", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T *yp = y.data<T>(), *dyp = dy.data<T>();
    T* dxp = dx.data<T>();
    launch_rows<T>(
        rows, cols, vec::aligned16(yp) && vec::aligned16(dyp) && vec::aligned16(dxp), 2,
        [&](auto vec_tag, RowConfig cfg, unsigned blocks) {
          dispatch_nv(cfg.nv, [&](auto nv_tag) {
            softmax_backward_kernel<T, decltype(vec_tag)::value, decltype(nv_tag)::value>
                <<<blocks, dim3(cfg.tpr, cfg.rpb), 0, s>>>(yp, dyp, dxp, rows, cols);
          });
        },
        [&] { softmax_backward_wide_kernel<T><<<unsigned(rows), kLoopThreads, 0, s>>>(yp, dyp, dxp, cols); });
  });
  TESSERA_CUDA_CHECK_LAUNCH();
}

}  // namespace tessera::cuda
