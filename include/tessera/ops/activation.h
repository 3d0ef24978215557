// Activation functions of the MLP block: GELU (tanh approximation) and SwiGLU.
//
// Tensors are contiguous; outputs are preallocated by the caller (any floating dtype) and
// never resized. The reference computes in double when x is F64 and in float otherwise.
//
// Gradient rule: input gradients (dx) are OVERWRITTEN (these ops have no parameters).
#pragma once

#include "tessera/core/context.h"
#include "tessera/core/tensor.h"
#include "tessera/fp8/quantized_tensor.h"

namespace tessera {

// GPT-2's "gelu_new": y = 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3))),
// elementwise; y has x's shape and may be the same tensor as x.
void gelu_forward(Context& ctx, const Tensor& x, Tensor& y);

// dx = dy * d/dx gelu(x), with x the forward input. All three share one shape; dx may be
// the same tensor as dy.
void gelu_backward(Context& ctx, const Tensor& x, const Tensor& dy, Tensor& dx);

// SwiGLU of Llama's MLP, over the last dimension: x is [..., 2F] holding the gate
// projection in columns [0, F) and the up projection in columns [F, 2F); y is [..., F]:
//   y = silu(gate) * up,   silu(g) = g * sigmoid(g) = g / (1 + exp(-g)).
// The last dimension of x must be even.
void swiglu_forward(Context& ctx, const Tensor& x, Tensor& y);

// From the forward input x [..., 2F] and dy [..., F], writes dx [..., 2F]:
//   dgate = dy * up * sigmoid(g) * (1 + g * (1 - sigmoid(g)))    (columns [0, F))
//   dup   = dy * silu(g)                                        (columns [F, 2F))
// dx may be the same tensor as x (the forward input is then overwritten).
// y, when given ([..., F], not x or dx), also receives the forward's output silu(gate) * up,
// bit for bit what swiglu_forward writes: for an MLP that did not keep it (recomputation), in
// the pass that reads x anyway instead of a second one.
void swiglu_backward(Context& ctx, const Tensor& x, const Tensor& dy, Tensor& dx, Tensor* y = nullptr);

// ---- SwiGLU fused with the FP8 cast of its output (the FP8 MLP) ----------------------------
//
// x is 2-D [rows, 2F] (dy [rows, F]). The result is what the unfused path gives, byte for
// byte: the activation in x's dtype (swiglu_forward's y / swiglu_backward's dx, as stored),
// then fp8::quantize_with_transpose of it with `scale` (F32 [1]) to `fp8` (E4M3 or E5M2),
// amax_out (F32 [1], when non-null; it must not be scale) receiving max |activation|. On
// CUDA, BF16 x with F % 8 == 0 and rows % 8 == 0 runs one kernel that never writes the
// activation (backend/cuda/swiglu_fp8.cu); anything else, and the CPU, runs the unfused ops.
fp8::QuantizedTensor swiglu_forward_fp8(Context& ctx, const Tensor& x, const Tensor& scale, DType fp8,
                                        Tensor* amax_out = nullptr);
fp8::QuantizedTensor swiglu_backward_fp8(Context& ctx, const Tensor& x, const Tensor& dy, const Tensor& scale,
                                         DType fp8, Tensor* amax_out = nullptr);

// amax_out (F32 [1]) = max |activation| of the same activation, nothing else kept: current
// scaling's statistic, taken before the cast above (amax's NaN rule: a NaN gives NaN).
void swiglu_forward_amax(Context& ctx, const Tensor& x, Tensor& amax_out);
void swiglu_backward_amax(Context& ctx, const Tensor& x, const Tensor& dy, Tensor& amax_out);

// ---- GELU fused with the FP8 cast of its output (the FP8 MLP of GPT-2) -------------------
//
// x is 2-D [rows, F] (dy the same shape and dtype). As the SwiGLU forms above: the bytes of
// the unfused path (gelu_forward's y / gelu_backward's dx in x's dtype, as stored, then
// fp8::quantize_with_transpose with `scale`), amax_out (F32 [1], non-null; not scale)
// receiving max |activation|. gelu_backward_fp8's dbias (non-null: [F], floating) receives
// fc's bias gradient, += the column sums of dx, as fp8::quantize_with_transpose_and_bias_grad
// adds them (on CUDA with an F32 dbias in the same kernel, deterministic; bias_grad's result
// up to the order of the double additions). On CUDA, BF16 x with F % 8 == 0 and rows % 8 == 0
// runs one kernel that never writes the activation (backend/cuda/gelu_fp8.cu); anything
// else, and the CPU, runs the unfused ops.
fp8::QuantizedTensor gelu_forward_fp8(Context& ctx, const Tensor& x, const Tensor& scale, DType fp8,
                                      Tensor* amax_out = nullptr);
fp8::QuantizedTensor gelu_backward_fp8(Context& ctx, const Tensor& x, const Tensor& dy, const Tensor& scale,
                                       DType fp8, Tensor* amax_out = nullptr, Tensor* dbias = nullptr);
// amax_out (F32 [1]) = max |activation|, nothing else kept (current scaling's statistic).
void gelu_forward_amax(Context& ctx, const Tensor& x, Tensor& amax_out);
void gelu_backward_amax(Context& ctx, const Tensor& x, const Tensor& dy, Tensor& amax_out);

}  // namespace tessera
