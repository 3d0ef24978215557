// Attention backward on the tensor cores, FlashAttention-2 style, for BF16 with head dim 64
// or 128 (the gradients of attention_fwd.cu), plus the backward dispatcher (which hands the
// call to cuDNN when attention_select.cu says so, the same choice as the forward's). With
// P = exp(scale * Q K^T - lse) rebuilt from the saved lse and Delta = rowsum(dO * O):
//   dV = P^T dO,  dS = P * (dO V^T - Delta),  dK = scale * dS^T Q,  dQ = scale * dS K.
//
// Layout as in the forward: q, out, d_out, dq [B, T, Hq, D]; k, v, dk, dv [B, S, Hkv, D];
// lse [B, Hq, T] F32; bottom-right causal alignment (query i sees keys j <= i + S - T).
//
// Three kernels, all deterministic (every output element has exactly one writer, no atomics):
//  1. Delta (attention_generic.cu's attention_backward_delta) into an F32 scratch [B, Hq, T].
//  2. dK/dV: one block of 8 warps per 128 keys of one (batch, kv head); each warp owns 16
//     keys and keeps their dK, dV in FP32 registers while the block walks every query tile
//     (64 rows) of every query head of the GQA group, double-buffered with cp.async.
//     The warp computes S^T = K Q^T and dP^T = V dO^T (keys as the M dimension), so P^T
//     and dS^T sit in registers already laid out as the A operand of dV += P^T dO and
//     dK += dS^T Q: no shared-memory round trip for P.
//  3. dQ: one block of 8 warps per 128 queries of one (batch, head), Q and dO in registers,
//     walking the key/value tiles (64 keys) like the forward and accumulating dQ += dS K.
//     It recomputes S and dP (2 of its 3 products), the price of determinism and of not
//     needing an FP32 dQ scratch buffer.
// Causal tiles that a warp cannot see are skipped; tiles on the diagonal or at the
// sequence ends are masked.
//
// The atomic variant (deterministic == false; tessera::set_attention_deterministic) is
// FlashAttention-2's: kernel 2 with kAtomicDq also stages each step's dS^T in shared memory
// (16 KB more) and computes dQ += dS K for the tile's 64 query rows from it and the K
// already resident, adding the partial to an F32 scratch [B, T, Hq, D] with FP32 atomics;
// a small kernel converts the scratch to BF16 dq. 5 products instead of 7, no dQ pass, but
// the order of the atomic adds (so dQ's last bits) varies between runs. Measured on the H200
// (2026-11-30, B=4 H=32 T=4096 D=128 causal): backward 211.9 against 205.7 TFLOP/s,
// forward+backward 226.4 against 218.0: only 3-4% for 2 of 7 products fewer, because the
// dK/dV kernel (255 registers, spilling) is the bottleneck and now does more per step.
// On Hopper the atomic variant runs attention_bwd_wgmma.cu instead (the same five products
// on warpgroup MMAs, between the same memset and conversion), and at D = 128 the
// deterministic variant's kernel 2 is that kernel without its dQ part; attention_bwd_variant.h
// has the switch.
//
// Floor: the 5 products FlashAttention-2 counts (2.5x the forward's FLOPs) over ~989
// TFLOP/s; this split does 7 (dQ's pass recomputes 2), so 1.4x that count is executed.
// Measured on the H200 (bench/attention_bench.cu, causal, FlashAttention's count):
// B=4 H=32 T=4096 D=128 backward 206 TFLOP/s (288 executed), forward+backward 219
// (PyTorch's FlashAttention-2 backend 269 / 293, cuDNN 453 / 475); B=16 H=12 T=1024 D=64
// backward 132, forward+backward 147 (FA2 129 / 165). The D=128 dK/dV kernel spills ~50
// bytes at 255 registers.
//
// Kernel 2 now runs as attention_dkdv_kernel_v2 (attention_bwd_dkdv_v2.cuh; what changed
// and why is there): bitwise the same dK, dV, with ldmatrix fragments loaded one mma step
// ahead and less integer work. D = 128 deterministic, per unmasked step ~1300 -> ~800
// instructions issued (HMMA 20% -> 32%), 48 -> 8 stack bytes. Measured on the H200 (ninth
// session, B=4 H=32 T=4096 D=128 causal, same run): backward 227.4 vs 212.1 TFLOP/s with
// atomic dQ, 218.1 vs 207.3 deterministic. The legacy kernel below stays for side-by-side
// timing (attention_bwd_variant.h).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>

#include "attention.h"
#include "attention_common.cuh"
#include "attention_bwd_variant.h"
#include "attention_bwd_wgmma.h"
#include "attention_cudnn.h"
#include "cuda_check.h"
#include "tessera/ops/attention.h"

namespace tessera::cuda {

namespace {

using namespace attn;

constexpr int kBwdWarps = 8;
constexpr int kBwdThreads = kBwdWarps * 32;

// ---- dK / dV ------------------------------------------------------------------------------

constexpr int kKVKeys = 16 * kBwdWarps;  // keys per block
constexpr int kKVRows = 64;              // query rows per tile

template <int D>
constexpr int dkdv_smem_bytes() {
  // K, V (once), then Q[2], dO[2], lse[2], Delta[2].
  return 2 * kKVKeys * D * 2 + 4 * kKVRows * D * 2 + 4 * kKVRows * 4;
}
// The atomic variant stages the step's dS^T (keys x query rows, BF16) after those.
constexpr int kDsBytes = kKVKeys * kKVRows * 2;

// The atomic variant's dQ for one step of the dK/dV kernel: dQ(64 x D) += dS(64 x 128) K(128 x D)
// with dS^T staged at s_ds (a kKVKeys x kKVRows tile) and K resident at s_k. Warp w takes
// query rows 16 (w % 4) .. +15 and the column half w / 4, over the 16-key blocks that
// those rows can see (every other dS entry of theirs is zero), and adds its partial,
// unscaled, to dq_accum with 8-byte FP32 atomics. All the dS it reads were written this
// step: a key block visible to some row here is visible to the tile's last row, which
// makes its warp active in the dK/dV pass.
template <int D>
__device__ __forceinline__ void dq_step_atomic(const BwdParams& p, uint32_t s_ds, uint32_t s_k, int b, int h, int q0,
                                               int k0, int warp, int lane) {
  constexpr int kHalfBlocks = D / 32;  // 16-column blocks per column half
  const int T = p.T, S = p.S;
  const int row0 = q0 + 16 * (warp & 3), half = warp >> 2;
  if (row0 >= T) return;
  const int row_last = min(row0 + 15, T - 1);
  const int key_end = p.causal ? min(S, row_last + (S - T) + 1) : S;
  const int kc_end = min(kKVKeys / 16, max(0, (key_end - k0 + 15) / 16));
  if (kc_end == 0) return;
  float acc[2 * kHalfBlocks][4];
#pragma unroll
  for (int i = 0; i < 2 * kHalfBlocks; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
  for (int kc = 0; kc < kc_end; ++kc) {
    // A = dS rows row0.. (queries) x keys 16kc..: the transposed 8x8 blocks of dS^T.
    uint32_t a[4];
    ldmatrix_x4_trans(a, b_addr<kKVRows>(s_ds, kc * 16, warp & 3, lane));
#pragma unroll
    for (int dp = 0; dp < kHalfBlocks; ++dp) {
      uint32_t r[4];
      ldmatrix_x4_trans(r, bt_addr<D>(s_k, kc * 16, half * kHalfBlocks + dp, lane));
      mma_bf16(acc[2 * dp], a, r[0], r[1]);
      mma_bf16(acc[2 * dp + 1], a, r[2], r[3]);
    }
  }
  const int64_t q_stride = static_cast<int64_t>(p.Hq) * D;
  const int row_a = row0 + (lane >> 2), row_b = row_a + 8;
  float* dst = p.dq_accum + static_cast<int64_t>(b) * T * q_stride + static_cast<int64_t>(h) * D + half * (D / 2) +
               2 * (lane & 3);
  if (row_a < T) {
    float* at = dst + row_a * q_stride;
#pragma unroll
    for (int j = 0; j < 2 * kHalfBlocks; ++j)
      atomic_add2(at + j * 8, acc[j][0], acc[j][1]);
  }
  if (row_b < T) {
    float* at = dst + row_b * q_stride;
#pragma unroll
    for (int j = 0; j < 2 * kHalfBlocks; ++j)
      atomic_add2(at + j * 8, acc[j][2], acc[j][3]);
  }
}

// The end of a dK/dV kernel (the legacy one below and attention_bwd_dkdv_v2.cuh): the warp's
// FP32 sums of its keys key_a and key_b (accumulator rows g and g + 8) as BF16, dK scaled.
template <int D>
__device__ __forceinline__ void store_dk_dv(const BwdParams& p, const float (&dk)[D / 8][4],
                                            const float (&dv)[D / 8][4], int b, int kvh, int key_a, int key_b,
                                            int lane) {
  const int S = p.S;
  const int64_t kv_stride = static_cast<int64_t>(p.Hkv) * D;
  const int64_t head = static_cast<int64_t>(kvh) * D + 2 * (lane & 3);
  const int keys[2] = {key_a, key_b};
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    if (keys[half] >= S) continue;
    const int64_t row = (static_cast<int64_t>(b) * S + keys[half]) * kv_stride + head;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      const int e = 2 * half;
      *reinterpret_cast<uint32_t*>(p.dk + row + dt * 8) = pack_bf16(dk[dt][e] * p.scale, dk[dt][e + 1] * p.scale);
      *reinterpret_cast<uint32_t*>(p.dv + row + dt * 8) = pack_bf16(dv[dt][e], dv[dt][e + 1]);
    }
  }
}

// kAtomicDq: also dQ += dS K per step, dS staged through shared memory and the block's
// 64 x D partial added to p.dq_accum with FP32 atomics (no separate dQ pass, not
// bitwise repeatable). kAtomicDq = false is the deterministic kernel, unchanged.
template <int D, bool kAtomicDq>
__global__ void __launch_bounds__(kBwdThreads, 1) attention_dkdv_kernel(const BwdParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int kKC = D / 16;
  constexpr int kNT = kKVRows / 8;  // 8-query tiles of the warp's S^T
  constexpr int kDT = D / 8;
  constexpr uint32_t kRowTile = kKVRows * D * 2;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int bkv = blockIdx.x, b = bkv / p.Hkv, kvh = bkv % p.Hkv;
  const int k0 = blockIdx.y * kKVKeys;  // low key blocks see the most queries: launched first
  const int T = p.T, S = p.S, diag = S - T;
  const int64_t q_stride = static_cast<int64_t>(p.Hq) * D, kv_stride = static_cast<int64_t>(p.Hkv) * D;
  const int64_t kv_offset = (static_cast<int64_t>(b) * S + k0) * kv_stride + static_cast<int64_t>(kvh) * D;

  const uint32_t s_k = smem_u32(smem);
  const uint32_t s_v = s_k + kKVKeys * D * 2;
  const uint32_t s_q = s_v + kKVKeys * D * 2;
  const uint32_t s_do = s_q + 2 * kRowTile;
  const uint32_t s_stat = s_do + 2 * kRowTile;  // lse[2][rows], then Delta[2][rows]
  const float* stat = reinterpret_cast<const float*>(smem + (s_stat - s_k));
  // dS^T: row = the block's key, 64 query columns, swizzled like the D = 64 tiles.
  const uint32_t s_ds = s_stat + 4 * kKVRows * 4;

  // Queries [first_q, T) see at least one key of this block.
  const int first_q = p.causal ? max(0, k0 - diag) : 0;
  const int q_tiles = (T + kKVRows - 1) / kKVRows;
  const int tile0 = first_q < T ? first_q / kKVRows : q_tiles;
  const int per_head = q_tiles - tile0;
  const int steps = per_head * p.group;

  auto load_step = [&](int step, int buf) {
    const int h = kvh * p.group + step / per_head;
    const int q0 = (tile0 + step % per_head) * kKVRows;
    const int64_t row_offset = (static_cast<int64_t>(b) * T + q0) * q_stride + static_cast<int64_t>(h) * D;
    load_tile<D, kKVRows, kBwdThreads>(s_q + buf * kRowTile, p.q + row_offset, q_stride, T - q0, tid);
    load_tile<D, kKVRows, kBwdThreads>(s_do + buf * kRowTile, p.d_out + row_offset, q_stride, T - q0, tid);
    const int64_t stat_offset = (static_cast<int64_t>(b) * p.Hq + h) * T + q0;
    load_floats(s_stat + buf * kKVRows * 4, p.lse + stat_offset, kKVRows, T - q0, tid, kBwdThreads);
    load_floats(s_stat + (2 + buf) * kKVRows * 4, p.delta + stat_offset, kKVRows, T - q0, tid, kBwdThreads);
  };

  load_tile<D, kKVKeys, kBwdThreads>(s_k, p.k + kv_offset, kv_stride, S - k0, tid);
  load_tile<D, kKVKeys, kBwdThreads>(s_v, p.v + kv_offset, kv_stride, S - k0, tid);
  if (steps > 0) load_step(0, 0);
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();

  const int w_key0 = k0 + warp * 16;  // the warp's first key
  const int key_a = w_key0 + (lane >> 2), key_b = key_a + 8;

  float dk[kDT][4], dv[kDT][4];
#pragma unroll
  for (int i = 0; i < kDT; ++i) {
    dk[i][0] = dk[i][1] = dk[i][2] = dk[i][3] = 0.0f;
    dv[i][0] = dv[i][1] = dv[i][2] = dv[i][3] = 0.0f;
  }

  for (int step = 0; step < steps; ++step) {
    const int buf = step & 1;
    if (step + 1 < steps) {
      load_step(step + 1, buf ^ 1);
      cp_async_commit();
    }
    const int q0 = (tile0 + step % per_head) * kKVRows;
    const int q_last = min(q0 + kKVRows, T) - 1;
    const bool active = w_key0 < S && (!p.causal || q_last + diag >= w_key0);
    if (active) {
      const uint32_t q_tile = s_q + buf * kRowTile, do_tile = s_do + buf * kRowTile;
      float st[kNT][4], dpt[kNT][4];
#pragma unroll
      for (int i = 0; i < kNT; ++i) {
        st[i][0] = st[i][1] = st[i][2] = st[i][3] = 0.0f;
        dpt[i][0] = dpt[i][1] = dpt[i][2] = dpt[i][3] = 0.0f;
      }
#pragma unroll
      for (int kc = 0; kc < kKC; ++kc) {
        uint32_t ka[4], va[4];
        ldmatrix_x4(ka, a_addr<D>(s_k, warp * 16, kc, lane));
        ldmatrix_x4(va, a_addr<D>(s_v, warp * 16, kc, lane));
#pragma unroll
        for (int np = 0; np < kNT / 2; ++np) {
          uint32_t r[4];
          ldmatrix_x4(r, b_addr<D>(q_tile, np * 16, kc, lane));
          mma_bf16(st[2 * np], ka, r[0], r[1]);
          mma_bf16(st[2 * np + 1], ka, r[2], r[3]);
          ldmatrix_x4(r, b_addr<D>(do_tile, np * 16, kc, lane));
          mma_bf16(dpt[2 * np], va, r[0], r[1]);
          mma_bf16(dpt[2 * np + 1], va, r[2], r[3]);
        }
      }
      const float* lse_s = stat + buf * kKVRows;
      const float* delta_s = stat + (2 + buf) * kKVRows;
      // Keys past S (zero rows of K and V) only matter to dQ: dK, dV of them are not stored.
      const bool need_mask = q0 + kKVRows > T || (p.causal && w_key0 + 15 > q0 + diag) ||
                             (kAtomicDq && w_key0 + 15 >= S);
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i_local = nt * 8 + 2 * (lane & 3) + (e & 1);
          float pv = exp2_approx(st[nt][e] * p.scale_log2 - lse_s[i_local] * kLog2e);
          if (need_mask) {
            const int i = q0 + i_local, key = e < 2 ? key_a : key_b;
            if (i >= T || (p.causal && key > i + diag) || (kAtomicDq && key >= S)) pv = 0.0f;
          }
          st[nt][e] = pv;
          dpt[nt][e] = pv * (dpt[nt][e] - delta_s[i_local]);
        }
      }
#pragma unroll
      for (int kc = 0; kc < kKVRows / 16; ++kc) {
        uint32_t pa[4], da[4];
        scores_to_a(pa, st[2 * kc], st[2 * kc + 1]);
        scores_to_a(da, dpt[2 * kc], dpt[2 * kc + 1]);
        if constexpr (kAtomicDq) {
          // da[0..3] = (key g | g+8, queries 16kc + 2c, +1 | 16kc + 8 + 2c, +1), g = lane / 4.
          const int row = warp * 16 + (lane >> 2);
          const uint32_t word = 4 * (lane & 3);
          st_shared_u32(s_ds + tile_offset<kKVRows>(row, 2 * kc) + word, da[0]);
          st_shared_u32(s_ds + tile_offset<kKVRows>(row + 8, 2 * kc) + word, da[1]);
          st_shared_u32(s_ds + tile_offset<kKVRows>(row, 2 * kc + 1) + word, da[2]);
          st_shared_u32(s_ds + tile_offset<kKVRows>(row + 8, 2 * kc + 1) + word, da[3]);
        }
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
          uint32_t r[4];
          ldmatrix_x4_trans(r, bt_addr<D>(do_tile, kc * 16, dp, lane));
          mma_bf16(dv[2 * dp], pa, r[0], r[1]);
          mma_bf16(dv[2 * dp + 1], pa, r[2], r[3]);
          ldmatrix_x4_trans(r, bt_addr<D>(q_tile, kc * 16, dp, lane));
          mma_bf16(dk[2 * dp], da, r[0], r[1]);
          mma_bf16(dk[2 * dp + 1], da, r[2], r[3]);
        }
      }
    }
    if constexpr (kAtomicDq) {
      __syncthreads();  // every active warp's dS^T is in shared memory
      const int h = kvh * p.group + step / per_head;
      dq_step_atomic<D>(p, s_ds, s_k, b, h, q0, k0, warp, lane);
    }
    cp_async_wait_all();
    __syncthreads();
  }

  store_dk_dv<D>(p, dk, dv, b, kvh, key_a, key_b, lane);
}

#include "attention_bwd_dkdv_v2.cuh"  // attention_dkdv_kernel_v2: uses the definitions above

// ---- dQ -----------------------------------------------------------------------------------

constexpr int kQRows = 16 * kBwdWarps;  // query rows per block
constexpr int kQKeys = 64;              // keys per tile

template <int D>
constexpr int dq_smem_bytes() {
  return 2 * kQRows * D * 2 + 4 * kQKeys * D * 2;  // Q, dO, then K[2], V[2]
}

template <int D>
__global__ void __launch_bounds__(kBwdThreads, 1) attention_dq_kernel(const BwdParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int kKC = D / 16;
  constexpr int kNT = kQKeys / 8;
  constexpr int kDT = D / 8;
  constexpr uint32_t kKVTile = kQKeys * D * 2;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int bh = blockIdx.x, b = bh / p.Hq, h = bh % p.Hq, kvh = h / p.group;
  const int q0 = (gridDim.y - 1 - blockIdx.y) * kQRows;  // heaviest causal blocks first
  const int T = p.T, S = p.S, diag = S - T;
  const int64_t q_stride = static_cast<int64_t>(p.Hq) * D, kv_stride = static_cast<int64_t>(p.Hkv) * D;
  const int64_t q_offset = (static_cast<int64_t>(b) * T + q0) * q_stride + static_cast<int64_t>(h) * D;
  const bf16_t* k_base = p.k + static_cast<int64_t>(b) * S * kv_stride + static_cast<int64_t>(kvh) * D;
  const bf16_t* v_base = p.v + static_cast<int64_t>(b) * S * kv_stride + static_cast<int64_t>(kvh) * D;

  const uint32_t s_q = smem_u32(smem);
  const uint32_t s_do = s_q + kQRows * D * 2;
  const uint32_t s_k = s_do + kQRows * D * 2;
  const uint32_t s_v = s_k + 2 * kKVTile;

  const int last_row = min(q0 + kQRows, T) - 1;
  const int kv_end = p.causal ? min(S, last_row + diag + 1) : S;
  const int n_tiles = (kv_end + kQKeys - 1) / kQKeys;

  load_tile<D, kQRows, kBwdThreads>(s_q, p.q + q_offset, q_stride, T - q0, tid);
  load_tile<D, kQRows, kBwdThreads>(s_do, p.d_out + q_offset, q_stride, T - q0, tid);
  load_tile<D, kQKeys, kBwdThreads>(s_k, k_base, kv_stride, S, tid);
  load_tile<D, kQKeys, kBwdThreads>(s_v, v_base, kv_stride, S, tid);
  cp_async_commit();

  const int w_row0 = warp * 16;
  const int row_a = q0 + w_row0 + (lane >> 2), row_b = row_a + 8;
  const int warp_first = q0 + w_row0;
  const int warp_last = min(warp_first + 15, T - 1);
  const bool warp_has_rows = warp_first < T;
  const int64_t stat = static_cast<int64_t>(bh) * T;
  const float lse_a = row_a < T ? p.lse[stat + row_a] * kLog2e : 0.0f;
  const float lse_b = row_b < T ? p.lse[stat + row_b] * kLog2e : 0.0f;
  const float delta_a = row_a < T ? p.delta[stat + row_a] : 0.0f;
  const float delta_b = row_b < T ? p.delta[stat + row_b] : 0.0f;

  cp_async_wait_all();
  __syncthreads();

  uint32_t qa[kKC][4], doa[kKC][4];
#pragma unroll
  for (int kc = 0; kc < kKC; ++kc) {
    ldmatrix_x4(qa[kc], a_addr<D>(s_q, w_row0, kc, lane));
    ldmatrix_x4(doa[kc], a_addr<D>(s_do, w_row0, kc, lane));
  }

  float dq[kDT][4];
#pragma unroll
  for (int i = 0; i < kDT; ++i) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.0f;

  for (int n = 0; n < n_tiles; ++n) {
    const int buf = n & 1;
    const int k0 = n * kQKeys;
    if (n + 1 < n_tiles) {
      const int64_t next = static_cast<int64_t>(k0 + kQKeys) * kv_stride;
      load_tile<D, kQKeys, kBwdThreads>(s_k + (buf ^ 1) * kKVTile, k_base + next, kv_stride, S - k0 - kQKeys, tid);
      load_tile<D, kQKeys, kBwdThreads>(s_v + (buf ^ 1) * kKVTile, v_base + next, kv_stride, S - k0 - kQKeys, tid);
      cp_async_commit();
    }
    const bool active = warp_has_rows && (!p.causal || k0 <= warp_last + diag);
    if (active) {
      const uint32_t k_tile = s_k + buf * kKVTile, v_tile = s_v + buf * kKVTile;
      float s[kNT][4], dp[kNT][4];
#pragma unroll
      for (int i = 0; i < kNT; ++i) {
        s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
        dp[i][0] = dp[i][1] = dp[i][2] = dp[i][3] = 0.0f;
      }
#pragma unroll
      for (int kc = 0; kc < kKC; ++kc) {
#pragma unroll
        for (int np = 0; np < kNT / 2; ++np) {
          uint32_t r[4];
          ldmatrix_x4(r, b_addr<D>(k_tile, np * 16, kc, lane));
          mma_bf16(s[2 * np], qa[kc], r[0], r[1]);
          mma_bf16(s[2 * np + 1], qa[kc], r[2], r[3]);
          ldmatrix_x4(r, b_addr<D>(v_tile, np * 16, kc, lane));
          mma_bf16(dp[2 * np], doa[kc], r[0], r[1]);
          mma_bf16(dp[2 * np + 1], doa[kc], r[2], r[3]);
        }
      }
      const bool need_mask = k0 + kQKeys > S || (p.causal && k0 + kQKeys - 1 > warp_first + diag);
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float pv = exp2_approx(s[nt][e] * p.scale_log2 - (e < 2 ? lse_a : lse_b));
          if (need_mask) {
            const int col = k0 + nt * 8 + 2 * (lane & 3) + (e & 1);
            const int row = e < 2 ? row_a : row_b;
            if (col >= S || (p.causal && col > row + diag)) pv = 0.0f;
          }
          s[nt][e] = pv * (dp[nt][e] - (e < 2 ? delta_a : delta_b));  // dS
        }
      }
#pragma unroll
      for (int kc = 0; kc < kQKeys / 16; ++kc) {
        uint32_t da[4];
        scores_to_a(da, s[2 * kc], s[2 * kc + 1]);
#pragma unroll
        for (int dpi = 0; dpi < D / 16; ++dpi) {
          uint32_t r[4];
          ldmatrix_x4_trans(r, bt_addr<D>(k_tile, kc * 16, dpi, lane));
          mma_bf16(dq[2 * dpi], da, r[0], r[1]);
          mma_bf16(dq[2 * dpi + 1], da, r[2], r[3]);
        }
      }
    }
    cp_async_wait_all();
    __syncthreads();
  }

  const int col0 = 2 * (lane & 3);
  if (row_a < T) {
    bf16_t* dst = p.dq + (static_cast<int64_t>(b) * T + row_a) * q_stride + static_cast<int64_t>(h) * D + col0;
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt)
      *reinterpret_cast<uint32_t*>(dst + dt * 8) = pack_bf16(dq[dt][0] * p.scale, dq[dt][1] * p.scale);
  }
  if (row_b < T) {
    bf16_t* dst = p.dq + (static_cast<int64_t>(b) * T + row_b) * q_stride + static_cast<int64_t>(h) * D + col0;
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt)
      *reinterpret_cast<uint32_t*>(dst + dt * 8) = pack_bf16(dq[dt][2] * p.scale, dq[dt][3] * p.scale);
  }
}

// dq = BF16(scale * dq_accum), four elements a thread (n is a multiple of 4: D is 64 or 128).
__global__ void attention_dq_convert_kernel(const float4* __restrict__ acc, uint2* __restrict__ dq, int64_t n4,
                                            float scale) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n4;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float4 v = acc[i];
    dq[i] = make_uint2(pack_bf16(v.x * scale, v.y * scale), pack_bf16(v.z * scale, v.w * scale));
  }
}

template <int D>
void launch_backward_atomic(cudaStream_t stream, const BwdParams& p, int64_t B, int64_t dq_numel, float* row_stats) {
  TESSERA_CUDA_CHECK(cudaMemsetAsync(p.dq_accum, 0, dq_numel * sizeof(float), stream));
  if (!attention_backward_wgmma() || !launch_backward_wgmma(stream, p, D, B, row_stats)) {
    constexpr int kv_smem = dkdv_smem_bytes<D>() + kDsBytes;
    const auto kernel = attention_backward_legacy() ? attention_dkdv_kernel<D, true> : attention_dkdv_kernel_v2<D, true>;
    TESSERA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kv_smem));
    const dim3 kv_grid(static_cast<unsigned>(B * p.Hkv), static_cast<unsigned>((p.S + kKVKeys - 1) / kKVKeys));
    kernel<<<kv_grid, kBwdThreads, kv_smem, stream>>>(p);
    TESSERA_CUDA_CHECK_LAUNCH();
  }
  const int64_t n4 = dq_numel / 4;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((n4 + 255) / 256, 132 * 16));
  attention_dq_convert_kernel<<<blocks, 256, 0, stream>>>(reinterpret_cast<const float4*>(p.dq_accum),
                                                          reinterpret_cast<uint2*>(p.dq), n4, p.scale);
  TESSERA_CUDA_CHECK_LAUNCH();
}

template <int D>
void launch_backward(cudaStream_t stream, const BwdParams& p, int64_t B, float* row_stats) {
  constexpr int kv_smem = dkdv_smem_bytes<D>(), q_smem = dq_smem_bytes<D>();
  // dK, dV: the wgmma kernel on Hopper at D = 128 (still one writer per element, so
  // deterministic): 230.5 against 214.0 TFLOP/s for the whole backward at B=4 H=32 T=4096
  // causal; at D = 64 it measured slower than the mma.sync kernel (119.6 against 134.9 at
  // B=16 H=12 T=1024, 145.1 against 173.5 at B=4 Hq=32 Hkv=8 T=2048; bench/RESULTS.md).
  if (D != 128 || !attention_backward_wgmma() || !launch_backward_wgmma(stream, p, D, B, row_stats, /*with_dq=*/false)) {
    const auto kernel =
        attention_backward_legacy() ? attention_dkdv_kernel<D, false> : attention_dkdv_kernel_v2<D, false>;
    TESSERA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kv_smem));
    const dim3 kv_grid(static_cast<unsigned>(B * p.Hkv), static_cast<unsigned>((p.S + kKVKeys - 1) / kKVKeys));
    kernel<<<kv_grid, kBwdThreads, kv_smem, stream>>>(p);
    TESSERA_CUDA_CHECK_LAUNCH();
  }
  TESSERA_CUDA_CHECK(cudaFuncSetAttribute(attention_dq_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, q_smem));
  const dim3 q_grid(static_cast<unsigned>(B * p.Hq), static_cast<unsigned>((p.T + kQRows - 1) / kQRows));
  attention_dq_kernel<D><<<q_grid, kBwdThreads, q_smem, stream>>>(p);
  TESSERA_CUDA_CHECK_LAUNCH();
}

int legacy_dkdv = -1;  // -1: not read from the environment yet
int wgmma_bwd = -1;

}  // namespace

bool attention_backward_legacy() {
  if (legacy_dkdv < 0) {
    const char* env = std::getenv("TESSERA_ATTN_BWD_LEGACY");
    legacy_dkdv = env != nullptr && env[0] == '1';
  }
  return legacy_dkdv == 1;
}
void set_attention_backward_legacy(bool legacy) { legacy_dkdv = legacy ? 1 : 0; }

bool attention_backward_wgmma() {
  if (wgmma_bwd < 0) {
    const char* env = std::getenv("TESSERA_ATTN_BWD_WGMMA");
    wgmma_bwd = !(env != nullptr && env[0] == '0');
  }
  return wgmma_bwd == 1;
}
void set_attention_backward_wgmma(bool on) { wgmma_bwd = on ? 1 : 0; }

void attention_backward_fast(void* stream, const Tensor& d_out, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& out, const Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv, bool causal,
                             float scale, bool deterministic) {
  const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), D = q.size(3), S = k.size(1), Hkv = k.size(2);
  if (B == 0 || Hq == 0 || S == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  if (T == 0) {  // no query sees any key: the key gradients are zero
    TESSERA_CUDA_CHECK(cudaMemsetAsync(dk.raw_data(), 0, dk.nbytes(), s));
    TESSERA_CUDA_CHECK(cudaMemsetAsync(dv.raw_data(), 0, dv.nbytes(), s));
    return;
  }
  // Scratch from the caching allocator: freed when this returns, reused in stream order.
  Tensor delta = Tensor::empty({B * Hq * T}, DType::F32, q.device());
  Tensor dq_accum;  // the atomic variant's F32 dQ, the same way
  if (!deterministic) dq_accum = Tensor::empty({dq.numel()}, DType::F32, q.device());
  attention_backward_delta(stream, d_out, out, delta);
  BwdParams p{static_cast<const bf16_t*>(q.raw_data()),
              static_cast<const bf16_t*>(k.raw_data()),
              static_cast<const bf16_t*>(v.raw_data()),
              static_cast<const bf16_t*>(d_out.raw_data()),
              lse.data<float>(),
              delta.data<float>(),
              static_cast<bf16_t*>(dq.raw_data()),
              static_cast<bf16_t*>(dk.raw_data()),
              static_cast<bf16_t*>(dv.raw_data()),
              static_cast<int>(T),
              static_cast<int>(S),
              static_cast<int>(Hq),
              static_cast<int>(Hkv),
              static_cast<int>(Hq / Hkv),
              scale,
              scale * kLog2e,
              causal,
              deterministic ? nullptr : dq_accum.data<float>()};
  // The wgmma kernel's padded row statistics (when it may run), from the caching allocator too.
  Tensor row_stats;
  if (attention_backward_wgmma() && backward_wgmma_runs(static_cast<int>(D)) && (!deterministic || D == 128))
    row_stats = Tensor::empty({backward_wgmma_scratch_floats(B, p)}, DType::F32, q.device());
  float* stats = row_stats.defined() ? row_stats.data<float>() : nullptr;
  if (!deterministic) {
    if (D == 64) launch_backward_atomic<64>(s, p, B, dq.numel(), stats);
    else launch_backward_atomic<128>(s, p, B, dq.numel(), stats);
  } else if (D == 64) {
    launch_backward<64>(s, p, B, stats);
  } else {
    launch_backward<128>(s, p, B, stats);
  }
}

void attention_backward(void* stream, const Tensor& d_out, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& out, const Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv, bool causal,
                        float scale) {
  if (attention_use_cudnn_backward(stream, d_out, q, k, v, out, lse, dq, dk, dv, causal, scale)) {
    cudnn_attention_backward(stream, d_out, q, k, v, out, lse, dq, dk, dv, causal, scale);
    return;
  }
  // tessera's kernels index packed [B, T, H, D] tensors: head slices of a fused QKV buffer
  // (and of its gradient) are packed first (cuDNN, above, takes them as they are).
  const bool packed = d_out.is_contiguous() && q.is_contiguous() && k.is_contiguous() && v.is_contiguous() &&
                      out.is_contiguous() && dq.is_contiguous() && dk.is_contiguous() && dv.is_contiguous();
  if (!packed) {
    const auto packed_like = [](Tensor& t) { return t.is_contiguous() ? t : Tensor::empty(t.shape(), t.dtype(), t.device()); };
    Tensor pdq = packed_like(dq), pdk = packed_like(dk), pdv = packed_like(dv);
    attention_backward(stream, d_out.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(), lse,
                       pdq, pdk, pdv, causal, scale);
    if (!dq.is_contiguous()) dq.copy_from(pdq);
    if (!dk.is_contiguous()) dk.copy_from(pdk);
    if (!dv.is_contiguous()) dv.copy_from(pdv);
    return;
  }
  if (attention_fast_path(q, k, lse, {&v, &d_out, &out, &dq, &dk, &dv}))
    attention_backward_fast(stream, d_out, q, k, v, out, lse, dq, dk, dv, causal, scale, attention_deterministic());
  else
    attention_backward_generic(stream, d_out, q, k, v, out, lse, dq, dk, dv, causal, scale);
}

}  // namespace tessera::cuda
