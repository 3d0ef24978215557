// Normalization layers over the last dimension: LayerNorm and RMSNorm (Llama style).
//
// x is a contiguous [..., C] tensor; every leading dimension is flattened into `rows`, and
// each row is normalized on its own. gamma and beta are [C] and may have a floating dtype
// other than x's. Outputs are preallocated by the caller and never resized.
//
// The row statistics saved for backward (mean, rstd) are F32, or F64 when x is F64; their
// shape is either [rows] or x's shape without its last dimension. The reference computes
// in double when x is F64 and in float otherwise (row and column sums in double).
//
// Gradient rule: the gradient of the input (dx) is OVERWRITTEN; the gradients of the
// parameters (dgamma, dbeta) ACCUMULATE (+=) into the caller's buffers, so summing over
// micro-batches needs no extra work. Zero them before the first micro-batch.
#pragma once

#include "tessera/core/context.h"
#include "tessera/core/tensor.h"

namespace tessera {

// y = (x - mean) * rstd * gamma + beta, with mean and the biased variance var taken over the
// last dimension, and rstd = 1 / sqrt(var + eps). beta may be undefined (no bias). Writes
// the per-row mean and rstd for layernorm_backward. y is any floating dtype, x's shape.
void layernorm_forward(Context& ctx, const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps, Tensor& y,
                       Tensor& mean, Tensor& rstd);

// With xhat = (x - mean) * rstd and g = dy * gamma:
//   dx      = rstd * (g - mean_C(g) - xhat * mean_C(g * xhat))      (overwritten)
//   dgamma += sum_rows(dy * xhat)                                    (accumulated)
//   dbeta  += sum_rows(dy)                                           (accumulated; may be undefined)
// mean and rstd are the tensors layernorm_forward wrote.
void layernorm_backward(Context& ctx, const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                        const Tensor& rstd, Tensor& dx, Tensor& dgamma, Tensor& dbeta);

// Llama RMSNorm: y = x * rstd * gamma with rstd = 1 / sqrt(mean_C(x^2) + eps). Writes the
// per-row rstd for rmsnorm_backward.
void rmsnorm_forward(Context& ctx, const Tensor& x, const Tensor& gamma, float eps, Tensor& y, Tensor& rstd);

// With xhat = x * rstd and g = dy * gamma:
//   dx      = rstd * (g - xhat * mean_C(g * xhat))    (overwritten)
//   dgamma += sum_rows(dy * xhat)                     (accumulated)
void rmsnorm_backward(Context& ctx, const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& rstd,
                      Tensor& dx, Tensor& dgamma);

}  // namespace tessera
