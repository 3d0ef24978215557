// Pieces shared by the cross-entropy kernels of loss.cu (the rules, the looping forward, the
// loss sum, the row-block backward) and loss_rows.cu (the register-row forwards and the flat
// backward): launch constants, the per-row target and loss
// term, and loss_rows.cu's two entry points. CUDA-only (included by those two .cu files).
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cuda_check.h"
#include "index_error.h"
#include "pdl.cuh"
#include "softmax_tuning.h"
#include "tessera/core/tensor.h"
#include "vec_io.cuh"

namespace tessera::cuda::xent {

constexpr int kGradThreads = 256;    // the backward: one block per row (flat: threads per block)
constexpr int kReduceThreads = 1024; // the single-block loss sum and gradient scale

// exp(d) as exp2f(d * log2(e)): one multiply and the SFU's exp2. d is x - max (or x - lse),
// exact near the max where the terms matter, so the scaling's rounding stays relative to d.
constexpr float kLog2e = 1.4426950408889634f;

// A thread's share of a row held as NV packed vectors: the largest value, and the sum of
// exp(v - m) for the row's max m. The same order of operations in every kernel that holds
// its row this way (lse_rows_kernel, the one-pass loss), so they agree to the bit.
template <int NV, typename T>
__device__ __forceinline__ float packed_max(const vec::Packed8<T> (&u)[NV]) {
  float m = -INFINITY;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    float v[vec::kWidth];
    vec::unpack(u[j], v);
#pragma unroll
    for (int k = 0; k < vec::kWidth; ++k) m = fmaxf(m, v[k]);
  }
  return m;
}

template <int NV, typename T>
__device__ __forceinline__ float packed_exp_sum(const vec::Packed8<T> (&u)[NV], float m) {
  float s = 0.0f;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    float v[vec::kWidth];
    vec::unpack(u[j], v);
#pragma unroll
    for (int k = 0; k < vec::kWidth; ++k) s += exp2f((v[k] - m) * kLog2e);
  }
  return s;
}

// The row's loss term lse - logits[n, target], in double, is written by thread 0 of the row
// next to lse; 0 for an ignored or bad target (the sum skips those rows). Thread 0 loads the
// target index before the row and the target logit once the row's loads are issued, so
// neither wait is on the row's path: the logit comes from lines the row is bringing in and
// is needed only after the reductions.
// fetch() only loads the index (code testing it there would stall the warp before the row's
// loads); gather() tests it and loads the logit, after the row's loads are issued.
struct RowTarget {
  int64_t t = 0;
  bool ok = false;
  float x = 0.0f;
  template <typename Tg>
  __device__ __forceinline__ void fetch(const Tg* targets, int64_t row) {
    t = static_cast<int64_t>(targets[row]);
  }
  template <typename T>
  __device__ __forceinline__ void gather(const T* row_logits, int64_t vocab, int64_t ignore_index) {
    ok = t != ignore_index && t >= 0 && t < vocab;
    if (ok) x = vec::load(row_logits, t);
  }
  __device__ __forceinline__ void write(int64_t row, float lse_value, double* terms) const {
    terms[row] = ok ? static_cast<double>(lse_value) - static_cast<double>(x) : 0.0;
  }
};

__device__ __forceinline__ float lse_value(float m, float s) {
  return (m == INFINITY || m == -INFINITY) ? NAN : m + logf(s);
}

template <typename Fn>
void dispatch_targets(const Tensor& targets, Fn&& fn) {
  if (targets.dtype() == DType::I64) fn(static_cast<int64_t*>(nullptr));
  else fn(static_cast<int32_t*>(nullptr));
}

// fn(T*, Tg*) with typed null pointers for the logits' and the targets' dtypes (the
// forward's kernels are templates on both).
template <typename Fn>
void dispatch_forward(const Tensor& logits, const Tensor& targets, Fn&& fn) {
  vec::dispatch(logits.dtype(), "cross_entropy_forward", [&](auto* tag) {
    dispatch_targets(targets, [&](auto* ttag) { fn(tag, ttag); });
  });
}

// fn(Tg*, T*, Out*) with typed null pointers for the targets', the logits' and the gradient's
// dtypes (the backward's kernels are templates on all three).
template <typename Fn>
void dispatch_backward(const Tensor& targets, const Tensor& logits, const Tensor& d_logits, Fn&& fn) {
  dispatch_targets(targets, [&](auto* ttag) {
    vec::dispatch(logits.dtype(), "cross_entropy_backward", [&](auto* tag) {
      vec::dispatch(d_logits.dtype(), "cross_entropy_backward", [&](auto* otag) { fn(ttag, tag, otag); });
    });
  });
}

// ---- loss_rows.cu ----------------------------------------------------------------------------

// The forward's row pass held in registers: lse[n] and terms[n] for rows [0, rows) by the
// warp-row kernel (tuning.cross_entropy_forward == 0) or the block-group register kernel,
// when vocab and the row stride are multiples of 8, the logits 16-byte aligned and the rows
// short enough. Returns false, launching nothing, otherwise: the caller takes the looping
// kernel. rows > 0. Launch errors are left to the caller's check.
bool forward_rows_in_registers(cudaStream_t s, const Tensor& logits, const Tensor& targets, Tensor& lse,
                               Tensor& terms, int64_t ignore_index, const RowTuning& tuning);

// The flat backward: d_logits from logits, lse and scale (d_loss / n_valid, written by the
// grad_scale_kernel launched just before on s: this one is its programmatic dependent), as
// `total` = rows * vocab / 8 16-byte vectors, `per_thread` (4 or 8) a thread. The caller has
// checked the layout (loss.cu: `flat`). Launch errors are left to the caller's check.
void backward_flat(cudaStream_t s, const Tensor& logits, const Tensor& targets, const Tensor& lse,
                   const Tensor& scale, Tensor& d_logits, int64_t total, int per_thread, int64_t ignore_index,
                   const IndexErrorSink& sink);

// ---- loss.cu's pieces for loss_fused.cu ------------------------------------------------------

// scale = d_loss / n_valid, one block (the kernel after it on s is its programmatic dependent).
void launch_grad_scale(cudaStream_t s, const Tensor& targets, int64_t rows, int64_t ignore_index, float d_loss,
                       Tensor& scale);
// loss = the mean of terms over the valid rows (NaN with a bad target, reported to sink), one
// block launched as a programmatic dependent of the kernel that writes terms.
void launch_loss_sum(cudaStream_t s, const Tensor& targets, const Tensor& terms, Tensor& loss, int64_t rows,
                     int64_t vocab, int64_t ignore_index, const IndexErrorSink& sink);

}  // namespace tessera::cuda::xent
