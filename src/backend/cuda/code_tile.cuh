// The 64 x 128 tile of 1-byte FP8 codes that the casting kernels write twice, row-major and
// transposed (cast_transpose.cu, swiglu_fp8.cu, norm_fp8.cu): a block of 256 threads stores
// its codes into a shared tile of 32-bit words (four codes of a row each), then writes the
// transpose from it. The word column is XOR-swizzled by the row's group of 8 so that both the
// row-wise stores and the column-wise reads hit 32 distinct banks; each thread then takes an
// 8-row x 4-column block of bytes, transposes it in registers (__byte_perm) and writes four
// 8-byte pieces of four rows of q_t, so a warp's pieces fill 64-byte runs.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace tessera::cuda::code_tile {

constexpr int kRows = 64, kCols = 128, kWords = kCols / 4;
constexpr int kThreads = 256;  // store_transposed maps one thread to each 8 x 4 block
// The activation -> FP8 kernels (gelu_fp8.cu, swiglu_fp8.cu) read a tile's BF16 rows as
// 16-byte vectors: 8 elements each, 16 to a row, 4 per thread per tile.
constexpr int kVec = 8;
constexpr int kVecPerRow = kCols / kVec;
constexpr int kUnits = kRows * kVecPerRow / kThreads;

// The physical word of (row, word) in the shared tile: rows in group g = (row / 8) % 8 have
// their word columns permuted by XOR with 4g (pairs of words stay adjacent).
__device__ __forceinline__ int swizzle(int row, int word) { return word ^ (((row >> 3) & 7) << 2); }

// Four rows of four codes (a..d, one word each) -> four columns (word j = byte j of a..d).
__device__ __forceinline__ void transpose4x4(uint32_t a, uint32_t b, uint32_t c, uint32_t d, uint32_t (&out)[4]) {
  const uint32_t ab_lo = __byte_perm(a, b, 0x5140), ab_hi = __byte_perm(a, b, 0x7362);
  const uint32_t cd_lo = __byte_perm(c, d, 0x5140), cd_hi = __byte_perm(c, d, 0x7362);
  out[0] = __byte_perm(ab_lo, cd_lo, 0x5410);
  out[1] = __byte_perm(ab_lo, cd_lo, 0x7632);
  out[2] = __byte_perm(ab_hi, cd_hi, 0x5410);
  out[3] = __byte_perm(ab_hi, cd_hi, 0x7632);
}

// Writes the tile whose top-left code is (r0, c0) of a [rows, *] code matrix to q_t, the
// transposed codes [*, rows]: code (r, c) lands at q_t[c * rows + r]. Columns from col_end on
// are skipped. Needs the codes' column count a multiple of 4 and rows a multiple of 8 (an
// 8 x 4 block is then wholly in or out), blockDim.x == kThreads, and the tile complete in
// shared memory (the caller's __syncthreads).
__device__ __forceinline__ void store_transposed(const uint32_t (&tile)[kRows][kWords], uint8_t* q_t, int64_t rows,
                                                 int64_t r0, int64_t c0, int64_t col_end) {
  // Thread = (word column w, row group g); a warp's lanes cover 4 word columns x 8 groups.
  const int w = int(threadIdx.x) >> 3, g = int(threadIdx.x) & 7;
  const int64_t col = c0 + 4 * w, row = r0 + 8 * g;
  if (col >= col_end || row >= rows) return;
  uint32_t a[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) a[i] = tile[8 * g + i][swizzle(8 * g + i, w)];
  uint32_t lo[4], hi[4];
  transpose4x4(a[0], a[1], a[2], a[3], lo);
  transpose4x4(a[4], a[5], a[6], a[7], hi);
#pragma unroll
  for (int j = 0; j < 4; ++j) *reinterpret_cast<uint2*>(q_t + (col + j) * rows + row) = make_uint2(lo[j], hi[j]);
}

}  // namespace tessera::cuda::code_tile
