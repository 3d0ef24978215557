// SwiGLU fused with the FP8 cast of its output (backend/cuda/swiglu_fp8.cu): the forward's h
// and the backward's d_h_pre straight to the two FP8 copies a per-tensor-scaled
// QuantizedTensor keeps (cast_transpose's layout), and, for current scaling (whose scale needs
// the amax first), an amax-only pass over the same values. The values are those of
// swiglu_forward / swiglu_backward rounded to BF16, then cast as quantize_per_tensor casts:
// the bytes of the unfused ops (ops/activation.h composes those where these do not apply).
#pragma once

#include "tessera/core/tensor.h"

namespace tessera::cuda {

// Whether the fused kernels take x [rows, 2F] (and dy [rows, F]) with these outputs: BF16
// x / dy, contiguous, F % 8 == 0 and 16-byte aligned; for the casting kernels also
// rows % 8 == 0 and q, q_t 8-byte aligned. Otherwise the caller composes the unfused ops.
bool swiglu_cast_transpose_supported(const Tensor& x, const Tensor* dy, const Tensor& q, const Tensor& q_t);
bool swiglu_amax_supported(const Tensor& x, const Tensor* dy, const Tensor& amax_out);

// q [rows, F] = fp8(bf16(swiglu(x)) * scale), q_t [F, rows] its transpose; amax_out F32 [1]
// (overwritten) = max |bf16(swiglu(x))|, or undefined. amax_out must not be scale.
void swiglu_forward_cast_transpose(void* stream, const Tensor& x, const Tensor& scale, Tensor& q, Tensor& q_t,
                                   Tensor& amax_out);
// The same for dx = bf16(swiglu_backward(x, dy)): q [rows, 2F], q_t [2F, rows].
void swiglu_backward_cast_transpose(void* stream, const Tensor& x, const Tensor& dy, const Tensor& scale, Tensor& q,
                                    Tensor& q_t, Tensor& amax_out);

// amax_out F32 [1] (overwritten) = max |bf16(swiglu(x))| / max |bf16(swiglu_backward(x, dy))|,
// nothing else written: current scaling's statistic before the cast above.
void swiglu_forward_amax(void* stream, const Tensor& x, Tensor& amax_out);
void swiglu_backward_amax(void* stream, const Tensor& x, const Tensor& dy, Tensor& amax_out);

}  // namespace tessera::cuda
