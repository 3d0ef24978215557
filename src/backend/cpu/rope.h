#pragma once
#include "tessera/core/tensor.h"
#include "tessera/ops/rope.h"
namespace tessera::cpu {
void rope_forward(const Tensor& x, Tensor& y, const RopeOptions& options);
void rope_backward(const Tensor& dy, Tensor& dx, const RopeOptions& options);
}  // namespace tessera::cpu
