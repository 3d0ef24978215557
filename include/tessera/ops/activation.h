// Activation functions of the MLP block: GELU (tanh approximation) and SwiGLU.
//
// Tensors are contiguous; outputs are preallocated by the caller (any floating dtype) and
// never resized. The reference computes in double when x is F64 and in float otherwise.
//
// Gradient rule: input gradients (dx) are OVERWRITTEN (these ops have no parameters).
#pragma once

#include "tessera/core/context.h"
#include "tessera/core/tensor.h"

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
void swiglu_backward(Context& ctx, const Tensor& x, const Tensor& dy, Tensor& dx);

}  // namespace tessera
