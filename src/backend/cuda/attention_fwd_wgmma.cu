// Attention forward on Hopper's warpgroup MMA (wgmma), for BF16 with head dim 64 or 128:
// out = softmax(scale * Q K^T) V and lse = log-sum-exp of each score row, FP32 accumulation,
// no T x S matrix in memory. Variants 16-23 of attention_forward_fast (attention.h, one per
// schedule below); 19 is the default at D = 128 on Hopper.
//
// Layout as attention_fwd.cu: q, out [B, T, Hq, D]; k, v [B, S, Hkv, D]; lse [B, Hq, T] F32;
// contiguous, 16-byte aligned; query head h reads kv head h / (Hq / Hkv); causal masking is
// bottom-right aligned (query i sees keys j <= i + S - T).
//
// Structure (sm_90a): a CTA owns 128 query rows of one (batch, head) and is two consumer
// warpgroups and a producer warp. One thread of the producer warp loads tiles with TMA (4-D
// tensor maps over [B, T, H, D], 64-column boxes, 128-byte swizzle; rows past T or S arrive
// as zeros): Q once, then K and V tiles of BN keys (128; 96 or 80 in schedules 4-7) into a
// two-stage ring guarded by mbarriers (K and V on separate "full" barriers, so the scores
// start before V lands). Each consumer warpgroup owns 64 query rows and, per key tile:
//   S = Q K^T      8 (D = 128) or 4 wgmma m64n128k16 from shared memory, 64 FP32 a thread;
//   online softmax in registers (scale, mask the edge tiles, row max over the quad of lanes
//                  holding a row, exp2, row sums of the unrounded P, rescale O);
//   O += P V       8 wgmma with A = P straight from the score registers (the accumulator
//                  layout is wgmma's register-A layout once packed to BF16 pairs) and B = V
//                  read MN-major (transpose bit) from shared memory;
// then frees the stage (one arrival per consumer warp). In the serial schedules the two
// consumer warpgroups run independently, so one's softmax overlaps the other's MMAs; the
// pipelined ones (FlashAttention-3's) also overlap a warpgroup's own softmax with its P V. CTAs launch heaviest causal
// query blocks first; tiles past the CTA's causal limit are never loaded.
//
// Floor: 4 * B * Hq * T * S * D FLOPs (half of it causal) over ~989 TFLOP/s BF16 dense.
// Speed, H200 (2026-11-30, bench_attention 20, causal; bench/RESULTS.md): B=4 H=32 T=4096
// D=128 438-456 TFLOP/s (44-46% of the peak), against the mma.sync default's 309-313 and
// PyTorch's FlashAttention-2 backend's 315 in the same run (cuDNN: 584-602). The default
// schedule is kSerialFolded (variant 19: 455.0 against kSerial's 449.6 in one run). At
// D = 64: 204 (B=16 H=12 T=1024) and 272 (B=4 Hq=32 Hkv=8 T=2048), against 221 and 259 for
// variant 9, which stays the D = 64 default.
// The pipelined schedules all measured slower at D = 128: on 128-key tiles (variants 17, 18:
// 305 and 274 TFLOP/s) they spill and ptxas serialises their wgmmas ("insufficient register
// resources", C7512; see kThreads); on 96- and 80-key tiles (20-23) they fit and stay
// asynchronous, yet reach only 270-309, most likely because with two stages the load of
// tile n + 2 cannot start until tile n is released, by which time tile n + 1 is already
// being used: the next thing to try is a third stage (176 KiB at 96 keys).
#include <cuda.h>  // CUtensorMap
#include <cuda_runtime.h>

#include <cmath>
#include <type_traits>

#include "attention_common.cuh"
#include "attention_fwd_variants.h"
#include "backend/cuda/sm90_ptx.cuh"
#include "backend/cuda/tensor_map.h"
#include "cuda_check.h"

namespace tessera::cuda::attn {

namespace {

using namespace sm90;

constexpr int kWgRows = 64;                   // query rows per consumer warpgroup (wgmma's M)
constexpr int kConsumers = 2;                 // consumer warpgroups
constexpr int kBlockM = kWgRows * kConsumers;  // query rows per CTA
// The producer is one warp, not a warpgroup. Registers are 168 a thread either way: the GPU
// allocates them per warpgroup (288 threads count as 384: a kernel built for 186 registers
// failed to launch), and in a 384-thread version whose producer hands its registers over
// with setmaxnreg, ptxas still spilled the pipelined 128-key schedules (it used registers
// up to R174 in the consumer code, then spilled and serialised). Those schedules keep O,
// the scores and P live at once (~180 registers at D = 128); the 96- and 80-key tiles fit.
constexpr int kThreads = kConsumers * 128 + 32;
constexpr int kStages = 2;

// BN: keys per tile (128, or 96 / 80 for the pipelined schedules: fewer score registers).
template <int D, int BN>
struct WgConfig {
  static_assert(BN == 128 || BN == 96 || BN == 80, "the key tiles issue_scores has a wgmma for");
  static constexpr int kBoxes = D / 64;                 // 64-column TMA boxes across the head dim
  static constexpr uint32_t kQBytes = kBlockM * D * 2;  // [box][128 rows][128 B]
  static constexpr uint32_t kKVBytes = BN * D * 2;      // one K or V tile: [box][BN rows][128 B]
  static constexpr uint32_t kQBox = kBlockM * 128;      // bytes of one Q box
  static constexpr uint32_t kKVBox = BN * 128;
  // + 1 KiB so the tiles start on a 1024-byte boundary (the swizzle pattern's period).
  static constexpr int kSmem = kQBytes + 2 * kStages * kKVBytes + 1024;
};

// The per-thread state of a consumer warpgroup's online softmax: rows row_a and row_a + 8.
struct RowState {
  float m[2] = {-INFINITY, -INFINITY};  // running max of the scaled (log2-domain) scores
  float l[2] = {0.0f, 0.0f};            // this thread's part of the running sum of exp2
};

// S = Q K^T for one key tile, issued and committed (not waited for): both K-major; a K step
// of 16 is +32 bytes inside a 128-byte swizzled row, and every 64 columns the next box.
template <int D, int BN>
__device__ __forceinline__ void issue_scores(float (&sc)[BN / 2], uint32_t q_rows, uint32_t s_k) {
  using C = WgConfig<D, BN>;
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const uint32_t box = kk / 4, in_row = (kk % 4) * 32;
    const uint64_t da = make_desc_sw128(q_rows + box * C::kQBox + in_row);
    const uint64_t db = make_desc_sw128(s_k + box * C::kKVBox + in_row);
    if constexpr (BN == 128) wgmma_m64n128k16_bf16<0>(sc, da, db, kk > 0);
    else if constexpr (BN == 96) wgmma_m64n96k16_bf16_ss(sc, da, db, kk > 0);
    else wgmma_m64n80k16_bf16_ss(sc, da, db, kk > 0);
  }
  wgmma_commit();
}

// O += P V for one key tile, issued and committed: V is [keys][D] with D contiguous, so
// MN-major; 16 keys further = 16 rows of 128 bytes = +2048 bytes, and the 64-column boxes
// are kKVBox apart. P's k-slice j (keys 16 j ..) is pa[4 j .. 4 j + 3].
template <int D, int BN>
__device__ __forceinline__ void issue_pv(float (&o)[D / 2], const uint32_t (&pa)[BN / 4], uint32_t s_v) {
  using C = WgConfig<D, BN>;
  wgmma_fence();
#pragma unroll
  for (int j = 0; j < BN / 16; ++j) {
    const uint64_t dv = make_desc_sw128_mn(s_v + j * 2048, C::kKVBox);
    if constexpr (D == 128) {
      wgmma_m64n128k16_bf16_rs_tb(o, pa[4 * j], pa[4 * j + 1], pa[4 * j + 2], pa[4 * j + 3], dv, 1);
    } else {
      wgmma_m64n64k16_bf16_rs_tb(o, pa[4 * j], pa[4 * j + 1], pa[4 * j + 2], pa[4 * j + 3], dv, 1);
    }
  }
  wgmma_commit();
}

// Sets the scores of keys past S or past a row's causal limit to `masked`. sc[i] is row
// row_a + 8 ((i / 2) % 2), key k0 + 8 (i / 4) + 2 (lane % 4) + i % 2. Only edge tiles have any.
template <int BN>
__device__ __forceinline__ void mask_tile(float (&sc)[BN / 2], float masked, const FwdParams& p, int k0, int row_a,
                                          int wg_first, int lane) {
  const int S = p.S, diag = S - p.T;
  if (k0 + BN > S || (p.causal && k0 + BN - 1 > wg_first + diag)) {
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) {
      const int col = k0 + 8 * (i / 4) + 2 * (lane % 4) + (i % 2);
      const int row = row_a + 8 * ((i / 2) % 2);
      if (col >= S || (p.causal && col > row + diag)) sc[i] = masked;
    }
  }
}

// Online softmax over one tile of raw scores (keys k0 ..): mask, update the running max and
// sums, turn sc into P = exp2(s * sl - max) with one FFMA per score. Returns in corr the
// factor O must be scaled by; O itself is not touched (it may still be the target of an MMA
// in flight). Row r's BN / 4 scores of this thread are sc[4 j + 2 r + {0, 1}], the rest in
// the quad's lanes. kNeg (sl < 0): the largest scaled score is the smallest raw one, and
// masked scores are +inf so that scaling turns them into -inf.
template <bool kNeg, int BN>
__device__ __forceinline__ void softmax_tile_folded(float (&sc)[BN / 2], RowState& st, float (&corr)[2], float sl,
                                                    const FwdParams& p, int k0, int row_a, int wg_first, int lane) {
  constexpr float kMasked = kNeg ? INFINITY : -INFINITY;
  mask_tile<BN>(sc, kMasked, p, k0, row_a, wg_first, lane);
  auto extreme = [](float a, float b) { return kNeg ? fminf(a, b) : fmaxf(a, b); };
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float e = kMasked;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) e = extreme(e, extreme(sc[4 * j + 2 * r], sc[4 * j + 2 * r + 1]));
    e = extreme(e, __shfl_xor_sync(0xffffffffu, e, 1));
    e = extreme(e, __shfl_xor_sync(0xffffffffu, e, 2));
    const float m_new = fmaxf(st.m[r], e * sl);  // fully masked so far: -inf
    const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // a row with nothing seen yet
    corr[r] = exp2_approx(st.m[r] - m_use);
    st.m[r] = m_new;
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      sc[4 * j + 2 * r] = exp2_approx(fmaf(sc[4 * j + 2 * r], sl, -m_use));
      sc[4 * j + 2 * r + 1] = exp2_approx(fmaf(sc[4 * j + 2 * r + 1], sl, -m_use));
      sum += sc[4 * j + 2 * r] + sc[4 * j + 2 * r + 1];
    }
    st.l[r] = st.l[r] * corr[r] + sum;  // per-thread partial; the quad's parts are added at the end
  }
}

// kSerial's softmax: every score scaled first (a separate multiply), then the above with a
// scale of 1 (the FFMA then rounds like the subtraction it replaces).
template <int BN>
__device__ __forceinline__ void softmax_tile(float (&sc)[BN / 2], RowState& st, float (&corr)[2], const FwdParams& p,
                                             int k0, int row_a, int wg_first, int lane) {
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) sc[i] *= p.scale_log2;
  softmax_tile_folded<false, BN>(sc, st, corr, 1.0f, p, k0, row_a, wg_first, lane);
}

template <int BN>
__device__ __forceinline__ void softmax_folded(float (&sc)[BN / 2], RowState& st, float (&corr)[2],
                                               const FwdParams& p, int k0, int row_a, int wg_first, int lane) {
  if (p.scale_log2 < 0.0f) softmax_tile_folded<true, BN>(sc, st, corr, p.scale_log2, p, k0, row_a, wg_first, lane);
  else softmax_tile_folded<false, BN>(sc, st, corr, p.scale_log2, p, k0, row_a, wg_first, lane);
}

// O needs rescaling only when some row's max moved (exp2(0) is exactly 1): a warp vote.
__device__ __forceinline__ bool any_row_max_moved(const float (&corr)[2]) {
  return __any_sync(0xffffffffu, corr[0] != 1.0f || corr[1] != 1.0f);
}

template <int N>
__device__ __forceinline__ void rescale(float (&o)[N], const float (&corr)[2]) {
#pragma unroll
  for (int j = 0; j < N / 4; ++j) {
    o[4 * j] *= corr[0];
    o[4 * j + 1] *= corr[0];
    o[4 * j + 2] *= corr[1];
    o[4 * j + 3] *= corr[1];
  }
}

// P as BF16 A fragments: k-slice j is sc[8 j .. 8 j + 7] packed pairwise (sm90_ptx.cuh).
template <int BN>
__device__ __forceinline__ void pack_p(const float (&sc)[BN / 2], uint32_t (&pa)[BN / 4]) {
#pragma unroll
  for (int i = 0; i < BN / 4; ++i) pa[i] = pack_bf16(sc[2 * i], sc[2 * i + 1]);
}

template <int D, int kMode, int BN>
__global__ void __launch_bounds__(kThreads, 1)
    attention_fwd_wgmma_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                               const __grid_constant__ CUtensorMap tm_v, const FwdParams p) {
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __trap();  // wgmma / setmaxnreg exist only on sm_90a; the host side checks the device.
#else
  using C = WgConfig<D, BN>;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t q_full;
  __shared__ __align__(8) uint64_t k_full[kStages];
  __shared__ __align__(8) uint64_t v_full[kStages];
  __shared__ __align__(8) uint64_t kv_empty[kStages];

  const uint32_t s_q = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const uint32_t s_k0 = s_q + C::kQBytes;
  const uint32_t s_v0 = s_k0 + kStages * C::kKVBytes;

  const int bh = blockIdx.x, b = bh / p.Hq, h = bh % p.Hq, kvh = h / p.group;
  const int q0 = (gridDim.y - 1 - blockIdx.y) * kBlockM;  // heaviest causal blocks first
  const int T = p.T, S = p.S, diag = S - T;
  // Keys [0, kv_end) are seen by at least one row of this CTA.
  const int last_row = min(q0 + kBlockM, T) - 1;
  const int kv_end = p.causal ? min(S, last_row + diag + 1) : S;
  const int n_tiles = kv_end > 0 ? (kv_end + BN - 1) / BN : 0;

  if (threadIdx.x == 0) {
    mbar_init(smem_addr(&q_full), 1);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(smem_addr(&k_full[s]), 1);
      mbar_init(smem_addr(&v_full[s]), 1);
      mbar_init(smem_addr(&kv_empty[s]), kConsumers * 4);  // one arrival per consumer warp
    }
    mbar_fence_init();
  }
  __syncthreads();

  const int wg = threadIdx.x / 128;
  if (wg == kConsumers) {
    if (threadIdx.x == kConsumers * 128) {
      tma_prefetch_descriptor(&tm_q);
      tma_prefetch_descriptor(&tm_k);
      tma_prefetch_descriptor(&tm_v);
      const uint32_t qf = smem_addr(&q_full);
      mbar_arrive_expect_tx(qf, C::kQBytes);
#pragma unroll
      for (int j = 0; j < C::kBoxes; ++j) tma_load_4d(s_q + j * C::kQBox, &tm_q, qf, 64 * j, h, q0, b);
      for (int n = 0; n < n_tiles; ++n) {
        const int s = n % kStages;
        const uint32_t phase = (n / kStages) & 1;
        mbar_wait(smem_addr(&kv_empty[s]), phase ^ 1);  // first lap: passes at once
        const uint32_t kf = smem_addr(&k_full[s]), vf = smem_addr(&v_full[s]);
        mbar_arrive_expect_tx(kf, C::kKVBytes);
#pragma unroll
        for (int j = 0; j < C::kBoxes; ++j)
          tma_load_4d(s_k0 + s * C::kKVBytes + j * C::kKVBox, &tm_k, kf, 64 * j, kvh, n * BN, b);
        mbar_arrive_expect_tx(vf, C::kKVBytes);
#pragma unroll
        for (int j = 0; j < C::kBoxes; ++j)
          tma_load_4d(s_v0 + s * C::kKVBytes + j * C::kKVBox, &tm_v, vf, 64 * j, kvh, n * BN, b);
      }
    }
    return;
  }

  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int wg_first = q0 + wg * kWgRows;
  const int row_a = wg_first + warp * 16 + lane / 4;  // the thread's rows: row_a and row_a + 8

  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
  RowState st;
  float sc[BN / 2], corr[2];
  uint32_t pa[BN / 4];

  mbar_wait(smem_addr(&q_full), 0);
  const uint32_t q_rows = s_q + wg * kWgRows * 128;  // this warpgroup's 64 rows of each Q box
  auto k_tile = [&](int n) { return s_k0 + (n % kStages) * C::kKVBytes; };
  auto v_tile = [&](int n) { return s_v0 + (n % kStages) * C::kKVBytes; };
  auto phase = [](int n) { return static_cast<uint32_t>((n / kStages) & 1); };
  auto release = [&](int n) {
    __syncwarp();
    if (lane == 0) mbar_arrive(smem_addr(&kv_empty[n % kStages]));
  };

  if constexpr (kMode == kSerial || kMode == kSerialFolded) {
    // Each tile's products waited for at once; the other warpgroup fills the gaps.
    for (int n = 0; n < n_tiles; ++n) {
      mbar_wait(smem_addr(&k_full[n % kStages]), phase(n));
      issue_scores<D, BN>(sc, q_rows, k_tile(n));
      wgmma_wait<0>();
      fence_registers(sc);
      if constexpr (kMode == kSerial) {
        softmax_tile<BN>(sc, st, corr, p, n * BN, row_a, wg_first, lane);
        rescale(o, corr);
      } else {
        softmax_folded<BN>(sc, st, corr, p, n * BN, row_a, wg_first, lane);
        if (any_row_max_moved(corr)) rescale(o, corr);
      }
      pack_p<BN>(sc, pa);
      mbar_wait(smem_addr(&v_full[n % kStages]), phase(n));
      issue_pv<D, BN>(o, pa, v_tile(n));
      wgmma_wait<0>();
      fence_registers(o);
      fence_registers(pa);
      release(n);
    }
  } else if (n_tiles > 0) {
    // Software-pipelined (FlashAttention-3's intra-warpgroup overlap): while P_n V_n runs on
    // the tensor cores, this warpgroup already has S_{n+1} and computes its softmax. The
    // two stages of the ring hold tiles n and n + 1 at once.
    mbar_wait(smem_addr(&k_full[0]), 0);
    issue_scores<D, BN>(sc, q_rows, k_tile(0));
    wgmma_wait<0>();
    fence_registers(sc);
    softmax_folded<BN>(sc, st, corr, p, 0, row_a, wg_first, lane);
    pack_p<BN>(sc, pa);
    // kPingPong: the two warpgroups take turns issuing their MMAs (named barriers 1 and 2,
    // 256 threads: the waiting warpgroup's bar_sync and the other's bar_arrive), so one
    // warpgroup's softmax runs while the other's products occupy the tensor cores
    // (FlashAttention-3's inter-warpgroup schedule). Warpgroup 1 opens warpgroup 0's first
    // turn; its own last turn hands nothing on, so no arrival is left pending at exit.
    const int my_turn = 1 + wg, other_turn = 2 - wg;
    if (kMode == kPingPong && wg == 1) bar_arrive(other_turn, 256);
    for (int n = 0; n + 1 < n_tiles; ++n) {
      mbar_wait(smem_addr(&k_full[(n + 1) % kStages]), phase(n + 1));
      mbar_wait(smem_addr(&v_full[n % kStages]), phase(n));
      if constexpr (kMode == kPingPong) bar_sync(my_turn, 256);
      issue_scores<D, BN>(sc, q_rows, k_tile(n + 1));
      issue_pv<D, BN>(o, pa, v_tile(n));
      if constexpr (kMode == kPingPong) bar_arrive(other_turn, 256);
      wgmma_wait<1>();  // S_{n+1} is done; P_n V_n may still run
      fence_registers(sc);
      softmax_folded<BN>(sc, st, corr, p, (n + 1) * BN, row_a, wg_first, lane);
      wgmma_wait<0>();
      fence_registers(o);
      fence_registers(pa);
      release(n);
      if (any_row_max_moved(corr)) rescale(o, corr);
      pack_p<BN>(sc, pa);
    }
    const int last = n_tiles - 1;
    mbar_wait(smem_addr(&v_full[last % kStages]), phase(last));
    if constexpr (kMode == kPingPong) bar_sync(my_turn, 256);
    issue_pv<D, BN>(o, pa, v_tile(last));
    if (kMode == kPingPong && wg == 0) bar_arrive(other_turn, 256);
    wgmma_wait<0>();
    fence_registers(o);
    fence_registers(pa);
    release(last);
  }

  // Finish: the quad's partial row sums, out = O / l, lse = (m + log2 l) ln 2.
  const int64_t q_stride = static_cast<int64_t>(p.Hq) * D;
  const int c2 = 2 * (lane % 4);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = st.l[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int row = row_a + 8 * r;
    if (row >= T) continue;
    const float inv = 1.0f / sum;
    bf16_t* dst = p.out + (static_cast<int64_t>(b) * T + row) * q_stride + static_cast<int64_t>(h) * D + c2;
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
      *reinterpret_cast<uint32_t*>(dst + 8 * j) = pack_bf16(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
    if (lane % 4 == 0) p.lse[static_cast<int64_t>(bh) * T + row] = (st.m[r] + log2f(sum)) * kLn2;
  }
#endif
}

template <int D, int kMode, int BN>
void launch(cudaStream_t stream, const FwdParams& p, int64_t batch_heads) {
  using C = WgConfig<D, BN>;
  constexpr const char* kWho = "attention forward (wgmma)";
  const int64_t batch = batch_heads / p.Hq;
  const CUtensorMap tm_q = make_bhd_tensor_map(p.q, batch, p.T, p.Hq, D, kBlockM, kWho);
  const CUtensorMap tm_k = make_bhd_tensor_map(p.k, batch, p.S, p.Hkv, D, BN, kWho);
  const CUtensorMap tm_v = make_bhd_tensor_map(p.v, batch, p.S, p.Hkv, D, BN, kWho);
  auto kernel = attention_fwd_wgmma_kernel<D, kMode, BN>;
  TESSERA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem));
  const dim3 grid(static_cast<unsigned>(batch_heads), static_cast<unsigned>((p.T + kBlockM - 1) / kBlockM));
  kernel<<<grid, kThreads, C::kSmem, stream>>>(tm_q, tm_k, tm_v, p);
  TESSERA_CUDA_CHECK_LAUNCH();
}

template <int D, int kMode, int BN>
void info(FwdVariantInfo* out) {
  cudaFuncAttributes a{};
  auto kernel = attention_fwd_wgmma_kernel<D, kMode, BN>;
  constexpr int smem = WgConfig<D, BN>::kSmem;
  TESSERA_CUDA_CHECK(cudaFuncGetAttributes(&a, kernel));
  TESSERA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  int blocks = 0;
  TESSERA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads, smem));
  out->registers = a.numRegs;
  out->local_bytes = static_cast<int>(a.localSizeBytes);
  out->smem_bytes = smem;
  out->blocks_per_sm = blocks;
}

// What each schedule is, for benchmark tables (with_schedule's order).
constexpr const char* kScheduleNames[] = {
    "wgmma: 2 consumer warpgroups x 64 rows, 128 keys, TMA producer",
    "wgmma, pipelined: softmax of tile n+1 beside P V of tile n",
    "wgmma, pipelined + ping-pong between the warpgroups",
    "wgmma, serial, scale folded into exp2, O rescaled when needed",
    "wgmma, pipelined, 96-key tiles",
    "wgmma, pipelined + ping-pong, 96-key tiles",
    "wgmma, pipelined, 80-key tiles",
    "wgmma, pipelined + ping-pong, 80-key tiles",
};

// Calls fn(D, mode, BN) as integral constants for schedule `schedule` (the variant number
// less kWgmmaForwardVariant); false for an unknown one.
template <class Fn>
bool with_schedule(int D, int schedule, Fn&& fn) {
  using std::integral_constant;
  auto for_d = [&](auto d) {
    switch (schedule) {
      case 0: fn(d, integral_constant<int, kSerial>{}, integral_constant<int, 128>{}); return true;
      case 1: fn(d, integral_constant<int, kPipelined>{}, integral_constant<int, 128>{}); return true;
      case 2: fn(d, integral_constant<int, kPingPong>{}, integral_constant<int, 128>{}); return true;
      case 3: fn(d, integral_constant<int, kSerialFolded>{}, integral_constant<int, 128>{}); return true;
      case 4: fn(d, integral_constant<int, kPipelined>{}, integral_constant<int, 96>{}); return true;
      case 5: fn(d, integral_constant<int, kPingPong>{}, integral_constant<int, 96>{}); return true;
      case 6: fn(d, integral_constant<int, kPipelined>{}, integral_constant<int, 80>{}); return true;
      case 7: fn(d, integral_constant<int, kPingPong>{}, integral_constant<int, 80>{}); return true;
      default: return false;
    }
  };
  if (D == 64) return for_d(integral_constant<int, 64>{});
  if (D == 128) return for_d(integral_constant<int, 128>{});
  return false;
}

}  // namespace

bool launch_forward_wgmma(cudaStream_t stream, const FwdParams& p, int D, int schedule, int64_t batch_heads) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || !device_is_hopper(device)) return false;
  return with_schedule(D, schedule, [&](auto d, auto m, auto bn) {
    launch<decltype(d)::value, decltype(m)::value, decltype(bn)::value>(stream, p, batch_heads);
  });
}

bool forward_wgmma_info(int D, int schedule, FwdVariantInfo* out) {
  if (!with_schedule(D, schedule, [&](auto d, auto m, auto bn) {
        info<decltype(d)::value, decltype(m)::value, decltype(bn)::value>(out);
      }))
    return false;
  out->shape = kScheduleNames[schedule];
  return true;
}

}  // namespace tessera::cuda::attn
