// CUDA cross-entropy backward with FP8 output (backend/cuda/loss_fp8.cu), for the FP8 LM
// head. Declarations only; usable from C++.
#pragma once

#include <cstdint>

#include "tessera/core/tensor.h"

namespace tessera::cuda {

// logits BF16 [N, V] with a row stride and base 16-byte aligned (multiples of 8 elements),
// lse F32 [N], fp8_scale F32 [1], q E4M3 or E5M2 [N, W] contiguous with W >= V and W % 8 == 0.
bool cross_entropy_backward_fp8_supported(const Tensor& logits, const Tensor& lse, const Tensor& q);
// q[n, v] = fp8(bf16(d_logits[n, v]) * fp8_scale) for v < V, 0 for V <= v < W, where
// d_logits is exactly what cross_entropy_backward writes in BF16 on CUDA (same arithmetic),
// so the codes equal that kernel followed by quantize_per_tensor / cast_transpose's.
// A bad target (outside [0, V), not ignore_index) gives a NaN row, as there; it is not
// reported here (the forward that produced lse reports it).
void cross_entropy_backward_fp8(void* stream, const Tensor& logits, const Tensor& targets, const Tensor& lse,
                                float d_loss, const Tensor& fp8_scale, Tensor& q, int64_t ignore_index);

}  // namespace tessera::cuda
