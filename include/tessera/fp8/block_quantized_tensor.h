// A block-scaled FP8 tensor (the "block" recipe: DeepSeek-V3's, Transformer Engine's
// Float8BlockScaling) with both orientations, and the GEMM that consumes it.
//
// Blocks are 1x128 (activations and gradients: one scale per 128 consecutive elements of a
// row) or 128x128 (weights: one scale per tile), the two that Hopper's cuBLASLt multiplies
// natively (VEC128_32F and BLK128x128_32F scale modes). As for QuantizedTensor, the GEMM is
// TN only, so each tensor keeps two FP8 copies, [M, K] and [K, M], each with its scales:
//  - 1x128: data_t is quantize_blockwise of x^T, i.e. its blocks run down the columns of x.
//    It is NOT the byte transpose of data: the blocks cover different elements, so the two
//    copies round differently (both are quantized from x itself);
//  - 128x128: a tile covers the same elements either way, so data_t and scale_inv_t are the
//    exact transposes of data and scale_inv.
#pragma once

#include "tessera/core/context.h"
#include "tessera/core/tensor.h"
#include "tessera/fp8/quantized_tensor.h"
#include "tessera/ops/quantize.h"

namespace tessera::fp8 {

struct BlockQuantizedTensor {
  Tensor data;         // FP8 [M, K]
  Tensor data_t;       // FP8 [K, M]
  Tensor scale_inv;    // F32 block_scale_shape(M, K, blocks): data's dequantization factors, 1 / block scale
  Tensor scale_inv_t;  // F32 block_scale_shape(K, M, blocks): data_t's
  BlockScaling blocks = BlockScaling::tile_1x128();
  DType dtype = DType::E4M3;
  // The same scales in cuBLASLt's layout (backend/cuda/gemm_fp8.h, gemm_block_scale_shape):
  // filled by quantize_blockwise_with_transpose on CUDA, so that GEMMs do not rearrange them
  // on every call; when undefined (a tensor built by hand, or copied from the CPU),
  // fp8_gemm_blockwise rearranges into a temporary.
  Tensor gemm_scale_inv, gemm_scale_inv_t;

  // The logical [M, K], also when one copy was dropped (nn::Linear keeps only what its
  // backward reads; fp8_gemm_blockwise needs only the copy of the orientation it uses).
  int64_t rows() const { return data.defined() ? data.size(0) : data_t.size(1); }
  int64_t cols() const { return data.defined() ? data.size(1) : data_t.size(0); }
  bool is_2d() const { return blocks.block_rows == 128; }  // 128x128 tiles (else 1x128)
};

// Casts a 2-D x [M, K] (any floating dtype) to `fp8` with `blocks` (1x128 or 128x128; its
// power_of_two_scales flag is kept), both orientations, with quantize_blockwise (and
// transpose_2d), so it runs wherever those run; on CUDA it also writes the GEMM-ready scales.
// Nothing is read back to the host. Outputs are allocated on ctx.device.
// On CUDA, 1x128 blocks with x F32 or BF16, contiguous, 16-byte aligned and M, K multiples of
// 16 take one fused kernel (backend/cuda/block_cast_transpose.cu: x read once, both copies and
// all four scale grids written) with the same bytes as the two-pass path below; 128x128
// tiles keep the two-pass path, whose transposes are byte copies of the codes and scales.
BlockQuantizedTensor quantize_blockwise_with_transpose(Context& ctx, const Tensor& x, const BlockScaling& blocks,
                                                       DType fp8);

// The same result without the fused kernel: quantize_blockwise(x), then transpose_2d of x and
// quantize_blockwise(x^T) (1x128) or transpose_2d of the codes and scales (128x128), then on
// CUDA to_gemm_block_scales. The fallback of the function above, and the reference that
// tests and bench_bandwidth compare the fused kernel with.
BlockQuantizedTensor quantize_blockwise_with_transpose_two_pass(Context& ctx, const Tensor& x,
                                                                const BlockScaling& blocks, DType fp8);

// data dequantized (dequantize_blockwise) as a new [M, K] tensor of `out_dtype` on ctx.device.
Tensor dequantize(Context& ctx, const BlockQuantizedTensor& q, DType out_dtype = DType::F32);

// c[M, N] = alpha * op(A) op(B) + beta * c (+ bias), op and the choice between data and data_t
// as fp8_gemm (quantized_tensor.h): always TN, A' = op(A) [M, K], B' = op(B)^T [N, K], each
// with the scales of the copy used.
// At most one operand may use 128x128 tiles (cuBLASLt has no 2-D x 2-D block GEMM): the usual
// pairs are y = x W^T (1x128 x 128x128), dx = dy W (1x128 x 128x128) and
// dW = dy^T x (1x128 x 1x128, both data_t). c: F32 or BF16 (F64 too on the CPU); no FP8
// output (options.out_scale / amax_out must be undefined); options.fast_accumulate is ignored.
// CPU: the reference, gemm of the two dequantized (F32) operands.
// CUDA: cuBLASLt with the block scales as device pointers; M and N multiples of 4, K and the
// row strides multiples of 16 (an Error names what is off).
void fp8_gemm_blockwise(Context& ctx, const BlockQuantizedTensor& a, bool transpose_a, const BlockQuantizedTensor& b,
                        bool transpose_b, Tensor& c, const Fp8GemmOptions& options);
void fp8_gemm_blockwise(Context& ctx, const BlockQuantizedTensor& a, bool transpose_a, const BlockQuantizedTensor& b,
                        bool transpose_b, Tensor& c, float alpha = 1, float beta = 0);

}  // namespace tessera::fp8
