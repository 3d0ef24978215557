#pragma once
#include "tessera/core/tensor.h"
#include "tessera/ops/loss.h"
namespace tessera::cpu {
// Both throw Error for a target outside [0, V) that is not ignore_index, before writing.
void cross_entropy_forward(const Tensor& logits, const Tensor& targets, Tensor& loss, Tensor& lse,
                           const CrossEntropyOptions& options);
void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, float d_loss,
                            Tensor& d_logits, const CrossEntropyOptions& options);
}  // namespace tessera::cpu
