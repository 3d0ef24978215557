// Warp-row building blocks shared by the softmax forward (softmax.cu) and the cross-entropy
// forward (loss_rows.cu): a row of `cols` elements (cols % 8 == 0, row start 16-byte aligned) held
// in registers as loaded (vec::Packed8: BF16 two to a register) by G lanes of one warp
// (G = 4, 8, 16 or 32; 32 / G rows per warp, 128-thread blocks), and its log-sum-exp.
//
// Every load of a thread is issued before any arithmetic. Each thread then takes the max of
// its own elements and the sum of exp(x - its max) from its registers (no group result to
// wait for), and one xor butterfly over the G lanes merges the (max, sum) pairs, rescaling
// the smaller side: one reduction instead of a max and then a sum, and only shuffles (no
// shared memory, no barrier). A butterfly's partners add the same two terms, so every lane
// ends with the same bits, in a fixed order (deterministic).
//
// Special values follow the CPU reference: the max propagates NaN (max.NaN), so a NaN row
// gets a NaN max and sum; a fully masked row (all -inf) keeps max -inf and sum 0; a +inf max
// makes the sum NaN (exp(inf - inf)). -inf padding (lanes past the row's end) adds nothing.
// CUDA-only (included by .cu files).
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <type_traits>

#include "vec_io.cuh"

namespace tessera::cuda::warprow {

constexpr float kLog2e = 1.4426950408889634f;

// The row-group kernels' reduction (softmax.cu, loss_rows.cu): reduces v over the blockDim.x
// threads of a row group; every thread of the group gets the same bits. Up to a warp: xor butterfly. Several warps (then the group is the whole block):
// warp results through `shared` (one array per call site: no reuse, no trailing barrier),
// combined in warp order.
template <typename Op>
__device__ __forceinline__ float group_reduce(float v, float* shared, Op op) {
  const int width = blockDim.x < 32 ? blockDim.x : 32;
  for (int offset = width / 2; offset > 0; offset /= 2) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  if (blockDim.x <= 32) return v;
  if ((threadIdx.x & 31) == 0) shared[threadIdx.x >> 5] = v;
  __syncthreads();
  float r = shared[0];
  for (int w = 1; w < int(blockDim.x >> 5); ++w) r = op(r, shared[w]);
  return r;
}

constexpr int kThreads = 128;     // block size of the warp-row kernels
constexpr int kMaxDataRegs = 64;  // registers of row data per thread (16 BF16 / 8 F32 vectors)

// Blocks per SM the warp-row kernels ask of the register allocator (__launch_bounds__'s
// second argument), from the registers of row data a thread holds: without it, a kernel
// that only needs the row's sum keeps the unpacked floats of its max pass live for its sum
// pass (twice the registers) instead of unpacking again.
template <typename T, int NV>
constexpr int min_blocks() {
  constexpr int data = NV * int(sizeof(vec::Packed8<T>) / 4);
  return data <= 16 ? 8 : data <= 32 ? 6 : 5;
}

// 2^x in one SFU instruction (flushes subnormal results to 0, which no BF16/F32 softmax or
// log-sum-exp comparison can see: they are below 2^-126 of the row's largest term).
__device__ __forceinline__ float ex2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// p[0..7] = v[0..7] rounded to T; p 16-byte aligned. BF16 through the hardware's
// round-to-nearest-even pair conversion (one instruction per two elements, where
// vec::store8's portable rounding takes several per element: a third of the softmax
// forward's instructions). Same bits for every non-NaN value; a NaN comes out as the
// canonical BF16 NaN rather than the float's payload shifted.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));  // a -> upper half, b -> lower
  return r;
}
template <typename T>
__device__ __forceinline__ void store8(T* p, const float (&v)[vec::kWidth]) {
  if constexpr (std::is_same_v<T, bf16>) {
    *reinterpret_cast<uint4*>(p) =
        make_uint4(pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]), pack_bf16x2(v[4], v[5]), pack_bf16x2(v[6], v[7]));
  } else {
    vec::store8(p, v);
  }
}

// s * exp(m - to), with s kept when m is -inf (nothing was added there: avoids -inf - -inf).
__device__ __forceinline__ float rescale(float s, float m, float to) {
  return m == -INFINITY ? s : s * ex2((m - to) * kLog2e);
}

// The row slice of one lane: units lane, lane + G, lane + 2G, ... (a warp's loads contiguous).
template <typename T, int NV>
struct RegRow {
  vec::Packed8<T> u[NV];

  __device__ __forceinline__ void load(const T* row, bool live, int lane, int g, int cols) {
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int c = (j * g + lane) * vec::kWidth;
      if (live && c < cols) vec::load_packed(row + c, u[j]);
      else vec::fill_neg_inf(u[j]);
    }
  }

  // The (max, sum of exp(x - max)) pair of the whole row, on every lane of the group: the
  // thread's max over its registers, then its sum relative to that max (two passes over
  // the registers; for a kernel that keeps the packed row anyway).
  __device__ __forceinline__ void lse(int g, float& m, float& s) const {
    m = -INFINITY;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      float v[vec::kWidth];
      vec::unpack(u[j], v);
#pragma unroll
      for (int k = 0; k < vec::kWidth; ++k) m = vec::max_nan(m, v[k]);
    }
    s = 0.0f;
    if (m != -INFINITY) {  // all -inf: nothing to add (and -inf - -inf would be NaN)
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        float v[vec::kWidth];
        vec::unpack(u[j], v);
#pragma unroll
        for (int k = 0; k < vec::kWidth; ++k) s += ex2((v[k] - m) * kLog2e);  // x - max: exact near the max
      }
    }
    merge(g, m, s);
  }

  // The same pair from one pass over the registers, online per 8-element vector (the sum
  // rescaled when the vector raises the max: one more exponential per 8 elements). For a
  // kernel that needs only the pair: each vector is unpacked once, so the compiler has no
  // unpacked row to keep live between passes (the two-pass form spills there).
  __device__ __forceinline__ void lse_online(int g, float& m, float& s) const {
    m = -INFINITY;
    s = 0.0f;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      float v[vec::kWidth];
      vec::unpack(u[j], v);
      float vmax = v[0];
#pragma unroll
      for (int k = 1; k < vec::kWidth; ++k) vmax = vec::max_nan(vmax, v[k]);
      const float mn = vec::max_nan(m, vmax);
      if (mn != -INFINITY) {  // else everything so far is -inf: nothing to add
        s = rescale(s, m, mn);
#pragma unroll
        for (int k = 0; k < vec::kWidth; ++k) s += ex2((v[k] - mn) * kLog2e);
      }
      m = mn;
    }
    merge(g, m, s);
  }

  // Xor butterfly over the g lanes of the group.
  static __device__ __forceinline__ void merge(int g, float& m, float& s) {
    for (int offset = g / 2; offset > 0; offset /= 2) {
      const float mo = __shfl_xor_sync(0xffffffffu, m, offset), so = __shfl_xor_sync(0xffffffffu, s, offset);
      const float mn = vec::max_nan(m, mo);
      s = rescale(s, m, mn) + rescale(so, mo, mn);
      m = mn;
    }
  }
};

// ---- Host side: the launch shape ----------------------------------------------------------

// The NV values instantiated (units per thread, rounded up to one of these).
inline int round_nv(int nv) {
  for (int v : {1, 2, 3, 4, 6, 8, 12, 16})
    if (nv <= v) return v;
  return 0;
}

// fn(integral_constant<int, NV>) for nv from round_nv; MaxNV bounds the instantiations
// (kMaxDataRegs / the unit's registers: 16 for BF16, 8 for F32).
template <int MaxNV, typename Fn>
void dispatch_nv(int nv, Fn&& fn) {
  if (nv == 1) fn(std::integral_constant<int, 1>{});
  else if (nv == 2) fn(std::integral_constant<int, 2>{});
  else if (nv == 3) fn(std::integral_constant<int, 3>{});
  else if (nv == 4) fn(std::integral_constant<int, 4>{});
  else if (nv == 6) fn(std::integral_constant<int, 6>{});
  else if (nv == 8) fn(std::integral_constant<int, 8>{});
  else if constexpr (MaxNV >= 16) {
    if (nv == 12) fn(std::integral_constant<int, 12>{});
    else fn(std::integral_constant<int, 16>{});
  }
}

struct Shape {
  int group = 0, nv = 0;  // nv 0: the warp-row kernels do not take this row
};

template <typename T>
constexpr int max_nv() {
  return kMaxDataRegs / int(sizeof(vec::Packed8<T>) / 4);
}

// Lanes per row and units per thread for rows of `units` 16-byte-aligned 8-element vectors
// whose packed form takes `unit_regs` registers: the forced group when it holds the row,
// else the fewest lanes (>= 4) that hold it in kMaxDataRegs registers.
inline Shape shape_for(long long units, int unit_regs, int forced_group) {
  const int max_nv = kMaxDataRegs / unit_regs;
  auto fit = [&](int g) {
    const long long need = (units + g - 1) / g;
    return need <= max_nv ? round_nv(int(need)) : 0;
  };
  if (units <= 0) return {};
  if (forced_group == 4 || forced_group == 8 || forced_group == 16 || forced_group == 32) {
    const int nv = fit(forced_group);
    if (nv > 0) return {forced_group, nv};
  }
  for (int g = 4; g <= 32; g *= 2) {
    const int nv = fit(g);
    if (nv > 0 && nv <= max_nv) return {g, nv};
  }
  return {};
}

}  // namespace tessera::cuda::warprow
