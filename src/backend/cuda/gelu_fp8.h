// GELU fused with the FP8 cast of its output (backend/cuda/gelu_fp8.cu): the forward's
// h = gelu(h_pre) and the backward's d_h_pre = d_h * gelu'(h_pre) straight to the two FP8
// copies a per-tensor-scaled QuantizedTensor keeps (cast_transpose's layout), the backward
// optionally with the bias gradient of fc (column sums of d_h_pre, as cast_transpose's dbias),
// and, for current scaling, an amax-only pass over the same values. The values are those of
// gelu_forward / gelu_backward's BF16 kernels rounded to BF16 as stored, then cast as
// quantize_per_tensor casts: the bytes of the unfused ops (ops/activation.cpp composes those
// where these do not apply).
#pragma once

#include "tessera/core/tensor.h"

namespace tessera::cuda {

// Whether the fused kernels take x [rows, F] (and dy [rows, F]) with these outputs: BF16,
// contiguous, F % 8 == 0, 16-byte aligned inputs; for the casting kernels also rows % 8 == 0
// and q, q_t 8-byte aligned. Otherwise the caller composes the unfused ops.
bool gelu_cast_transpose_supported(const Tensor& x, const Tensor* dy, const Tensor& q, const Tensor& q_t);
bool gelu_amax_supported(const Tensor& x, const Tensor* dy, const Tensor& amax_out);

// q [rows, F] = fp8(bf16(gelu(x)) * scale), q_t [F, rows] its transpose; amax_out F32 [1]
// (overwritten) = max |bf16(gelu(x))|, or undefined. amax_out must not be scale.
void gelu_forward_cast_transpose(void* stream, const Tensor& x, const Tensor& scale, Tensor& q, Tensor& q_t,
                                 Tensor& amax_out);
// The same for dx = bf16(dy * gelu'(x)); dbias, when non-null: F32 [F] contiguous, += the
// column sums of dx (deterministic, no atomics; nothing for rows == 0).
void gelu_backward_cast_transpose(void* stream, const Tensor& x, const Tensor& dy, const Tensor& scale, Tensor& q,
                                  Tensor& q_t, Tensor& amax_out, Tensor* dbias);

// amax_out F32 [1] (overwritten) = max |bf16(gelu(x))| / max |bf16(dy * gelu'(x))|, nothing
// else written: current scaling's statistic before the cast above.
void gelu_forward_amax(void* stream, const Tensor& x, Tensor& amax_out);
void gelu_backward_amax(void* stream, const Tensor& x, const Tensor& dy, Tensor& amax_out);

}  // namespace tessera::cuda
