// Cross-entropy's register-row kernels (loss.cu has the rules, the looping forward, the loss
// sum and the row-block backward; loss_kernels.cuh what they share). The forward's row pass
// writes lse[n] and the loss term lse[n] - logits[n, target] per row, read by loss.cu's sum.
//
// Layout: logits / d_logits [N, V] row-major, V and both row strides multiples of 8, the
// bases 16-byte aligned (anything else takes loss.cu's kernels).
//  - Block-group register forward: rows of up to 32768 BF16 / 16384 F32 logits held in
//    registers as loaded (BF16 packed two to a register, so a thread holds 8 vectors in 32
//    registers and more rows are in flight per SM) by a group of threads: the max, then the
//    sum of exp2((x - max) * log2 e) from the registers. Thread 0 of a row loads the target
//    index before the row and the target logit after issuing the row's loads.
//  - Warp-row forward (the default where it applies; softmax_tuning.h keeps the kernel above
//    selectable): rows of up to 4096 BF16 / 2048 F32 logits held by 4 to 32 lanes of one warp
//    (row_lse.cuh: one online pass over the registers, one merged butterfly, no barrier).
//  - Flat backward (the default where it applies): no reduction is needed, so it maps
//    16-byte vectors of the whole [N, V] gradient, 4 (or 8) per thread with all loads issued
//    first, and short rows fill whole blocks.
// Floors: forward N * V * bytes / 4.1 TB/s (1024 x 128256 BF16 = 263 MB -> 64 us); backward
// twice that. Measured on the H200 against cudaMemcpy D2D (3.8 TB/s) in the same run
// (bench_bandwidth, 16384 x 4096 BF16), the block-group register forward: 12% (the forward
// before it) -> 53% (single-pass rows, the target gathered per row); then with the
// packed rows, the target logit loaded beside the row, PDL and exp2 (2026-11-30): 68%; at
// 16384 x 768 (rows of 1.5 KB, launch and tail bound) 45% (the row backward of the same
// runs: loss.cu). Still short of the 85% goal: a row of 4096 is too short to keep enough
// bytes in flight per SM. Warp-row forward (the default where it applies) and flat backward
// (2026-11-30, seventh session): forward 67.6% (51.7% at x 768), backward 79.6% (65.5%).
// Since (ninth session, measured 16384 x 4096: forward 68.7% -> 87.3%, backward 88%): the
// backward's BF16 stores through the hardware
// conversion (vec::store8: ~6 fewer instructions per element; same bits); the forward's rows
// that need more than 32 registers of a warp's lanes on two warps (kPairRows in
// lse_warp_kernel: 4096 BF16 went from 95 registers a thread to the 64 of 8 blocks an SM;
// the sum's order changes, see there).
#include <cuda_runtime.h>

#include <cmath>
#include <type_traits>

#include "cuda_check.h"
#include "index_error.h"
#include "loss_kernels.cuh"
#include "row_lse.cuh"
#include "softmax_tuning.h"
#include "vec_io.cuh"

namespace tessera::cuda::xent {

namespace {

using warprow::group_reduce;

using vec::kWidth;

constexpr int kLseMaxGroup = 512;    // the register forward kernel: threads per row ...
constexpr int kLseMaxVectors = 4;    // ... and F32 vectors per thread (rows up to 16384 logits;
                                     // BF16, packed: 8, rows up to 32768)

// Rows of vocab % 8 == 0 logits, 16-byte aligned, held in registers as loaded (BF16
// packed, half the registers of floats: more rows in flight per SM): NV vectors per thread
// of a group of blockDim.x threads (a warp's loads contiguous); blockDim.y rows per block.
// The max first, then the sum of exp(x - max) from the registers: one read of the row, and
// a more accurate sum than the online rescaling. -inf entries (and the padding of a partial
// group, set to -inf) add exp(-inf) = 0; a NaN makes the sum NaN; a max of +-inf gives NaN.
template <typename T, typename Tg, int NV>
__global__ void __launch_bounds__(kLseMaxGroup)
    lse_rows_kernel(const T* logits, const Tg* targets, float* lse, double* terms, int64_t rows, int64_t vocab,
                    int64_t ld, int64_t ignore_index) {
  __shared__ float red[2][32];
  pdl_launch_dependents();  // the loss kernel may start; it waits before reading terms
  const int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool live = row < rows;
  const T* x = logits + (live ? row : 0) * ld;
  RowTarget target;
  if (live && threadIdx.x == 0) target.fetch(targets, row);
  const int width = int(vocab);  // at most kLseMaxGroup * 8 * kWidth: 32-bit column offsets
  vec::Packed8<T> u[NV];
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int c = (j * int(blockDim.x) + int(threadIdx.x)) * kWidth;
    if (live && c < width) vec::load_packed(x + c, u[j]);
    else vec::fill_neg_inf(u[j]);
  }
  if (live && threadIdx.x == 0) target.gather(x, vocab, ignore_index);
  float m = packed_max(u);
  m = group_reduce(m, red[0], [](float a, float b) { return fmaxf(a, b); });
  float s = packed_exp_sum(u, m);
  s = group_reduce(s, red[1], [](float a, float b) { return a + b; });
  if (!live || threadIdx.x != 0) return;
  const float value = lse_value(m, s);
  lse[row] = value;
  target.write(row, value, terms);
}

// The warp-row forward (the default where it applies): rows of vocab % 8 == 0 logits, row
// stride a multiple of 8 and 16-byte aligned, held by G lanes of one warp (row_lse.cuh: one
// merged (max, sum) butterfly, no barrier); 128-thread blocks of 128 / G rows. The target is
// handled as in lse_rows_kernel (lane 0: index before the row, logit after its loads).
// kWarps = 2 (kPairRows): a row too long for 32 registers of a warp's lanes goes to two warps
// (g = 32 each, 64 lanes a row, 2 rows a block), each merging its own (max, sum) and warp 0
// adding warp 1's through shared memory. At 4096 BF16 a lane then holds 8 vectors instead of
// 16: 95 registers (5 blocks, 20 warps an SM) became at most 64 (8 blocks, 32 warps), and a
// warp's exp pass over its half row is half as long, so more rows' loads are in flight while
// others compute. The sum's order changes with it (each lane adds half as many terms, then one
// more merge): deterministic, within the tests' tolerance, not the one-warp kernel's bits.
constexpr bool kPairRows = true;
constexpr int kPairMinBlocks = 8;  // 64 registers: the pair shape is chosen for <= 32 of data

template <typename T, typename Tg, int NV, int kWarps>
__global__ void __launch_bounds__(warprow::kThreads, (kWarps == 1 ? warprow::min_blocks<T, NV>() : kPairMinBlocks))
    lse_warp_kernel(const T* logits, const Tg* targets, float* lse, double* terms, int64_t rows, int vocab,
                    int64_t ld, int64_t ignore_index, int g) {
  static_assert(kWarps == 1 || kWarps == 2, "one or two warps a row");
  pdl_launch_dependents();  // the loss kernel may start; it waits before reading terms
  const int span = kWarps == 1 ? g : 64;  // lanes a row
  const int lane = int(threadIdx.x) & (span - 1);
  const int64_t row = int64_t(blockIdx.x) * (warprow::kThreads / span) + threadIdx.x / span;
  const bool live = row < rows;
  const T* x = logits + (live ? row : 0) * ld;
  RowTarget target;
  if (live && lane == 0) target.fetch(targets, row);
  warprow::RegRow<T, NV> r;
  r.load(x, live, lane, span, vocab);
  if (live && lane == 0) target.gather(x, vocab, ignore_index);
  float m, sum;
  r.lse_online(kWarps == 1 ? g : 32, m, sum);
  if constexpr (kWarps == 2) {
    __shared__ float pair_m[warprow::kThreads / 32], pair_s[warprow::kThreads / 32];
    const int warp = int(threadIdx.x) >> 5;
    if ((threadIdx.x & 31) == 0) pair_m[warp] = m, pair_s[warp] = sum;
    __syncthreads();  // every thread reaches it: no return above
    if (lane == 0) {  // warp 0 of the pair (lane 0 of the row), the same order for every row
      const float mo = pair_m[warp + 1], so = pair_s[warp + 1], mn = vec::max_nan(m, mo);
      sum = warprow::rescale(sum, m, mn) + warprow::rescale(so, mo, mn);
      m = mn;
    }
  }
  if (!live || lane != 0) return;
  const float value = lse_value(m, sum);
  lse[row] = value;
  target.write(row, value, terms);
}

// The flat backward (the default where it applies): the gradient is a map of each logit
// given its row's lse and target, so no row needs a block. The [N, V] logits are walked as
// N * V / 8 16-byte vectors (vocab, both row strides multiples of 8, both bases 16-byte
// aligned, fewer than 2^32 vectors), K per thread, a warp's contiguous: every thread issues
// its K loads first, then its rows' target and lse (cached: a row's vectors share them),
// then waits for the scale (pdl_wait: grad_scale_kernel is its programmatic predecessor).
// Short rows (768) thus fill whole blocks instead of leaving most of a 256-thread row block
// idle. Same arithmetic as grad_kernel (the FP8 backward's bytes rely on it); a bad target's
// row is NaN and reported by the thread holding its first vector; d_logits may be logits.
template <typename T, typename Out, typename Tg, int K>
__global__ void __launch_bounds__(kGradThreads, (sizeof(T) == 2 ? (K <= 4 ? 4 : 2) : 1))
    grad_flat_kernel(const T* logits, const Tg* targets, const float* lse, const float* scale_ptr, Out* d_logits,
                     uint32_t total, uint32_t vectors_per_row, int64_t vocab, int64_t ld, int64_t ld_out,
                     int64_t ignore_index, IndexErrorSink sink) {
  const uint32_t first = blockIdx.x * uint32_t(kGradThreads * K) + threadIdx.x;
  vec::Packed8<T> p[K];
  uint32_t row[K], col[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const uint32_t i = first + uint32_t(k * kGradThreads);
    row[k] = i / vectors_per_row;
    col[k] = (i - row[k] * vectors_per_row) * kWidth;
    if (i < total) vec::load_packed(logits + int64_t(row[k]) * ld + col[k], p[k]);
  }
  // Per vector, what the target makes of it (int, not the int64 target: fewer registers,
  // more vectors in flight): kIgnored, kBad, or the target's offset in the vector (0..7),
  // kWidth when it lies elsewhere in the row.
  constexpr int kIgnored = -1, kBad = -2;
  int code[K];
  float row_lse[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const bool in = first + uint32_t(k * kGradThreads) < total;
    const int64_t t = in ? static_cast<int64_t>(targets[row[k]]) : ignore_index;
    const int64_t offset = t - int64_t(col[k]);
    code[k] = t == ignore_index          ? kIgnored
              : (t < 0 || t >= vocab)   ? kBad
              : (offset >= 0 && offset < kWidth) ? int(offset)
                                                 : kWidth;
    row_lse[k] = in ? lse[row[k]] : 0.0f;
  }
  pdl_wait();  // every thread (see pdl_wait)
  const float scale = *scale_ptr;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    if (first + uint32_t(k * kGradThreads) >= total) break;
    const bool fixed = code[k] < 0;
    const float fixed_value = code[k] == kIgnored ? 0.0f : NAN;
    float w[kWidth];
    vec::unpack(p[k], w);
#pragma unroll
    for (int e = 0; e < kWidth; ++e) {
      const float q = scale * exp2f((w[e] - row_lse[k]) * kLog2e);
      w[e] = fixed ? fixed_value : (e == code[k] ? q - scale : q);
    }
    vec::store8(d_logits + int64_t(row[k]) * ld_out + col[k], w);
  }
#pragma unroll
  for (int k = 0; k < K; ++k) {
    if (first + uint32_t(k * kGradThreads) >= total) break;
    if (col[k] == 0 && code[k] == kBad) record_bad_index(sink, static_cast<int64_t>(targets[row[k]]), row[k]);
  }
}

}  // namespace

bool forward_rows_in_registers(cudaStream_t s, const Tensor& logits, const Tensor& targets, Tensor& lse,
                               Tensor& terms, int64_t ignore_index, const RowTuning& tuning) {
  const int64_t rows = logits.size(0), vocab = logits.size(1), ld = logits.stride(0);
  bool launched = false;
  dispatch_forward(logits, targets, [&](auto* tag, auto* ttag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using Tg = std::remove_pointer_t<decltype(ttag)>;
    const T* x = logits.data<T>();
    const Tg* tg = targets.data<Tg>();
    const warprow::Shape warp_shape =
        tuning.cross_entropy_forward == 0 && vocab % kWidth == 0 && ld % kWidth == 0 && vec::aligned16(x)
            ? warprow::shape_for(vocab / kWidth, int(sizeof(vec::Packed8<T>) / 4), tuning.group)
            : warprow::Shape{};
    const int unit_regs = int(sizeof(vec::Packed8<T>) / 4);
    if (kPairRows && warp_shape.nv > 0 && tuning.group == 0 && warp_shape.group == 32 &&
        warp_shape.nv * unit_regs > 32) {
      // Two warps a row (see lse_warp_kernel): 32 registers of data a lane or fewer.
      const int nv = warprow::round_nv(int((vocab / kWidth + 63) / 64));
      const unsigned blocks = static_cast<unsigned>((rows + 1) / 2);
      auto pair = [&](auto nv_tag) {
        lse_warp_kernel<T, Tg, decltype(nv_tag)::value, 2><<<blocks, warprow::kThreads, 0, s>>>(
            x, tg, lse.data<float>(), terms.data<double>(), rows, int(vocab), ld, ignore_index, 32);
      };
      if constexpr (sizeof(T) == 2) {
        if (nv <= 6) pair(std::integral_constant<int, 6>{});
        else pair(std::integral_constant<int, 8>{});
      } else {
        if (nv <= 3) pair(std::integral_constant<int, 3>{});
        else pair(std::integral_constant<int, 4>{});
      }
      launched = true;
      return;
    }
    if (warp_shape.nv > 0) {
      const int per_block = warprow::kThreads / warp_shape.group;
      const unsigned blocks = static_cast<unsigned>((rows + per_block - 1) / per_block);
      warprow::dispatch_nv<warprow::max_nv<T>()>(warp_shape.nv, [&](auto nv_tag) {
        lse_warp_kernel<T, Tg, decltype(nv_tag)::value, 1><<<blocks, warprow::kThreads, 0, s>>>(
            x, tg, lse.data<float>(), terms.data<double>(), rows, int(vocab), ld, ignore_index, warp_shape.group);
      });
      launched = true;
      return;
    }
    // Registers when the rows are 16-byte aligned and short enough; else the caller's looping kernel.
    const int64_t units = vocab % kWidth == 0 && ld % kWidth == 0 && vec::aligned16(x) ? vocab / kWidth : 0;
    // A thread holds about 32 registers of the row: 8 packed BF16 vectors or 4 F32 ones.
    const int per_thread = sizeof(T) == 2 ? 8 : 4, max_nv = sizeof(T) == 2 ? 8 : kLseMaxVectors;
    int tpr = 1;
    while (tpr < (units + per_thread - 1) / per_thread && tpr < kLseMaxGroup) tpr *= 2;
    int nv = 1;
    while (nv < (units + tpr - 1) / tpr) nv *= 2;
    if (units == 0 || nv > max_nv) return;
    const int rpb = tpr > 32 ? 1 : 128 / tpr;
    const unsigned blocks = static_cast<unsigned>((rows + rpb - 1) / rpb);
    const dim3 block(tpr, rpb);
    auto launch = [&](auto kernel) {
      kernel<<<blocks, block, 0, s>>>(x, tg, lse.data<float>(), terms.data<double>(), rows, vocab, ld,
                                      ignore_index);
    };
    if (nv == 1) launch(lse_rows_kernel<T, Tg, 1>);
    else if (nv == 2) launch(lse_rows_kernel<T, Tg, 2>);
    else if (nv == 4) launch(lse_rows_kernel<T, Tg, 4>);
    else if constexpr (sizeof(T) == 2) launch(lse_rows_kernel<T, Tg, 8>);
    launched = true;
  });
  return launched;
}

void backward_flat(cudaStream_t s, const Tensor& logits, const Tensor& targets, const Tensor& lse,
                   const Tensor& scale, Tensor& d_logits, int64_t total, int per_thread, int64_t ignore_index,
                   const IndexErrorSink& sink) {
  const int64_t vocab = logits.size(1), ld = logits.stride(0), ld_out = d_logits.stride(0);
  dispatch_backward(targets, logits, d_logits, [&](auto* ttag, auto* tag, auto* otag) {
    using Tg = std::remove_pointer_t<decltype(ttag)>;
    using T = std::remove_pointer_t<decltype(tag)>;
    using Out = std::remove_pointer_t<decltype(otag)>;
    const T* x = logits.data<T>();
    const Tg* tg = targets.data<Tg>();
    const float *lse_p = lse.data<float>(), *scale_p = scale.data<float>();
    auto launch = [&](auto kernel, int k) {
      const int64_t blocks = (total + int64_t(kGradThreads) * k - 1) / (int64_t(kGradThreads) * k);
      launch_pdl(kernel, static_cast<unsigned>(blocks), kGradThreads, s, x, tg, lse_p, scale_p, d_logits.data<Out>(),
                 static_cast<uint32_t>(total), static_cast<uint32_t>(vocab / kWidth), vocab, ld, ld_out, ignore_index,
                 sink);
    };
    if (per_thread == 8) launch(grad_flat_kernel<T, Out, Tg, 8>, 8);
    else launch(grad_flat_kernel<T, Out, Tg, 4>, 4);
  });
}

}  // namespace tessera::cuda::xent
