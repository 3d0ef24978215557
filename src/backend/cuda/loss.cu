// Cross-entropy on the GPU with the CPU reference's rules (backend/cpu/loss.cpp): per-row
// log-sum-exp, the mean over rows whose target is not ignore_index (0 when there is none),
// and the gradient (softmax - one-hot) * d_loss / n_valid, zero on ignored rows. A bad
// target (outside [0, V), not ignore_index) is reported lazily (index_error.h): the loss
// becomes NaN, the row's gradient NaN, and the next embedding/cross-entropy call throws.
//
// Layout: logits / d_logits [N, V] row-major (row stride >= V). Forward, one read of each
// row: rows that loss_rows.cu's register-row kernels take (V and stride multiples of 8,
// 16-byte aligned, short enough) go there; wider or unaligned rows (GPT-2's 50257 starts
// rows at any 2- or 4-byte boundary) take one 512-thread block per row here, walked as a
// scalar head up to the first 16-byte boundary, 8-element vectors (four in flight per
// thread) and a scalar tail, with an online max and rescaled sum per thread merged across
// the block. Thread 0 of a row loads the target index before the row and the target logit
// after issuing the row's loads, so the row's term lse - logits[n, target] costs no memory
// round trip after the reductions. One block (a programmatic dependent launch: it counts
// the targets while the last rows run, then waits) sums the terms in a fixed order
// (deterministic; with shuffles after the warp-row forward). Backward: a one-block kernel
// computes d_loss / n_valid; the gradient kernel (its programmatic dependent) starts at
// once: loss_rows.cu's flat backward where it applies, else the row kernel here, 256
// threads a row, two vectors in flight per thread, reading the scale after its first loads
// are issued; the row's target and lse are loaded beside the row and ignored / bad rows go
// through the same walk (a select), so no load waits on another. It may run in place
// (d_logits == logits): every element is read and written by one thread.
// Floors: forward N * V * bytes / 4.1 TB/s (1024 x 128256 BF16 = 263 MB -> 64 us);
// backward twice that. Measured on the H200 against cudaMemcpy D2D (3.8 TB/s) in the same
// run (bench_bandwidth, 16384 x 4096 BF16): the row backward 66 -> 68%, then with the
// target and lse loaded beside the row, PDL and exp2 (2026-11-30): 72%; at 16384 x 768
// (rows of 1.5 KB, launch and tail bound) 44%. The forward's figures of those runs are
// the register-row kernels' (loss_rows.cu).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "cuda_check.h"
#include "index_error.h"
#include "loss.h"
#include "loss_kernels.cuh"
#include "softmax_tuning.h"
#include "vec_io.cuh"

namespace tessera::cuda {

namespace xent {

namespace {

using vec::kWidth;

constexpr int kRowThreads = 512;     // the looping forward kernel: one block per row
constexpr int kUnroll = 8;           // rows per thread per step of the single-block sums
constexpr int kRowVectors = 4;       // the looping forward kernel: vectors in flight per thread

// ---- Online log-sum-exp ------------------------------------------------------------------
//
// (m, s) stands for s * exp(m): a running max and the sum of exp(x - m). -inf entries add
// nothing (so masked logits before the first finite one do not make 0 * inf), NaN
// entries make s NaN. A row whose max is +-inf gets NaN, as exp(inf - inf) gives on the CPU.

struct Lse {
  float m = -INFINITY, s = 0.0f;
};

template <int K>
__device__ __forceinline__ void lse_add(Lse& a, const float (&v)[K]) {
  float vmax = -INFINITY;
#pragma unroll
  for (int i = 0; i < K; ++i) vmax = fmaxf(vmax, v[i]);
  if (vmax > a.m) {
    a.s *= exp2f((a.m - vmax) * kLog2e);  // 0 * exp(-inf) = 0; NaN stays NaN
    a.m = vmax;
  }
#pragma unroll
  for (int i = 0; i < K; ++i)
    if (v[i] != -INFINITY) a.s += exp2f((v[i] - a.m) * kLog2e);
}

__device__ __forceinline__ float lse_rescaled(float s, float m, float to) {
  return m == -INFINITY ? s : s * expf(m - to);
}

__device__ __forceinline__ Lse lse_merge(Lse a, Lse b) {
  Lse r;
  r.m = fmaxf(a.m, b.m);
  r.s = lse_rescaled(a.s, a.m, r.m) + lse_rescaled(b.s, b.m, r.m);
  return r;
}

// Reduces one Lse per thread of a kRowThreads block; every thread gets the result.
__device__ Lse block_lse(Lse v) {
  __shared__ float shared_m[32], shared_s[32];
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    Lse other;
    other.m = __shfl_xor_sync(0xffffffffu, v.m, offset);
    other.s = __shfl_xor_sync(0xffffffffu, v.s, offset);
    v = lse_merge(v, other);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) shared_m[warp] = v.m, shared_s[warp] = v.s;
  __syncthreads();
  Lse r;
  for (int w = 0; w < kRowThreads / 32; ++w) r = lse_merge(r, Lse{shared_m[w], shared_s[w]});
  return r;
}

// One block per row of any width and alignment: a scalar head to the first 16-byte
// boundary, kRowVectors vectors in flight per thread per step, a scalar tail; an online
// (max, rescaled sum) per thread, merged across the block. One read of the row.
template <typename T, typename Tg>
__global__ void __launch_bounds__(kRowThreads)
    lse_kernel(const T* logits, const Tg* targets, float* lse, double* terms, int64_t vocab, int64_t ld,
               int64_t ignore_index) {
  const T* x = logits + blockIdx.x * ld;
  pdl_launch_dependents();  // the loss kernel may start; it waits before reading terms
  RowTarget target;
  if (threadIdx.x == 0) target.fetch(targets, blockIdx.x);
  const int64_t head = min(vec::misalignment_head(x), vocab);
  const int64_t vectors = (vocab - head) / kWidth;
  Lse acc;
  for (int64_t c = threadIdx.x; c < head; c += kRowThreads) lse_add<1>(acc, {vec::load(x, c)});
  for (int64_t u0 = threadIdx.x; u0 < vectors; u0 += int64_t(kRowVectors) * kRowThreads) {
    vec::Packed8<T> p[kRowVectors];
#pragma unroll
    for (int q = 0; q < kRowVectors; ++q) {
      const int64_t u = u0 + int64_t(q) * kRowThreads;
      if (u < vectors) vec::load_packed(x + head + u * kWidth, p[q]);
    }
#pragma unroll
    for (int q = 0; q < kRowVectors; ++q) {
      if (u0 + int64_t(q) * kRowThreads >= vectors) break;
      float v[kWidth];
      vec::unpack(p[q], v);
      lse_add<kWidth>(acc, v);
    }
  }
  for (int64_t c = head + vectors * kWidth + threadIdx.x; c < vocab; c += kRowThreads) lse_add<1>(acc, {vec::load(x, c)});
  if (threadIdx.x == 0) target.gather(x, vocab, ignore_index);  // an L2 hit: the row was just read
  const Lse row = block_lse(acc);
  if (threadIdx.x != 0) return;
  const float value = lse_value(row.m, row.s);
  lse[blockIdx.x] = value;
  target.write(blockIdx.x, value, terms);
}

// ---- Fixed-order block sums ---------------------------------------------------------------

template <typename V>
__device__ V block_sum(V v) {
  __shared__ V shared[kReduceThreads];
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int stride = kReduceThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) shared[threadIdx.x] += shared[threadIdx.x + stride];
    __syncthreads();
  }
  const V result = shared[0];
  __syncthreads();  // shared is rewritten by the next call
  return result;
}

// The same sum over a kReduceThreads block in a fixed order with shuffles: a butterfly per
// warp, then one over the 32 warp sums (two barrier-free steps and one barrier, against the
// tree's eleven). `shared`: 32 entries, one array per call site (no reuse: no trailing barrier).
template <typename V>
__device__ __forceinline__ V warp_sum(V v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}
template <typename V>
__device__ __forceinline__ V block_sum_shfl(V v, V* shared) {
  v = warp_sum(v);
  if ((threadIdx.x & 31) == 0) shared[threadIdx.x >> 5] = v;
  __syncthreads();
  return warp_sum(threadIdx.x % 32 < kReduceThreads / 32 ? shared[threadIdx.x % 32] : V(0));
}

// loss = sum over valid rows of terms[n] (= lse[n] - logits[n, target]) / n_valid, in double;
// NaN when a target is bad. One block of kReduceThreads; thread i takes rows i, i + 1024, ...
// in that order, loading kUnroll of them before adding (the loads overlap; the order of the
// additions does not change). Ignored and bad rows have terms[n] = 0, so all terms are
// added: the same bits as adding the valid ones only. Launched as a programmatic dependent
// of the row kernel: the targets (written before that kernel) are counted while its last
// rows run; the terms only after pdl_wait.
// kFast (the warp-row path's): the counts are reduced before pdl_wait, with shuffles.
template <typename Tg, bool kFast>
__global__ void __launch_bounds__(kReduceThreads)
    loss_kernel(const Tg* targets, const double* terms, void* loss, bool loss_f64, int64_t rows, int64_t vocab,
                int64_t ignore_index, IndexErrorSink sink) {
  int64_t valid = 0, bad = 0;
  for (int64_t n0 = threadIdx.x; n0 < rows; n0 += int64_t(kUnroll) * kReduceThreads) {
    int64_t t[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t n = n0 + int64_t(u) * kReduceThreads;
      t[u] = n < rows ? static_cast<int64_t>(targets[n]) : ignore_index;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (t[u] == ignore_index) continue;
      if (t[u] < 0 || t[u] >= vocab) {
        record_bad_index(sink, t[u], n0 + int64_t(u) * kReduceThreads);
        ++bad;
        continue;
      }
      ++valid;
    }
  }
  __shared__ int64_t shared_valid[32], shared_bad[32];
  __shared__ double shared_sum[32];
  if constexpr (kFast) {
    valid = block_sum_shfl(valid, shared_valid);
    bad = block_sum_shfl(bad, shared_bad);
  }
  pdl_wait();
  // kFast: 16 terms in flight per thread, so up to 16384 rows cost one round trip after the
  // wait (the addition order is the same: row i, i + 1024, ... per thread).
  constexpr int kTerms = kFast ? 16 : kUnroll;
  double sum = 0;
  for (int64_t n0 = threadIdx.x; n0 < rows; n0 += int64_t(kTerms) * kReduceThreads) {
    double term[kTerms];
#pragma unroll
    for (int u = 0; u < kTerms; ++u) {
      const int64_t n = n0 + int64_t(u) * kReduceThreads;
      term[u] = n < rows ? terms[n] : 0.0;
    }
#pragma unroll
    for (int u = 0; u < kTerms; ++u) sum += term[u];
  }
  if constexpr (kFast) {
    sum = block_sum_shfl(sum, shared_sum);
  } else {
    sum = block_sum(sum);
    valid = block_sum(valid);
    bad = block_sum(bad);
  }
  if (threadIdx.x != 0) return;
  const double value = bad > 0 ? NAN : (valid > 0 ? sum / static_cast<double>(valid) : 0.0);
  if (loss_f64) *static_cast<double*>(loss) = value;
  else *static_cast<float*>(loss) = static_cast<float>(value);
}

// scale = d_loss / n_valid (0 when no row is valid), rounded once to float as the CPU does.
// It lets the gradient kernel (its programmatic dependent) start at once: that kernel loads
// its rows, then waits for this one's result.
template <typename Tg, bool kFast>
__global__ void __launch_bounds__(kReduceThreads)
    grad_scale_kernel(const Tg* targets, int64_t rows, int64_t ignore_index, float d_loss, float* scale) {
  pdl_launch_dependents();
  constexpr int kTargets = kFast ? 16 : kUnroll;  // kFast: 16384 rows in one round trip
  int64_t valid = 0;
  for (int64_t n0 = threadIdx.x; n0 < rows; n0 += int64_t(kTargets) * kReduceThreads) {
    int64_t t[kTargets];
#pragma unroll
    for (int u = 0; u < kTargets; ++u) {
      const int64_t n = n0 + int64_t(u) * kReduceThreads;
      t[u] = n < rows ? static_cast<int64_t>(targets[n]) : ignore_index;
    }
#pragma unroll
    for (int u = 0; u < kTargets; ++u) valid += t[u] != ignore_index;
  }
  if constexpr (kFast) {
    __shared__ int64_t shared_valid[32];
    valid = block_sum_shfl(valid, shared_valid);
  } else {
    valid = block_sum(valid);
  }
  if (threadIdx.x == 0)
    *scale = valid > 0 ? static_cast<float>(static_cast<double>(d_loss) / static_cast<double>(valid)) : 0.0f;
}

// ---- Backward ------------------------------------------------------------------------------

// Applies y[v] = f(v, x[v]) over one row with the block: scalar head to x's first 16-byte
// boundary, 8-element vectors, scalar tail (all scalar when y is not aligned with x).
// Each element is read and written by the same thread, so y may be x. ready() runs once per
// thread before its first f, after the loads of its first vector step are issued (before
// anything else on the scalar paths), so whatever it waits for overlaps those loads.
template <typename In, typename Out, typename Ready, typename F>
__device__ __forceinline__ void map_row(const In* x, Out* y, int64_t n, Ready ready, F f) {
  const int64_t head = min(vec::misalignment_head(x), n);
  const int64_t vectors = (n - head) / kWidth;
  if (vectors == 0 || !vec::aligned16(y + head)) {
    ready();
    for (int64_t v = threadIdx.x; v < n; v += blockDim.x) vec::store(y, v, f(v, vec::load(x, v)));
    return;
  }
  bool waited = false;
  if (head > 0) {
    ready();
    waited = true;
  }
  for (int64_t v = threadIdx.x; v < head; v += blockDim.x) vec::store(y, v, f(v, vec::load(x, v)));
  // Two vectors per thread per step, both loaded before either is stored.
  for (int64_t u = threadIdx.x; u < vectors; u += 2 * int64_t(blockDim.x)) {
    const int64_t u1 = u + blockDim.x;
    const int64_t v0 = head + u * kWidth, v1 = head + u1 * kWidth;
    float w0[kWidth], w1[kWidth];
    vec::load8(x + v0, w0);
    if (u1 < vectors) vec::load8(x + v1, w1);
    if (!waited) {
      ready();
      waited = true;
    }
#pragma unroll
    for (int k = 0; k < kWidth; ++k) w0[k] = f(v0 + k, w0[k]);
    vec::store8(y + v0, w0);
    if (u1 < vectors) {
#pragma unroll
      for (int k = 0; k < kWidth; ++k) w1[k] = f(v1 + k, w1[k]);
      vec::store8(y + v1, w1);
    }
  }
  if (!waited) ready();
  for (int64_t v = head + vectors * kWidth + threadIdx.x; v < n; v += blockDim.x)
    vec::store(y, v, f(v, vec::load(x, v)));
}

// The row's loads come first: the target, lse and the scale (from grad_scale_kernel, this
// kernel's programmatic predecessor: read after pdl_wait) are loaded in map_row's ready(),
// once the thread's first vectors are in flight, so their latency overlaps the row's (code
// that tested the target before the walk would stall the warp on it). An ignored row (0)
// or a bad target (NaN) goes through the same walk, the value selected per element (0 * NaN
// or inf logits would not be 0): that costs a read of each ignored row.
template <typename T, typename Out, typename Tg>
__global__ void __launch_bounds__(kGradThreads)
    grad_kernel(const T* logits, const Tg* targets, const float* lse, const float* scale_ptr, Out* d_logits,
                int64_t vocab, int64_t ld, int64_t ld_out, int64_t ignore_index, IndexErrorSink sink) {
  const int64_t row = blockIdx.x;
  int64_t t = 0;
  float row_lse = 0.0f, scale = 0.0f, fixed_value = 0.0f;
  bool fixed = false;
  map_row(
      logits + row * ld, d_logits + row * ld_out, vocab,
      [&] {
        t = static_cast<int64_t>(targets[row]);
        row_lse = lse[row];
        pdl_wait();
        scale = *scale_ptr;
        const bool ignored = t == ignore_index;
        fixed = ignored || t < 0 || t >= vocab;
        fixed_value = ignored ? 0.0f : NAN;
      },
      [&](int64_t v, float x) {
        const float p = scale * exp2f((x - row_lse) * kLog2e);
        return fixed ? fixed_value : (v == t ? p - scale : p);
      });
  pdl_wait();  // every thread, also one without elements (see pdl_wait)
  // After the walk: a store the compiler cannot tell from the row's would hold back its loads.
  if (threadIdx.x == 0) {
    const int64_t tt = static_cast<int64_t>(targets[row]);
    if (tt != ignore_index && (tt < 0 || tt >= vocab)) record_bad_index(sink, tt, row);
  }
}

}  // namespace

void launch_grad_scale(cudaStream_t s, const Tensor& targets, int64_t rows, int64_t ignore_index, float d_loss,
                       Tensor& scale) {
  dispatch_targets(targets, [&](auto* ttag) {
    using Tg = std::remove_pointer_t<decltype(ttag)>;
    grad_scale_kernel<Tg, true><<<1, kReduceThreads, 0, s>>>(targets.data<Tg>(), rows, ignore_index, d_loss,
                                                             scale.data<float>());
  });
}

void launch_loss_sum(cudaStream_t s, const Tensor& targets, const Tensor& terms, Tensor& loss, int64_t rows,
                     int64_t vocab, int64_t ignore_index, const IndexErrorSink& sink) {
  dispatch_targets(targets, [&](auto* ttag) {
    using Tg = std::remove_pointer_t<decltype(ttag)>;
    launch_pdl(loss_kernel<Tg, true>, 1, kReduceThreads, s, targets.data<Tg>(),
               static_cast<const double*>(terms.data<double>()), loss.raw_data(), loss.dtype() == DType::F64, rows,
               vocab, ignore_index, sink);
  });
}

}  // namespace xent

bool cross_entropy_forward_supported(const Tensor& logits, const Tensor& loss, const Tensor& lse) {
  return vec::is_f32_or_bf16(logits.dtype()) && lse.dtype() == DType::F32 &&
         (loss.dtype() == DType::F32 || loss.dtype() == DType::F64);
}

void cross_entropy_forward(void* stream, const Tensor& logits, const Tensor& targets, Tensor& loss, Tensor& lse,
                           int64_t ignore_index) {
  using namespace xent;
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TESSERA_CHECK(rows <= 0x7fffffff, "cross_entropy_forward on CUDA: ", rows, " rows exceed one grid");
  auto s = static_cast<cudaStream_t>(stream);
  const IndexErrorSink sink =
      index_error_sink(logits.device().index, IndexOp::CrossEntropyForward, vocab, ignore_index);
  // terms[n] = lse[n] - logits[n, target]: written beside lse, summed by loss_kernel.
  Tensor terms = Tensor::empty({std::max<int64_t>(rows, 1)}, DType::F64, logits.device());
  const int64_t ld = logits.stride(0);
  dispatch_forward(logits, targets, [&](auto* tag, auto* ttag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using Tg = std::remove_pointer_t<decltype(ttag)>;
    const T* x = logits.data<T>();
    const Tg* tg = targets.data<Tg>();
    const RowTuning tuning = row_tuning();
    // The register-row kernels (loss_rows.cu) where the rows allow them; else the looping kernel.
    if (rows > 0 && !forward_rows_in_registers(s, logits, targets, lse, terms, ignore_index, tuning)) {
      lse_kernel<T, Tg><<<static_cast<unsigned>(rows), kRowThreads, 0, s>>>(x, tg, lse.data<float>(),
                                                                            terms.data<double>(), vocab, ld,
                                                                            ignore_index);
    }
    // Also for rows = 0: the loss is then written as 0.
    auto loss_launch = [&](auto kernel) {
      launch_pdl(kernel, 1, kReduceThreads, s, tg, static_cast<const double*>(terms.data<double>()),
                 loss.raw_data(), loss.dtype() == DType::F64, rows, vocab, ignore_index, sink);
    };
    if (tuning.cross_entropy_forward == 0) loss_launch(loss_kernel<Tg, true>);
    else loss_launch(loss_kernel<Tg, false>);
  });
  TESSERA_CUDA_CHECK_LAUNCH();
}

bool cross_entropy_backward_supported(const Tensor& logits, const Tensor& lse, const Tensor& d_logits) {
  return vec::is_f32_or_bf16(logits.dtype()) && vec::is_f32_or_bf16(d_logits.dtype()) && lse.dtype() == DType::F32;
}

void cross_entropy_backward(void* stream, const Tensor& logits, const Tensor& targets, const Tensor& lse,
                            float d_loss, Tensor& d_logits, int64_t ignore_index) {
  using namespace xent;
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  if (rows == 0) return;
  TESSERA_CHECK(rows <= 0x7fffffff, "cross_entropy_backward on CUDA: ", rows, " rows exceed one grid");
  auto s = static_cast<cudaStream_t>(stream);
  const IndexErrorSink sink =
      index_error_sink(logits.device().index, IndexOp::CrossEntropyBackward, vocab, ignore_index);
  Tensor scale = Tensor::empty({1}, DType::F32, logits.device());  // d_loss / n_valid, computed on the device
  const RowTuning tuning = row_tuning();
  const int64_t ld = logits.stride(0), ld_out = d_logits.stride(0);
  const int64_t total = rows * (vocab / kWidth);
  const bool flat = tuning.cross_entropy_backward == 0 && vocab % kWidth == 0 && ld % kWidth == 0 &&
                    ld_out % kWidth == 0 && vec::aligned16(logits.raw_data()) && vec::aligned16(d_logits.raw_data()) &&
                    total > 0 && total < (int64_t(1) << 32) - int64_t(kGradThreads) * 8;
  const int per_thread = tuning.backward_vectors == 8 ? 8 : 4;
  dispatch_targets(targets, [&](auto* ttag) {
    using Tg = std::remove_pointer_t<decltype(ttag)>;
    if (flat)
      grad_scale_kernel<Tg, true><<<1, kReduceThreads, 0, s>>>(targets.data<Tg>(), rows, ignore_index, d_loss,
                                                               scale.data<float>());
    else
      grad_scale_kernel<Tg, false><<<1, kReduceThreads, 0, s>>>(targets.data<Tg>(), rows, ignore_index, d_loss,
                                                                scale.data<float>());
  });
  if (flat) {
    backward_flat(s, logits, targets, lse, scale, d_logits, total, per_thread, ignore_index, sink);  // loss_rows.cu
  } else {
    dispatch_backward(targets, logits, d_logits, [&](auto* ttag, auto* tag, auto* otag) {
      using Tg = std::remove_pointer_t<decltype(ttag)>;
      using T = std::remove_pointer_t<decltype(tag)>;
      using Out = std::remove_pointer_t<decltype(otag)>;
      launch_pdl(grad_kernel<T, Out, Tg>, static_cast<unsigned>(rows), kGradThreads, s, logits.data<T>(),
                 targets.data<Tg>(), lse.data<float>(), scale.data<float>(), d_logits.data<Out>(), vocab, ld, ld_out,
                 ignore_index, sink);
    });
  }
  TESSERA_CUDA_CHECK_LAUNCH();
}

}  // namespace tessera::cuda
