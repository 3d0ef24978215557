#pragma once
#include "tessera/core/tensor.h"
#include "tessera/ops/optimizer.h"
namespace tessera::cpu {
void adamw_step(Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq, const AdamWOptions& options);
}  // namespace tessera::cpu
