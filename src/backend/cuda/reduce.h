// CUDA reductions of the linear layers' backward and of gradient clipping
// (backend/cuda/reduce.cu). Declarations only; usable from C++.
#pragma once

#include "tessera/core/tensor.h"

namespace tessera::cuda {

// dbias[n] += sum_m dy[m, n]: dy and dbias each F32 or BF16. Deterministic.
bool bias_grad_supported(const Tensor& dy, const Tensor& dbias);
void bias_grad(void* stream, const Tensor& dy, Tensor& dbias);

// out[0] = sum_i x[i]^2 into a device scalar (no host sync): x F32 or BF16, out F32 or
// F64. Deterministic.
bool sum_of_squares_supported(const Tensor& x, const Tensor& out);
void sum_of_squares(void* stream, const Tensor& x, Tensor& out);

}  // namespace tessera::cuda
