// CUDA form of accumulate_weighted_loss (backend/cuda/loss_accumulate.cu). Declarations
// only; usable from C++.
#pragma once

#include <vector>

#include "tessera/core/tensor.h"

namespace tessera::cuda {

// chunk_losses F32 or F64, acc F64 [1], both on the device.
bool accumulate_weighted_loss_supported(const Tensor& chunk_losses, const Tensor& acc);
void accumulate_weighted_loss(void* stream, const Tensor& chunk_losses, const std::vector<double>& weights,
                              double divisor, Tensor& acc);

}  // namespace tessera::cuda
