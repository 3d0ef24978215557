// The FP8 casts of the MoE expert weights w [E, N, K] (BF16) with one per-tensor scale per
// expert (current scaling), in three launches whatever the number of experts, instead of
// three launches and two allocations per expert:
//  1. amax: the grid's y dimension walks the listed experts, x strides over one expert's
//     16-byte vectors; each block folds its max into its expert's word with one atomic
//     (fp8_cvt.cuh's order-free bits, so the value is cuda::amax's, NaN included);
//  2. scales: one block, one thread per expert, numeric.h's fp8_scale_for_amax and
//     gemm_fp8.cu's reciprocal rule (the very expressions of the per-expert path, so the
//     bits match);
//  3. cast: row-wise only, the same grid shape as the amax (a 16-byte load of 8 BF16, the
//     hardware cvt, an 8-byte store); or, when the transposed codes are wanted too, 64 x 128
//     tiles of every listed expert in one persistent grid, cast_transpose.cu's tile scheme
//     (code_tile.cuh) with the tile's expert looked up from the tile index.
// Delayed scaling skips 1 and 2: the cast reads each expert's scale from the scaling state
// (indexed by the expert's id) and folds the expert's amax into the state's slot from its
// own read (per-thread max, one atomic per block and expert).
//
// Layout: w contiguous and 16-byte aligned, K % 8 == 0 (N % 8 == 0 for the transpose);
// outputs in compact slots (moe_weight_cast.h). The codes equal quantize_with_transpose's
// of each expert with its scale, byte for byte (fp8_cvt.cuh's conversion).
//
// Floor (H200, ~4.1 TB/s), per element: amax 2 B read, cast 2 B read + 1 B written (+1 B for
// the transposed copy): 5 B (6 B). Mixtral's fc w [8, 28672, 4096]: 4.70 GB, ~1.15 ms (5.64
// GB, ~1.38 ms); proj w [8, 4096, 14336]: 2.35 GB, ~0.57 ms (2.82 GB, ~0.69 ms). Measured
// (H200, 2026-11-30, bench_bandwidth moe_weights, same run as the per-expert loop): row-wise
// 1106 us and 562 us (at copy speed; the loop with W^T the forward ran before: 1561, 843),
// with W^T 1576 and 771 us.
#include "moe_weight_cast.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "code_tile.cuh"
#include "cuda_backend.h"
#include "cuda_check.h"
#include "fp8_cvt.cuh"
#include "tessera/core/numeric.h"
#include "vec_io.cuh"

namespace tessera::cuda {

namespace {

constexpr int kThreads = 256;
// The streaming kernels: 1024 threads a SM, each with 4 x 16 B of loads in flight (64 KB a
// SM, twice what 4.1 TB/s needs at ~1 us latency over 132 SMs); the bound keeps their
// registers within it, so that the grid sized by it is one resident wave.
constexpr int kStreamBlocksPerSm = 4;
constexpr int kTileBlocksPerSm = 3;    // the tile kernel (cast_transpose.cu's figure)
constexpr int kUnroll = 4;             // 16-byte loads in flight per thread
constexpr int kVec = 8;                // BF16 elements per 16-byte load
constexpr int kTileRows = code_tile::kRows, kTileCols = code_tile::kCols, kTileWords = code_tile::kWords;
static_assert(kThreads == code_tile::kThreads, "the transposed store maps 256 threads");

// The listed experts' indices into w, by value (kernel parameters: no copy to the device).
struct ExpertList {
  int32_t id[kMoeWeightCastMaxExperts];
};

// Where the cast of list slot i finds its scale and puts its amax: current scaling's compact
// scales scale[4 i] and no amax; delayed scaling's state, scale[id] and amax[id] (id the
// expert's index in w), the amax folded from the cast's own read.
struct ScaleSlots {
  const float* scale;
  uint32_t* amax_bits;  // null: no amax
  bool by_expert;
  __device__ __forceinline__ int key(const ExpertList& list, int64_t slot) const {
    return by_expert ? list.id[slot] : 4 * int(slot);
  }
};

__global__ void __launch_bounds__(kThreads, kStreamBlocksPerSm)
    weight_amax_kernel(const uint4* w, int64_t vecs, ExpertList list, uint32_t* amax_bits) {
  const int slot = blockIdx.y;
  const uint4* src = w + int64_t(list.id[slot]) * vecs;
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  uint32_t m = 0;
  for (int64_t v = blockIdx.x * int64_t(kThreads) + threadIdx.x; v < vecs; v += kUnroll * stride) {
    uint4 raw[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k)  // zeros past the end add nothing to the max
      raw[k] = v + k * stride < vecs ? __ldg(src + v + k * stride) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      float f[kVec];
      vec::unpack16<uint16_t>(raw[k], f);
#pragma unroll
      for (int i = 0; i < kVec; ++i) m = max(m, fp8cvt::abs_bits(f[i]));
    }
  }
  fp8cvt::block_atomic_max(m, amax_bits + slot);
}

__global__ void weight_scales_kernel(const float* amax, int n, float fp8_max, float margin, bool power_of_two,
                                     float* scale, float* scale_inv) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const float s = fp8_scale_for_amax(amax[i], fp8_max, margin, power_of_two);
    scale[4 * i] = s;
    // gemm_fp8.cu's reciprocal_kernel (what quantize_with_transpose's scale_inv comes from).
    scale_inv[4 * i] = (s > 0.0f && s <= 3.402823466e38f) ? __fdiv_rn(1.0f, s) : __int_as_float(0x7fc00000);
  }
}

__global__ void gather_scales_kernel(const float* from, int n, ExpertList list, float* scale_inv) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) scale_inv[4 * i] = from[list.id[i]];
}

template <bool kE4M3>
__global__ void __launch_bounds__(kThreads, kStreamBlocksPerSm)
    weight_cast_kernel(const uint4* w, ScaleSlots scales, uint2* q, int64_t vecs, ExpertList list) {
  const int slot = blockIdx.y;
  const uint4* src = w + int64_t(list.id[slot]) * vecs;
  uint2* dst = q + int64_t(slot) * vecs;
  const float s = scales.scale[scales.key(list, slot)];
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  uint32_t m = 0;
  for (int64_t v = blockIdx.x * int64_t(kThreads) + threadIdx.x; v < vecs; v += kUnroll * stride) {
    uint4 raw[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k)
      if (v + k * stride < vecs) raw[k] = __ldg(src + v + k * stride);
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      if (v + k * stride >= vecs) break;
      float f[kVec];
      vec::unpack16<uint16_t>(raw[k], f);
      if (scales.amax_bits) {
#pragma unroll
        for (int i = 0; i < kVec; ++i) m = max(m, fp8cvt::abs_bits(f[i]));
      }
      uint32_t words[2];
      fp8cvt::quantize_words<kE4M3, kVec>(f, s, words);
      dst[v + k * stride] = make_uint2(words[0], words[1]);
    }
  }
  if (scales.amax_bits) fp8cvt::block_atomic_max(m, scales.amax_bits + list.id[slot]);
}

// Tile t of the grid's loop is tile (t % per_expert) of slot t / per_expert; within an
// expert, tiles run row-major over [rows = N, cols = K]. BF16 only: 16 vectors a tile row,
// 4 loads a thread.
template <bool kE4M3>
__global__ void __launch_bounds__(kThreads, kTileBlocksPerSm)
    weight_cast_transpose_kernel(const uint16_t* w, ScaleSlots scales, uint8_t* q, uint8_t* q_t, int64_t rows,
                                 int64_t cols, int64_t tiles_across, int64_t per_expert, int64_t tiles,
                                 ExpertList list) {
  constexpr int VPR = kTileCols / kVec;               // loads per tile row
  constexpr int LOADS = kTileRows * VPR / kThreads;   // loads per thread per tile
  __shared__ uint32_t tile[kTileRows][kTileWords];
  const int64_t size = rows * cols;
  // The amax of the expert this block is on: flushed when the (block-uniform) expert changes.
  uint32_t m = 0;
  int64_t amax_slot = -1;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t slot = t / per_expert, local = t % per_expert;
    if (scales.amax_bits && slot != amax_slot) {
      if (amax_slot >= 0) fp8cvt::block_atomic_max(m, scales.amax_bits + list.id[amax_slot]);
      m = 0;
      amax_slot = slot;
    }
    const int64_t r0 = (local / tiles_across) * kTileRows, c0 = (local % tiles_across) * kTileCols;
    const uint16_t* x = w + int64_t(list.id[slot]) * size;
    uint8_t* qe = q + slot * size;
    const float s = scales.scale[scales.key(list, slot)];
    uint4 raw[LOADS];
#pragma unroll
    for (int k = 0; k < LOADS; ++k) {
      const int id = int(threadIdx.x) + k * kThreads, row = id / VPR, vec = id % VPR;
      const int64_t r = r0 + row, c = c0 + int64_t(vec) * kVec;
      if (r < rows && c < cols) raw[k] = __ldg(reinterpret_cast<const uint4*>(x + r * cols + c));
    }
#pragma unroll
    for (int k = 0; k < LOADS; ++k) {
      const int id = int(threadIdx.x) + k * kThreads, row = id / VPR, vec = id % VPR;
      const int64_t r = r0 + row, c = c0 + int64_t(vec) * kVec;
      if (r >= rows || c >= cols) continue;
      float f[kVec];
      vec::unpack16<uint16_t>(raw[k], f);
      if (scales.amax_bits) {
#pragma unroll
        for (int i = 0; i < kVec; ++i) m = max(m, fp8cvt::abs_bits(f[i]));
      }
      uint32_t words[2];
      fp8cvt::quantize_words<kE4M3, kVec>(f, s, words);
      *reinterpret_cast<uint2*>(qe + r * cols + c) = make_uint2(words[0], words[1]);
      tile[row][code_tile::swizzle(row, 2 * vec)] = words[0];
      tile[row][code_tile::swizzle(row, 2 * vec + 1)] = words[1];
    }
    __syncthreads();
    code_tile::store_transposed(tile, q_t + slot * size, rows, r0, c0, cols);  // K % 4 == 0, N % 8 == 0
    __syncthreads();  // the tile is rewritten by the next iteration
  }
  if (scales.amax_bits && amax_slot >= 0) fp8cvt::block_atomic_max(m, scales.amax_bits + list.id[amax_slot]);
}

ExpertList make_list(const std::vector<int64_t>& experts) {
  TESSERA_CHECK(!experts.empty() && static_cast<int64_t>(experts.size()) <= kMoeWeightCastMaxExperts,
                "moe_weight_cast: 1 to ", kMoeWeightCastMaxExperts, " experts, got ", experts.size());
  ExpertList list{};
  for (size_t i = 0; i < experts.size(); ++i) list.id[i] = static_cast<int32_t>(experts[i]);
  return list;
}

// The streaming kernels' grid: about one resident wave in all, split evenly over the experts.
dim3 stream_grid(const Tensor& w, int64_t vecs, size_t experts) {
  const int64_t wave = int64_t(multiprocessor_count(w.device().index)) * kStreamBlocksPerSm;
  const int64_t per_expert = std::max<int64_t>(1, wave / static_cast<int64_t>(experts));
  const int64_t needed = std::max<int64_t>(1, (vecs + kThreads - 1) / kThreads);
  return dim3(static_cast<unsigned>(std::min({per_expert, needed, int64_t(0x7fffffff)})),
              static_cast<unsigned>(experts));
}

}  // namespace

bool moe_weight_cast_supported(const Tensor& w, bool transposed) {
  return w.defined() && w.dtype() == DType::BF16 && w.dim() == 3 && w.is_contiguous() &&
         vec::aligned16(w.raw_data()) && w.size(0) <= kMoeWeightCastMaxExperts && w.size(2) % kVec == 0 &&
         (!transposed || w.size(1) % 8 == 0);
}

void moe_weight_amax(void* stream, const Tensor& w, const std::vector<int64_t>& experts, Tensor& amax) {
  auto s = static_cast<cudaStream_t>(stream);
  const ExpertList list = make_list(experts);
  uint32_t* bits = amax.data<uint32_t>();
  TESSERA_CUDA_CHECK(cudaMemsetAsync(bits, 0, experts.size() * sizeof(uint32_t), s));
  const int64_t vecs = w.size(1) * w.size(2) / kVec;
  if (vecs == 0) return;
  weight_amax_kernel<<<stream_grid(w, vecs, experts.size()), kThreads, 0, s>>>(
      static_cast<const uint4*>(w.raw_data()), vecs, list, bits);
  TESSERA_CUDA_CHECK_LAUNCH();
}

void moe_weight_scales(void* stream, const Tensor& amax, float fp8_max, float margin, bool power_of_two, Tensor& scale,
                       Tensor& scale_inv) {
  const int n = static_cast<int>(amax.numel());
  if (n == 0) return;
  const int threads = std::min(1024, (n + 31) / 32 * 32);
  weight_scales_kernel<<<1, threads, 0, static_cast<cudaStream_t>(stream)>>>(
      amax.data<float>(), n, fp8_max, margin, power_of_two, scale.data<float>(), scale_inv.data<float>());
  TESSERA_CUDA_CHECK_LAUNCH();
}

void moe_weight_cast(void* stream, const Tensor& w, const Tensor& scale, const std::vector<int64_t>& experts,
                     Tensor& data, Tensor& data_t, bool by_expert, Tensor* amax) {
  auto s = static_cast<cudaStream_t>(stream);
  const ExpertList list = make_list(experts);
  const ScaleSlots scales{scale.data<float>(), amax ? amax->data<uint32_t>() : nullptr, by_expert};
  const int64_t rows = w.size(1), cols = w.size(2);
  if (rows == 0 || cols == 0) return;
  const bool e4m3 = data.dtype() == DType::E4M3;
  auto launch = [&](auto e4m3_tag) {
    constexpr bool kE4M3 = decltype(e4m3_tag)::value;
    if (!data_t.defined()) {
      const int64_t vecs = rows * cols / kVec;
      weight_cast_kernel<kE4M3><<<stream_grid(w, vecs, experts.size()), kThreads, 0, s>>>(
          static_cast<const uint4*>(w.raw_data()), scales, static_cast<uint2*>(data.raw_data()), vecs, list);
      return;
    }
    const int64_t down = (rows + kTileRows - 1) / kTileRows, across = (cols + kTileCols - 1) / kTileCols;
    const int64_t per_expert = down * across, tiles = per_expert * static_cast<int64_t>(experts.size());
    const int64_t wave = int64_t(multiprocessor_count(w.device().index)) * kTileBlocksPerSm;
    weight_cast_transpose_kernel<kE4M3><<<unsigned(std::min(tiles, wave)), kThreads, 0, s>>>(
        static_cast<const uint16_t*>(w.raw_data()), scales, data.data<uint8_t>(),
        data_t.data<uint8_t>(), rows, cols, across, per_expert, tiles, list);
  };
  if (e4m3) launch(std::true_type{});
  else launch(std::false_type{});
  TESSERA_CUDA_CHECK_LAUNCH();
}

void moe_weight_gather_scales(void* stream, const Tensor& from, const std::vector<int64_t>& experts,
                              Tensor& scale_inv) {
  const ExpertList list = make_list(experts);
  const int n = static_cast<int>(experts.size());
  gather_scales_kernel<<<1, std::min(1024, (n + 31) / 32 * 32), 0, static_cast<cudaStream_t>(stream)>>>(
      from.data<float>(), n, list, scale_inv.data<float>());
  TESSERA_CUDA_CHECK_LAUNCH();
}

}  // namespace tessera::cuda
