// LayerNorm / RMSNorm whose output goes straight to FP8 (backend/cuda/norm_fp8.cu), for the
// ops of tessera/ops/norm.h's "FP8 output" section: the norm's y, rounded to x's dtype, is
// cast with a per-tensor scale to E4M3 and its amax taken in the same pass, with no y
// written unless asked for. Arguments are checked by the front end (src/ops/norm.cpp).
#pragma once

#include "tessera/core/tensor.h"

namespace tessera::cuda {

// norm_supported's dtype rules (norm.h) with x as the activations, and q (if defined) E4M3.
bool norm_fp8_supported(const Tensor& x, const Tensor& q, const Tensor& y, const Tensor& gamma, const Tensor& beta);

// q = fp8(round_x(norm(x)) * scale) when q is defined, amax = max |round_x(norm(x))| when
// amax is defined (overwritten), y = round_x(norm(x)) when y is defined; mean and rstd as the
// plain forward. q undefined: the statistics pass of current scaling (amax required).
void layernorm_forward_fp8(void* stream, const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps,
                           const Tensor& scale, Tensor& q, Tensor& amax, Tensor& y, Tensor& mean, Tensor& rstd);
void rmsnorm_forward_fp8(void* stream, const Tensor& x, const Tensor& gamma, float eps, const Tensor& scale, Tensor& q,
                         Tensor& amax, Tensor& y, Tensor& rstd);
// The same after the fused residual add (sum = x + residual, as add_*_forward).
void add_layernorm_forward_fp8(void* stream, const Tensor& x, const Tensor& residual, const Tensor& gamma,
                               const Tensor& beta, float eps, const Tensor& scale, Tensor& sum, Tensor& q,
                               Tensor& amax, Tensor& y, Tensor& mean, Tensor& rstd);
void add_rmsnorm_forward_fp8(void* stream, const Tensor& x, const Tensor& residual, const Tensor& gamma, float eps,
                             const Tensor& scale, Tensor& sum, Tensor& q, Tensor& amax, Tensor& y, Tensor& rstd);

// q = fp8(round_x(y) * scale) with y recomputed from x and the saved statistics exactly as
// the forward computes it (mean undefined: RMSNorm).
void norm_apply_fp8(void* stream, const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& mean,
                    const Tensor& rstd, const Tensor& scale, Tensor& q);

// norm_apply_fp8 that also writes q_t [C, rows] = q transposed, from the same pass (the
// copy a QuantizedTensor keeps): x BF16 2-D [rows, C] with rows % 8 == 0 and C % 8 == 0,
// q and q_t E4M3 contiguous and 8-byte aligned (norm_apply_fp8_transpose_supported).
bool norm_apply_fp8_transpose_supported(const Tensor& x, const Tensor& q, const Tensor& q_t, const Tensor& gamma,
                                        const Tensor& beta);
void norm_apply_fp8_transpose(void* stream, const Tensor& x, const Tensor& gamma, const Tensor& beta,
                              const Tensor& mean, const Tensor& rstd, const Tensor& scale, Tensor& q, Tensor& q_t);

}  // namespace tessera::cuda
