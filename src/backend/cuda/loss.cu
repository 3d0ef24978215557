// Cross-entropy on the GPU with the CPU reference's rules (backend/cpu/loss.cpp): per-row
// log-sum-exp, the mean over rows whose target is not ignore_index (0 when there is none),
// and the gradient (softmax - one-hot) * d_loss / n_valid, zero on ignored rows. A bad
// target (outside [0, V), not ignore_index) is reported lazily (index_error.h): the loss
// becomes NaN, the row's gradient NaN, and the next embedding/cross-entropy call throws.
//
// Layout: logits / d_logits [N, V] row-major. One 512-thread block per row. Rows of an odd
// vocabulary (GPT-2's 50257) start at any 2- or 4-byte boundary, so each row is walked as
// a scalar head up to the first 16-byte boundary, 8-element (16/32-byte) vectors, and a
// scalar tail. The forward reads each row once (online max and rescaled sum per thread,
// merged across the block), then one block sums the row losses in a fixed order
// (deterministic). The backward reads each row once and writes it once; it may run in
// place (d_logits == logits), because every element is read and written by one thread.
// Floors: forward N * V * bytes / 4.1 TB/s (1024 x 128256 BF16 = 263 MB -> 64 us);
// backward twice that.
#include <cuda_runtime.h>

#include <cmath>

#include "cuda_check.h"
#include "index_error.h"
#include "loss.h"
#include "vec_io.cuh"

namespace tessera::cuda {

namespace {

using vec::kWidth;

constexpr int kRowThreads = 512;
constexpr int kReduceThreads = 1024;

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
    a.s *= expf(a.m - vmax);  // 0 * exp(-inf) = 0; NaN stays NaN
    a.m = vmax;
  }
#pragma unroll
  for (int i = 0; i < K; ++i)
    if (v[i] != -INFINITY) a.s += expf(v[i] - a.m);
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

template <typename T>
__global__ void __launch_bounds__(kRowThreads) lse_kernel(const T* logits, float* lse, int64_t vocab, int64_t ld) {
  const T* x = logits + blockIdx.x * ld;
  const int64_t head = min(vec::misalignment_head(x), vocab);
  const int64_t vectors = (vocab - head) / kWidth;
  Lse acc;
  for (int64_t v = threadIdx.x; v < head; v += kRowThreads) lse_add<1>(acc, {vec::load(x, v)});
  for (int64_t u = threadIdx.x; u < vectors; u += kRowThreads) {
    float v[kWidth];
    vec::load8(x + head + u * kWidth, v);
    lse_add<kWidth>(acc, v);
  }
  for (int64_t v = head + vectors * kWidth + threadIdx.x; v < vocab; v += kRowThreads)
    lse_add<1>(acc, {vec::load(x, v)});
  const Lse row = block_lse(acc);
  if (threadIdx.x == 0) lse[blockIdx.x] = (row.m == INFINITY || row.m == -INFINITY) ? NAN : row.m + logf(row.s);
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

// loss = sum over valid rows of (lse[n] - logits[n, target]) / n_valid, in double; NaN when
// a target is bad. One block of kReduceThreads; thread i takes rows i, i + 1024, ...
template <typename T, typename Tg>
__global__ void __launch_bounds__(kReduceThreads)
    loss_kernel(const T* logits, const Tg* targets, const float* lse, void* loss, bool loss_f64, int64_t rows,
                int64_t vocab, int64_t ld, int64_t ignore_index, IndexErrorSink sink) {
  double sum = 0;
  int64_t valid = 0, bad = 0;
  for (int64_t n = threadIdx.x; n < rows; n += kReduceThreads) {
    const int64_t t = static_cast<int64_t>(targets[n]);
    if (t == ignore_index) continue;
    if (t < 0 || t >= vocab) {
      record_bad_index(sink, t, n);
      ++bad;
      continue;
    }
    ++valid;
    sum += static_cast<double>(lse[n]) - static_cast<double>(vec::load(logits, n * ld + t));
  }
  sum = block_sum(sum);
  valid = block_sum(valid);
  bad = block_sum(bad);
  if (threadIdx.x != 0) return;
  const double value = bad > 0 ? NAN : (valid > 0 ? sum / static_cast<double>(valid) : 0.0);
  if (loss_f64) *static_cast<double*>(loss) = value;
  else *static_cast<float*>(loss) = static_cast<float>(value);
}

// scale = d_loss / n_valid (0 when no row is valid), rounded once to float as the CPU does.
template <typename Tg>
__global__ void __launch_bounds__(kReduceThreads)
    grad_scale_kernel(const Tg* targets, int64_t rows, int64_t ignore_index, float d_loss, float* scale) {
  int64_t valid = 0;
  for (int64_t n = threadIdx.x; n < rows; n += kReduceThreads)
    valid += static_cast<int64_t>(targets[n]) != ignore_index;
  valid = block_sum(valid);
  if (threadIdx.x == 0)
    *scale = valid > 0 ? static_cast<float>(static_cast<double>(d_loss) / static_cast<double>(valid)) : 0.0f;
}

// ---- Backward ------------------------------------------------------------------------------

// Applies y[v] = f(v, x[v]) over one row with the block: scalar head to x's first 16-byte
// boundary, 8-element vectors, scalar tail (all scalar when y is not aligned with x).
// Each element is read and written by the same thread, so y may be x.
template <typename In, typename Out, typename F>
__device__ __forceinline__ void map_row(const In* x, Out* y, int64_t n, F f) {
  const int64_t head = min(vec::misalignment_head(x), n);
  const int64_t vectors = (n - head) / kWidth;
  if (vectors == 0 || !vec::aligned16(y + head)) {
    for (int64_t v = threadIdx.x; v < n; v += blockDim.x) vec::store(y, v, f(v, vec::load(x, v)));
    return;
  }
  for (int64_t v = threadIdx.x; v < head; v += blockDim.x) vec::store(y, v, f(v, vec::load(x, v)));
  for (int64_t u = threadIdx.x; u < vectors; u += blockDim.x) {
    const int64_t v0 = head + u * kWidth;
    float w[kWidth];
    vec::load8(x + v0, w);
#pragma unroll
    for (int k = 0; k < kWidth; ++k) w[k] = f(v0 + k, w[k]);
    vec::store8(y + v0, w);
  }
  for (int64_t v = head + vectors * kWidth + threadIdx.x; v < n; v += blockDim.x)
    vec::store(y, v, f(v, vec::load(x, v)));
}

template <typename Out>
__device__ __forceinline__ void fill_row(Out* y, int64_t n, float value) {
  const int64_t head = min(vec::misalignment_head(y), n);
  const int64_t vectors = (n - head) / kWidth;
  float w[kWidth];
#pragma unroll
  for (int k = 0; k < kWidth; ++k) w[k] = value;
  for (int64_t v = threadIdx.x; v < head; v += blockDim.x) vec::store(y, v, value);
  for (int64_t u = threadIdx.x; u < vectors; u += blockDim.x) vec::store8(y + head + u * kWidth, w);
  for (int64_t v = head + vectors * kWidth + threadIdx.x; v < n; v += blockDim.x) vec::store(y, v, value);
}

template <typename T, typename Out, typename Tg>
__global__ void __launch_bounds__(kRowThreads)
    grad_kernel(const T* logits, const Tg* targets, const float* lse, const float* scale_ptr, Out* d_logits,
                int64_t vocab, int64_t ld, int64_t ld_out, int64_t ignore_index, IndexErrorSink sink) {
  const int64_t row = blockIdx.x;
  Out* g = d_logits + row * ld_out;
  const int64_t t = static_cast<int64_t>(targets[row]);
  if (t == ignore_index) {  // written directly: 0 * (NaN or inf logits) would not be 0
    fill_row(g, vocab, 0.0f);
    return;
  }
  if (t < 0 || t >= vocab) {
    if (threadIdx.x == 0) record_bad_index(sink, t, row);
    fill_row(g, vocab, NAN);
    return;
  }
  const float scale = *scale_ptr, row_lse = lse[row];
  map_row(logits + row * ld, g, vocab, [&](int64_t v, float x) {
    const float p = scale * expf(x - row_lse);
    return v == t ? p - scale : p;
  });
}

template <typename Fn>
void dispatch_targets(const Tensor& targets, Fn&& fn) {
  if (targets.dtype() == DType::I64) fn(static_cast<int64_t*>(nullptr));
  else fn(static_cast<int32_t*>(nullptr));
}

}  // namespace

bool cross_entropy_forward_supported(const Tensor& logits, const Tensor& loss, const Tensor& lse) {
  return vec::is_f32_or_bf16(logits.dtype()) && lse.dtype() == DType::F32 &&
         (loss.dtype() == DType::F32 || loss.dtype() == DType::F64);
}

void cross_entropy_forward(void* stream, const Tensor& logits, const Tensor& targets, Tensor& loss, Tensor& lse,
                           int64_t ignore_index) {
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TESSERA_CHECK(rows <= 0x7fffffff, "cross_entropy_forward on CUDA: ", rows, " rows exceed one grid");
  auto s = static_cast<cudaStream_t>(stream);
  const IndexErrorSink sink =
      index_error_sink(logits.device().index, IndexOp::CrossEntropyForward, vocab, ignore_index);
  vec::dispatch(logits.dtype(), "cross_entropy_forward", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if (rows > 0)
      lse_kernel<T><<<static_cast<unsigned>(rows), kRowThreads, 0, s>>>(logits.data<T>(), lse.data<float>(), vocab,
                                                                         logits.stride(0));
    dispatch_targets(targets, [&](auto* ttag) {
      using Tg = std::remove_pointer_t<decltype(ttag)>;
      // Also for rows = 0: the loss is then written as 0.
      loss_kernel<T, Tg><<<1, kReduceThreads, 0, s>>>(logits.data<T>(), targets.data<Tg>(), lse.data<float>(),
                                                      loss.raw_data(), loss.dtype() == DType::F64, rows, vocab,
                                                      logits.stride(0), ignore_index, sink);
    });
  });
  TESSERA_CUDA_CHECK_LAUNCH();
}

bool cross_entropy_backward_supported(const Tensor& logits, const Tensor& lse, const Tensor& d_logits) {
  return vec::is_f32_or_bf16(logits.dtype()) && vec::is_f32_or_bf16(d_logits.dtype()) && lse.dtype() == DType::F32;
}

void cross_entropy_backward(void* stream, const Tensor& logits, const Tensor& targets, const Tensor& lse,
                            float d_loss, Tensor& d_logits, int64_t ignore_index) {
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  if (rows == 0) return;
  TESSERA_CHECK(rows <= 0x7fffffff, "cross_entropy_backward on CUDA: ", rows, " rows exceed one grid");
  auto s = static_cast<cudaStream_t>(stream);
  const IndexErrorSink sink =
      index_error_sink(logits.device().index, IndexOp::CrossEntropyBackward, vocab, ignore_index);
  Tensor scale = Tensor::empty({1}, DType::F32, logits.device());  // d_loss / n_valid, computed on the device
  dispatch_targets(targets, [&](auto* ttag) {
    using Tg = std::remove_pointer_t<decltype(ttag)>;
    grad_scale_kernel<Tg><<<1, kReduceThreads, 0, s>>>(targets.data<Tg>(), rows, ignore_index, d_loss,
                                                       scale.data<float>());
    vec::dispatch(logits.dtype(), "cross_entropy_backward", [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      vec::dispatch(d_logits.dtype(), "cross_entropy_backward", [&](auto* otag) {
        using Out = std::remove_pointer_t<decltype(otag)>;
        grad_kernel<T, Out, Tg><<<static_cast<unsigned>(rows), kRowThreads, 0, s>>>(
            logits.data<T>(), targets.data<Tg>(), lse.data<float>(), scale.data<float>(), d_logits.data<Out>(), vocab,
            logits.stride(0), d_logits.stride(0), ignore_index, sink);
      });
    });
  });
  TESSERA_CUDA_CHECK_LAUNCH();
}

}  // namespace tessera::cuda
