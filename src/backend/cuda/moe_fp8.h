// CUDA kernels of the MoE FP8 casts (backend/cuda/moe_fp8.cu): an expert-contiguous
// activation cast to FP8 with its padded transposed copy (ops/moe.h, MoEFp8Rows), and the
// scaled SwiGLU computed on the fly and cast the same way. Declarations only; C++17.
#pragma once

#include <cstdint>
#include <vector>

#include "tessera/core/tensor.h"

namespace tessera::cuda {

// Most experts the kernels take (their offsets travel as kernel parameters).
constexpr int64_t kMoeFp8MaxExperts = 256;

// x F32 or BF16, contiguous, M < 2^31 rows, and at most kMoeFp8MaxExperts experts.
bool moe_fp8_cast_supported(const Tensor& x, int64_t experts);

// data [M, K] = fp8(x * scale[0]) for the rows the splits cover, zero codes in the rows past
// their sum; data_t [K, P]: column padded[e] + i = row off_e + i of data for every expert,
// zero in the padding columns. scale F32 [1] (device). amax, when given (F32 [1]), gets max
// |x| over the kept rows folded in by an atomic max on its bits (NaN sticky; not reset).
void moe_fp8_cast_rows(void* stream, const Tensor& x, const Tensor& scale, const std::vector<int64_t>& splits,
                       const std::vector<int64_t>& padded, Tensor& data, Tensor& data_t, Tensor* amax = nullptr);

// amax[0] = max |h|, h[r, c] = prob[r] * silu(x[r, c]) * x[r, F + c] (x [M, 2F]), NaN if any h is.
void moe_swiglu_scaled_amax(void* stream, const Tensor& x, const Tensor& prob, Tensor& amax);
// moe_fp8_cast_rows of h (not stored): data [M, F], data_t [K = F, P].
void moe_swiglu_scaled_cast(void* stream, const Tensor& x, const Tensor& prob, const Tensor& scale,
                            const std::vector<int64_t>& splits, const std::vector<int64_t>& padded, Tensor& data,
                            Tensor& data_t, Tensor* amax = nullptr);

// The scaled SwiGLU backward straight to FP8 (moe_swiglu.cu), for x [M, 2F] and dy [M, F]
// BF16, contiguous, 16-byte aligned, F % 8 == 0, prob F32 or BF16, M < 2^31 rows and at most
// kMoeFp8MaxExperts experts. Pass 1: d_prob [M] and amax[0] = max |BF16(dx)| (dx not
// written); pass 2: moe_fp8_cast_rows of BF16(dx) (recomputed) with the given scale:
// data [M, 2F], data_t [2F, P].
bool moe_swiglu_backward_cast_supported(const Tensor& x, const Tensor& prob, const Tensor& dy, int64_t experts);
void moe_swiglu_scaled_backward_amax(void* stream, const Tensor& x, const Tensor& prob, const Tensor& dy,
                                     Tensor& d_prob, Tensor& dx_amax);
void moe_swiglu_scaled_backward_cast(void* stream, const Tensor& x, const Tensor& prob, const Tensor& dy,
                                     const Tensor& scale, const std::vector<int64_t>& splits,
                                     const std::vector<int64_t>& padded, Tensor& data, Tensor& data_t);
// Delayed scaling's one pass: pass 2 with the given scale, which also folds max |BF16(dx)|
// into amax (F32 [1], when given) and writes d_prob [M]: each 64-feature tile's partial sum
// of a kept row into partial F32 [M, ceil(F / 64)], then one warp per row adds them in
// order (rows past the split sum: their whole dot, directly).
int64_t moe_swiglu_backward_partial_columns(int64_t half);
void moe_swiglu_scaled_backward_cast_fused(void* stream, const Tensor& x, const Tensor& prob, const Tensor& dy,
                                           const Tensor& scale, const std::vector<int64_t>& splits,
                                           const std::vector<int64_t>& padded, Tensor& data, Tensor& data_t,
                                           Tensor& partial, Tensor& d_prob, Tensor* amax);

}  // namespace tessera::cuda
