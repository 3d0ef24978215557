// FP8 cast with transpose: q = fp8(x * scale) [M, K], q_t = q transposed [K, M], and
// optionally amax = max |x|, from one read of x (F32 or BF16). The bytes equal
// quantize_per_tensor followed by transpose_2d (the CPU reference; fp8_cvt.cuh holds the
// conversion rules), so QuantizedTensor's two copies come out of one kernel instead of a
// cast and a byte transpose.
//
// Layout: x, q, q_t contiguous. Tiles of 64 rows x 128 columns; one wave of 256-thread
// blocks loops over the tiles (so the amax costs one atomic per block):
//  - every thread issues its 16-byte loads of the tile first (4 for BF16; F32 in two
//    batches of 4), then converts, stores its codes row-major (8 or 4 bytes) and into the
//    shared tile;
//  - the shared tile is 32-bit words (four codes of a row), the word column XOR-swizzled by
//    the row's group of 8 so that both the row-wise writes and the column-wise reads below
//    hit 32 distinct banks;
//  - each thread then takes an 8-row x 4-column block (eight words), transposes the bytes
//    in registers (__byte_perm) and writes four 8-byte pieces of four q_t rows; a warp's
//    pieces fill 64-byte runs of q_t.
// That vector path needs K a multiple of the load width (8 BF16 / 4 F32), M a multiple of 8,
// and aligned pointers (the FP8 linear's sizes, multiples of 16, always qualify); anything
// else takes a scalar 32 x 32 tile kernel with the same results.
//
// Floor (H200, ~4.1 TB/s): BF16 in: 2 bytes read + 2 written per element, 4 B against 5 for
// quantize_per_tensor then transpose_2d (16384 x 4096: 268 MB, ~65 us against ~82 us);
// F32 in: 6 B against 7. Current scaling adds the amax pass before it (2 or 4 B).
//
// Optional bias gradient (dbias F32 [K] += column sums of x, for a linear layer's output
// gradient): the same pass also sums each tile's columns (a thread's rows of one column in
// float, then the tile's row groups in double, in a fixed order) into partial[tile row, K]
// (double), and a small kernel adds the tile rows in order into dbias: deterministic, no
// atomics, the order fixed by the shape alone. It replaces bias_grad's second read of x
// (2 B per BF16 element) with 8 B per 64 rows x column of partials: BF16 4 B -> ~4.1 B per
// element, against 6 B for the cast plus bias_grad. Measured (H200, 2026-11-30, bench_bandwidth
// castbias, 16384 x 4096 BF16 -> E5M2): 94.3 us (76% of copy by bytes moved) against 138.0 us
// for the cast then bias_grad, 1.46x.
#include "cast_transpose.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <type_traits>

#include "code_tile.cuh"
#include "cuda_backend.h"
#include "cuda_check.h"
#include "fp8_cvt.cuh"
#include "vec_io.cuh"

namespace tessera::cuda {

namespace {

using fp8cvt::abs_bits;

constexpr int kThreads = 256;
constexpr int kBlocksPerSm = 3;  // resident vector-kernel blocks per SM (about 70 registers a thread)
constexpr int kTileRows = code_tile::kRows, kTileCols = code_tile::kCols, kTileWords = code_tile::kWords;
static_assert(kThreads == code_tile::kThreads, "the transposed store maps 256 threads");
constexpr int kScalarTile = 32;

template <typename T, bool kE4M3, bool kAmax, bool kBias>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    cast_transpose_kernel(const T* x, const float* scale, uint8_t* q, uint8_t* q_t, uint32_t* amax_bits, int64_t rows,
                          int64_t cols, int64_t tiles_across, int64_t tiles, double* partial) {
  constexpr int VEC = 16 / int(sizeof(T));               // elements per 16-byte load
  constexpr int WPV = VEC / 4;                           // code words per load (2 BF16, 1 F32)
  constexpr int VPR = kTileCols / VEC;                   // loads per tile row
  constexpr int LOADS = kTileRows * VPR / kThreads;      // loads per thread per tile
  // A thread's loads all hit the same VEC columns (id % VPR == threadIdx.x % VPR), its rows
  // spaced kThreads / VPR apart: GROUPS row groups per tile for the column sums.
  static_assert(kThreads % VPR == 0, "a thread keeps one column vector across its loads");
  constexpr int GROUPS = kThreads / VPR;
  __shared__ uint32_t tile[kTileRows][kTileWords];
  __shared__ double colsum[kBias ? GROUPS : 1][kBias ? kTileCols : 1];
  const float s = *scale;
  uint32_t m = 0;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t r0 = (t / tiles_across) * kTileRows, c0 = (t % tiles_across) * kTileCols;
    float acc[kBias ? VEC : 1];
#pragma unroll
    for (int i = 0; i < (kBias ? VEC : 1); ++i) acc[i] = 0.0f;
    // At most four loads in flight per batch (F32 takes two batches): more kept the F32
    // kernel from fitting its registers.
    constexpr int BATCH = LOADS < 4 ? LOADS : 4;
#pragma unroll
    for (int b0 = 0; b0 < LOADS; b0 += BATCH) {
      uint4 raw[BATCH];
#pragma unroll
      for (int k = 0; k < BATCH; ++k) {
        const int id = int(threadIdx.x) + (b0 + k) * kThreads, row = id / VPR, vec = id % VPR;
        const int64_t r = r0 + row, c = c0 + int64_t(vec) * VEC;
        if (r < rows && c < cols) raw[k] = __ldg(reinterpret_cast<const uint4*>(x + r * cols + c));
      }
#pragma unroll
      for (int k = 0; k < BATCH; ++k) {
        const int id = int(threadIdx.x) + (b0 + k) * kThreads, row = id / VPR, vec = id % VPR;
        const int64_t r = r0 + row, c = c0 + int64_t(vec) * VEC;
        if (r >= rows || c >= cols) continue;
        float f[VEC];
        vec::unpack16<T>(raw[k], f);
        if constexpr (kAmax) {
#pragma unroll
          for (int i = 0; i < VEC; ++i) m = max(m, abs_bits(f[i]));
        }
        if constexpr (kBias) {
#pragma unroll
          for (int i = 0; i < VEC; ++i) acc[i] += f[i];
        }
        uint32_t words[WPV];
        fp8cvt::quantize_words<kE4M3, VEC>(f, s, words);
        if (q != nullptr) {  // null: the transposed copy alone (quantize_transposed)
          uint8_t* dst = q + r * cols + c;
          if constexpr (WPV == 2) *reinterpret_cast<uint2*>(dst) = make_uint2(words[0], words[1]);
          else *reinterpret_cast<uint32_t*>(dst) = words[0];
        }
#pragma unroll
        for (int w = 0; w < WPV; ++w) tile[row][code_tile::swizzle(row, vec * WPV + w)] = words[w];
      }
    }
    if constexpr (kBias) {
      const int group = int(threadIdx.x) / VPR, vec = int(threadIdx.x) % VPR;
#pragma unroll
      for (int i = 0; i < VEC; ++i) colsum[group][vec * VEC + i] = double(acc[i]);
    }
    __syncthreads();
    code_tile::store_transposed(tile, q_t, rows, r0, c0, cols);  // K % 4 == 0 and M % 8 == 0
    if constexpr (kBias) {
      if (threadIdx.x < kTileCols && c0 + threadIdx.x < cols) {
        double sum = colsum[0][threadIdx.x];
        for (int g = 1; g < GROUPS; ++g) sum += colsum[g][threadIdx.x];
        partial[(r0 / kTileRows) * cols + c0 + threadIdx.x] = sum;
      }
    }
    __syncthreads();  // the tile (and colsum) are rewritten by the next iteration
  }
  if constexpr (kAmax) fp8cvt::block_atomic_max(m, amax_bits);
}

// Any shape and alignment: 32 x 32 tiles, block (32, 8), one element per load.
template <typename T, bool kE4M3, bool kAmax, bool kBias>
__global__ void __launch_bounds__(kThreads)
    cast_transpose_scalar_kernel(const T* x, const float* scale, uint8_t* q, uint8_t* q_t, uint32_t* amax_bits,
                                 int64_t rows, int64_t cols, int64_t tiles_across, int64_t tiles, double* partial) {
  __shared__ uint8_t tile[kScalarTile][kScalarTile + 1];
  __shared__ double colsum[kBias ? 8 : 1][kBias ? kScalarTile : 1];
  const float s = *scale;
  const int tx = threadIdx.x, ty = threadIdx.y;
  uint32_t m = 0;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t r0 = (t / tiles_across) * kScalarTile, c0 = (t % tiles_across) * kScalarTile;
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < kScalarTile; i += 8) {
      const int64_t r = r0 + ty + i, c = c0 + tx;
      if (r >= rows || c >= cols) continue;
      const float f = vec::bits_to_float(x[r * cols + c]);
      if constexpr (kAmax) m = max(m, abs_bits(f));
      if constexpr (kBias) acc += f;
      const uint8_t code = fp8cvt::encode_scaled<kE4M3>(f, s);
      if (q != nullptr) q[r * cols + c] = code;
      tile[ty + i][tx] = code;
    }
    if constexpr (kBias) colsum[ty][tx] = double(acc);
    __syncthreads();
    if constexpr (kBias) {
      if (ty == 0 && c0 + tx < cols) {
        double sum = colsum[0][tx];
        for (int g = 1; g < 8; ++g) sum += colsum[g][tx];
        partial[(r0 / kScalarTile) * cols + c0 + tx] = sum;
      }
    }
#pragma unroll
    for (int i = 0; i < kScalarTile; i += 8) {
      const int64_t c = c0 + ty + i, r = r0 + tx;  // q_t[c, r] = q[r, c]
      if (c < cols && r < rows) q_t[c * rows + r] = tile[tx][ty + i];
    }
    __syncthreads();
  }
  if constexpr (kAmax) fp8cvt::block_atomic_max(m, amax_bits);
}

// dbias[c] += the partials of column c summed over the tile rows in order (in double, rounded
// once to float, as bias_grad does). Block (32, 8): row group g sums tile rows g, g + 8, ...;
// the groups are then added in order, so the result depends on the shape alone.
__global__ void __launch_bounds__(256)
    add_column_partials_kernel(const double* partial, int64_t chunks, int64_t cols, float* dbias) {
  __shared__ double sums[8][32];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t c = int64_t(blockIdx.x) * 32 + tx;
  double s = 0;
  if (c < cols)
    for (int64_t k = ty; k < chunks; k += 8) s += partial[k * cols + c];
  sums[ty][tx] = s;
  __syncthreads();
  if (ty != 0 || c >= cols) return;
  double total = sums[0][tx];
  for (int g = 1; g < 8; ++g) total += sums[g][tx];
  dbias[c] = static_cast<float>(static_cast<double>(dbias[c]) + total);
}

bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }


template <typename Fn>
void dispatch_flags(bool e4m3, bool amax, bool bias, Fn&& fn) {
  auto with_bias = [&](auto e4m3_tag, auto amax_tag) {
    if (bias) fn(e4m3_tag, amax_tag, std::true_type{});
    else fn(e4m3_tag, amax_tag, std::false_type{});
  };
  if (e4m3) {
    if (amax) with_bias(std::true_type{}, std::true_type{});
    else with_bias(std::true_type{}, std::false_type{});
  } else {
    if (amax) with_bias(std::false_type{}, std::true_type{});
    else with_bias(std::false_type{}, std::false_type{});
  }
}

}  // namespace

void add_column_partials(void* stream, const double* partial, int64_t chunks, int64_t cols, float* dbias,
                         const char* op) {
  const int64_t blocks = ceil_div(cols, 32);
  TESSERA_CHECK(blocks <= 0x7fffffff, op, ": ", cols, " columns exceed one grid");
  add_column_partials_kernel<<<unsigned(blocks), dim3(32, 8), 0, static_cast<cudaStream_t>(stream)>>>(
      partial, chunks, cols, dbias);
  TESSERA_CUDA_CHECK_LAUNCH();
}


bool cast_transpose_supported(DType x) { return x == DType::F32 || x == DType::BF16; }

void cast_transpose(void* stream, const Tensor& x, const Tensor& scale, Tensor& q, Tensor& q_t, Tensor& amax_out,
                    Tensor* dbias) {
  auto s = static_cast<cudaStream_t>(stream);
  const int64_t rows = x.size(0), cols = x.size(1);
  // Zeroing an amax that is the scale itself would change the scale the kernel reads.
  const bool separate_amax = amax_out.defined() && amax_out.raw_data() == scale.raw_data();
  const bool fused_amax = amax_out.defined() && !separate_amax;
  uint32_t* amax_bits = fused_amax ? amax_out.data<uint32_t>() : nullptr;
  if (fused_amax) TESSERA_CUDA_CHECK(cudaMemsetAsync(amax_bits, 0, sizeof(uint32_t), s));
  const bool bias = dbias != nullptr && dbias->defined();  // rows == 0: nothing to add, as bias_grad
  if (rows > 0 && cols > 0) {
    const int64_t wave = int64_t(multiprocessor_count(x.device().index)) * kBlocksPerSm;
    const bool e4m3 = q_t.dtype() == DType::E4M3;
    auto run = [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      constexpr int64_t kVec = 16 / sizeof(T);
      uint8_t* q_ptr = q.defined() ? q.data<uint8_t>() : nullptr;
      const bool vector = cols % kVec == 0 && rows % 8 == 0 && aligned(x.raw_data(), 16) &&
                          aligned(q_ptr, kVec) && aligned(q_t.raw_data(), 8);
      // The column sums' partials: one row of K doubles per tile row of the kernel taken.
      const int64_t chunks = ceil_div(rows, vector ? kTileRows : kScalarTile);
      Tensor partial = bias ? Tensor::empty({chunks, cols}, DType::F64, x.device()) : Tensor();
      double* partial_ptr = bias ? partial.data<double>() : nullptr;
      dispatch_flags(e4m3, fused_amax, bias, [&](auto e4m3_tag, auto amax_tag, auto bias_tag) {
        constexpr bool kE4M3 = decltype(e4m3_tag)::value, kAmax = decltype(amax_tag)::value;
        constexpr bool kBias = decltype(bias_tag)::value;
        if (vector) {
          const int64_t across = ceil_div(cols, kTileCols), tiles = chunks * across;
          cast_transpose_kernel<T, kE4M3, kAmax, kBias><<<unsigned(std::min(tiles, wave)), kThreads, 0, s>>>(
              x.data<T>(), scale.data<float>(), q_ptr, q_t.data<uint8_t>(), amax_bits, rows, cols, across,
              tiles, partial_ptr);
        } else {
          const int64_t across = ceil_div(cols, kScalarTile), tiles = chunks * across;
          cast_transpose_scalar_kernel<T, kE4M3, kAmax, kBias>
              <<<unsigned(std::min(tiles, wave)), dim3(32, 8), 0, s>>>(x.data<T>(), scale.data<float>(), q_ptr,
                                                                       q_t.data<uint8_t>(), amax_bits, rows, cols,
                                                                       across, tiles, partial_ptr);
        }
      });
      TESSERA_CUDA_CHECK_LAUNCH();
      if (bias) add_column_partials(s, partial_ptr, chunks, cols, dbias->data<float>(), "cast_transpose");
    };
    if (x.dtype() == DType::F32) run(static_cast<float*>(nullptr));
    else run(static_cast<uint16_t*>(nullptr));
    TESSERA_CUDA_CHECK_LAUNCH();
  }
  if (separate_amax) amax(stream, x, amax_out);
}

}  // namespace tessera::cuda
