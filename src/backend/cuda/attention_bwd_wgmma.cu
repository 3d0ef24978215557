// Attention backward on Hopper's warpgroup MMA (wgmma), for BF16 with head dim 64 or 128: the
// gradients of attention_fwd_wgmma.cu's forward. With P = exp2(scale_log2 * Q K^T - lse log2 e)
// rebuilt from the saved lse and Delta = rowsum(dO * O) (computed before, attention_generic.cu):
//   dV = P^T dO,  dS = P * (dO V^T - Delta),  dK = scale * dS^T Q,  dQ = scale * dS K.
// dK and dV are written as BF16; dQ is added, unscaled, into an F32 buffer (FlashAttention-2's
// and -3's way: 5 products, no dQ pass, dQ's last bits depend on the order of the adds). The
// caller zeroes the buffer first and converts it after (attention_bwd.cu).
//
// Layout (attention_bwd_wgmma.h): q, d_out, dq_accum [B, T, Hq, D]; k, v, dk, dv [B, S, Hkv, D];
// lse, delta [B, Hq, T] F32; contiguous; bottom-right causal alignment (query i sees keys
// j <= i + S - T).
//
// Structure (sm_90a): a CTA owns 128 keys of one (batch, kv head) and is two consumer
// warpgroups of 64 keys each plus a producer warpgroup that hands them its registers
// (setmaxnreg: 240 a consumer thread); each consumer thread keeps its share of its warpgroup's
// dK and dV (64 keys x D in FP32: 2 x 64 registers at D = 128) for the whole kernel. One
// producer thread loads K and V once and then, for every 64-row query tile of every query
// head of the GQA group, Q and dO (TMA, 128-byte swizzle) and that tile's lse (times log2 e)
// and Delta (bulk copies from a padded copy made first) into a two-stage ring. Per query
// tile, each consumer warpgroup computes, keys as the M dimension:
//   S^T = K Q^T, dP^T = V dO^T    wgmma m64n64, both operands K-major from shared memory;
//   P^T = exp2(S^T scale_log2 - lse), masked on causal-diagonal and sequence-end tiles;
//   dV += P^T dO                  register-A wgmma (P^T straight from the score registers, as
//                                 the forward's P V) with dO read MN-major (transpose bit);
//   dS^T = P^T * (dP^T - Delta)   written to shared memory as BF16 rows of 64 queries per key;
//   dK += dS^T Q                  dS^T read back K-major, Q MN-major;
//   dQ += dS K                    at D = 128 warpgroup w takes head-dim columns 64 w .. over all
//                                 128 keys (both warpgroups' dS^T tiles, read as dS MN-major, a
//                                 barrier of the CTA between); at D = 64 each warpgroup all
//                                 columns over its own keys. The FP32 block goes through shared
//                                 memory to bulk reduce-adds (cp.reduce.async.bulk), a row each.
// At D = 64, query tiles a warpgroup's keys are all hidden from (causal) are skipped. With
// kDq = false (launch_backward_wgmma's with_dq) the kernel stops after dK: the deterministic
// backward's dK/dV pass at D = 128, its dQ coming from attention_bwd.cu's own pass.
//
// Floor: FlashAttention's count, 2.5x the forward's 4 B Hq T S D (halved when causal), over
// ~989 TFLOP/s BF16 dense. Speed, H200 (2026-12-01, causal; bench/RESULTS.md, twelfth
// session): B=4 H=32 T=4096 D=128 backward 321 TFLOP/s in bench_attention (340-346 alone in
// attention_bwd_probe, 34% of the peak), against 302 for the same kernel without the producer
// warpgroup (256 threads, 255 registers, thread 0 loading) and 225 for the mma.sync kernel
// with atomic dQ; D = 64: 166 (B=16 H=12 T=1024) and 210 (B=4 Hq=32 Hkv=8 T=2048). What was
// measured on the way (probe, D = 128):
//   - the first producer version spilled ~1 KB and serialised every wgmma (C7512): the
//     trap in mbar_wait's hang guard makes ptxas fit what is live at it into the launch-bound
//     168 registers, whatever setmaxnreg grants. The consumers now wait without a trap
//     (mbar_wait<true>) and ptxas uses up to R237 with no spill;
//   - every consumer thread arrives on a stage's "empty" barrier, not lane 0 after a
//     __syncwarp: with lane-0 arrivals compute-sanitizer racecheck reports the producer's
//     lse/Delta bulk copies against the other lanes' reads (it does not take __syncwarp plus
//     one arrival as ordering them); with all threads arriving it reports nothing, at the
//     same speed.
// The 256-thread version (no producer), measured before the trap was found:
//   - dQ over each warpgroup's own keys (no barrier between the warpgroups, twice the adds):
//     272 against 293 TFLOP/s for the split by columns;
//   - 16-byte atomics from registers (red.global.add.v4.f32) instead of the bulk reduces:
//     283 against 291; 8-byte ones: 238 (with the own-keys dQ);
//   - issuing the next tile's S^T and dP^T behind dK and dQ (software pipelining, registers
//     permitting: 250): no faster (295-301 against 293-303), and slower at D = 64;
//   - dQ of each tile one tile late, behind mbarriers instead of the barrier of the CTA (three
//     dS^T buffers), so that the warpgroups drift apart: no faster either (301-305 against
//     303-305).
// Where the time goes, roughly: per tile and SM the products need ~2560 tensor-core cycles
// and ~2100 cycles of shared-memory reads (the m64n64 products with both operands in shared
// memory, S^T, dP^T and dQ, read 4 KB per 131 kFLOP: 32 cycles either way), but a tile takes
// ~7600 at 340 TFLOP/s: each warpgroup's chain of products, softmax and stores is
// latency-bound and two warpgroups hide only part of it. Next: retry the pipelined schedule
// above with the 240 registers the producer now gives.
#include <cuda.h>  // CUtensorMap
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "attention_bwd_wgmma.h"
#include "backend/cuda/sm90_ptx.cuh"
#include "backend/cuda/tensor_map.h"
#include "cuda_check.h"

namespace tessera::cuda::attn {

namespace {

using namespace sm90;

constexpr int kWgKeys = 64;                    // keys per consumer warpgroup (wgmma's M)
constexpr int kConsumers = 2;                  // consumer warpgroups
constexpr int kKeys = kWgKeys * kConsumers;    // keys per CTA
constexpr int kRows = 64;                      // query rows per step
constexpr int kThreads = (kConsumers + 1) * 128;  // + a producer warpgroup
// The producer hands its registers to the consumers (setmaxnreg): 2 x 128 x 240 + 128 x 24 =
// 64512 of 65536. dK + dV are 128 a thread at D = 128, a step's scores 64 more.
constexpr int kConsumerRegisters = 240;
constexpr int kProducerRegisters = 24;
constexpr int kStages = 2;
constexpr bool kSplitDqAt128 = true;
constexpr int kDqStride = 72;  // floats per row of a staged dQ block: 64 + 8 so that the stores are conflict-free

template <int D>
struct BwdConfig {
  static constexpr int kBoxes = D / 64;                   // 64-column TMA boxes across the head dim
  static constexpr uint32_t kKVBox = kKeys * 128;         // one box of the K or V tile: [128 keys][128 B]
  static constexpr uint32_t kKVBytes = kKeys * D * 2;
  static constexpr uint32_t kRowBox = kRows * 128;        // one box of a Q or dO tile: [64 rows][128 B]
  static constexpr uint32_t kRowBytes = kRows * D * 2;
  static constexpr uint32_t kDsBytes = kWgKeys * kRows * 2;  // one warpgroup's dS^T: [64 keys][64 queries]
  static constexpr uint32_t kDqBytes = kRows * kDqStride * 4;  // one warpgroup's staged 64 x 64 dQ block
  // K, V; Q and dO per stage; dS^T twice per warpgroup (see the step loop); a dQ block per
  // warpgroup. + 1 KiB so every tile starts on a 1024-byte boundary (the swizzle pattern's
  // period). D = 128: 197 KiB.
  static constexpr int kSmem =
      2 * kKVBytes + kStages * 2 * kRowBytes + 2 * kConsumers * kDsBytes + kConsumers * kDqBytes + 1024;
  static constexpr uint32_t kStepBytes = 2 * kRowBytes + 2 * kRows * 4;  // Q, dO, lse, Delta
};

// The step sequence a CTA walks (producer and consumers alike): for each query head of the
// kv head's group, the query tiles m_first .. n_m - 1 that can see any key of the CTA.
struct Steps {
  int m_first, per_head, total;
  __device__ Steps(const BwdParams& p, int key0) {
    const int diag = p.S - p.T;
    const int first_row = p.causal ? max(0, key0 - diag) : 0;  // the first query that sees key0
    m_first = first_row / kRows;
    per_head = first_row < p.T ? (p.T + kRows - 1) / kRows - m_first : 0;
    total = per_head * p.group;
  }
  __device__ int head(int t, int kvh, int group) const { return kvh * group + t / per_head; }
  __device__ int row0(int t) const { return (m_first + t % per_head) * kRows; }
};

// acc (+)= A B^T over K = D for a 64-row slice of the K or V tile (a_rows: its first row in
// box 0) against a Q or dO tile (b_rows): both K-major, 16 columns = +32 bytes inside a
// swizzled row, every 64 columns the next box. Issued and committed, not waited for.
template <int D>
__device__ __forceinline__ void issue_scores_t(float (&acc)[32], uint32_t a_rows, uint32_t b_rows) {
  using C = BwdConfig<D>;
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const uint32_t box = kk / 4, in_row = (kk % 4) * 32;
    wgmma_m64n64k16_bf16_ss<0, 0>(acc, make_desc_sw128(a_rows + box * C::kKVBox + in_row),
                                  make_desc_sw128(b_rows + box * C::kRowBox + in_row), kk > 0);
  }
  wgmma_commit();
}

// acc[64 keys x D] += A[64 keys x 64 rows] X[64 rows x D], X a Q or dO tile read MN-major
// (16 rows further = +2048 bytes). A in registers (k-slice j is a[4 j .. 4 j + 3]): dV's P^T.
template <int D>
__device__ __forceinline__ void issue_grad(float (&acc)[D / 2], const uint32_t (&a)[16], uint32_t x_tile) {
  using C = BwdConfig<D>;
  wgmma_fence();
#pragma unroll
  for (int j = 0; j < kRows / 16; ++j) {
    const uint64_t dx = make_desc_sw128_mn(x_tile + j * 2048, C::kRowBox);
    if constexpr (D == 128) wgmma_m64n128k16_bf16_rs_tb(acc, a[4 * j], a[4 * j + 1], a[4 * j + 2], a[4 * j + 3], dx, 1);
    else wgmma_m64n64k16_bf16_rs_tb(acc, a[4 * j], a[4 * j + 1], a[4 * j + 2], a[4 * j + 3], dx, 1);
  }
  wgmma_commit();
}

// The same with A from shared memory: dK's dS^T, from the warpgroup's dS^T tile (rows of 64
// queries per key: K-major, 16 queries = +32 bytes inside a row). Reading it back instead of
// keeping it in registers frees 16 registers a thread while dK and dQ run.
template <int D>
__device__ __forceinline__ void issue_grad_ss(float (&acc)[D / 2], uint32_t s_a, uint32_t x_tile) {
  using C = BwdConfig<D>;
  wgmma_fence();
#pragma unroll
  for (int j = 0; j < kRows / 16; ++j) {
    const uint64_t da = make_desc_sw128(s_a + j * 32);
    if constexpr (D == 128) {
      wgmma_m64n128k16_bf16<1, 0>(acc, da, make_desc_sw128_mn(x_tile + j * 2048, C::kRowBox), 1);
    } else {
      wgmma_m64n64k16_bf16_ss<0, 1>(acc, da, make_desc_sw128_mn64(x_tile + j * 2048), 1);
    }
  }
  wgmma_commit();
}

// dq[64 rows x 64 columns] = dS[64 rows x 16 kSteps keys] K[16 kSteps keys x 64 columns], for
// one 64-column box of the head dim. dS comes from dS^T tiles (rows of 64 queries per key:
// MN-major), K from the rows of that box of the K tile (MN-major along D); 16 keys further =
// 16 rows = +2048 bytes in both.
template <int kSteps>
__device__ __forceinline__ void issue_dq_box(float (&dq)[32], uint32_t s_ds, uint32_t k_box) {
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk)
    wgmma_m64n64k16_bf16_ss<1, 1>(dq, make_desc_sw128_mn64(s_ds + kk * 2048), make_desc_sw128_mn64(k_box + kk * 2048),
                                  kk > 0);
  wgmma_commit();
}

// dS^T (FP32 in the accumulator layout: ds[2 i], ds[2 i + 1] is key row kl + 8 (i % 2),
// queries 8 (i / 2) + c2 and + 1, kl = 16 warp + lane / 4) as BF16 into a [64 keys][64 queries]
// tile: 128-byte rows, 16-byte chunk c at c ^ (kl % 8) (the TMA swizzle the descriptors expect).
// Conflict-free: the 8 rows of a store land in 8 different chunks.
__device__ __forceinline__ void store_ds_t(uint32_t s_ds, const float (&ds)[32], int warp, int lane) {
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int kl = warp * 16 + lane / 4 + 8 * (i % 2), chunk = i / 2;
    st_shared_u32(s_ds + kl * 128 + ((chunk ^ (kl % 8)) << 4) + 4 * (lane % 4), pack_bf16(ds[2 * i], ds[2 * i + 1]));
  }
}

__device__ __forceinline__ void store_zero_ds_t(uint32_t s_ds, int warp, int lane) {
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int kl = warp * 16 + lane / 4 + 8 * (i % 2), chunk = i / 2;
    st_shared_u32(s_ds + kl * 128 + ((chunk ^ (kl % 8)) << 4) + 4 * (lane % 4), 0u);
  }
}

// Adds a 64 x 64 dQ block (wgmma accumulator layout: dq[4 j + {0, 1}] is row lane / 4 of the
// warp's 16, columns 8 j + 2 (lane % 4) + {0, 1}; dq[4 j + {2, 3}] the row 8 below) to `at`
// (row 0, column 0 of the block; rows `stride` floats apart; rows >= valid_rows skipped).
// Each warp stages its 16 rows in shared memory (s_dq: kDqStride floats a row) and 16 of its
// lanes hand one row each (256 bytes) to the TMA unit as a bulk FP32 reduce-add. Measured
// against 16-byte atomics from registers (red.global.add.v4.f32): those made the L2 apply
// 16 operations per row segment and cost ~a fifth of the kernel's time.
__device__ __forceinline__ void add_dq_box(float* at, int64_t stride, int valid_rows, const float (&dq)[32],
                                           uint32_t s_dq, int warp, int lane) {
  if (lane < 16) bulk_wait_read<0>();  // this warp's reduce of the previous step has read its rows
  __syncwarp();
  const int row = warp * 16 + lane / 4;
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const uint32_t addr = s_dq + ((row + 8 * r) * kDqStride + 8 * j + 2 * (lane % 4)) * 4;
      asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(dq[4 * j + 2 * r]), "f"(dq[4 * j + 2 * r + 1])
                   : "memory");
    }
  fence_proxy_async_shared();
  __syncwarp();
  if (lane < 16) {
    const int my_row = warp * 16 + lane;
    if (my_row < valid_rows) bulk_reduce_add_f32(at + my_row * stride, s_dq + my_row * kDqStride * 4, 64 * 4);
    bulk_commit();
  }
}

// The padded per-row statistics the kernel copies beside each Q tile: lse2 = lse log2 e
// (+inf past T and for rows that see no key, so that P = exp2(.. - lse2) is 0 there) and
// Delta (0 past T), [B Hq][T_pad] with T_pad a multiple of kRows, so that a step's 64 values
// are one aligned 256-byte bulk copy.
__global__ void backward_row_stats_kernel(const float* __restrict__ lse, const float* __restrict__ delta,
                                          float* __restrict__ lse2, float* __restrict__ delta_pad, int64_t rows,
                                          int T, int T_pad) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < rows * T_pad;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t bh = i / T_pad;
    const int t = static_cast<int>(i % T_pad);
    const float l = t < T ? lse[bh * T + t] : -INFINITY;
    lse2[i] = l == -INFINITY ? INFINITY : l * kLog2e;
    delta_pad[i] = t < T ? delta[bh * T + t] : 0.0f;
  }
}

// kDq = false: dK and dV only (the deterministic backward computes dQ in a pass of its own);
// kSplitDq: see the dQ product in the step loop.
template <int D, bool kDq, bool kSplitDq>
__global__ void __launch_bounds__(kThreads, 1)
    attention_bwd_wgmma_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                               const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_do,
                               const BwdParams p, const float* __restrict__ lse2, const float* __restrict__ delta_pad,
                               int T_pad) {
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __trap();  // wgmma exists only on sm_90a; the host side checks the device.
#else
  using C = BwdConfig<D>;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t kv_full;
  __shared__ __align__(8) uint64_t full[kStages];
  __shared__ __align__(8) uint64_t empty[kStages];
  __shared__ __align__(16) float lse_log2[kStages][kRows];
  __shared__ __align__(16) float delta_s[kStages][kRows];

  const uint32_t s_k = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const uint32_t s_v = s_k + C::kKVBytes;
  const uint32_t s_q0 = s_v + C::kKVBytes;
  const uint32_t s_do0 = s_q0 + kStages * C::kRowBytes;
  const uint32_t s_ds0 = s_do0 + kStages * C::kRowBytes;
  const uint32_t s_dq0 = s_ds0 + 2 * kConsumers * C::kDsBytes;

  const int b = blockIdx.x / p.Hkv, kvh = blockIdx.x % p.Hkv;
  const int key0 = blockIdx.y * kKeys;  // launch order puts the heaviest causal key blocks first
  const int T = p.T, S = p.S, diag = S - T;
  const Steps steps(p, key0);

  if (threadIdx.x == 0) {
    mbar_init(smem_addr(&kv_full), 1);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(smem_addr(&full[s]), 1);
      mbar_init(smem_addr(&empty[s]), kConsumers * 128);  // every consumer thread arrives
    }
    mbar_fence_init();
  }
  __syncthreads();

  // The producer warpgroup: one thread loads K and V once, then step n's Q, dO, lse2 and
  // Delta into stage n % kStages once every consumer thread has released that stage's previous
  // step.
  if (threadIdx.x / 128 == kConsumers) {
    regs_dealloc<kProducerRegisters>();
    if (threadIdx.x == kConsumers * 128) {
      const uint32_t kvf = smem_addr(&kv_full);
      mbar_arrive_expect_tx(kvf, 2 * C::kKVBytes);
#pragma unroll
      for (int j = 0; j < C::kBoxes; ++j) {
        tma_load_4d(s_k + j * C::kKVBox, &tm_k, kvf, 64 * j, kvh, key0, b);
        tma_load_4d(s_v + j * C::kKVBox, &tm_v, kvf, 64 * j, kvh, key0, b);
      }
      for (int n = 0; n < steps.total; ++n) {
        const int s = n % kStages;
        mbar_wait(smem_addr(&empty[s]), ((n / kStages) & 1) ^ 1);  // first lap: passes at once
        const int h = steps.head(n, kvh, p.group), m0 = steps.row0(n);
        const uint32_t f = smem_addr(&full[s]);
        mbar_arrive_expect_tx(f, C::kStepBytes);
#pragma unroll
        for (int j = 0; j < C::kBoxes; ++j) {
          tma_load_4d(s_q0 + s * C::kRowBytes + j * C::kRowBox, &tm_q, f, 64 * j, h, m0, b);
          tma_load_4d(s_do0 + s * C::kRowBytes + j * C::kRowBox, &tm_do, f, 64 * j, h, m0, b);
        }
        const int64_t row = (static_cast<int64_t>(b) * p.Hq + h) * T_pad + m0;
        bulk_load(smem_addr(&lse_log2[s][0]), lse2 + row, kRows * 4, f);
        bulk_load(smem_addr(&delta_s[s][0]), delta_pad + row, kRows * 4, f);
      }
    }
    return;
  }
  regs_alloc<kConsumerRegisters>();

  const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int key_base = key0 + wg * kWgKeys;        // this warpgroup's first key
  const int key_a = key_base + warp * 16 + lane / 4;  // the thread's score rows: key_a and key_a + 8
  const int c2 = 2 * (lane % 4);
  const uint32_t k_rows = s_k + wg * kWgKeys * 128, v_rows = s_v + wg * kWgKeys * 128;

  float dk[D / 2], dv[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.0f;

  // The consumers' waits must not trap (sm90_ptx.cuh, mbar_wait): that would cost them the
  // registers setmaxnreg gave them.
  mbar_wait<true>(smem_addr(&kv_full), 0);
  for (int t = 0; t < steps.total; ++t) {
    const int s = t % kStages;
    const int h = steps.head(t, kvh, p.group), m0 = steps.row0(t);
    const uint32_t s_q = s_q0 + s * C::kRowBytes, s_do = s_do0 + s * C::kRowBytes;
    mbar_wait<true>(smem_addr(&full[s]), (t / kStages) & 1);
    auto release = [&] {
      // Every thread arrives after its own reads of the stage (its lse/Delta loads included),
      // rather than lane 0 after __syncwarp: the release is then the reading thread's own.
      mbar_arrive(smem_addr(&empty[s]));
    };
    // This step's two dS^T tiles (one per warpgroup, [64 keys][64 queries] each, so together
    // the CTA's 128 keys in order), double-buffered by step: a warpgroup that runs ahead into
    // the next step cannot overwrite what the other's dQ product of this step still reads,
    // since neither passes the next step's barrier before both finished this one.
    const uint32_t s_ds_pair = s_ds0 + (t & 1) * kConsumers * C::kDsBytes;
    const uint32_t s_ds = s_ds_pair + wg * C::kDsBytes;

    // No key of this warpgroup is seen by these rows (causal), or it has no keys at all.
    const bool idle = key_base >= S || (p.causal && key_base > m0 + kRows - 1 + diag);
    if (idle && !(kDq && kSplitDq)) {
      release();
      continue;
    }
    if (!idle) {
      // Declared here, not outside the loop: the first wgmma of each product reads its
      // accumulators ("+f"), which would otherwise keep last step's values live across the
      // whole step.
      float st[32], dpt[32];
      uint32_t pa[16];
      issue_scores_t<D>(st, k_rows, s_q);
      issue_scores_t<D>(dpt, v_rows, s_do);
      wgmma_wait<1>();
      fence_registers(st);

      // P^T in place of S^T. st[i] is key key_a + 8 ((i / 2) % 2), query m0 + 8 (i / 4) + c2 + i % 2.
      const bool edge = key_base + kWgKeys > S || (p.causal && key_base + kWgKeys - 1 > m0 + diag);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float2 l = *reinterpret_cast<const float2*>(&lse_log2[s][8 * j + c2]);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = 4 * j + e;
          st[i] = exp2_approx(fmaf(st[i], p.scale_log2, -(e % 2 ? l.y : l.x)));
          if (edge) {
            const int key = key_a + 8 * (e / 2), q = m0 + 8 * j + c2 + e % 2;
            if (key >= S || (p.causal && key > q + diag)) st[i] = 0.0f;
          }
        }
      }
#pragma unroll
      for (int i = 0; i < 16; ++i) pa[i] = pack_bf16(st[2 * i], st[2 * i + 1]);
      issue_grad<D>(dv, pa, s_do);
      wgmma_wait<1>();  // dP^T is done; dV may still run
      fence_registers(dpt);

#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float2 dl = *reinterpret_cast<const float2*>(&delta_s[s][8 * j + c2]);
#pragma unroll
        for (int e = 0; e < 4; ++e) st[4 * j + e] *= dpt[4 * j + e] - (e % 2 ? dl.y : dl.x);
      }
      store_ds_t(s_ds, st, warp, lane);
      wgmma_wait<0>();  // dV is done
      fence_registers(dv);
      fence_registers(pa);
    } else {
      store_zero_ds_t(s_ds, warp, lane);  // the other warpgroup's dQ product reads it
    }
    fence_proxy_async_shared();
    if constexpr (kDq && kSplitDq) bar_sync(1, kConsumers * 128);
    else bar_sync(1 + wg, 128);
    if (!idle) issue_grad_ss<D>(dk, s_ds, s_q);
    if constexpr (!kDq) {
      wgmma_wait<0>();
      fence_registers(dk);
      release();
      continue;
    }

    // dQ += dS K, one 64-column box of the head dim at a time. kSplitDq: warpgroup wg takes
    // box wg over all 128 keys (both dS^T tiles); otherwise every box over its own 64 keys.
    float* dq_block = p.dq_accum + (static_cast<int64_t>(b) * T + m0) * p.Hq * D + static_cast<int64_t>(h) * D;
    constexpr int kMyBoxes = kSplitDq ? 1 : C::kBoxes;
#pragma unroll
    for (int i = 0; i < kMyBoxes; ++i) {
      const int box = kSplitDq ? wg : i;
      float dq[32];
      if constexpr (kSplitDq) issue_dq_box<kKeys / 16>(dq, s_ds_pair, s_k + box * C::kKVBox);
      else issue_dq_box<kWgKeys / 16>(dq, s_ds, k_rows + box * C::kKVBox);
      if (i == 0) {
        wgmma_wait<1>();  // dK, the last reader of this stage's Q, is done
        fence_registers(dk);
        release();
      }
      wgmma_wait<0>();
      fence_registers(dq);
      add_dq_box(dq_block + 64 * box, static_cast<int64_t>(p.Hq) * D, T - m0, dq, s_dq0 + wg * C::kDqBytes, warp,
                 lane);
    }
  }
  if (lane < 16) bulk_wait<0>();  // the last reduces have read their rows before the CTA ends

  // dK = scale * sum dS^T Q, dV = sum P^T dO, rows key_a and key_a + 8.
  const int64_t kv_stride = static_cast<int64_t>(p.Hkv) * D;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = key_a + 8 * r;
    if (key >= S) continue;
    const int64_t off = (static_cast<int64_t>(b) * S + key) * kv_stride + static_cast<int64_t>(kvh) * D + c2;
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      *reinterpret_cast<uint32_t*>(p.dk + off + 8 * j) =
          pack_bf16(dk[4 * j + 2 * r] * p.scale, dk[4 * j + 2 * r + 1] * p.scale);
      *reinterpret_cast<uint32_t*>(p.dv + off + 8 * j) = pack_bf16(dv[4 * j + 2 * r], dv[4 * j + 2 * r + 1]);
    }
  }
#endif
}

template <int D>
void launch(cudaStream_t stream, const BwdParams& p, int64_t batch, float* stats, bool with_dq) {
  using C = BwdConfig<D>;
  constexpr const char* kWho = "attention backward (wgmma)";
  const CUtensorMap tm_q = make_bhd_tensor_map(p.q, batch, p.T, p.Hq, D, kRows, kWho);
  const CUtensorMap tm_do = make_bhd_tensor_map(p.d_out, batch, p.T, p.Hq, D, kRows, kWho);
  const CUtensorMap tm_k = make_bhd_tensor_map(p.k, batch, p.S, p.Hkv, D, kKeys, kWho);
  const CUtensorMap tm_v = make_bhd_tensor_map(p.v, batch, p.S, p.Hkv, D, kKeys, kWho);

  // The padded row statistics, into the caller's scratch.
  const int T_pad = (p.T + kRows - 1) / kRows * kRows;
  const int64_t rows = batch * p.Hq, n = rows * T_pad;
  const unsigned stat_blocks = static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 132 * 8));
  backward_row_stats_kernel<<<stat_blocks, 256, 0, stream>>>(p.lse, p.delta, stats, stats + n, rows, p.T, T_pad);
  TESSERA_CUDA_CHECK_LAUNCH();

  auto kernel = with_dq ? attention_bwd_wgmma_kernel<D, true, kSplitDqAt128 && D == 128>
                        : attention_bwd_wgmma_kernel<D, false, false>;
  TESSERA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem));
  const dim3 grid(static_cast<unsigned>(batch * p.Hkv), static_cast<unsigned>((p.S + kKeys - 1) / kKeys));
  kernel<<<grid, kThreads, C::kSmem, stream>>>(tm_q, tm_k, tm_v, tm_do, p, stats, stats + n, T_pad);
  TESSERA_CUDA_CHECK_LAUNCH();
}

}  // namespace

int64_t backward_wgmma_scratch_floats(int64_t batch, const BwdParams& p) {
  const int64_t T_pad = (p.T + kRows - 1) / kRows * kRows;
  return 2 * batch * p.Hq * T_pad;  // lse2, then Delta
}

bool backward_wgmma_runs(int D) {
  int device = 0;
  return (D == 64 || D == 128) && cudaGetDevice(&device) == cudaSuccess && device_is_hopper(device);
}

bool launch_backward_wgmma(cudaStream_t stream, const BwdParams& p, int D, int64_t batch, float* row_stats,
                           bool with_dq) {
  if (!backward_wgmma_runs(D)) return false;
  TESSERA_CHECK(row_stats != nullptr, "attention backward (wgmma): no scratch for the row statistics");
  if (D == 64) launch<64>(stream, p, batch, row_stats, with_dq);
  else launch<128>(stream, p, batch, row_stats, with_dq);
  return true;
}

}  // namespace tessera::cuda::attn
