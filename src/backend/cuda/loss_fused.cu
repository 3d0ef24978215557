// Cross-entropy forward and backward in one pass over the logits (the LM head's loss and
// gradient): lse[n], the loss and d_logits from a single read of each row, where the
// separate kernels (loss.cu, loss_rows.cu) read it twice (the forward, then the backward).
//
// A row is too wide for one block's registers (Llama's 128256 BF16 logits are 256 KB, the
// whole register file of an SM), so a cluster of kCtas = 8 blocks holds it: block r of the
// cluster keeps the 16-byte vectors (j * 8 + r) * 512 + thread (j < NV) in registers, BF16
// packed two to a register, as loaded (Llama: NV = 4, 16 registers of data a thread). The
// row's max and then its sum of exp(x - max) are reduced in each block (shuffles, then the
// 16 warps' partials) and across the cluster through distributed shared memory (every warp
// reads the 8 blocks' partials in rank order: the same bits in every block, deterministic);
// then each thread writes its vectors' gradient from its registers. d_logits may be logits:
// every element is read into registers before the cluster's first barrier, written after.
//
// Same rules as the separate kernels: rows with target == ignore_index get a zero gradient,
// a bad target a NaN loss and NaN gradient row (reported by the loss sum, loss.cu). The
// gradient is scale * exp(x - lse) (- scale at the target), scale = d_loss / n_valid from
// loss.cu's grad_scale_kernel, this kernel's programmatic predecessor (read after the
// reductions); lse is the two-pass (max, then sum) value of the register-row forwards, so
// it may differ from the looping forward's online value in the last bit.
//
// Layout: logits / d_logits [N, V] row-major of one dtype (F32 or BF16), both row strides
// multiples of 8 and both bases 16-byte aligned; V in [kMinVocab, kCapacity]. The last
// vector of a row may be partial (GPT-2's 50257): it is read and written element by element.
// Floor: N * V * bytes * 2 (one read, one write) / 4.1 TB/s (2048 x 128256 BF16: 256 us);
// the separate kernels move 1.5x that. Measured on the H200 (2026-12-02, bench_bandwidth
// lm_head_loss, bench/RESULTS.md): 2048 x 128256 BF16 480 us (57% of copy) against the
// separate kernels' 452 us (3 passes at 90%); 2048 x 50257 288 against 219 us. Slower: a
// block's life is serial (its slice loaded, two cluster barriers, then the stores) and 2-4
// blocks an SM keep too few bytes in flight; more blocks (a small spill) gave 458 / 254 us.
// Hence off by default (softmax_tuning.h). One cluster exchange of an online (max, sum)
// instead of the two barriers was slower still (577 us): the barriers are not the cost.
// Next: persistent clusters that issue the next row's loads before reducing this one.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cmath>
#include <type_traits>

#include "cuda_check.h"
#include "index_error.h"
#include "loss.h"
#include "loss_kernels.cuh"
#include "softmax_tuning.h"
#include "vec_io.cuh"

namespace tessera::cuda {

namespace xent {

namespace {

namespace cg = cooperative_groups;
using vec::kWidth;

constexpr int kCtas = 8;           // blocks of a row's cluster (the portable cluster size)
constexpr int kFusedThreads = 512; // threads a block
constexpr int kMaxNv = 8;          // vectors a thread (NV is 1, 2, 4 or 8)
constexpr int64_t kRowThreadsAll = int64_t(kCtas) * kFusedThreads;
constexpr int64_t kCapacity = kRowThreadsAll * kMaxNv * kWidth;  // 262144 logits a row
// Narrower rows are left to the separate kernels: their register-row forward already reads
// a row of up to 32768 BF16 logits in one warp pair, and a cluster would leave threads idle.
constexpr int64_t kMinVocab = 16384;

// The partial last vector of a row: elements at or past vocab are -inf (nothing to the max
// or the sum), built by value so the row's registers never spill to local memory.
__device__ __forceinline__ void load_partial(const float* x, int c, int vocab, vec::Packed8<float>& p) {
  float f[kWidth];
#pragma unroll
  for (int k = 0; k < kWidth; ++k) f[k] = c + k < vocab ? x[c + k] : -INFINITY;
  p.a = make_float4(f[0], f[1], f[2], f[3]);
  p.b = make_float4(f[4], f[5], f[6], f[7]);
}
__device__ __forceinline__ void load_partial(const bf16* x, int c, int vocab, vec::Packed8<bf16>& p) {
  uint32_t w[kWidth / 2];
#pragma unroll
  for (int k = 0; k < kWidth / 2; ++k) {
    const uint32_t lo = c + 2 * k < vocab ? x[c + 2 * k].bits : 0xff80u;  // BF16 -inf
    const uint32_t hi = c + 2 * k + 1 < vocab ? x[c + 2 * k + 1].bits : 0xff80u;
    w[k] = lo | (hi << 16);
  }
  p.w = make_uint4(w[0], w[1], w[2], w[3]);
}

// The block's value of op over its threads, in every thread: a butterfly per warp, then the
// 16 warp values in order. `parts`: kFusedThreads / 32 floats, one array per call site.
template <typename Op>
__device__ __forceinline__ float block_reduce(float v, float* parts, Op op) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  if ((threadIdx.x & 31) == 0) parts[threadIdx.x >> 5] = v;
  __syncthreads();
  float r = parts[0];
#pragma unroll
  for (int w = 1; w < kFusedThreads / 32; ++w) r = op(r, parts[w]);
  return r;
}

// The cluster's value of op over its blocks' values (`mine`, this block's, in shared memory
// after the barrier): lanes 0..7 of every warp read the 8 blocks' values, merged in a fixed
// butterfly, so every thread of every block gets the same bits.
template <typename Op>
__device__ __forceinline__ float cluster_reduce(cg::cluster_group& cluster, float* mine, Op op) {
  cluster.sync();  // every block's value is written
  const int lane = int(threadIdx.x & 31);
  float v = *cluster.map_shared_rank(mine, lane % kCtas);
#pragma unroll
  for (int offset = kCtas / 2; offset > 0; offset /= 2) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset, kCtas));
  return v;
}

template <typename T, typename Tg, int NV>
__global__ void __cluster_dims__(kCtas, 1, 1) __launch_bounds__(kFusedThreads, (NV <= 2 ? 3 : NV <= 4 ? 2 : 1))
    fused_kernel(const T* logits, const Tg* targets, float* lse, double* terms, const float* scale_ptr, T* d_logits,
                 int vocab, int64_t ld, int64_t ld_out, int64_t ignore_index) {
  __shared__ float warp_max[kFusedThreads / 32], warp_sum[kFusedThreads / 32];
  __shared__ float block_max, block_sum;
  pdl_launch_dependents();  // the loss sum may start; it waits before reading terms
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank());
  const int64_t row = blockIdx.x / kCtas;
  const T* x = logits + row * ld;
  const bool leader = rank == 0 && threadIdx.x == 0;  // writes lse and the loss term
  RowTarget target;
  if (leader) target.fetch(targets, row);
  const int64_t t = static_cast<int64_t>(targets[row]);  // every thread: the gradient's one-hot
  vec::Packed8<T> u[NV];
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int c = ((j * kCtas + rank) * kFusedThreads + int(threadIdx.x)) * kWidth;  // < 2^18
    if (c + kWidth <= vocab) vec::load_packed(x + c, u[j]);
    else if (c < vocab) load_partial(x, c, vocab, u[j]);
    else vec::fill_neg_inf(u[j]);
  }
  // Before the first cluster barrier, so before any block of the row writes (in place).
  if (leader) target.gather(x, vocab, ignore_index);

  float m = packed_max(u);
  const auto max_op = [](float a, float b) { return fmaxf(a, b); };
  m = block_reduce(m, warp_max, max_op);
  if (threadIdx.x == 0) block_max = m;
  m = cluster_reduce(cluster, &block_max, max_op);

  float s = packed_exp_sum(u, m);
  const auto sum_op = [](float a, float b) { return a + b; };
  s = block_reduce(s, warp_sum, sum_op);
  if (threadIdx.x == 0) block_sum = s;
  s = cluster_reduce(cluster, &block_sum, sum_op);
  // No block may exit while another still reads its shared memory: arrive now, wait at the end.
  cluster.barrier_arrive();
  const float row_lse = lse_value(m, s);
  if (leader) {
    lse[row] = row_lse;
    target.write(row, row_lse, terms);
  }

  pdl_wait();  // grad_scale_kernel's scale (every thread: see pdl_wait)
  const float scale = *scale_ptr;
  const bool ignored = t == ignore_index, fixed = ignored || t < 0 || t >= vocab;
  const float fixed_value = ignored ? 0.0f : NAN;
  T* y = d_logits + row * ld_out;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int c = ((j * kCtas + rank) * kFusedThreads + int(threadIdx.x)) * kWidth;  // < 2^18
    if (c >= vocab) break;
    float w[kWidth];
    vec::unpack(u[j], w);
#pragma unroll
    for (int k = 0; k < kWidth; ++k) {
      const float q = scale * exp2f((w[k] - row_lse) * kLog2e);
      w[k] = fixed ? fixed_value : (c + k == t ? q - scale : q);
    }
    if (c + kWidth <= vocab) {
      vec::store8(y + c, w);
    } else {
#pragma unroll
      for (int k = 0; k < kWidth; ++k)
        if (c + k < vocab) vec::store(y, c + k, w[k]);
    }
  }
  cluster.barrier_wait();
}

}  // namespace

}  // namespace xent

bool cross_entropy_fused_supported(const Tensor& logits, const Tensor& loss, const Tensor& lse,
                                   const Tensor& d_logits) {
  using namespace xent;
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  return row_tuning().cross_entropy_fused == 0 && vec::is_f32_or_bf16(logits.dtype()) &&
         d_logits.dtype() == logits.dtype() && lse.dtype() == DType::F32 &&
         (loss.dtype() == DType::F32 || loss.dtype() == DType::F64) && rows > 0 && rows <= 0x7fffffff / kCtas &&
         vocab >= kMinVocab && vocab <= kCapacity && logits.stride(0) % kWidth == 0 &&
         d_logits.stride(0) % kWidth == 0 && vec::aligned16(logits.raw_data()) && vec::aligned16(d_logits.raw_data());
}

void cross_entropy_fused(void* stream, const Tensor& logits, const Tensor& targets, Tensor& loss, Tensor& lse,
                         float d_loss, Tensor& d_logits, int64_t ignore_index) {
  using namespace xent;
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  auto s = static_cast<cudaStream_t>(stream);
  const IndexErrorSink sink =
      index_error_sink(logits.device().index, IndexOp::CrossEntropyForward, vocab, ignore_index);
  Tensor terms = Tensor::empty({rows}, DType::F64, logits.device());
  Tensor scale = Tensor::empty({1}, DType::F32, logits.device());
  launch_grad_scale(s, targets, rows, ignore_index, d_loss, scale);
  const int64_t per_vector_step = kRowThreadsAll * kWidth;
  const int64_t steps = (vocab + per_vector_step - 1) / per_vector_step;
  const int nv = steps <= 1 ? 1 : steps <= 2 ? 2 : steps <= 4 ? 4 : 8;
  dispatch_forward(logits, targets, [&](auto* tag, auto* ttag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using Tg = std::remove_pointer_t<decltype(ttag)>;
    auto launch = [&](auto kernel) {
      launch_pdl(kernel, static_cast<unsigned>(rows * kCtas), kFusedThreads, s, logits.data<T>(), targets.data<Tg>(),
                 lse.data<float>(), terms.data<double>(), static_cast<const float*>(scale.data<float>()),
                 d_logits.data<T>(), static_cast<int>(vocab), logits.stride(0), d_logits.stride(0), ignore_index);
    };
    if (nv == 1) launch(fused_kernel<T, Tg, 1>);
    else if (nv == 2) launch(fused_kernel<T, Tg, 2>);
    else if (nv == 4) launch(fused_kernel<T, Tg, 4>);
    else launch(fused_kernel<T, Tg, 8>);
  });
  launch_loss_sum(s, targets, terms, loss, rows, vocab, ignore_index, sink);
  TESSERA_CUDA_CHECK_LAUNCH();
}

}  // namespace tessera::cuda
