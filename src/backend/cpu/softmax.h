#pragma once
#include "tessera/core/tensor.h"
namespace tessera::cpu {
void softmax_forward(const Tensor& x, Tensor& y);
void softmax_backward(const Tensor& y, const Tensor& dy, Tensor& dx);
}  // namespace tessera::cpu
