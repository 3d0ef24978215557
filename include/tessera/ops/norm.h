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
#include "tessera/fp8/quantized_tensor.h"

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

// ---- Residual add fused into the norm (pre-norm Transformer: h = x + branch; y = norm(h)) ----
//
// Each equals the plain ops composed, bit for bit on the CPU, with one pass over memory on
// the GPU. Tensors other than the parameters and statistics are x's shape.

// sum_out = x + residual, rounded to sum_out's dtype (which must be x's) exactly as add()
// rounds; then layernorm_forward(sum_out, ...) on that ROUNDED sum, writing y, mean, rstd.
// The sum is the residual stream that continues past the norm, and the x to pass to
// layernorm_backward(_add). sum_out may be x or residual itself (an in-place residual
// stream); so may y, as long as it is not sum_out. Other overlaps are an error.
void add_layernorm_forward(Context& ctx, const Tensor& x, const Tensor& residual, const Tensor& gamma,
                           const Tensor& beta, float eps, Tensor& sum_out, Tensor& y, Tensor& mean, Tensor& rstd);

// sum_out = x + residual (as above); then rmsnorm_forward(sum_out, ...).
void add_rmsnorm_forward(Context& ctx, const Tensor& x, const Tensor& residual, const Tensor& gamma, float eps,
                         Tensor& sum_out, Tensor& y, Tensor& rstd);

// dx = layernorm_backward's dx (rounded to dx's dtype) + d_residual_in, rounded as add()
// rounds: the gradient through the norm plus the one arriving along the residual path, in
// one pass. x is the forward's sum. dgamma/dbeta accumulate as in layernorm_backward. dx may
// be d_residual_in, dy or x itself (other overlaps are an error).
void layernorm_backward_add(Context& ctx, const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                            const Tensor& rstd, const Tensor& d_residual_in, Tensor& dx, Tensor& dgamma,
                            Tensor& dbeta);

// dx = rmsnorm_backward's dx + d_residual_in (as above); dgamma accumulates.
void rmsnorm_backward_add(Context& ctx, const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& rstd,
                          const Tensor& d_residual_in, Tensor& dx, Tensor& dgamma);

// ---- FP8 output: the norm feeding an FP8 GEMM -------------------------------------------------
//
// The norm's y, rounded to x's dtype as the plain op stores it, cast to E4M3 with a per-tensor
// scale, q = fp8(y * scale[0]) (quantize_per_tensor's rule), and its amax max |y|, without y
// itself being written unless a copy is asked for. Each op is the plain op followed by
// quantize_per_tensor: on the CPU literally so (the reference), on CUDA in the norm's own pass
// (backend/cuda/norm_fp8.cu: x read once, one FP8 byte written per element). mean, rstd and
// the add forms' sum_out are written exactly as by the plain ops, for their backward, which
// is unchanged (it needs x and the statistics, never y). Delayed scaling passes the scale it
// already has; current scaling, whose scale depends on this amax, runs the op without q (the
// statistics pass), turns the amax into a scale (fp8::scale_from_amax) and casts with the
// apply op below, which recomputes y from x and the statistics bit for bit.
struct NormFp8Output {
  Tensor q;     // E4M3, x's shape, contiguous; undefined: the statistics pass (nothing cast)
  Tensor amax;  // F32 [1] or undefined: max |y| (NaN if any y is), overwritten; needed without q
  Tensor y;     // x's shape and dtype, or undefined: a copy of the unquantized output
};

// scale F32 [1] (read only when out.q is defined); x F32 or BF16 on CUDA (with parameters as
// for the plain ops). out.amax must not overlap scale; out.y must not overlap x or the sum.
void layernorm_forward_fp8(Context& ctx, const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps,
                           const Tensor& scale, NormFp8Output& out, Tensor& mean, Tensor& rstd);
void rmsnorm_forward_fp8(Context& ctx, const Tensor& x, const Tensor& gamma, float eps, const Tensor& scale,
                         NormFp8Output& out, Tensor& rstd);
// sum_out = x + residual as in add_layernorm_forward / add_rmsnorm_forward (same aliasing
// rules: it may be x or residual), then the FP8 forward of that rounded sum.
void add_layernorm_forward_fp8(Context& ctx, const Tensor& x, const Tensor& residual, const Tensor& gamma,
                               const Tensor& beta, float eps, const Tensor& scale, Tensor& sum_out,
                               NormFp8Output& out, Tensor& mean, Tensor& rstd);
void add_rmsnorm_forward_fp8(Context& ctx, const Tensor& x, const Tensor& residual, const Tensor& gamma, float eps,
                             const Tensor& scale, Tensor& sum_out, NormFp8Output& out, Tensor& rstd);

// Current scaling's second pass: q = fp8(y * scale[0]) with y recomputed from x (the
// forward's input, or its sum_out) and the mean and rstd that forward wrote, by the
// forward's own operations, so q equals what the forward would have cast with this scale.
void layernorm_apply_fp8(Context& ctx, const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& mean,
                         const Tensor& rstd, const Tensor& scale, Tensor& q);
void rmsnorm_apply_fp8(Context& ctx, const Tensor& x, const Tensor& gamma, const Tensor& rstd, const Tensor& scale,
                       Tensor& q);

// The same pass returning the QuantizedTensor the linear layer takes: data = q as above,
// data_t its transpose, scale_inv = 1.0f / scale[0] (as fp8::quantized_from_codes makes
// them, so the result equals the apply followed by quantized_from_codes byte for byte). On
// CUDA, a 2-D BF16 x with rows and C multiples of 8 writes both copies in one pass
// (backend/cuda/norm_fp8.cu, norm_apply_fp8_transpose) instead of the apply and a byte
// transpose; anything else runs those two.
fp8::QuantizedTensor layernorm_apply_fp8_with_transpose(Context& ctx, const Tensor& x, const Tensor& gamma,
                                                        const Tensor& beta, const Tensor& mean, const Tensor& rstd,
                                                        const Tensor& scale);
fp8::QuantizedTensor rmsnorm_apply_fp8_with_transpose(Context& ctx, const Tensor& x, const Tensor& gamma,
                                                      const Tensor& rstd, const Tensor& scale);

}  // namespace tessera
