// Fused 1x128 block-scaled FP8 cast with transpose (the "block" recipe's activations and
// gradients): from one read of x [M, K] (F32 or BF16), both copies a BlockQuantizedTensor keeps
//  - q [M, K], one scale per 128 consecutive elements of a row (scale_inv [M, ceil(K/128)]),
//  - q_t [K, M], the 1x128 quantization of x^T: one scale per 128 consecutive ROWS of a column
//    of x (scale_inv_t [K, ceil(M/128)]),
// and both scale grids again in cuBLASLt's Vec128 layout (gemm_fp8.h: the transposes,
// [ceil(K/128), M] and [ceil(M/128), K]). The bytes are those of quantize_blockwise(x),
// transpose_2d, quantize_blockwise(x^T) and to_gemm_block_scales, which this replaces: the
// same amax (max of |v|'s bits, NaN above Inf, over the block's present elements), the same
// scale (numeric.h's fp8_scale_for_amax, power of two or not; scale_inv = 1 / scale rounded
// to nearest) and the same codes (fp8_cvt.cuh: the hardware conversion, NaN groups re-encoded).
//
// Layout: x, q, q_t contiguous and 16-byte aligned; M and K multiples of 16, so a 16-code
// piece of either copy is wholly inside the tensor (block_cast_transpose_supported; other
// shapes take the two-pass path). One 256-thread block per 128 x 128 tile of x, which holds
// exactly one row block per row and one column block per column:
//  1. 16-byte loads of the whole tile (all issued before any use), kept in shared memory; the
//     CPR threads sharing a tile row reduce its amax with shuffles, then convert their chunk
//     from registers and store it to q (a half-warp or warp writes 128 contiguous bytes);
//     the row scales go to scale_inv, and through shared memory to gemm_scale_inv (128
//     contiguous floats);
//  2. a thread per column and half-tile (64 rows) takes the column amax from shared memory
//     (a warp reads consecutive elements of one row: no bank conflicts), the two halves meet
//     in shared memory, and each converts its 64 codes into a shared code tile of [128 columns]
//     x [32 words + 4 padding] (16-byte stores; the padding puts the 8 threads of a store phase
//     on distinct banks);
//  3. the code tile goes out as q_t with 16-byte stores, 8 threads per 128-byte row piece.
// Shared memory: 32 KB (BF16) or 64 KB (F32) of x, 18 KB of codes, 1.5 KB of amaxes and scales.
//
// Floor (H200, ~4.1 TB/s): BF16 in, 2 B read + 2 B of codes written per element, plus 4 scale
// layouts of 4 B per 128 elements (16384 x 4096: ~277 MB, ~68 us), against ~10 B per element
// for the two-pass path (quantize, transpose, quantize). F32 in: 6 B per element.
// Speed: not yet measured (bench_bandwidth 30 blockcast).
#include "block_cast_transpose.h"

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda_check.h"
#include "fp8_cvt.cuh"
#include "vec_io.cuh"

namespace tessera::cuda {

namespace {

using fp8cvt::abs_bits;

constexpr int kThreads = 256;
constexpr int kTile = 128;                  // a tile is one 1x128 block in each direction
constexpr int kHalf = kTile / 2;            // rows per thread in the column pass
constexpr int kCodeStride = kTile / 4 + 4;  // words per column of the transposed-code tile
constexpr int kPieces = kTile / 16;         // 16-byte pieces per q_t row of a tile

template <typename T>
constexpr size_t smem_bytes() {
  return size_t(kTile) * kTile * sizeof(T) + (size_t(kTile) * kCodeStride + 3 * kTile) * sizeof(uint32_t);
}

template <typename T, bool kE4M3>
__global__ void __launch_bounds__(kThreads, sizeof(T) == 2 ? 4 : 2)
    block_cast_transpose_kernel(const T* __restrict__ x, uint8_t* __restrict__ q, float* __restrict__ scale_inv,
                                uint8_t* __restrict__ q_t, float* __restrict__ scale_inv_t, float* gemm_s,
                                float* gemm_s_t, int64_t rows, int64_t cols, int64_t tiles_across, bool power_of_two) {
  constexpr int VEC = 16 / int(sizeof(T));  // elements per 16-byte load
  constexpr int CPR = kTile / VEC;          // threads per tile row: 16 (BF16) or 32 (F32)
  constexpr int RPP = kThreads / CPR;       // tile rows per pass
  constexpr int PASSES = kTile / RPP;       // loads per thread
  constexpr float kMax = kE4M3 ? kE4M3Max : kE5M2Max;
  extern __shared__ __align__(16) unsigned char smem[];
  T* xs = reinterpret_cast<T*>(smem);                                                      // [kTile][kTile]
  uint32_t* codes_t = reinterpret_cast<uint32_t*>(smem + size_t(kTile) * kTile * sizeof(T));  // [kTile][kCodeStride]
  uint32_t* col_partial = codes_t + kTile * kCodeStride;                                   // [2][kTile]
  float* row_inv = reinterpret_cast<float*>(col_partial + 2 * kTile);                      // [kTile]

  const int tid = int(threadIdx.x);
  const int64_t rb = int64_t(blockIdx.x) / tiles_across, cb = int64_t(blockIdx.x) - rb * tiles_across;
  const int64_t r0 = rb * kTile, c0 = cb * kTile;
  const int64_t row_blocks = (rows + kTile - 1) / kTile;

  // 1. Load the tile (absent elements as zeros: they leave every amax unchanged), rows' codes.
  const int chunk = tid % CPR, sub = tid / CPR;
  const int64_t c = c0 + int64_t(chunk) * VEC;
  uint4 raw[PASSES];
#pragma unroll
  for (int p = 0; p < PASSES; ++p) {
    const int64_t r = r0 + sub + p * RPP;
    raw[p] = r < rows && c < cols ? __ldg(reinterpret_cast<const uint4*>(x + r * cols + c)) : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int p = 0; p < PASSES; ++p) {
    const int row = sub + p * RPP;
    const int64_t r = r0 + row;
    *reinterpret_cast<uint4*>(xs + row * kTile + chunk * VEC) = raw[p];
    float f[VEC];
    vec::unpack16<T>(raw[p], f);
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < VEC; ++i) m = max(m, abs_bits(f[i]));
#pragma unroll
    for (int o = CPR / 2; o > 0; o /= 2) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
    const float s = fp8_scale_for_amax(__uint_as_float(m), kMax, 0.0f, power_of_two);
    if (r < rows && c < cols) {
      uint32_t words[VEC / 4];
      fp8cvt::quantize_words<kE4M3, VEC>(f, s, words);
      uint8_t* dst = q + r * cols + c;
      if constexpr (VEC == 8) *reinterpret_cast<uint2*>(dst) = make_uint2(words[0], words[1]);
      else *reinterpret_cast<uint32_t*>(dst) = words[0];
    }
    if (chunk == 0) {
      const float inv = __fdiv_rn(1.0f, s);
      row_inv[row] = inv;  // the GEMM-ready copy goes out below, 128 contiguous floats
      if (r < rows) scale_inv[r * tiles_across + cb] = inv;
    }
  }
  __syncthreads();

  // 2. Column amaxes and the transposed codes, into the shared code tile.
  const int col = tid % kTile, half = tid / kTile;
  if (gemm_s && half == 1 && r0 + col < rows) gemm_s[cb * rows + r0 + col] = row_inv[col];
  const T* xcol = xs + half * kHalf * kTile + col;
  uint32_t m = 0;
#pragma unroll 16
  for (int i = 0; i < kHalf; ++i) m = max(m, abs_bits(vec::bits_to_float(xcol[i * kTile])));
  col_partial[half * kTile + col] = m;
  __syncthreads();
  m = max(col_partial[col], col_partial[kTile + col]);
  const float s = fp8_scale_for_amax(__uint_as_float(m), kMax, 0.0f, power_of_two);
#pragma unroll
  for (int g = 0; g < kHalf / 16; ++g) {
    float f[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) f[i] = vec::bits_to_float(xcol[(g * 16 + i) * kTile]);
    uint32_t w[4];
    fp8cvt::quantize_words<kE4M3, 16>(f, s, w);
    *reinterpret_cast<uint4*>(codes_t + col * kCodeStride + half * (kHalf / 4) + g * 4) = make_uint4(w[0], w[1], w[2], w[3]);
  }
  const int64_t cc = c0 + col;
  if (half == 0 && cc < cols) {
    const float inv = __fdiv_rn(1.0f, s);
    scale_inv_t[cc * row_blocks + rb] = inv;
    if (gemm_s_t) gemm_s_t[rb * cols + cc] = inv;
  }
  __syncthreads();

  // 3. The code tile out as q_t rows c0.., columns r0.. (M % 16 == 0: a piece is in or out).
#pragma unroll
  for (int i = 0; i < kTile * kPieces / kThreads; ++i) {
    const int id = tid + i * kThreads, crow = id / kPieces, piece = id % kPieces;
    const int64_t qc = c0 + crow, r = r0 + piece * 16;
    if (qc < cols && r < rows)
      *reinterpret_cast<uint4*>(q_t + qc * rows + r) =
          *reinterpret_cast<const uint4*>(codes_t + crow * kCodeStride + piece * 4);
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <typename T, bool kE4M3>
void launch(cudaStream_t stream, const Tensor& x, Tensor& q, Tensor& scale_inv, Tensor& q_t, Tensor& scale_inv_t,
            Tensor& gemm_s, Tensor& gemm_s_t, bool power_of_two) {
  const int64_t rows = x.size(0), cols = x.size(1);
  const int64_t across = (cols + kTile - 1) / kTile, tiles = (rows + kTile - 1) / kTile * across;
  constexpr size_t smem = smem_bytes<T>();
  auto kernel = block_cast_transpose_kernel<T, kE4M3>;
  // Once per instantiation, not per launch (one process per device: the attributes of the
  // current device; host-side calls, also legal when the first launch is inside a graph
  // capture). A failure throws and leaves `configured` unset, so the next call retries.
  static const bool configured = [kernel] {
    // Above the 48 KB default: opt in.
    TESSERA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    // All shared memory, little L1: four BF16 blocks (two F32) per SM need 211 KB (170 KB); x is read once.
    TESSERA_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared));
    return true;
  }();
  (void)configured;
  kernel<<<unsigned(tiles), kThreads, smem, stream>>>(
      x.data<T>(), q.data<uint8_t>(), scale_inv.data<float>(), q_t.data<uint8_t>(), scale_inv_t.data<float>(),
      gemm_s.defined() ? gemm_s.data<float>() : nullptr, gemm_s_t.defined() ? gemm_s_t.data<float>() : nullptr,
      rows, cols, across, power_of_two);
  TESSERA_CUDA_CHECK_LAUNCH();
}

}  // namespace

bool block_cast_transpose_supported(const Tensor& x) {
  if (!x.defined() || x.dim() != 2 || !x.is_contiguous()) return false;
  if (x.dtype() != DType::F32 && x.dtype() != DType::BF16) return false;
  const int64_t rows = x.size(0), cols = x.size(1);
  const int64_t tiles = (rows + kTile - 1) / kTile * ((cols + kTile - 1) / kTile);
  return rows % 16 == 0 && cols % 16 == 0 && tiles < (int64_t(1) << 31) && aligned16(x.raw_data());
}

void block_cast_transpose(void* stream, const Tensor& x, Tensor& q, Tensor& scale_inv, Tensor& q_t,
                          Tensor& scale_inv_t, Tensor& gemm_scale_inv, Tensor& gemm_scale_inv_t, bool power_of_two) {
  TESSERA_CHECK(block_cast_transpose_supported(x) && aligned16(q.raw_data()) && aligned16(q_t.raw_data()),
                "block_cast_transpose: x must be a contiguous, 16-byte aligned F32 or BF16 [M, K] with M and K "
                "multiples of 16 (and q, q_t 16-byte aligned), got x ",
                x.describe());
  if (x.size(0) == 0 || x.size(1) == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  const bool e4m3 = q.dtype() == DType::E4M3;
  if (x.dtype() == DType::BF16) {
    if (e4m3) launch<uint16_t, true>(s, x, q, scale_inv, q_t, scale_inv_t, gemm_scale_inv, gemm_scale_inv_t, power_of_two);
    else launch<uint16_t, false>(s, x, q, scale_inv, q_t, scale_inv_t, gemm_scale_inv, gemm_scale_inv_t, power_of_two);
  } else {
    if (e4m3) launch<float, true>(s, x, q, scale_inv, q_t, scale_inv_t, gemm_scale_inv, gemm_scale_inv_t, power_of_two);
    else launch<float, false>(s, x, q, scale_inv, q_t, scale_inv_t, gemm_scale_inv, gemm_scale_inv_t, power_of_two);
  }
}

}  // namespace tessera::cuda
