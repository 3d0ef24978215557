// Pieces of the MoEFp8Rows casts shared by moe_fp8.cu (x and the forward SwiGLU to FP8) and
// moe_swiglu.cu (the SwiGLU backward to FP8): the experts' offsets passed by value, the
// row <-> padded column maps, and the write of one shared-memory tile of codes into the
// padded transposed copy. Layout rules: include/tessera/ops/moe.h ("FP8").
// CUDA-only (included by .cu files).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "cuda_check.h"
#include "moe_fp8.h"

namespace tessera::cuda::moe_fp8_detail {

constexpr int kVTile = 64;  // vector kernels: tiles of 64 padded positions x 64 features

// The experts' row offsets and padded column offsets (E + 1 each), passed by value.
struct ExpertTable {
  int32_t n = 0;
  int32_t first_row[kMoeFp8MaxExperts + 1];
  int32_t padded[kMoeFp8MaxExperts + 1];
};

inline ExpertTable make_table(const std::vector<int64_t>& splits, const std::vector<int64_t>& padded) {
  ExpertTable t;
  t.n = static_cast<int32_t>(splits.size());
  t.first_row[0] = 0;
  for (size_t e = 0; e <= splits.size(); ++e) {
    if (e > 0) t.first_row[e] = static_cast<int32_t>(t.first_row[e - 1] + splits[e - 1]);
    t.padded[e] = static_cast<int32_t>(padded[e]);
  }
  return t;
}

// 16 bytes of BF16 as 8 floats (exact).
__device__ __forceinline__ void unpack8(const uint4& raw, float* f) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    f[2 * k] = __uint_as_float(w[k] << 16);
    f[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
  }
}

// Zero codes in data's rows past the splits' sum (no GEMM reads them; the CPU path writes the
// same); returns that sum, the rows the cast kernels cover.
inline int64_t zero_rows_past_splits(cudaStream_t s, const std::vector<int64_t>& splits, Tensor& data) {
  const int64_t rows = data.size(0), cols = data.size(1);
  int64_t kept = 0;
  for (int64_t v : splits) kept += v;
  if (kept < rows && cols > 0)
    TESSERA_CUDA_CHECK(cudaMemsetAsync(data.data<uint8_t>() + kept * cols, 0, size_t((rows - kept) * cols), s));
  return kept;
}


// The padded column of row r < first_row[n] (the scalar kernel walks rows).
__device__ __forceinline__ int64_t padded_column(const ExpertTable& t, int64_t r) {
  int lo = 0, hi = t.n - 1;  // the first expert whose rows end after r
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (t.first_row[mid + 1] > r) hi = mid;
    else lo = mid + 1;
  }
  return t.padded[lo] + (r - t.first_row[lo]);
}

// The source row of padded column p < padded[n], or -1 for a padding column (the vector
// kernels walk padded columns: expert boundaries there are multiples of 16).
__device__ __forceinline__ int64_t source_row(const ExpertTable& t, int64_t p) {
  int lo = 0, hi = t.n - 1;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (t.padded[mid + 1] > p) hi = mid;
    else lo = mid + 1;
  }
  const int64_t i = p - t.padded[lo];
  return i < t.first_row[lo + 1] - t.first_row[lo] ? t.first_row[lo] + i : -1;
}

// Rows of 68 bytes: word-aligned, and the column reads below meet 2-way bank conflicts at most.
using CodeTile = uint8_t[kVTile][kVTile + 4];

// tile[pl][cl] holds the code of padded position p0 + pl, feature c0 + cl (zero for padding
// positions); writes features [c0, c0 + 64) of q_t [cols, width] at columns [p0, p0 + 64).
// A 256-thread block, thread = (feature, 16-column chunk): four neighbours write 64
// contiguous bytes, and width % 16 == 0 makes each chunk wholly in or out and its 16-byte
// store aligned (q_t 16-byte aligned).
__device__ __forceinline__ void store_tile_transposed(const CodeTile& tile, uint8_t* q_t, int64_t c0, int64_t p0,
                                                      int64_t cols, int64_t width) {
  const int chunk = int(threadIdx.x) & 3, cl = int(threadIdx.x) >> 2;
  const int64_t c = c0 + cl, p = p0 + chunk * 16;
  if (c >= cols || p >= width) return;
  uint32_t w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int r = chunk * 16 + 4 * j;
    w[j] = uint32_t(tile[r][cl]) | uint32_t(tile[r + 1][cl]) << 8 | uint32_t(tile[r + 2][cl]) << 16 |
           uint32_t(tile[r + 3][cl]) << 24;
  }
  *reinterpret_cast<uint4*>(q_t + c * width + p) = make_uint4(w[0], w[1], w[2], w[3]);
}

}  // namespace tessera::cuda::moe_fp8_detail
