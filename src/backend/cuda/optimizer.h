// CUDA AdamW step (backend/cuda/optimizer.cu). Declarations only; usable from C++.
#pragma once

#include "tessera/core/tensor.h"
#include "tessera/ops/optimizer.h"

namespace tessera::cuda {

// param, exp_avg, exp_avg_sq F32; grad F32 or BF16. Bit-identical to the CPU reference.
bool adamw_step_supported(const Tensor& param, const Tensor& grad);
void adamw_step(void* stream, Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                const AdamWOptions& options);

}  // namespace tessera::cuda
