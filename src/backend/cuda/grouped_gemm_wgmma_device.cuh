// Device pieces of tessera's own Hopper grouped GEMM (grouped_gemm_wgmma.cu, which has the
// kernel and the notes on layout and speed): tile constants and shared-memory budget, the
// tile walk, the per-k-block MMAs and the two epilogues. Included by that file only; needs
// sm_90a for the wgmma / stmatrix paths.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "backend/cuda/sm90_ptx.cuh"

namespace tessera::cuda::grouped_gemm_detail {

using namespace sm90;
constexpr int kBlockM = 128;      // two consumer warpgroups x 64 rows (wgmma's M)
constexpr int kBlockK = 64;       // 64 BF16 = 128 bytes: one swizzle row
constexpr int kConsumers = 2;     // consumer warpgroups
constexpr int kThreads = (kConsumers + 1) * 128;
constexpr int kMaxExperts = 256;  // the per-CTA tile table lives in static shared memory

template <int BN>
struct Config {
  // 4 x 48 KiB or 6 x 32 KiB: 192 KiB of the 227 KiB a CTA may have.
  static constexpr int kStages = BN == 256 ? 4 : 6;
  static constexpr int kABytes = kBlockM * kBlockK * 2;
  static constexpr int kBBytes = BN * kBlockK * 2;
  // The epilogue's staging buffers after the ring: 2 KiB per consumer warp (store_slab_vec).
  static constexpr int kStagingBytes = kConsumers * 4 * 2048;
  // + 1 KiB so the ring can start on a 1024-byte boundary (the swizzle atom).
  static constexpr int kSmemBytes = kStages * (kABytes + kBBytes) + kStagingBytes + 1024;
};

struct Tile {
  int expert;
  int64_t row0;     // first row of the tile in x / y
  int64_t row_end;  // the expert's end row: rows at or past it are not stored
  int col0;         // first column (row of w[e])
};

// The tile of linear index t. tile_begin[e] = tiles of the experts before e; the expert of t
// is the last e with tile_begin[e] <= t (an empty expert shares its start with the next one,
// so the last such e always has tiles).
// With m_step = 2 (cluster pairs) a "tile" of the walk is a pair of M tiles sharing the w
// tile; CTA `rank` of the pair takes M tile 2 m + rank (possibly past the expert's rows).
__device__ __forceinline__ Tile locate(int64_t t, const int64_t* tile_begin, const int64_t* row_begin, int experts,
                                       int block_n, int m_step = 1, int rank = 0) {
  int lo = 0, hi = experts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (tile_begin[mid] <= t) lo = mid; else hi = mid - 1;
  }
  const int64_t local = t - tile_begin[lo];
  const int64_t rows = row_begin[lo + 1] - row_begin[lo];
  const int64_t m_tiles = (rows + kBlockM * m_step - 1) / (kBlockM * m_step);
  // M fastest: the CTAs in flight at once share a few w tiles and sweep the expert's rows,
  // which stay in L2.
  Tile tile;
  tile.expert = lo;
  tile.row0 = row_begin[lo] + ((local % m_tiles) * m_step + rank) * kBlockM;
  tile.row_end = row_begin[lo + 1];
  tile.col0 = static_cast<int>(local / m_tiles) * block_n;
  return tile;
}

// Kernel modes (GroupedGemmVariant, grouped_gemm_wgmma.h):
//   kWait0    the round-1 kernel: cooperative (two consumer warpgroups x 64 rows of one
//             128 x BN tile); each k-block's MMAs are waited for (wait_group 0) before its
//             stage is freed, so the tensor cores drain at every k-block. Dgrad: n64 chunks.
//   kPipe     cooperative, but a k-block's stage is freed one k-block later (wait_group 1):
//             the MMAs of k-block kb run while kb + 1's are issued. Dgrad: one m64nBNk16
//             per k16 step with the transpose bit (B's 64-column boxes as one MN-major
//             operand, make_desc_sw128_mn).
//   kPingPong the two consumer warpgroups each own a whole 128 x 128 tile (two m64n128k16 per
//             k16 step, 128 accumulators a thread) and take the CTA's tiles in turn; a pair of
//             named barriers orders their main loops, so one warpgroup's epilogue runs while
//             the other's MMAs keep the tensor cores busy. MMAs pipelined as in kPipe.
//   kPipeMc   kPipe on clusters of two CTAs that take M tiles 2m and 2m + 1 of the same
//             w tile: each loads half of the w tile and multicasts it to both, so the L2
//             reads per CTA drop from 48 to 32 KiB per k-block at BN 256. A stage's "empty"
//             barrier collects both CTAs' consumer warps (a producer writes into both).
enum Mode : int { kWait0 = 0, kPipe = 1, kPingPong = 2, kPipeMc = 3 };

// Dgrad of the kPipe / kPingPong modes: one wide transposed-B MMA per k16 step (true) or
// round 1's m64n64k16 per 64-column box (false; the fallback should the wide MN-major
// descriptor prove wrong on the GPU).
constexpr bool kDgradWideB = true;

// The MMAs of one 64-deep k-block into one 64-row accumulator slab: a is that slab's 64 rows
// of the stage's A tile, b the stage's B tile (BN rows of 128 B K-major forward; BN / 64
// boxes of [64 K rows][64 N] = 8 KiB each, MN-major, for dgrad).
template <int BN, bool kDgrad, bool kWideB>
__device__ __forceinline__ void mma_kblock(float (&acc)[BN / 2], uint32_t a, uint32_t b, int kb) {
#pragma unroll
  for (int kk = 0; kk < kBlockK / 16; ++kk) {
    // +32 bytes = 16 BF16 further along K inside the swizzled 128-byte rows.
    const uint64_t da = make_desc_sw128(a + kk * 32);
    const int accumulate = (kb | kk) != 0;
    if constexpr (kDgrad && !kWideB) {
      // Chunk j (columns 64 j ..) is 64 K-rows of 128 bytes at b + 8 KiB j; 16 K-rows
      // further = +2048 bytes. Its accumulators are acc[32 j ..] (same layout as above).
      // Chunks past n (last tile only) were not loaded: they multiply stale shared memory
      // into accumulator columns the epilogue never stores. No branch here: a branch
      // between wgmmas makes ptxas fence each one.
#pragma unroll
      for (int j = 0; j < BN / 64; ++j)
        wgmma_m64n64k16_bf16_ss<0, 1>(acc + 32 * j, da, make_desc_sw128_mn64(b + j * 64 * kBlockK * 2 + kk * 2048),
                                accumulate);
    } else {
      // Dgrad: the BN / 64 boxes as one MN-major operand (leading offset 8 KiB = one box);
      // unloaded boxes past n feed unstored columns as above.
      const uint64_t db = kDgrad ? make_desc_sw128_mn(b + kk * 2048, 64 * kBlockK * 2) : make_desc_sw128(b + kk * 32);
      if constexpr (BN == 256) {
        wgmma_m64n256k16_bf16<kDgrad ? 1 : 0>(acc, da, db, accumulate);
      } else {
        wgmma_m64n128k16_bf16<kDgrad ? 1 : 0>(acc, da, db, accumulate);
      }
    }
  }
}

// Stores one 64-row slab of accumulators (rows row0 .. row0 + 63, columns col0 .. col0 +
// 2 N - 1) as BF16, masked to the expert's rows and to n. d[4j], d[4j+1] are row r, columns
// 8j + 2 (lane % 4) + {0, 1}; d[4j+2], d[4j+3] the same columns of row r + 8 (sm90_ptx.cuh).
template <int N>
__device__ __forceinline__ void store_slab(const float (&acc)[N], __nv_bfloat16* __restrict__ y, int64_t ldy,
                                           int64_t row0, int64_t row_end, int col0, int n) {
  const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
  const int64_t r = row0 + warp * 16 + lane / 4;
  const bool row_a = r < row_end, row_b = r + 8 < row_end;
  __nv_bfloat16* y_a = y + r * ldy;
  __nv_bfloat16* y_b = y_a + 8 * ldy;
#pragma unroll
  for (int j = 0; j < N / 4; ++j) {
    const int col = col0 + 8 * j + 2 * (lane % 4);
    if (col < n) {
      if (row_a) *reinterpret_cast<__nv_bfloat162*>(y_a + col) = __floats2bfloat162_rn(acc[4 * j], acc[4 * j + 1]);
      if (row_b) *reinterpret_cast<__nv_bfloat162*>(y_b + col) = __floats2bfloat162_rn(acc[4 * j + 2], acc[4 * j + 3]);
    }
  }
}

// The same through shared memory, for 16-byte global stores: per 64-column chunk the warp
// writes its 16 rows with stmatrix into its own 2 KiB buffer (16 rows x 128 B, 16-byte
// chunk c of row r at c ^ (r % 8) so neither side has bank conflicts), then each lane reads
// 16 bytes back and stores them: a warp store covers 4 rows x 128 contiguous bytes instead
// of 8 rows x 16 bytes. y's rows must be 16-byte aligned (operands_ok). Warp-local: only
// __syncwarp between the two sides.
template <int N>
__device__ __forceinline__ void store_slab_vec(const float (&acc)[N], uint32_t buf, __nv_bfloat16* __restrict__ y,
                                               int64_t ldy, int64_t row0, int64_t row_end, int col0, int n) {
  const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
  const int64_t wrow0 = row0 + warp * 16;  // this warp's first row
  // stmatrix addresses: lane -> matrix lane / 8 (rows +8 for odd, columns +8 for the upper two).
  const int m = lane / 8, st_row = lane % 8 + 8 * (m & 1);
  auto pack = [](float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  };
#pragma unroll
  for (int c = 0; c < N / 32; ++c) {  // 64-column chunks: 8 j's of 8 columns each
#pragma unroll
    for (int jp = 0; jp < 4; ++jp) {
      const int j = 8 * c + 2 * jp;
      const int chunk = 2 * jp + (m >> 1);
      stmatrix_x4(buf + st_row * 128 + ((chunk ^ (st_row & 7)) << 4), pack(acc[4 * j], acc[4 * j + 1]),
                  pack(acc[4 * j + 2], acc[4 * j + 3]), pack(acc[4 * j + 4], acc[4 * j + 5]),
                  pack(acc[4 * j + 6], acc[4 * j + 7]));
    }
    __syncwarp();
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int u = q * 32 + lane, row = u / 8, chunk = u % 8;
      const uint4 v = ld_shared_v4(buf + row * 128 + ((chunk ^ (row & 7)) << 4));
      const int col = col0 + 64 * c + 8 * chunk;
      if (wrow0 + row < row_end && col < n) *reinterpret_cast<uint4*>(y + (wrow0 + row) * ldy + col) = v;
    }
    __syncwarp();  // the buffer is rewritten by the next chunk
  }
}

__device__ __forceinline__ void release(uint32_t empty_bar) {
  __syncwarp();
  if (threadIdx.x % 32 == 0) mbar_arrive(empty_bar);
}

}  // namespace tessera::cuda::grouped_gemm_detail
