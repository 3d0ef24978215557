// An MXFP8-quantized tensor (the "mxfp8" recipe: OCP microscaling, 1x32 blocks along the
// contracted dimension, E8M0 power-of-two scales) with both orientations, and its GEMM.
//
// Hopper has no MXFP8 tensor cores (Blackwell's tcgen05 has), so the GEMM is EMULATED on every
// device: the two operands are dequantized to BF16 (exact: an FP8 value times a power of two is
// a BF16 value, apart from BF16 subnormals below 2^-126) and multiplied by the ordinary BF16
// GEMM with FP32 accumulation. The numerics are the recipe's (what the blocks round away is
// rounded away); the speed is BF16's plus the casts, so it is for studying the recipe, not for
// going faster.
//
// As for BlockQuantizedTensor, each tensor keeps a row-wise copy (data [M, K], 1x32 blocks
// along K) and a column-wise one (data_t [K, M], quantize_mxfp8 of x^T: 1x32 blocks down the
// columns of x). The two are quantized from x separately and round differently.
#pragma once

#include "tessera/core/context.h"
#include "tessera/core/tensor.h"
#include "tessera/fp8/quantized_tensor.h"

namespace tessera::fp8 {

struct MxQuantizedTensor {
  Tensor data;      // FP8 [M, K]
  Tensor scales;    // E8M0 [M, ceil(K / 32)]
  Tensor data_t;    // FP8 [K, M]
  Tensor scales_t;  // E8M0 [K, ceil(M / 32)]
  DType dtype = DType::E4M3;

  // The logical [M, K], also when one copy was dropped (nn::Linear keeps only what its
  // backward reads).
  int64_t rows() const { return data.defined() ? data.size(0) : data_t.size(1); }
  int64_t cols() const { return data.defined() ? data.size(1) : data_t.size(0); }
};

// Casts a 2-D x [M, K] (any floating dtype quantize_mxfp8 takes) to `fp8` (E4M3 or E5M2), both
// orientations (quantize_mxfp8 of x and of transpose_2d(x)). Runs wherever those ops run (CPU
// and CUDA); nothing is read back to the host. Outputs are allocated on ctx.device.
MxQuantizedTensor quantize_mxfp8_with_transpose(Context& ctx, const Tensor& x, DType fp8);

// One copy dequantized as a new tensor of out_dtype: data ([M, K]) or, with transposed, data_t.
Tensor dequantize(Context& ctx, const MxQuantizedTensor& q, DType out_dtype = DType::F32, bool transposed = false);

// c[M, N] = alpha * op(A) op(B) + beta * c (+ bias), the copies chosen as fp8_gemm chooses them
// (op(A) = A -> a.data, A^T -> a.data_t; op(B) = B -> b.data_t, B^T -> b.data), so the blocks
// always run along the contracted dimension, as an MXFP8 tensor core needs. Emulated (above):
// both copies dequantized to BF16, then gemm(). c F32 or BF16 (F64 on the CPU); bias as gemm()
// takes it on the device (on CUDA: c's dtype); no FP8 output; fast_accumulate is ignored.
void mxfp8_gemm_emulated(Context& ctx, const MxQuantizedTensor& a, bool transpose_a, const MxQuantizedTensor& b,
                         bool transpose_b, Tensor& c, const Fp8GemmOptions& options = {});

}  // namespace tessera::fp8
