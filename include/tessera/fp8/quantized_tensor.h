// A per-tensor-scaled FP8 tensor together with its transposed copy, and the GEMM that
// consumes it.
//
// Hopper's FP8 tensor-core GEMMs (cuBLASLt) accept only the "TN" layout: in tessera's
// row-major terms, c[M, N] = A[M, K] * B[N, K]^T, i.e. both operands K-contiguous. A linear
// layer's backward needs the other orientations too (dW = dy^T x contracts over the rows),
// so the recipe casts each tensor once and keeps both the [M, K] and the [K, M] FP8 copies
// (Transformer Engine's rowwise / columnwise data). Transposing the FP8 bytes is exact: the
// copy holds exactly the codes that quantizing x^T would give.
#pragma once

#include "tessera/core/context.h"
#include "tessera/core/tensor.h"
#include "tessera/ops/gemm.h"

namespace tessera::fp8 {

struct QuantizedTensor {
  Tensor data;       // FP8 [M, K]: fp8(x * scale), saturating
  Tensor data_t;     // FP8 [K, M]: data transposed, byte for byte
  Tensor scale_inv;  // F32 [1]: 1 / scale (float division), to dequantize
  DType dtype = DType::E4M3;

  int64_t rows() const { return data.size(0); }
  int64_t cols() const { return data.size(1); }
};

// Casts a 2-D x [M, K] (any floating dtype) with the per-tensor scale (F32 [1]) to `fp8`
// (E4M3 or E5M2) with quantize_per_tensor, and transposes the result with transpose_2d, so
// it runs wherever those two ops run. When amax_out is non-null (F32 [1]) it receives
// max |x| of the unscaled input, the statistic delayed scaling records.
// scale_inv = 1.0f / scale[0] is computed on the host, the same float division that
// quantize_blockwise uses for its scale_inv, so for a device scale this reads one float
// back (a stream synchronisation). The recipes keep scales on the host anyway
// (DelayedScalingState), and gemm takes its scale_inv factors as host floats.
// scale must be finite and > 0. All outputs are allocated on ctx.device.
QuantizedTensor quantize_with_transpose(Context& ctx, const Tensor& x, const Tensor& scale, DType fp8,
                                        Tensor* amax_out = nullptr);

// float(q) * scale_inv as a new tensor of `out_dtype` [M, K] on ctx.device
// (dequantize_per_tensor on q.data).
Tensor dequantize(Context& ctx, const QuantizedTensor& q, DType out_dtype = DType::F32);

// c[M, N] = alpha * op(A) op(B) + beta * c, where A and B are the logical (unquantized)
// matrices of a and b, op(X) = X^T when the flag is set, and the FP8 scale_inv factors are
// applied by the GEMM. The operand passed to gemm is always chosen between data and data_t
// so that the call is TN (transpose_a = false, transpose_b = true), the only layout
// Hopper's FP8 GEMMs support:
//   op(A) = A   -> a.data   [M, K]       op(B) = B   -> b.data_t [N, K]
//   op(A) = A^T -> a.data_t [M, K]       op(B) = B^T -> b.data   [N, K]
// c: F32 or BF16 (or F64), as gemm allows. Reads both scale_inv values to the host.
// E.g. for y = x W^T: fp8_gemm(x, false, w, true, y); dx = dy W: fp8_gemm(dy, false, w, false, dx);
// dW = dy^T x: fp8_gemm(dy, true, x, false, dW, 1, 1).
void fp8_gemm(Context& ctx, const QuantizedTensor& a, bool transpose_a, const QuantizedTensor& b, bool transpose_b,
              Tensor& c, float alpha = 1, float beta = 0);

}  // namespace tessera::fp8
