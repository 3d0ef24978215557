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

  // The logical [M, K], also when one copy was dropped (nn::Linear keeps only data_t of
  // what its backward reads; fp8_gemm needs only the copy of the orientation it uses).
  int64_t rows() const { return data.defined() ? data.size(0) : data_t.size(1); }
  int64_t cols() const { return data.defined() ? data.size(1) : data_t.size(0); }
};

// Casts a 2-D x [M, K] (any floating dtype) with the per-tensor scale (F32 [1]) to `fp8`
// (E4M3 or E5M2) with quantize_per_tensor, and transposes the result with transpose_2d, so
// it runs wherever those two ops run. When amax_out is non-null (F32 [1]) it receives
// max |x| of the unscaled input, the statistic delayed scaling records.
// scale_inv = 1.0f / scale[0], the same float division that quantize_blockwise uses:
//  - on the CPU it is computed on the host, after checking that scale is finite and > 0;
//  - on CUDA a one-thread kernel divides on the device (IEEE round to nearest, the same
//    bits), so nothing waits for the GPU; the scale is not checked there, and one that is
//    not finite and > 0 gives scale_inv = NaN, which turns every GEMM using it into NaN.
// All outputs are allocated on ctx.device; x, scale and amax_out must live there too.
// On CUDA, for F32 and BF16 x, one kernel writes both copies and the amax from one read of x
// (backend/cuda/cast_transpose.cu: the same bytes as the two ops). amax_out may be the scale
// tensor itself: codes and scale_inv then use the scale as it was before the call.
QuantizedTensor quantize_with_transpose(Context& ctx, const Tensor& x, const Tensor& scale, DType fp8,
                                        Tensor* amax_out = nullptr);

// quantize_with_transpose plus a linear layer's bias gradient from the same x (its output
// gradient dy): dbias[c] += sum over the rows of x[:, c] (accumulates, as bias_grad does;
// dbias [K] floating, on ctx.device). On the CPU, and on CUDA where the fused kernel does
// not apply, it is quantize_with_transpose then bias_grad (the same bytes as calling the
// two). On CUDA, for contiguous F32 / BF16 x and an F32 contiguous dbias (the FP32 master
// gradient), the cast kernel also sums the columns (backend/cuda/cast_transpose.cu): no
// second read of x; deterministic, equal to bias_grad's result up to the order of the
// double additions (not bit for bit).
QuantizedTensor quantize_with_transpose_and_bias_grad(Context& ctx, const Tensor& x, const Tensor& scale, DType fp8,
                                                      Tensor& dbias, Tensor* amax_out = nullptr);

// The transposed copy alone (data undefined): data_t and scale_inv exactly as
// quantize_with_transpose writes them, no amax. For a backward that casts a weight again
// (nn::Linear under fp8.keep_weight_transpose = false): on CUDA the kernel then skips the
// row-wise stores, 3 bytes per BF16 element instead of 4.
QuantizedTensor quantize_transposed(Context& ctx, const Tensor& x, const Tensor& scale, DType fp8);

// The QuantizedTensor of codes already cast with `scale` (e.g. by a norm with an FP8 output,
// ops/norm.h): data is kept (contiguous 2-D E4M3 or E5M2), data_t is its transpose_2d, and
// scale_inv = 1.0f / scale[0] exactly as quantize_with_transpose computes it (checked on the
// CPU, not on CUDA).
QuantizedTensor quantized_from_codes(Context& ctx, const Tensor& data, const Tensor& scale);

// float(q) * scale_inv as a new tensor of `out_dtype` [M, K] on ctx.device
// (dequantize_per_tensor on q.data).
Tensor dequantize(Context& ctx, const QuantizedTensor& q, DType out_dtype = DType::F32);

// What an FP8 GEMM does besides the product (fp8_gemm, fp8_gemm_blockwise).
struct Fp8GemmOptions {
  float alpha = 1, beta = 0;  // c = alpha * op(A) op(B) (+ bias) + beta * c
  // cuBLASLt's fast accumulation (partial sums stay in the tensor cores' reduced-precision
  // accumulator): Transformer Engine uses it for the forward GEMM and not for the backward
  // ones. No effect on the CPU, nor for block-scaled GEMMs (cuBLASLt always promotes there).
  bool fast_accumulate = false;
  Tensor bias;  // optional [N], added to every row; on CUDA it must be BF16
  // E4M3 output only (per-tensor operands, beta = 0): c = fp8(result * out_scale), where
  // result includes the bias; out_scale F32 [1] (undefined = 1), and amax_out F32 [1]
  // receives max |result| before out_scale, the statistic the next layer's scale needs.
  Tensor out_scale;
  Tensor amax_out;
};

// c[M, N] = alpha * op(A) op(B) + beta * c, where A and B are the logical (unquantized)
// matrices of a and b, op(X) = X^T when the flag is set, and the FP8 scale_inv factors are
// applied by the GEMM. The operand used is always chosen between data and data_t so that
// the call is TN (c = A' B'^T with A' [M, K] and B' [N, K] both K-contiguous), the only
// layout Hopper's FP8 GEMMs support:
//   op(A) = A   -> a.data   [M, K]       op(B) = B   -> b.data_t [N, K]
//   op(A) = A^T -> a.data_t [M, K]       op(B) = B^T -> b.data   [N, K]
// E.g. for y = x W^T: fp8_gemm(x, false, w, true, y); dx = dy W: fp8_gemm(dy, false, w, false, dx);
// dW = dy^T x: fp8_gemm(dy, true, x, false, dW, 1, 1).
//
// CPU: c F32, BF16 or F64 (as gemm allows) or E4M3 (options above); the product is gemm's
// with the two scale_inv values read to the host (cheap there) and multiplied into alpha.
// CUDA: cuBLASLt's FP8 GEMM (backend/cuda/gemm_fp8.h) with the scale_inv tensors as device
// scale pointers: no host synchronisation. c F32, BF16 or E4M3; E5M2 x E5M2 is refused
// (Hopper has no such GEMM), K and the operands' row strides must be multiples of 16, c's
// rows 16-byte aligned; each violation is an Error that names it.
void fp8_gemm(Context& ctx, const QuantizedTensor& a, bool transpose_a, const QuantizedTensor& b, bool transpose_b,
              Tensor& c, const Fp8GemmOptions& options);
void fp8_gemm(Context& ctx, const QuantizedTensor& a, bool transpose_a, const QuantizedTensor& b, bool transpose_b,
              Tensor& c, float alpha = 1, float beta = 0);

}  // namespace tessera::fp8
