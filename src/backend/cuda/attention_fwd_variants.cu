// Tile shapes of the tensor-core attention forward (attention_fwd.cu has variants 0-2; these
// are variants 3-15 of attention_forward_fast, and variant 9 is the default):
// out = softmax(scale * Q K^T) V and lse, BF16 in and out, FP32 accumulation, head dim 64
// or 128. Same layout as attention_fwd.cu: q, out [B, T, Hq, D]; k, v [B, S, Hkv, D]; lse
// [B, Hq, T] F32; contiguous, 16-byte aligned; bottom-right causal mask.
//
// They aim at the D = 128 register problem of the default (4 warps x 32 rows, 64-key
// tiles: 255 registers, ~56 bytes spilled, Q fragments re-read from shared memory every
// tile). Knobs (template parameters of one kernel):
//  - MT (16-row mma slices per warp): MT = 1 halves the O accumulators (64 registers at
//    D = 128), so Q fits in registers and more blocks share an SM;
//  - Keys per tile (32 or 64): fewer score registers with 32;
//  - Sub: keys per compute step within a tile (Sub < Keys: the score registers of a
//    Sub-key tile with the barriers and copies of a Keys-key one);
//  - QReg: how much of Q lives in registers (none, the first quarter or half of D, all);
//    with all of Q in registers and a Q tile no larger than one pipeline stage, Q is loaded
//    into the last stage's buffer (read once before the loop): no shared memory of its own;
//  - Stages: 2 or 3 K/V tiles in flight (cp.async groups, one __syncthreads per tile);
//  - MinBlocks: the __launch_bounds__ occupancy target (registers per thread <= 64K /
//    (threads * MinBlocks)).
// Softmax changes common to all of them: the row max is taken over the raw scores and the
// scale folded into one FFMA per score (exp2(s * scale_log2 - m)); a negative scale is
// handled by negating Q's fragments (sign bits) and using |scale|. O is rescaled only when
// the running max of some row of the warp changed (a warp vote). P is packed to BF16 right
// after the exponential (half the registers of the FP32 scores during P V); the row sums
// stay FP32 sums of the unrounded P, as in the default: summing the BF16-rounded P would
// shift a row's lse by about 2^-9 / sqrt(keys seen), ~1e-3 on the tests' short causal rows,
// past their 1e-4 relative bound on lse.
//
// ptxas for sm_90a (-Xptxas -v), registers / spill-store bytes per thread, D = 128:
//   3: 233/0  4: 168/24  5: 234/0  6: 255/24  7: 255/4  8: 255/8  9: 255/48  10: 168/0
//   11: 255/8  12: 255/8  13: 254/0  14: 255/16  15: 255/8
// (the default, variant 0: 255/56; 1: 224/0; 2: 255/4). At D = 64 none spills (146-232).
// The allocator moves these by a few bytes with unrelated code changes: bench_attention
// prints the compiled kernel's figures beside its time.
//
// Speed, H200 (2026-11-30, bench_attention 30, causal): variant 9 is the fastest and the
// default (attention.h): 311.7 TFLOP/s at B=4 H=32 T=4096 D=128 (variant 0: 280.1, 3: 302.2,
// 11: 303.1, 8: 299.7), 214.9 at B=16 H=12 T=1024 D=64 (0: 200.1, 3: 216.9). Spilling 48
// bytes costs 9 less than the softmax saves. Floor as attention_fwd.cu: 4 * B * Hq * T * S * D FLOPs (half
// of it causal) over ~989 TFLOP/s BF16 dense on the H200 (mma.sync reaches ~2/3 of it).
#include <cuda_runtime.h>

#include <cmath>

#include "attention_common.cuh"
#include "attention_fwd_variants.h"
#include "cuda_check.h"
#include "tessera/core/error.h"

namespace tessera::cuda::attn {

namespace {

template <int N>
__device__ __forceinline__ void cp_async_wait_groups() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

enum QReg { kQSmem = 0, kQHalf = 1, kQAll = 2, kQQuarter = 3 };

template <int D, int MT, int Warps, int Keys, int Stages, int QRegMode, int MinBlocks>
struct VarConfig {
  static constexpr int kThreads = Warps * 32;
  static constexpr int kRows = 16 * MT * Warps;
  static constexpr int kKC = D / 16;
  static constexpr int kQRegKC =
      QRegMode == kQAll ? kKC : (QRegMode == kQHalf ? kKC / 2 : (QRegMode == kQQuarter ? kKC / 4 : 0));
  static constexpr int kKVTile = Keys * D * 2;  // bytes of one K (or V) tile
  static constexpr int kStage = 2 * kKVTile;    // K then V
  // Q read once into registers, before the last stage's buffer is first written.
  static constexpr bool kQAliased = kQRegKC == kKC && kRows * D * 2 <= kStage;
  static constexpr int kQBytes = kQAliased ? 0 : kRows * D * 2;
  static constexpr int kSmem = kQBytes + Stages * kStage;
  static_assert(Stages >= 2 && Stages <= 4, "2 to 4 pipeline stages");
};

template <int D, int MT, int Warps, int Keys, int Sub, int Stages, int QRegMode, int MinBlocks>
__global__ void __launch_bounds__(Warps * 32, MinBlocks) attention_fwd_variant_kernel(const FwdParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  using Cfg = VarConfig<D, MT, Warps, Keys, Stages, QRegMode, MinBlocks>;
  constexpr int kThreads = Cfg::kThreads, kRows = Cfg::kRows, kKC = Cfg::kKC, kQRegKC = Cfg::kQRegKC;
  constexpr int kNT = Sub / 8, kDT = D / 8;
  static_assert(Keys % Sub == 0 && Sub % 16 == 0, "Sub-key steps must tile the key tile");

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int bh = blockIdx.x, b = bh / p.Hq, h = bh % p.Hq, kvh = h / p.group;
  const int q0 = (gridDim.y - 1 - blockIdx.y) * kRows;  // heaviest causal blocks first
  const int T = p.T, S = p.S, diag = S - T;
  const int64_t q_stride = static_cast<int64_t>(p.Hq) * D, kv_stride = static_cast<int64_t>(p.Hkv) * D;
  const bf16_t* q_tile = p.q + (static_cast<int64_t>(b) * T + q0) * q_stride + static_cast<int64_t>(h) * D;
  const bf16_t* k_base = p.k + static_cast<int64_t>(b) * S * kv_stride + static_cast<int64_t>(kvh) * D;
  const bf16_t* v_base = p.v + static_cast<int64_t>(b) * S * kv_stride + static_cast<int64_t>(kvh) * D;

  const uint32_t s_base = smem_u32(smem);
  const uint32_t s_kv = s_base + Cfg::kQBytes;  // stage i: K at s_kv + i * kStage, V after it
  const uint32_t s_q = Cfg::kQAliased ? s_kv + (Stages - 1) * Cfg::kStage : s_base;

  const int last_row = min(q0 + kRows, T) - 1;
  const int kv_end = p.causal ? min(S, last_row + diag + 1) : S;
  const int n_tiles = (kv_end + Keys - 1) / Keys;

  auto load_kv = [&](int tile) {
    const uint32_t dst = s_kv + (tile % Stages) * Cfg::kStage;
    const int k0 = tile * Keys;
    const int64_t off = static_cast<int64_t>(k0) * kv_stride;
    load_tile<D, Keys, kThreads>(dst, k_base + off, kv_stride, S - k0, tid);
    load_tile<D, Keys, kThreads>(dst + Cfg::kKVTile, v_base + off, kv_stride, S - k0, tid);
  };

  // Prologue: Q with tile 0 in group 0, tiles 1 .. Stages-2 in groups of their own (empty
  // groups past the end keep the count uniform).
  load_tile<D, kRows, kThreads>(s_q, q_tile, q_stride, T - q0, tid);
#pragma unroll
  for (int i = 0; i < Stages - 1; ++i) {
    if (i < n_tiles) load_kv(i);
    cp_async_commit();
  }

  const int w_row0 = warp * 16 * MT;
  const int warp_first = q0 + w_row0;
  const int warp_last = min(warp_first + 16 * MT - 1, T - 1);
  const bool warp_has_rows = warp_first < T;
  const int row_base = warp_first + (lane >> 2);
  // A negative scale: negate Q (its fragments' sign bits) and use |scale|, so that the
  // row max over the raw scores is the max of the scaled ones.
  const uint32_t q_sign = p.scale_log2 < 0 ? 0x80008000u : 0u;
  const float sl = fabsf(p.scale_log2);

  uint32_t qa[MT][kQRegKC > 0 ? kQRegKC : 1][4];
  if constexpr (kQRegKC > 0) {
    cp_async_wait_groups<Stages - 2>();
    __syncthreads();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int kc = 0; kc < kQRegKC; ++kc) {
        ldmatrix_x4(qa[mt][kc], a_addr<D>(s_q, w_row0 + 16 * mt, kc, lane));
#pragma unroll
        for (int i = 0; i < 4; ++i) qa[mt][kc][i] ^= q_sign;
      }
  }

  float o[MT][kDT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < kDT; ++i) o[mt][i][0] = o[mt][i][1] = o[mt][i][2] = o[mt][i][3] = 0.0f;
  float m[MT][2], l[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) m[mt][0] = m[mt][1] = -INFINITY, l[mt][0] = l[mt][1] = 0.0f;

  for (int n = 0; n < n_tiles; ++n) {
    // Tile n has landed and every warp is done with tile n - 1 (and with Q, when aliased):
    // its buffer takes tile n + Stages - 1.
    cp_async_wait_groups<Stages - 2>();
    __syncthreads();
    if (n + Stages - 1 < n_tiles) load_kv(n + Stages - 1);
    cp_async_commit();

    const uint32_t k_tile = s_kv + (n % Stages) * Cfg::kStage, v_tile = k_tile + Cfg::kKVTile;
    // The tile in Sub-key steps (one online-softmax update each): Sub < Keys keeps the
    // score registers of a Sub-key tile with the barriers of a Keys-key one.
#pragma unroll 1
    for (int sub = 0; sub < Keys / Sub; ++sub) {
      const int k0 = n * Keys + sub * Sub;
      const bool active = warp_has_rows && k0 < S && (!p.causal || k0 <= warp_last + diag);
      if (!active) break;  // the later steps lie further right
      const int kr = sub * Sub;  // the step's first row in the K and V tiles

      float s[MT][kNT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int i = 0; i < kNT; ++i) s[mt][i][0] = s[mt][i][1] = s[mt][i][2] = s[mt][i][3] = 0.0f;
#pragma unroll
      for (int kc = 0; kc < kKC; ++kc) {
        uint32_t qf[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          if (kc < kQRegKC) {
#pragma unroll
            for (int i = 0; i < 4; ++i) qf[mt][i] = qa[mt][kc < kQRegKC ? kc : 0][i];
          } else {
            ldmatrix_x4(qf[mt], a_addr<D>(s_q, w_row0 + 16 * mt, kc, lane));
#pragma unroll
            for (int i = 0; i < 4; ++i) qf[mt][i] ^= q_sign;
          }
        }
#pragma unroll
        for (int np = 0; np < kNT / 2; ++np) {
          uint32_t r[4];
          ldmatrix_x4(r, b_addr<D>(k_tile, kr + np * 16, kc, lane));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma_bf16(s[mt][2 * np], qf[mt], r[0], r[1]);
            mma_bf16(s[mt][2 * np + 1], qf[mt], r[2], r[3]);
          }
        }
      }
      // Mask the raw scores (|scale| > 0 keeps -inf at -inf through the FFMA below).
      if (k0 + Sub > S || (p.causal && k0 + Sub - 1 > warp_first + diag)) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int col = k0 + nt * 8 + 2 * (lane & 3) + (e & 1);
              const int row = row_base + 16 * mt + (e < 2 ? 0 : 8);
              if (col >= S || (p.causal && col > row + diag)) s[mt][nt][e] = -INFINITY;
            }
      }
      // Online softmax; P packed to BF16 pairs as the A operand of P V wants them:
      // pk[mt][nt][r] = (row g + 8r, keys nt*8 + 2c, +1).
      uint32_t pk[MT][kNT][2];
      float corr[MT][2];
      bool changed = false;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float mx = -INFINITY;
#pragma unroll
          for (int nt = 0; nt < kNT; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          const float m_new = fmaxf(m[mt][r], mx * sl);
          const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // a row with nothing seen yet
          changed |= m_new != m[mt][r];
          corr[mt][r] = exp2_approx(m[mt][r] - m_use);
          m[mt][r] = m_new;
          float sum = 0.0f;
#pragma unroll
          for (int nt = 0; nt < kNT; ++nt) {
            const float p0 = exp2_approx(fmaf(s[mt][nt][2 * r], sl, -m_use));
            const float p1 = exp2_approx(fmaf(s[mt][nt][2 * r + 1], sl, -m_use));
            sum += p0 + p1;
            pk[mt][nt][r] = pack_bf16(p0, p1);
          }
          l[mt][r] = l[mt][r] * corr[mt][r] + sum;  // per-thread partial; the quad's parts are added at the end
        }
      }
      // An unchanged max gives corr == 1 exactly: skip the rescale when no row of the warp moved.
      if (__any_sync(0xffffffffu, changed)) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int dt = 0; dt < kDT; ++dt) {
            o[mt][dt][0] *= corr[mt][0];
            o[mt][dt][1] *= corr[mt][0];
            o[mt][dt][2] *= corr[mt][1];
            o[mt][dt][3] *= corr[mt][1];
          }
      }
      // O += P V.
#pragma unroll
      for (int kc = 0; kc < Sub / 16; ++kc) {
        uint32_t pa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          pa[mt][0] = pk[mt][2 * kc][0];
          pa[mt][1] = pk[mt][2 * kc][1];
          pa[mt][2] = pk[mt][2 * kc + 1][0];
          pa[mt][3] = pk[mt][2 * kc + 1][1];
        }
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
          uint32_t r[4];
          ldmatrix_x4_trans(r, bt_addr<D>(v_tile, kr + kc * 16, dp, lane));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma_bf16(o[mt][2 * dp], pa[mt], r[0], r[1]);
            mma_bf16(o[mt][2 * dp + 1], pa[mt], r[2], r[3]);
          }
        }
      }
    }
  }

  store_out_and_lse<D, MT>(p.out, p.lse, o, l, m, row_base, b, h, bh, T, q_stride, lane);
}

template <int D, int MT, int Warps, int Keys, int Sub, int Stages, int QRegMode, int MinBlocks>
struct Variant {
  using Cfg = VarConfig<D, MT, Warps, Keys, Stages, QRegMode, MinBlocks>;
  static constexpr auto kernel = attention_fwd_variant_kernel<D, MT, Warps, Keys, Sub, Stages, QRegMode, MinBlocks>;

  static void launch(cudaStream_t stream, const FwdParams& p, int64_t batch_heads, int64_t T) {
    const int64_t row_blocks = (T + Cfg::kRows - 1) / Cfg::kRows;
    TESSERA_CHECK(row_blocks <= 65535, "attention forward variant: sequence too long for its grid");
    TESSERA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmem));
    const dim3 grid(static_cast<unsigned>(batch_heads), static_cast<unsigned>(row_blocks));
    kernel<<<grid, Cfg::kThreads, Cfg::kSmem, stream>>>(p);
    TESSERA_CUDA_CHECK_LAUNCH();
  }

  static void info(FwdVariantInfo* out) {
    cudaFuncAttributes a{};
    TESSERA_CUDA_CHECK(cudaFuncGetAttributes(&a, kernel));
    TESSERA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmem));
    int blocks = 0;
    TESSERA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, Cfg::kThreads, Cfg::kSmem));
    out->registers = a.numRegs;
    out->local_bytes = static_cast<int>(a.localSizeBytes);
    out->smem_bytes = Cfg::kSmem;
    out->blocks_per_sm = blocks;
  }
};

// Calls fn(Variant<...>{}, description) for `variant`; false when there is no such variant.
template <int D, class Fn>
bool with_variant(int variant, Fn&& fn) {
  // Variant<D, MT, Warps, Keys, Sub, Stages, QReg, MinBlocks>
  switch (variant) {
    case 3:
      fn(Variant<D, 1, 4, 64, 64, 2, kQAll, 2>{}, "MT=1 4 warps, 64 keys, 2 stages, Q in regs");
      return true;
    case 4:
      fn(Variant<D, 1, 4, 64, 64, 2, kQAll, 3>{}, "MT=1 4 warps, 64 keys, 2 stages, Q in regs, 3 blocks/SM");
      return true;
    case 5:
      fn(Variant<D, 1, 4, 64, 64, 3, kQAll, 2>{}, "MT=1 4 warps, 64 keys, 3 stages, Q in regs");
      return true;
    case 6:
      fn(Variant<D, 2, 4, 32, 32, 2, kQHalf, 2>{}, "MT=2 4 warps, 32 keys, 2 stages, 1/2 of Q in regs");
      return true;
    case 7:
      fn(Variant<D, 2, 4, 32, 32, 3, kQHalf, 2>{}, "MT=2 4 warps, 32 keys, 3 stages, 1/2 of Q in regs");
      return true;
    case 8:
      fn(Variant<D, 2, 4, 32, 32, 3, kQSmem, 2>{}, "MT=2 4 warps, 32 keys, 3 stages, Q in smem");
      return true;
    case 9:
      fn(Variant<D, 2, 4, 64, 64, 2, kQSmem, 2>{}, "MT=2 4 warps, 64 keys, 2 stages, Q in smem");
      return true;
    case 10:
      fn(Variant<D, 1, 4, 32, 32, 3, kQAll, 3>{}, "MT=1 4 warps, 32 keys, 3 stages, Q in regs, 3 blocks/SM");
      return true;
    case 11:
      fn(Variant<D, 2, 4, 32, 32, 2, kQSmem, 2>{}, "MT=2 4 warps, 32 keys, 2 stages, Q in smem");
      return true;
    case 12:
      fn(Variant<D, 2, 4, 32, 32, 3, kQQuarter, 2>{}, "MT=2 4 warps, 32 keys, 3 stages, 1/4 of Q in regs");
      return true;
    case 13:
      fn(Variant<D, 2, 4, 64, 32, 2, kQSmem, 2>{}, "MT=2 4 warps, 64-key tiles in 32-key steps, Q in smem");
      return true;
    case 14:
      fn(Variant<D, 2, 4, 64, 32, 2, kQHalf, 2>{}, "MT=2 4 warps, 64-key tiles in 32-key steps, 1/2 of Q in regs");
      return true;
    case 15:
      fn(Variant<D, 2, 4, 64, 32, 2, kQQuarter, 2>{}, "MT=2 4 warps, 64-key tiles in 32-key steps, 1/4 of Q in regs");
      return true;
    default: return false;
  }
}

}  // namespace

bool launch_forward_variant(cudaStream_t stream, const FwdParams& p, int D, int variant, int64_t batch_heads,
                            int64_t T) {
  if (variant >= kWgmmaForwardVariant && variant <= kLastAttentionForwardVariant) {
    if (launch_forward_wgmma(stream, p, D, variant - kWgmmaForwardVariant, batch_heads)) return true;
    variant = 9;  // not a Hopper GPU: the mma.sync default instead
  }
  auto run = [&](auto v, const char*) { decltype(v)::launch(stream, p, batch_heads, T); };
  return D == 64 ? with_variant<64>(variant, run) : with_variant<128>(variant, run);
}

bool forward_variant_info(int D, int variant, FwdVariantInfo* info) {
  if (variant >= kWgmmaForwardVariant) return forward_wgmma_info(D, variant - kWgmmaForwardVariant, info);
  auto get = [&](auto v, const char* shape) {
    decltype(v)::info(info);
    info->shape = shape;
  };
  return D == 64 ? with_variant<64>(variant, get) : with_variant<128>(variant, get);
}

}  // namespace tessera::cuda::attn
