// CUDA kernels of the one-launch FP8 casts of the MoE expert weights (backend/cuda/
// moe_weight_cast.cu), for ops/moe.cpp's moe_fp8_quantize_weights: every expert's amax in one
// launch, every expert's scale in one, every expert's codes in one. Declarations only; C++17.
//
// The experts cast are a list of indices into w [E, N, K] (those with rows); their results go
// to COMPACT slots, slot i for the i-th listed expert: amax [A], scale and scale_inv [4A]
// (slot i at element 4i, 16 bytes apart, as cuBLASLt wants its scale pointers), data
// [A, N, K], data_t [A, K, N]. Arguments are checked by the caller.
#pragma once

#include <cstdint>
#include <vector>

#include "tessera/core/tensor.h"

namespace tessera::cuda {

// Most experts one call takes (their indices travel as a kernel parameter).
constexpr int64_t kMoeWeightCastMaxExperts = 256;

// w BF16 [E, N, K], contiguous, 16-byte aligned, K % 8 == 0, E <= kMoeWeightCastMaxExperts,
// and N % 8 == 0 when the transposed codes are wanted too.
bool moe_weight_cast_supported(const Tensor& w, bool transposed);

// amax[i] = max |w[experts[i]]| (NaN when it holds a NaN), the bits of cuda::amax's rule.
void moe_weight_amax(void* stream, const Tensor& w, const std::vector<int64_t>& experts, Tensor& amax);

// scale[4i] = fp8_scale_for_amax(amax[i], fp8_max, margin, power_of_two) and scale_inv[4i] its
// reciprocal with fp8_reciprocal_scale's rule; elements 4i + 1..3 are left as they are.
void moe_weight_scales(void* stream, const Tensor& amax, float fp8_max, float margin, bool power_of_two, Tensor& scale,
                       Tensor& scale_inv);

// data[i] = fp8(w[experts[i]] * scale[4i]) (E4M3 or E5M2, data's dtype) and, when data_t is
// defined, data_t[i] = data[i] transposed, from the same read of w.
// by_expert (delayed scaling, whose state holds a scale per expert): scale[experts[i]]
// instead, and max |w[experts[i]]| folded into amax[experts[i]] (F32 [E]; atomic max on the
// bits, NaN sticky, not reset) by the cast's own read of w.
void moe_weight_cast(void* stream, const Tensor& w, const Tensor& scale, const std::vector<int64_t>& experts,
                     Tensor& data, Tensor& data_t, bool by_expert = false, Tensor* amax = nullptr);

// scale_inv[4i] = from[experts[i]] (F32; from [E], scale_inv [4A]): delayed scaling's
// per-expert inverse scales copied out of the state, 16 bytes apart, since cuBLASLt refuses
// some FP8 GEMMs whose scale pointers are not 16-byte aligned.
void moe_weight_gather_scales(void* stream, const Tensor& from, const std::vector<int64_t>& experts,
                              Tensor& scale_inv);

}  // namespace tessera::cuda
