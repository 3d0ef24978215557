#pragma once
#include "tessera/core/tensor.h"
namespace tessera::cpu {
void gelu_forward(const Tensor& x, Tensor& y);
void gelu_backward(const Tensor& x, const Tensor& dy, Tensor& dx);
void swiglu_forward(const Tensor& x, Tensor& y);
void swiglu_backward(const Tensor& x, const Tensor& dy, Tensor& dx, Tensor* y = nullptr);  // y: also silu(gate) * up
}  // namespace tessera::cpu
