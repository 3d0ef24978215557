// tessera's own grouped FP8 weight-gradient GEMM for Hopper (backend/cuda/grouped_wgrad_fp8.cu,
// which has the notes on layout and speed), for ops/moe_fp8.cpp's
// grouped_linear_backward_weight_fp8. Declarations only; C++17.
#pragma once

#include <cstdint>
#include <vector>

#include "tessera/core/tensor.h"

namespace tessera::cuda {

// Most experts with rows one launch takes (each brings two TMA descriptors, 256 bytes of
// kernel parameters).
constexpr int64_t kGroupedWgradFp8MaxExperts = 64;

// Whether the kernel takes these operands: a Hopper device; dy_t [out, P] and x_t [in, P]
// E4M3 or E5M2 codes with unit column stride, row strides multiples of 16 bytes and 16-byte
// aligned bases; dw F32 [E, out, in] contiguous with out % 128 == 0 and in % 256 == 0;
// at most kGroupedWgradFp8MaxExperts experts with rows.
bool grouped_wgrad_fp8_supported(const Tensor& dy_t, const Tensor& x_t, const Tensor& dw, int64_t experts_with_rows);

// For every expert e with splits[e] > 0, in ONE persistent launch:
//   dw[e] = alpha * dy_t[:, p_e : p_{e+1}] x_t[:, p_e : p_{e+1}]^T        (accumulate false)
//   dw[e] += alpha * ...                                                   (accumulate true)
// with alpha = scale_inv_dy[0] * scale_inv_x[0] (F32 [1] on the device) and p = padded_offsets
// (ops/moe.h's padding rule: the columns past an expert's rows inside its block are zero
// codes). Experts without rows are not touched. FP32 accumulation in the tensor cores; the
// sums are ordered differently from cuBLASLt's, so the two agree to rounding, not bit for bit.
void grouped_wgrad_fp8(void* stream, const Tensor& dy_t, const Tensor& x_t, const std::vector<int64_t>& splits,
                       const std::vector<int64_t>& padded_offsets, const Tensor& scale_inv_dy,
                       const Tensor& scale_inv_x, Tensor& dw, bool accumulate);

}  // namespace tessera::cuda
