// Device helpers shared by the tensor-core attention kernels (attention_fwd.cu,
// attention_bwd.cu): asynchronous copies into swizzled shared-memory tiles, ldmatrix and
// the m16n8k16 BF16 mma.sync with FP32 accumulation.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16"), with g = lane / 4 and
// c = lane % 4:
//   A 16x16 (row-major): a[0] = (row g,   cols 2c, 2c+1)   a[1] = (row g+8, cols 2c, 2c+1)
//                        a[2] = (row g,   cols 2c+8, +9)   a[3] = (row g+8, cols 2c+8, +9)
//   B 16x8 (k x n):      b[0] = (k 2c, 2c+1; n g)          b[1] = (k 2c+8, 2c+9; n g)
//   C 16x8 (fp32):       c[0], c[1] = (row g, cols 2c, 2c+1); c[2], c[3] = (row g+8, same)
// So the accumulators of two neighbouring 16x8 score tiles are, once rounded to BF16, the
// A operand of the next product over those 16 keys, with no shuffle (FlashAttention-2's
// register reuse).
//
// A tile is `rows` x D BF16 values, one row per key or query, stored as 16-byte chunks
// whose index is XORed with (row % 8). ldmatrix reads eight rows at one logical chunk; the
// XOR spreads them over eight different bank groups, so neither ldmatrix nor the
// cp.async writes conflict, for D = 64 (128-byte rows) and D = 128 (256-byte rows).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace tessera::cuda::attn {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

using bf16_t = __nv_bfloat16;

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Byte offset of (row, 16-byte chunk) in a swizzled tile of D BF16 columns.
template <int D>
__device__ __forceinline__ uint32_t tile_offset(int row, int chunk) {
  return static_cast<uint32_t>(row * (D * 2) + ((chunk ^ (row & 7)) << 4));
}

// 16-byte asynchronous copy; with valid == false the destination is zero-filled and
// nothing is read (rows past the end of the sequence).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// Copies rows [0, rows) of a tile (row r at src + r * row_stride elements) into shared
// memory; rows at or past `valid_rows` become zeros. Every thread of the block takes part.
// A thread copies the same chunk column of rows r0, r0 + step, ...; step is a multiple of
// 8, so the swizzled column is the same for all of them and the addresses advance by a
// constant (few registers held across the main loop).
template <int D, int Rows, int Threads>
__device__ __forceinline__ void load_tile(uint32_t dst, const bf16_t* src, int64_t row_stride, int valid_rows,
                                          int tid) {
  constexpr int kChunks = D / 8;
  constexpr int kStep = Threads / kChunks;  // rows per pass of the block
  static_assert(Threads % kChunks == 0 && kStep % 8 == 0 && Rows % kStep == 0, "tile shape and threads mismatch");
  const int r0 = tid / kChunks, chunk = tid % kChunks;
  const bf16_t* from = src + r0 * row_stride + chunk * 8;
  const uint32_t to = dst + tile_offset<D>(r0, chunk);
#pragma unroll
  for (int i = 0; i < Rows / kStep; ++i) {
    const bool valid = r0 + i * kStep < valid_rows;
    cp_async_16(to + i * kStep * D * 2, valid ? from + i * kStep * row_stride : src, valid);
  }
}

// Copies `n` floats (entries at or past `valid` become 0) with 4-byte asynchronous copies.
__device__ __forceinline__ void load_floats(uint32_t dst, const float* src, int n, int valid, int tid,
                                            int threads) {
  for (int i = tid; i < n; i += threads) cp_async_4(dst + 4 * i, i < valid ? src + i : src, i < valid);
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// c += a * b for one 16x8x16 step.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 4-byte shared-memory store, ordered with the asm loads and copies above ("memory").
__device__ __forceinline__ void st_shared_u32(uint32_t addr, uint32_t value) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(value) : "memory");
}

// Two floats as a BF16 pair, `lo` in the low half (the lower column index).
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Two FP32 atomic adds at an 8-byte-aligned address (one vector red on sm_90).
__device__ __forceinline__ void atomic_add2(float* at, float x, float y) {
#if __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(at), make_float2(x, y));
#else
  atomicAdd(at, x);
  atomicAdd(at + 1, y);
#endif
}

// 2^x on the special-function unit (exp2(-inf) = 0).
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// A operand (16 rows x 16 keys) from the fp32 accumulators of score tiles 2kc and 2kc+1.
__device__ __forceinline__ void scores_to_a(uint32_t (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
  a[0] = pack_bf16(lo[0], lo[1]);
  a[1] = pack_bf16(lo[2], lo[3]);
  a[2] = pack_bf16(hi[0], hi[1]);
  a[3] = pack_bf16(hi[2], hi[3]);
}

// Lane addresses for ldmatrix over a swizzled tile (row0: first row of the 16-row block,
// kc: the 16-column block):
//  - a_addr: the A operand of rows row0..row0+15 (registers as a[0..3] above);
//  - b_addr: the B operands of two 8-row groups (rows row0..+7 -> r[0], r[1]; row0+8..+15
//    -> r[2], r[3]) when the tile's rows are the n index (K for Q K^T);
//  - bt_addr (with .trans): the B operands of two 8-column groups (cols 16kc..+7 -> r[0],
//    r[1]; +8..+15 -> r[2], r[3]) when the tile's rows are the k index (V for P V).
template <int D>
__device__ __forceinline__ uint32_t a_addr(uint32_t base, int row0, int kc, int lane) {
  return base + tile_offset<D>(row0 + (lane & 15), kc * 2 + (lane >> 4));
}
template <int D>
__device__ __forceinline__ uint32_t b_addr(uint32_t base, int row0, int kc, int lane) {
  return base + tile_offset<D>(row0 + (lane & 7) + ((lane >> 4) << 3), kc * 2 + ((lane >> 3) & 1));
}
template <int D>
__device__ __forceinline__ uint32_t bt_addr(uint32_t base, int row0, int kc, int lane) {
  return base + tile_offset<D>(row0 + (lane & 7) + (((lane >> 3) & 1) << 3), kc * 2 + (lane >> 4));
}

// The forward's epilogue, shared by every tile shape: each thread's two rows of each 16-row
// slice normalised by their row sums (summed over the 4 lanes of a row) into out [B, T, Hq, D]
// as BF16, and lse = (m + log2(sum)) ln 2 (m is the row max in the log2 domain). Rows past T
// are not written.
template <int D, int MT>
__device__ __forceinline__ void store_out_and_lse(bf16_t* out, float* lse, const float (&o)[MT][D / 8][4],
                                                  const float (&l)[MT][2], const float (&m)[MT][2], int row_base,
                                                  int b, int h, int bh, int T, int64_t q_stride, int lane) {
  const int col0 = 2 * (lane & 3);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float sum = l[mt][r];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const int row = row_base + 16 * mt + 8 * r;
      if (row >= T) continue;
      const float inv = 1.0f / sum;
      bf16_t* dst = out + (static_cast<int64_t>(b) * T + row) * q_stride + static_cast<int64_t>(h) * D + col0;
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt)
        *reinterpret_cast<uint32_t*>(dst + dt * 8) = pack_bf16(o[mt][dt][2 * r] * inv, o[mt][dt][2 * r + 1] * inv);
      if ((lane & 3) == 0) lse[static_cast<int64_t>(bh) * T + row] = (m[mt][r] + log2f(sum)) * kLn2;
    }
  }
}

}  // namespace tessera::cuda::attn
