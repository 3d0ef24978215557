#pragma once
#include "tessera/core/tensor.h"
#include "tessera/ops/quantize.h"
namespace tessera::cpu {
void amax(const Tensor& x, Tensor& amax_out);
// amax_out may be undefined (no statistic recorded).
void quantize_per_tensor(const Tensor& x, const Tensor& scale, Tensor& out, Tensor& amax_out);
void dequantize_per_tensor(const Tensor& q, const Tensor& scale_inv, Tensor& out);
void quantize_blockwise(const Tensor& x, Tensor& out, Tensor& scale_inv, const BlockScaling& blocks);
void dequantize_blockwise(const Tensor& q, const Tensor& scale_inv, Tensor& out, const BlockScaling& blocks);
void quantize_mxfp8(const Tensor& x, Tensor& out, Tensor& scales);
void dequantize_mxfp8(const Tensor& q, const Tensor& scales, Tensor& out);
}  // namespace tessera::cpu
