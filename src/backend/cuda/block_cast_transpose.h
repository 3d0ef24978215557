// The fused 1x128 block-scaled FP8 cast with transpose on the GPU
// (backend/cuda/block_cast_transpose.cu): one read of x [M, K] writes both copies that the
// "block" recipe's BlockQuantizedTensor keeps for an activation or gradient, and their scales
// in both layouts (tessera's block_scale_shape and cuBLASLt's Vec128, gemm_fp8.h):
//  - q [M, K]   = quantize_blockwise(x, 1x128),   scale_inv [M, ceil(K/128)];
//  - q_t [K, M] = quantize_blockwise(x^T, 1x128), scale_inv_t [K, ceil(M/128)];
//  - gemm_scale_inv [ceil(K/128), M], gemm_scale_inv_t [ceil(M/128), K] (optional).
// The bytes are those of the two-pass path (quantize_blockwise, transpose_2d, quantize_blockwise,
// to_gemm_block_scales) that fp8::quantize_blockwise_with_transpose uses elsewhere.
#pragma once

#include "tessera/core/tensor.h"

namespace tessera::cuda {

// Whether the fused kernel takes x: F32 or BF16, contiguous, 16-byte aligned, M and K
// multiples of 16 (every shape an FP8 GEMM accepts). Anything else takes the two-pass path.
bool block_cast_transpose_supported(const Tensor& x);

// Arguments as above, all contiguous on x's device (checked by the caller; q and q_t both E4M3
// or both E5M2, fresh allocations, so 16-byte aligned). gemm_scale_inv and gemm_scale_inv_t may
// be undefined (not written). power_of_two: BlockScaling::power_of_two_scales. Runs on `stream`
// (a cudaStream_t); nothing synchronises with the host.
void block_cast_transpose(void* stream, const Tensor& x, Tensor& q, Tensor& scale_inv, Tensor& q_t,
                          Tensor& scale_inv_t, Tensor& gemm_scale_inv, Tensor& gemm_scale_inv_t, bool power_of_two);

}  // namespace tessera::cuda
