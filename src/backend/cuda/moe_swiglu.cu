// The SwiGLU scaled by the routing probability between the MoE expert GEMMs
// (include/tessera/ops/moe.h), x [M, 2F] = [gate | up], per row r:
//   forward   h[r, c]  = prob[r] * silu(g) * u                    (g = x[r, c], u = x[r, F + c])
//   backward  dx[r, c] = dy*prob * u * s * (1 + g * (1 - s)),  dx[r, F + c] = dy*prob * g * s
//             (s = sigmoid(g)), d_prob[r] = sum_c dy[r, c] * silu(g) * u
// and the backward straight to FP8 (MoEFp8Rows of dx, for fc's FP8 dgrad / wgrad), in two
// passes: (1) d_prob and the amax of BF16(dx), no dx written; (2) dx recomputed, rounded to
// BF16 as the stored BF16 dx would be, encoded with the current scale into data [M, 2F] and
// the padded transposed data_t [2F, P] (padding and rows past the split sum zero codes).
// Its codes are the bytes of the unfused path (BF16 dx, then moe_fp8_cast_rows with the
// scale of dx's amax): the same float operations give the same dx, and the encoder is
// moe_fp8.cu's (fp8_cvt.cuh).
//
// Kernels:
//  - vector (BF16 x / dy / outputs, F % 8 == 0, pointers 16-byte aligned: the model's case):
//    16-byte loads and stores (8 BF16), kVecs independent vectors in flight per thread, all
//    loads issued before the math. The forward is flat over the [M, F] vectors; the backward
//    gives each row one block so that d_prob[r] is one fixed-shape reduction (per-thread
//    partial sums in column order, then moe_common.cuh's block_sum: the result depends on
//    the inputs and F only, though it may differ in the last bits from the scalar kernel's).
//    The FP8 pass 2 tiles 64 padded rows x 64 features (moe_fp8_rows.cuh), each thread
//    producing the gate and the up codes of its 8 features.
//  - scalar (F32, odd widths, misalignment; and every case under TESSERA_MOE_LEGACY=1, to
//    time the two): one block per row, one element per thread and step.
// The elementwise formulas are shared (swiglu_forward / swiglu_backward below), so y and dx
// are bit-identical between the two kernels; expf as the CPU reference's order of operations.
//
// Floor (H200, copy ~4.1 TB/s), per element of h [M, F] (M = 16384, F = 14336: 235 M):
//   forward:  read x 4 B + write h 2 B = 6 B   -> 1.41 GB, ~344 us (scalar: 599 us)
//   backward: read x 4 + dy 2, write dx 4 = 10 B -> 2.35 GB, ~573 us (scalar: 841 us)
//   FP8 backward: pass 1 reads 6 B, pass 2 reads 6 B and writes 2 codes twice (row-wise and
//   transposed) = 16 B -> 3.76 GB, ~917 us, against 18 B (~1.03 ms) for the BF16 backward
//   then the cast (read dx 4, write 4).
// Measured (H200, 2026-11-30, bench_bandwidth moe_swiglu, same run as the scalar kernels):
// forward 338.5 us (1.79x the scalar 606.9), backward 690.7 us (1.23x 846.8, 90% of copy),
// the FP8 backward's two passes 1607 us against 1788 for the BF16 backward then the cast.
// Delayed scaling's one pass (2026-12-02, same tool): 1239 us, 49.5% of copy, 1.30x the two
// passes but half the BF16 backward's bandwidth on the same reads: each 64 x 64 tile reads
// 128 bytes from each of 64 rows and passes two barriers, where the row kernel streams rows.
// ncu (inside bench_moe, 2026-12-02): 870 us, DRAM 56% of peak, L2 73%, SM 65%, 74-80
// registers (3 blocks an SM, 37.5% occupancy). More occupancy does not help: capped at 64
// registers (4 blocks) it ran 1272 us, at 48 (5 blocks, spilling) 1619 us, against 1239-1241
// uncapped in the same run (bench_bandwidth). Nor does taking the loads off the critical
// path: the next tile copied into a shared-memory ring by cp.async over a persistent grid
// (same registers and blocks) ran 1231.7 us against 1234.2 (2026-12-03); nor a split form
// (row-wise codes from a flat row kernel, then a separate transpose of the codes on
// code_tile.cuh's word tile: 1318 us, commit 8f212a6, reverted). The transposed copy, not
// DRAM latency or the math, is what holds these kernels.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "cuda_check.h"
#include "fp8_cvt.cuh"
#include "moe.h"
#include "moe_common.cuh"
#include "moe_fp8_rows.cuh"

namespace tessera::cuda {
namespace {

using namespace moe_detail;
using namespace moe_fp8_detail;

constexpr int kThreads = 256;
constexpr int kVecs = 4;  // 16-byte vectors in flight per thread and operand
constexpr int64_t kMaxBlocks = 8192;

// ---- The elementwise formulas (both kernels, so that they round the same) ---------------

__device__ __forceinline__ float swiglu_forward(float g, float u, float sc) {
  return g * (1.0f / (1.0f + expf(-g))) * u * sc;
}

// dg, du: the two dx elements; h = silu(g) * u, the term of d_prob (times d0).
__device__ __forceinline__ void swiglu_backward(float g, float u, float d0, float sc, float& dg, float& du, float& h) {
  const float s = 1.0f / (1.0f + expf(-g)), d = d0 * sc;
  h = g * s * u;
  dg = d * u * s * (1.0f + g * (1.0f - s));
  du = d * g * s;
}

__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16(v)); }

// The value st() leaves in memory, as a float (for the amax of what was stored).
__device__ __forceinline__ float stored(const float*, float v) { return v; }
__device__ __forceinline__ float stored(const __nv_bfloat16*, float v) { return round_bf16(v); }

__device__ __forceinline__ uint32_t bf16_bits(float v) { return __bfloat16_as_ushort(__float2bfloat16(v)); }

// 8 floats rounded to BF16 as 16 bytes (unpack8, the way back, is in moe_fp8_rows.cuh).
__device__ __forceinline__ uint4 pack8(const float* f) {
  uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) w[k] = bf16_bits(f[2 * k]) | bf16_bits(f[2 * k + 1]) << 16;
  return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ uint4 load16(const uint16_t* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

// ---- Scalar kernels (any dtype and width) ---------------------------------------------------

template <typename T>
__global__ void swiglu_scaled_kernel(const T* x, AnyPtr scale, T* y, int64_t half) {
  const int64_t r = blockIdx.x;
  const float sc = scale.load(r);
  for (int64_t c = threadIdx.x; c < half; c += blockDim.x)
    st(y, r * half + c, swiglu_forward(ld(x, r * 2 * half + c), ld(x, r * 2 * half + half + c), sc));
}

// kAmax: also folds max |dx| (of the stored values) into *dx_amax, zeroed beforehand, the
// statistic the FP8 cast of dx needs (saves the cast's separate amax pass over dx).
template <typename T, bool kAmax>
__global__ void swiglu_scaled_backward_kernel(const T* x, AnyPtr scale, const T* dy, T* dx, AnyPtr d_scale, int64_t half,
                                              uint32_t* dx_amax) {
  const int64_t r = blockIdx.x;
  const float sc = scale.load(r);
  float dot = 0;
  uint32_t m = 0;
  for (int64_t c = threadIdx.x; c < half; c += blockDim.x) {
    const float d0 = ld(dy, r * half + c);
    float dg, du, h;
    swiglu_backward(ld(x, r * 2 * half + c), ld(x, r * 2 * half + half + c), d0, sc, dg, du, h);
    dot += d0 * h;
    st(dx, r * 2 * half + c, dg);
    st(dx, r * 2 * half + half + c, du);
    if constexpr (kAmax) m = max(m, max(fp8cvt::abs_bits(stored(dx, dg)), fp8cvt::abs_bits(stored(dx, du))));
  }
  dot = block_sum(dot);
  if (threadIdx.x == 0) d_scale.store(r, dot);
  if constexpr (kAmax) fp8cvt::block_atomic_max(m, dx_amax);
}

// ---- Vector kernels (BF16, F % 8 == 0, 16-byte aligned) -------------------------------------

// Flat over the M * F / 8 vectors of h: h's vector v is elements [8v, 8v + 8) of y.
__global__ void __launch_bounds__(kThreads)
    swiglu_forward_vector_kernel(const uint16_t* x, AnyPtr scale, uint16_t* y, int64_t half, int64_t vectors) {
  const int64_t per_row = half / 8, step = int64_t(gridDim.x) * kThreads * kVecs;
  for (int64_t base = blockIdx.x * int64_t(kThreads * kVecs); base < vectors; base += step) {
    uint4 g[kVecs], u[kVecs];
    float sc[kVecs];
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {  // every load before any math
      const int64_t v = base + k * kThreads + threadIdx.x;
      if (v >= vectors) continue;
      const int64_t r = v / per_row, c = (v - r * per_row) * 8;
      g[k] = load16(x + r * 2 * half + c);
      u[k] = load16(x + r * 2 * half + half + c);
      sc[k] = scale.load(r);
    }
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int64_t v = base + k * kThreads + threadIdx.x;
      if (v >= vectors) continue;
      float gf[8], uf[8];
      unpack8(g[k], gf);
      unpack8(u[k], uf);
#pragma unroll
      for (int i = 0; i < 8; ++i) gf[i] = swiglu_forward(gf[i], uf[i], sc[k]);
      *reinterpret_cast<uint4*>(y + v * 8) = pack8(gf);
    }
  }
}

// One block per row (blockDim a multiple of 32, <= kThreads). kStore: write dx (off: FP8
// pass 1, which keeps d_prob and the amax only); kAmax: max |BF16(dx)| into *dx_amax.
template <bool kAmax, bool kStore>
__global__ void __launch_bounds__(kThreads)
    swiglu_backward_vector_kernel(const uint16_t* x, AnyPtr scale, const uint16_t* dy, uint16_t* dx, AnyPtr d_scale,
                                  int64_t half, uint32_t* dx_amax) {
  // Vectors within a row in int (the host checks F / 8 < 2^30): fewer registers.
  const int64_t r = blockIdx.x;
  const int per_row = int(half / 8), step = int(blockDim.x) * kVecs;
  const uint4* gr = reinterpret_cast<const uint4*>(x + r * 2 * half);
  const uint4* ur = reinterpret_cast<const uint4*>(x + r * 2 * half + half);
  const uint4* dyr = reinterpret_cast<const uint4*>(dy + r * half);
  uint4* dgr = reinterpret_cast<uint4*>(dx + r * 2 * half);
  uint4* dur = reinterpret_cast<uint4*>(dx + r * 2 * half + half);
  const float sc = scale.load(r);
  float dot = 0;
  uint32_t m = 0;
  for (int base = int(threadIdx.x); base < per_row; base += step) {
    uint4 g[kVecs], u[kVecs], d[kVecs];
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int j = base + k * int(blockDim.x);
      if (j >= per_row) continue;
      g[k] = __ldg(gr + j);
      u[k] = __ldg(ur + j);
      d[k] = __ldg(dyr + j);
    }
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int j = base + k * int(blockDim.x);
      if (j >= per_row) continue;
      float gf[8], uf[8], df[8];
      unpack8(g[k], gf);
      unpack8(u[k], uf);
      unpack8(d[k], df);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        float dg, du, h;
        swiglu_backward(gf[i], uf[i], df[i], sc, dg, du, h);
        dot += df[i] * h;
        gf[i] = dg;
        uf[i] = du;
      }
      const uint4 wg = pack8(gf), wu = pack8(uf);
      if constexpr (kStore) {
        dgr[j] = wg;
        dur[j] = wu;
      }
      if constexpr (kAmax) {
        float sg[8], su[8];  // the stored values
        unpack8(wg, sg);
        unpack8(wu, su);
#pragma unroll
        for (int i = 0; i < 8; ++i) m = max(m, max(fp8cvt::abs_bits(sg[i]), fp8cvt::abs_bits(su[i])));
      }
    }
  }
  dot = block_sum(dot);
  if (threadIdx.x == 0) d_scale.store(r, dot);
  if constexpr (kAmax) fp8cvt::block_atomic_max(m, dx_amax);
}

// FP8 pass 2. Tiles of 64 padded positions x 64 features c < F: each thread loads gate, up
// and dy vectors of two (padded position, 8 features) pieces, computes the gate and the up
// halves of dx there, stores their codes row-wise (columns c and F + c of data) and into two
// shared tiles, which then become 16-byte pieces of data_t rows c and F + c.
//
// kFused (delayed scaling's one pass): also d_prob's partial sum of each (kept row, 64-feature
// tile), into partial [M, tiles_across] (the 8 threads of a row piece add their 8 features in
// order, then a fixed shuffle tree), and max |BF16(dx)| into amax_bits when given.
template <bool kE4M3, bool kFused>
__global__ void __launch_bounds__(kThreads)
    swiglu_backward_cast_kernel(const uint16_t* x, AnyPtr prob, const uint16_t* dy, const float* scale, uint8_t* q,
                                uint8_t* q_t, int64_t half, int64_t width, ExpertTable table, int64_t tiles_across,
                                int64_t tiles, float* partial, uint32_t* amax_bits) {
  __shared__ __align__(16) CodeTile tile[2];  // gate half, up half
  const float s = *scale;
  uint32_t m = 0;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t p0 = (t / tiles_across) * kVTile, c0 = (t % tiles_across) * kVTile;
    uint4 g[2], u[2], d[2];
    int64_t src[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) {  // all loads first
      const int id = int(threadIdx.x) + k * kThreads;
      const int64_t p = p0 + id / 8, c = c0 + (id % 8) * 8;
      src[k] = p < width && c < half ? source_row(table, p) : -1;
      if (src[k] < 0) continue;
      g[k] = load16(x + src[k] * 2 * half + c);
      u[k] = load16(x + src[k] * 2 * half + half + c);
      d[k] = load16(dy + src[k] * half + c);
    }
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int id = int(threadIdx.x) + k * kThreads, pl = id / 8, v = id % 8;
      uint32_t wg[2] = {0, 0}, wu[2] = {0, 0};  // padding positions: zero codes
      float dot = 0;
      if (src[k] >= 0) {
        float gf[8], uf[8], df[8];
        unpack8(g[k], gf);
        unpack8(u[k], uf);
        unpack8(d[k], df);
        const float sc = prob.load(src[k]);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          float dg, du, h;
          swiglu_backward(gf[i], uf[i], df[i], sc, dg, du, h);
          dot += df[i] * h;
          gf[i] = round_bf16(dg);  // what a BF16 dx would hold
          uf[i] = round_bf16(du);
          if constexpr (kFused) m = max(m, max(fp8cvt::abs_bits(gf[i]), fp8cvt::abs_bits(uf[i])));
        }
        fp8cvt::quantize_words<kE4M3, 8>(gf, s, wg);
        fp8cvt::quantize_words<kE4M3, 8>(uf, s, wu);
        const int64_t c = c0 + v * 8;
        *reinterpret_cast<uint2*>(q + src[k] * 2 * half + c) = make_uint2(wg[0], wg[1]);
        *reinterpret_cast<uint2*>(q + src[k] * 2 * half + half + c) = make_uint2(wu[0], wu[1]);
      }
      uint32_t* rg = reinterpret_cast<uint32_t*>(&tile[0][pl][v * 8]);
      uint32_t* ru = reinterpret_cast<uint32_t*>(&tile[1][pl][v * 8]);
      rg[0] = wg[0];
      rg[1] = wg[1];
      ru[0] = wu[0];
      ru[1] = wu[1];
      if constexpr (kFused) {
        // The 8 neighbouring lanes of this row piece (v = 0..7); every lane takes part.
#pragma unroll
        for (int offset = 4; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
        if (v == 0 && src[k] >= 0) partial[src[k] * tiles_across + c0 / kVTile] = dot;
      }
    }
    __syncthreads();
    store_tile_transposed(tile[0], q_t, c0, p0, half, width);
    store_tile_transposed(tile[1], q_t + half * width, c0, p0, half, width);
    __syncthreads();  // the tiles are rewritten by the next iteration
  }
  if constexpr (kFused)
    if (amax_bits) fp8cvt::block_atomic_max(m, amax_bits);
}

// d_prob[r] of the fused pass: one warp per row; kept rows add their tiles' partial sums in
// a fixed order (lane-strided, then a shuffle tree), rows past the split sum (if any) their
// whole dot from x and dy.
__global__ void __launch_bounds__(kThreads)
    swiglu_backward_prob_kernel(const uint16_t* x, AnyPtr prob, const uint16_t* dy, const float* partial,
                                AnyPtr d_prob, int64_t rows, int64_t kept, int64_t half, int64_t tiles_across) {
  const int lane = int(threadIdx.x) & 31;
  const int64_t r = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32;
  if (r >= rows) return;
  float sum = 0;
  if (r < kept) {
    for (int64_t j = lane; j < tiles_across; j += 32) sum += partial[r * tiles_across + j];
  } else {
    const float sc = prob.load(r);
    for (int64_t c = lane; c < half; c += 32) {
      const float g = __uint_as_float(uint32_t(x[r * 2 * half + c]) << 16);
      const float u = __uint_as_float(uint32_t(x[r * 2 * half + half + c]) << 16);
      const float d0 = __uint_as_float(uint32_t(dy[r * half + c]) << 16);
      float dg, du, h;
      swiglu_backward(g, u, d0, sc, dg, du, h);
      sum += d0 * h;
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (lane == 0) d_prob.store(r, sum);
}

// ---- Host side ------------------------------------------------------------------------------

bool aligned16(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.raw_data()) % 16 == 0; }

// The vector kernels' case: BF16, F % 8 == 0 and every operand 16-byte aligned.
bool vector_case(const Tensor& x, std::initializer_list<const Tensor*> others) {
  const int64_t half = x.size(1) / 2;
  if (x.dtype() != DType::BF16 || half % 8 != 0 || half / 8 >= (int64_t{1} << 30) || !aligned16(x)) return false;
  for (const Tensor* t : others)
    if (t->dtype() != DType::BF16 || !aligned16(*t)) return false;
  return true;
}

// Threads of a backward block: enough for one pass over a row at kVecs vectors each, whole
// warps, at most kThreads (a function of F only, so d_prob's reduction shape is too).
unsigned backward_threads(int64_t half) {
  const int64_t need = (half / 8 + kVecs - 1) / kVecs;
  return unsigned(std::clamp<int64_t>((need + 31) / 32 * 32, 32, kThreads));
}

void launch_backward_vector(cudaStream_t s, const Tensor& x, const Tensor& scale, const Tensor& dy, Tensor* dx,
                            Tensor& d_scale, uint32_t* amax_bits) {
  const int64_t rows = x.size(0), half = x.size(1) / 2;
  const unsigned threads = backward_threads(half);
  const auto* xp = static_cast<const uint16_t*>(x.raw_data());
  const auto* dyp = static_cast<const uint16_t*>(dy.raw_data());
  uint16_t* dxp = dx ? static_cast<uint16_t*>(dx->raw_data()) : nullptr;
  const unsigned blocks = static_cast<unsigned>(rows);
  if (!dx)
    swiglu_backward_vector_kernel<true, false>
        <<<blocks, threads, 0, s>>>(xp, any_ptr(scale), dyp, dxp, any_ptr(d_scale), half, amax_bits);
  else if (amax_bits)
    swiglu_backward_vector_kernel<true, true>
        <<<blocks, threads, 0, s>>>(xp, any_ptr(scale), dyp, dxp, any_ptr(d_scale), half, amax_bits);
  else
    swiglu_backward_vector_kernel<false, true>
        <<<blocks, threads, 0, s>>>(xp, any_ptr(scale), dyp, dxp, any_ptr(d_scale), half, nullptr);
  TESSERA_CUDA_CHECK_LAUNCH();
}

}  // namespace

void moe_swiglu_scaled_forward(void* stream, const Tensor& x, const Tensor& scale, Tensor& y, bool legacy) {
  auto s = static_cast<cudaStream_t>(stream);
  const int64_t rows = x.size(0), half = x.size(1) / 2;
  if (rows == 0 || half == 0) return;
  if (!legacy && vector_case(x, {&y})) {
    const int64_t vectors = rows * (half / 8), per_block = int64_t(kThreads) * kVecs;
    const unsigned blocks = unsigned(std::min<int64_t>((vectors + per_block - 1) / per_block, int64_t{1} << 30));
    swiglu_forward_vector_kernel<<<blocks, kThreads, 0, s>>>(static_cast<const uint16_t*>(x.raw_data()),
                                                             any_ptr(scale), static_cast<uint16_t*>(y.raw_data()),
                                                             half, vectors);
    TESSERA_CUDA_CHECK_LAUNCH();
    return;
  }
  by_dtype(x, [&](auto zero) {
    using T = decltype(zero);
    swiglu_scaled_kernel<T><<<static_cast<unsigned>(rows), kThreads, 0, s>>>(x.data<T>(), any_ptr(scale), y.data<T>(), half);
  });
  TESSERA_CUDA_CHECK_LAUNCH();
}

void moe_swiglu_scaled_backward(void* stream, const Tensor& x, const Tensor& scale, const Tensor& dy, Tensor& dx,
                                Tensor& d_scale, Tensor* dx_amax, bool legacy) {
  auto s = static_cast<cudaStream_t>(stream);
  const int64_t rows = x.size(0), half = x.size(1) / 2;
  uint32_t* amax_bits = dx_amax ? dx_amax->data<uint32_t>() : nullptr;
  if (amax_bits) TESSERA_CUDA_CHECK(cudaMemsetAsync(amax_bits, 0, sizeof(uint32_t), s));
  if (rows == 0) return;
  if (!legacy && half > 0 && vector_case(x, {&dy, &dx})) {
    launch_backward_vector(s, x, scale, dy, &dx, d_scale, amax_bits);
    return;
  }
  by_dtype(x, [&](auto zero) {
    using T = decltype(zero);
    if (amax_bits)
      swiglu_scaled_backward_kernel<T, true><<<static_cast<unsigned>(rows), kThreads, 0, s>>>(
          x.data<T>(), any_ptr(scale), dy.data<T>(), dx.data<T>(), any_ptr(d_scale), half, amax_bits);
    else
      swiglu_scaled_backward_kernel<T, false><<<static_cast<unsigned>(rows), kThreads, 0, s>>>(
          x.data<T>(), any_ptr(scale), dy.data<T>(), dx.data<T>(), any_ptr(d_scale), half, nullptr);
  });
  TESSERA_CUDA_CHECK_LAUNCH();
}

bool moe_swiglu_backward_cast_supported(const Tensor& x, const Tensor& scale, const Tensor& dy, int64_t experts) {
  return x.dim() == 2 && x.is_contiguous() && dy.is_contiguous() && x.size(1) > 0 && f32_or_bf16(scale) &&
         vector_case(x, {&dy}) && x.size(0) < (int64_t{1} << 31) - kVTile && experts <= kMoeFp8MaxExperts;
}

void moe_swiglu_scaled_backward_amax(void* stream, const Tensor& x, const Tensor& scale, const Tensor& dy,
                                     Tensor& d_scale, Tensor& dx_amax) {
  auto s = static_cast<cudaStream_t>(stream);
  TESSERA_CUDA_CHECK(cudaMemsetAsync(dx_amax.raw_data(), 0, sizeof(uint32_t), s));
  if (x.size(0) == 0) return;
  launch_backward_vector(s, x, scale, dy, nullptr, d_scale, dx_amax.data<uint32_t>());
}

void moe_swiglu_scaled_backward_cast(void* stream, const Tensor& x, const Tensor& scale, const Tensor& dy,
                                     const Tensor& fp8_scale, const std::vector<int64_t>& splits,
                                     const std::vector<int64_t>& padded, Tensor& data, Tensor& data_t) {
  auto s = static_cast<cudaStream_t>(stream);
  const int64_t cols = data.size(1), half = cols / 2, width = data_t.size(1);
  const int64_t kept = zero_rows_past_splits(s, splits, data);
  if (kept == 0 || half == 0) return;
  const ExpertTable table = make_table(splits, padded);
  const int64_t across = (half + kVTile - 1) / kVTile, tiles = (width + kVTile - 1) / kVTile * across;
  const unsigned blocks = unsigned(std::min(tiles, kMaxBlocks));
  const auto* xp = static_cast<const uint16_t*>(x.raw_data());
  const auto* dyp = static_cast<const uint16_t*>(dy.raw_data());
  if (data.dtype() == DType::E4M3)
    swiglu_backward_cast_kernel<true, false><<<blocks, kThreads, 0, s>>>(
        xp, any_ptr(scale), dyp, fp8_scale.data<float>(), data.data<uint8_t>(), data_t.data<uint8_t>(), half, width,
        table, across, tiles, nullptr, nullptr);
  else
    swiglu_backward_cast_kernel<false, false><<<blocks, kThreads, 0, s>>>(
        xp, any_ptr(scale), dyp, fp8_scale.data<float>(), data.data<uint8_t>(), data_t.data<uint8_t>(), half, width,
        table, across, tiles, nullptr, nullptr);
  TESSERA_CUDA_CHECK_LAUNCH();
}

int64_t moe_swiglu_backward_partial_columns(int64_t half) { return (half + kVTile - 1) / kVTile; }

void moe_swiglu_scaled_backward_cast_fused(void* stream, const Tensor& x, const Tensor& scale, const Tensor& dy,
                                           const Tensor& fp8_scale, const std::vector<int64_t>& splits,
                                           const std::vector<int64_t>& padded, Tensor& data, Tensor& data_t,
                                           Tensor& partial, Tensor& d_prob, Tensor* amax) {
  auto s = static_cast<cudaStream_t>(stream);
  const int64_t rows = x.size(0), cols = data.size(1), half = cols / 2, width = data_t.size(1);
  const int64_t kept = zero_rows_past_splits(s, splits, data);
  const int64_t across = moe_swiglu_backward_partial_columns(half);
  const auto* xp = static_cast<const uint16_t*>(x.raw_data());
  const auto* dyp = static_cast<const uint16_t*>(dy.raw_data());
  if (kept > 0 && half > 0) {
    const ExpertTable table = make_table(splits, padded);
    const int64_t tiles = (width + kVTile - 1) / kVTile * across;
    const unsigned blocks = unsigned(std::min(tiles, kMaxBlocks));
    uint32_t* amax_bits = amax ? amax->data<uint32_t>() : nullptr;
    if (data.dtype() == DType::E4M3)
      swiglu_backward_cast_kernel<true, true><<<blocks, kThreads, 0, s>>>(
          xp, any_ptr(scale), dyp, fp8_scale.data<float>(), data.data<uint8_t>(), data_t.data<uint8_t>(), half,
          width, table, across, tiles, partial.data<float>(), amax_bits);
    else
      swiglu_backward_cast_kernel<false, true><<<blocks, kThreads, 0, s>>>(
          xp, any_ptr(scale), dyp, fp8_scale.data<float>(), data.data<uint8_t>(), data_t.data<uint8_t>(), half,
          width, table, across, tiles, partial.data<float>(), amax_bits);
    TESSERA_CUDA_CHECK_LAUNCH();
  }
  if (rows == 0) return;
  const int64_t warps_per_block = kThreads / 32;
  swiglu_backward_prob_kernel<<<unsigned((rows + warps_per_block - 1) / warps_per_block), kThreads, 0, s>>>(
      xp, any_ptr(scale), dyp, partial.data<float>(), any_ptr(d_prob), rows, kept, half, across);
  TESSERA_CUDA_CHECK_LAUNCH();
}

}  // namespace tessera::cuda
