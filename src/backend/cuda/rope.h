// Rotary position embedding kernels on the GPU (backend/cuda/rope.cu). The op front end
// (src/ops/rope.cpp) has already checked shapes, options, overlap and devices; these
// functions only launch. Same convention, table precision and rounding as the CPU reference.
#pragma once

#include "tessera/core/tensor.h"
#include "tessera/ops/rope.h"

namespace tessera::cuda {

// Whether a kernel exists: input and output both F32, or both BF16.
bool rope_supported(const Tensor& in, const Tensor& out);

void rope_forward(void* stream, const Tensor& x, Tensor& y, const RopeOptions& options);
void rope_backward(void* stream, const Tensor& dy, Tensor& dx, const RopeOptions& options);

}  // namespace tessera::cuda
