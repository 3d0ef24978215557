// Optimizer steps over parameter tensors.
//
// An optimizer updates parameters in place from their gradients; it does not produce
// gradients, so the overwrite / accumulate rule of the other ops does not apply here:
// param, exp_avg and exp_avg_sq are read and updated in place, grad is only read.
#pragma once

#include <cstdint>

#include "tessera/core/context.h"
#include "tessera/core/tensor.h"

namespace tessera {

struct AdamWOptions {
  float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0.0f;
  int64_t step = 1;  // 1-based count of steps taken including this one, for bias correction
};

// One AdamW step with the semantics of PyTorch's torch.optim.AdamW, for every element:
//   p  = p * (1 - lr * weight_decay)                 (decoupled weight decay)
//   m  = beta1 * m + (1 - beta1) * g
//   v  = beta2 * v + (1 - beta2) * g^2
//   p -= lr * (m / (1 - beta1^step)) / (sqrt(v / (1 - beta2^step)) + eps)
// param: F32 or F64 master weights; exp_avg (m) and exp_avg_sq (v): same dtype and shape
// as param, zero before step 1; grad: same shape, any floating dtype (BF16 gradients are
// upcast). Computes in double for F64 params, float otherwise; the bias corrections are
// computed in double. Requires step >= 1, lr >= 0, eps >= 0, weight_decay >= 0 and
// beta1, beta2 in [0, 1), as PyTorch does.
void adamw_step(Context& ctx, Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                const AdamWOptions& options);

}  // namespace tessera
