// CUDA cross-entropy (backend/cuda/loss.cu). Declarations only; usable from C++.
#pragma once

#include <cstdint>

#include "tessera/core/tensor.h"

namespace tessera::cuda {

// logits F32 or BF16, lse F32, loss F32 or F64 (all on the device). logits and d_logits
// may be row-strided (unit inner stride, row stride >= V: a padded logits buffer).
bool cross_entropy_forward_supported(const Tensor& logits, const Tensor& loss, const Tensor& lse);
void cross_entropy_forward(void* stream, const Tensor& logits, const Tensor& targets, Tensor& loss, Tensor& lse,
                           int64_t ignore_index);

// logits and d_logits each F32 or BF16 (d_logits may be logits itself), lse F32.
bool cross_entropy_backward_supported(const Tensor& logits, const Tensor& lse, const Tensor& d_logits);
void cross_entropy_backward(void* stream, const Tensor& logits, const Tensor& targets, const Tensor& lse,
                            float d_loss, Tensor& d_logits, int64_t ignore_index);

// Both in one pass (loss_fused.cu): logits and d_logits of one dtype (F32 or BF16; d_logits
// may be logits itself), 16-byte aligned rows with strides multiples of 8, V in [16384,
// 262144]; anything else takes the two calls above.
bool cross_entropy_fused_supported(const Tensor& logits, const Tensor& loss, const Tensor& lse,
                                   const Tensor& d_logits);
void cross_entropy_fused(void* stream, const Tensor& logits, const Tensor& targets, Tensor& loss, Tensor& lse,
                         float d_loss, Tensor& d_logits, int64_t ignore_index);

}  // namespace tessera::cuda
