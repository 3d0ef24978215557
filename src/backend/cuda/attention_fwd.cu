// Attention forward on the tensor cores, FlashAttention-2 style, for BF16 with head dim 64
// or 128: out = softmax(scale * Q K^T) V and lse = log-sum-exp of each score row, without
// ever materialising the T x S score matrix. Also the CUDA entry points that pick between
// this path, cuDNN's (attention_cudnn.cu, chosen in attention_select.cu) and the generic one
// (attention_generic.cu).
//
// Layout: q, out [B, T, Hq, D]; k, v [B, S, Hkv, D]; lse [B, Hq, T] F32; contiguous, 16-byte
// aligned. Query head h reads kv head h / (Hq / Hkv). Causal masking is bottom-right
// aligned: query i sees keys j <= i + (S - T).
//
// One block owns 128 query rows of one (batch, head). Variant 0 is 4 warps of 32 rows
// each (two 16-row mma slices per warp), 2 blocks per SM; variants with 8 warps of 16 rows,
// or 32-key tiles, stay selectable for benchmarks (attention_forward_fast's `variant`).
// The block walks the key/value tiles (64 keys), double-buffered in shared memory with
// cp.async: tile n+1 is in flight while tile n is used. Per tile a warp computes
// S = Q K^T (mma.sync m16n8k16, FP32 accumulate), scales it into the log2 domain, masks
// the edges, updates the running max / sum (online softmax, rescaling O), and adds P V
// with P taken straight from the accumulator registers. Tiles wholly past a warp's causal
// limit are skipped; the block stops at the last tile its last row can see, and blocks are
// launched heaviest (last query blocks) first.
//
// Measured on the H200 (bench/attention_bench.cu, causal, TFLOP/s counting causal as
// half): B=4 H=32 T=4096 D=128: 280 (variant 1: 257, variant 2: 273; PyTorch's
// FlashAttention-2 backend 323, cuDNN 587); B=16 H=12 T=1024 D=64: 200 (FA2 148, cuDNN
// 254). The D=128 kernel spills ~56 bytes (255 registers); wgmma is the next step.
//
// The default at D = 64 is variant 9 of attention_fwd_variants.cu (variant 0's shape with the
// cheaper softmax below): 311.7 TFLOP/s at B=4 H=32 T=4096 D=128, 214.9 at D=64 (2026-11-30).
// At D = 128 on Hopper the default is the wgmma kernel (attention_fwd_wgmma.cu, 456 TFLOP/s).
// Variants 3-15 (attention_fwd_variants.cu) attack the D = 128 register
// problem with one kernel template: MT = 1 with Q in registers (3-5, 10: 233/168 registers,
// 0-24 bytes spilled, 2-3 blocks per SM), MT = 2 with 32-key tiles and a half, a quarter or
// none of Q in registers (6, 7, 12, 8, 11), MT = 2 with 64-key tiles computed in 32-key
// steps (13-15; 13: 254 registers, no spill), 3-stage K/V pipelines (5, 7, 8, 10, 12), and
// variant 0's shape (9), all with a cheaper online softmax (one FFMA per score, O rescaled
// only when a row max moved, P packed to BF16 at once). Registers: that file's note.
//
// Floor: 4 * B * Hq * T * S * D FLOPs (half of it causal) over the BF16 dense peak,
// ~989 TFLOP/s on the H200 (mma.sync reaches roughly two thirds of that). Memory is
// O(B * (T * Hq + S * Hkv) * D), far below the compute time.
#include <cuda_runtime.h>

#include <cmath>

#include "attention.h"
#include "attention_common.cuh"
#include "attention_cudnn.h"
#include "attention_fwd_variants.h"
#include "cuda_check.h"

namespace tessera::cuda {

namespace {

using namespace attn;

// A block is `Warps` warps, each owning MT slices of 16 query rows. MT = 2 halves the
// shared-memory reads of K and V per product (each B fragment feeds two mma) and gives
// each warp two independent accumulator chains; Q then lives in registers only where they
// suffice (D = 64), else its fragments are re-read from shared memory per tile.
template <int D, int MT, int Warps, int Keys>
struct FwdConfig {
  static constexpr int kThreads = Warps * 32;
  static constexpr int kRows = 16 * MT * Warps;  // query rows per block
  static constexpr bool kQInRegs = D * MT <= 128;
  static constexpr int kMinBlocks = MT == 2 ? 2 : (D == 64 ? 2 : 1);
  static constexpr int kSmem = kRows * D * 2 + 4 * Keys * D * 2;  // Q, K[2], V[2]
};

template <int D, int MT, int Warps, int kFwdKeys>
__global__ void __launch_bounds__(FwdConfig<D, MT, Warps, kFwdKeys>::kThreads,
                                  FwdConfig<D, MT, Warps, kFwdKeys>::kMinBlocks)
    attention_fwd_kernel(const FwdParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  using Cfg = FwdConfig<D, MT, Warps, kFwdKeys>;
  constexpr int kThreads = Cfg::kThreads, kRows = Cfg::kRows;
  constexpr int kKC = D / 16;        // 16-wide steps over the head dim
  constexpr int kNT = kFwdKeys / 8;  // 8-key score tiles per row slice
  constexpr int kDT = D / 8;         // 8-wide output tiles per row slice
  constexpr int kQRegs = Cfg::kQInRegs ? kKC : 1;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int bh = blockIdx.x, b = bh / p.Hq, h = bh % p.Hq, kvh = h / p.group;
  const int q0 = (gridDim.y - 1 - blockIdx.y) * kRows;  // heaviest causal blocks first
  const int T = p.T, S = p.S, diag = S - T;
  const int64_t q_stride = static_cast<int64_t>(p.Hq) * D, kv_stride = static_cast<int64_t>(p.Hkv) * D;
  const bf16_t* q_tile = p.q + (static_cast<int64_t>(b) * T + q0) * q_stride + static_cast<int64_t>(h) * D;
  const bf16_t* k_base = p.k + static_cast<int64_t>(b) * S * kv_stride + static_cast<int64_t>(kvh) * D;
  const bf16_t* v_base = p.v + static_cast<int64_t>(b) * S * kv_stride + static_cast<int64_t>(kvh) * D;

  const uint32_t s_q = smem_u32(smem);
  const uint32_t s_k = s_q + kRows * D * 2;
  const uint32_t s_v = s_k + 2 * kFwdKeys * D * 2;
  constexpr uint32_t kKVTile = kFwdKeys * D * 2;

  // Keys [0, kv_end) are seen by at least one row of this block.
  const int last_row = min(q0 + kRows, T) - 1;
  const int kv_end = p.causal ? min(S, last_row + diag + 1) : S;
  const int n_tiles = (kv_end + kFwdKeys - 1) / kFwdKeys;

  load_tile<D, kRows, kThreads>(s_q, q_tile, q_stride, T - q0, tid);
  load_tile<D, kFwdKeys, kThreads>(s_k, k_base, kv_stride, S, tid);
  load_tile<D, kFwdKeys, kThreads>(s_v, v_base, kv_stride, S, tid);
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();

  const int w_row0 = warp * 16 * MT;             // the warp's first row within the block
  const int warp_first = q0 + w_row0;
  const int warp_last = min(warp_first + 16 * MT - 1, T - 1);
  const bool warp_has_rows = warp_first < T;
  const int row_base = warp_first + (lane >> 2);  // + 16 * mt + 8 * half: the thread's rows

  uint32_t qa[MT][kQRegs][4];
  if constexpr (Cfg::kQInRegs) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int kc = 0; kc < kKC; ++kc) ldmatrix_x4(qa[mt][kc], a_addr<D>(s_q, w_row0 + 16 * mt, kc, lane));
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
    const int buf = n & 1;
    const int k0 = n * kFwdKeys;
    if (n + 1 < n_tiles) {
      const int64_t next = static_cast<int64_t>(k0 + kFwdKeys) * kv_stride;
      load_tile<D, kFwdKeys, kThreads>(s_k + (buf ^ 1) * kKVTile, k_base + next, kv_stride, S - k0 - kFwdKeys, tid);
      load_tile<D, kFwdKeys, kThreads>(s_v + (buf ^ 1) * kKVTile, v_base + next, kv_stride, S - k0 - kFwdKeys, tid);
      cp_async_commit();
    }
    const bool active = warp_has_rows && (!p.causal || k0 <= warp_last + diag);
    if (active) {
      const uint32_t k_tile = s_k + buf * kKVTile, v_tile = s_v + buf * kKVTile;
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
          if constexpr (Cfg::kQInRegs) {
#pragma unroll
            for (int i = 0; i < 4; ++i) qf[mt][i] = qa[mt][kc][i];
          } else {
            ldmatrix_x4(qf[mt], a_addr<D>(s_q, w_row0 + 16 * mt, kc, lane));
          }
        }
#pragma unroll
        for (int np = 0; np < kNT / 2; ++np) {
          uint32_t r[4];
          ldmatrix_x4(r, b_addr<D>(k_tile, np * 16, kc, lane));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma_bf16(s[mt][2 * np], qf[mt], r[0], r[1]);
            mma_bf16(s[mt][2 * np + 1], qf[mt], r[2], r[3]);
          }
        }
      }
      // Scale first, then mask: a negative scale would turn a masked -inf into +inf.
      const bool need_mask = k0 + kFwdKeys > S || (p.causal && k0 + kFwdKeys - 1 > warp_first + diag);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            s[mt][nt][e] *= p.scale_log2;
            if (need_mask) {
              const int col = k0 + nt * 8 + 2 * (lane & 3) + (e & 1);
              const int row = row_base + 16 * mt + (e < 2 ? 0 : 8);
              if (col >= S || (p.causal && col > row + diag)) s[mt][nt][e] = -INFINITY;
            }
          }
        }
      }
      // Online softmax for the thread's rows (each row lives in one quad of lanes).
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float mx = -INFINITY;
#pragma unroll
          for (int nt = 0; nt < kNT; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          const float m_new = fmaxf(m[mt][r], mx);
          const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // a row with nothing seen yet
          const float corr = exp2_approx(m[mt][r] - m_use);
          m[mt][r] = m_new;
          float sum = 0.0f;
#pragma unroll
          for (int nt = 0; nt < kNT; ++nt) {
            s[mt][nt][2 * r] = exp2_approx(s[mt][nt][2 * r] - m_use);
            s[mt][nt][2 * r + 1] = exp2_approx(s[mt][nt][2 * r + 1] - m_use);
            sum += s[mt][nt][2 * r] + s[mt][nt][2 * r + 1];
          }
          l[mt][r] = l[mt][r] * corr + sum;  // per-thread partial; the quad's parts are added at the end
#pragma unroll
          for (int dt = 0; dt < kDT; ++dt) {
            o[mt][dt][2 * r] *= corr;
            o[mt][dt][2 * r + 1] *= corr;
          }
        }
      }
      // O += P V, P straight from the score registers.
#pragma unroll
      for (int kc = 0; kc < kFwdKeys / 16; ++kc) {
        uint32_t pa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) scores_to_a(pa[mt], s[mt][2 * kc], s[mt][2 * kc + 1]);
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
          uint32_t r[4];
          ldmatrix_x4_trans(r, bt_addr<D>(v_tile, kc * 16, dp, lane));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma_bf16(o[mt][2 * dp], pa[mt], r[0], r[1]);
            mma_bf16(o[mt][2 * dp + 1], pa[mt], r[2], r[3]);
          }
        }
      }
    }
    cp_async_wait_all();
    __syncthreads();
  }

  store_out_and_lse<D, MT>(p.out, p.lse, o, l, m, row_base, b, h, bh, T, q_stride, lane);
}

template <int D, int MT, int Warps, int Keys>
void launch_forward(cudaStream_t stream, const FwdParams& p, int64_t batch_heads, int64_t T) {
  using Cfg = FwdConfig<D, MT, Warps, Keys>;
  // Per device and cheap (no synchronisation), so set on every launch rather than tracked.
  TESSERA_CUDA_CHECK(cudaFuncSetAttribute(attention_fwd_kernel<D, MT, Warps, Keys>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmem));
  const dim3 grid(static_cast<unsigned>(batch_heads), static_cast<unsigned>((T + Cfg::kRows - 1) / Cfg::kRows));
  attention_fwd_kernel<D, MT, Warps, Keys><<<grid, Cfg::kThreads, Cfg::kSmem, stream>>>(p);
  TESSERA_CUDA_CHECK_LAUNCH();
}

bool aligned16(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.raw_data()) % 16 == 0; }

}  // namespace

bool attention_supported(const Tensor& q, const Tensor& lse) {
  return is_floating(q.dtype()) && q.dtype() != DType::F64 && (lse.dtype() == DType::F32 || lse.dtype() == DType::F64);
}

bool attention_fast_path(const Tensor& q, const Tensor& k, const Tensor& lse,
                         std::initializer_list<const Tensor*> others) {
  if (q.dtype() != DType::BF16 || lse.dtype() != DType::F32) return false;
  const int64_t D = q.size(3);
  if (D != 64 && D != 128) return false;
  // Grid limits: batch * heads in x, blocks of 128 queries or keys in y.
  const int64_t max_seq = int64_t(65535) * 128;
  if (q.size(0) * q.size(2) > 0x7fffffff || q.size(1) > max_seq || k.size(1) > max_seq) return false;
  if (!aligned16(q) || !aligned16(k) || !aligned16(lse)) return false;
  for (const Tensor* t : others)
    if (!aligned16(*t)) return false;
  return true;
}

void attention_forward_fast(void* stream, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                            Tensor& lse, bool causal, float scale, int variant) {
  const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), D = q.size(3), S = k.size(1), Hkv = k.size(2);
  if (B == 0 || T == 0 || Hq == 0) return;
  TESSERA_CHECK(T <= 0x7fffffff && S <= 0x7fffffff, "attention_forward on CUDA: sequence too long");
  FwdParams p{static_cast<const bf16_t*>(q.raw_data()),
              static_cast<const bf16_t*>(k.raw_data()),
              static_cast<const bf16_t*>(v.raw_data()),
              static_cast<bf16_t*>(out.raw_data()),
              lse.data<float>(),
              static_cast<int>(T),
              static_cast<int>(S),
              static_cast<int>(Hq),
              static_cast<int>(Hkv),
              static_cast<int>(Hq / Hkv),
              scale * kLog2e,
              causal};
  auto s = static_cast<cudaStream_t>(stream);
  if (variant < 0) variant = default_attention_forward_variant(D);
  if (variant > 2 && launch_forward_variant(s, p, static_cast<int>(D), variant, B * Hq, T)) return;
  switch (variant) {
    case 1:  // 16 rows per warp, 8 warps, 64-key tiles
      if (D == 64) launch_forward<64, 1, 8, 64>(s, p, B * Hq, T);
      else launch_forward<128, 1, 8, 64>(s, p, B * Hq, T);
      break;
    case 2:  // 32 rows per warp, 4 warps, 32-key tiles
      if (D == 64) launch_forward<64, 2, 4, 32>(s, p, B * Hq, T);
      else launch_forward<128, 2, 4, 32>(s, p, B * Hq, T);
      break;
    default:  // 32 rows per warp, 4 warps, 64-key tiles
      if (D == 64) launch_forward<64, 2, 4, 64>(s, p, B * Hq, T);
      else launch_forward<128, 2, 4, 64>(s, p, B * Hq, T);
  }
}

void attention_forward(void* stream, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                       bool causal, float scale) {
  if (attention_use_cudnn_forward(stream, q, k, v, out, lse, causal, scale)) {
    cudnn_attention_forward(stream, q, k, v, out, lse, causal, scale);
    return;
  }
  // tessera's kernels index packed [B, T, H, D] tensors: head slices of a fused QKV buffer
  // are packed first (cuDNN, above, takes them as they are).
  if (!(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() && out.is_contiguous())) {
    Tensor packed_out = out.is_contiguous() ? out : Tensor::empty(out.shape(), out.dtype(), out.device());
    attention_forward(stream, q.contiguous(), k.contiguous(), v.contiguous(), packed_out, lse, causal, scale);
    if (!out.is_contiguous()) out.copy_from(packed_out);
    return;
  }
  if (attention_fast_path(q, k, lse, {&v, &out})) attention_forward_fast(stream, q, k, v, out, lse, causal, scale);
  else attention_forward_generic(stream, q, k, v, out, lse, causal, scale);
}

}  // namespace tessera::cuda
