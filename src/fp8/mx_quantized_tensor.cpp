#include "tessera/fp8/mx_quantized_tensor.h"

#include "fp8_common.h"
#include "ops/dispatch.h"
#include "tessera/core/error.h"
#include "tessera/ops/elementwise.h"
#include "tessera/ops/gemm.h"
#include "tessera/ops/quantize.h"

namespace tessera::fp8 {

namespace {

Shape mx_scale_shape(int64_t rows, int64_t cols) { return {rows, (cols + kMxBlockSize - 1) / kMxBlockSize}; }

// The copy a call reads (data with its scales, or data_t with scales_t), checked.
void check_copy(const Tensor& data, const Tensor& scales, const char* op, const char* name) {
  TESSERA_CHECK(data.defined() && scales.defined(), op, ": ", name,
                " is not an MXFP8 tensor, or the copy this call reads was dropped");
  TESSERA_CHECK(data.dim() == 2 && is_fp8(data.dtype()), op, ": ", name, " must be 2-D E4M3 or E5M2, got ",
                data.describe());
  check_dtype(scales, DType::E8M0, op, name);
  check_shape(scales, mx_scale_shape(data.size(0), data.size(1)), op, name);
}

}  // namespace

MxQuantizedTensor quantize_mxfp8_with_transpose(Context& ctx, const Tensor& x, DType fp8) {
  const char* op = "quantize_mxfp8_with_transpose";
  check_defined(x, op, "x");
  TESSERA_CHECK(x.dim() == 2, op, ": x must be 2-D, got ", x.describe());
  TESSERA_CHECK(fp8 == DType::E4M3 || fp8 == DType::E5M2, op, ": fp8 must be E4M3 or E5M2, got ", dtype_name(fp8));
  check_on_device(ctx, op, {&x});
  const int64_t m = x.size(0), k = x.size(1);
  MxQuantizedTensor q;
  q.dtype = fp8;
  q.data = Tensor::empty({m, k}, fp8, ctx.device);
  q.scales = Tensor::empty(mx_scale_shape(m, k), DType::E8M0, ctx.device);
  quantize_mxfp8(ctx, x, q.data, q.scales);
  // Column-wise: blocks of 32 down the columns of x, i.e. the row-wise cast of x^T.
  Tensor xt = Tensor::empty({k, m}, x.dtype(), ctx.device);
  transpose_2d(ctx, x, xt);
  q.data_t = Tensor::empty({k, m}, fp8, ctx.device);
  q.scales_t = Tensor::empty(mx_scale_shape(k, m), DType::E8M0, ctx.device);
  quantize_mxfp8(ctx, xt, q.data_t, q.scales_t);
  return q;
}

Tensor dequantize(Context& ctx, const MxQuantizedTensor& q, DType out_dtype, bool transposed) {
  const Tensor& data = transposed ? q.data_t : q.data;
  const Tensor& scales = transposed ? q.scales_t : q.scales;
  check_copy(data, scales, "dequantize", transposed ? "q (data_t)" : "q (data)");
  Tensor out = Tensor::empty(data.shape(), out_dtype, ctx.device);
  dequantize_mxfp8(ctx, data, scales, out);
  return out;
}

void mxfp8_gemm_emulated(Context& ctx, const MxQuantizedTensor& a, bool transpose_a, const MxQuantizedTensor& b,
                         bool transpose_b, Tensor& c, const Fp8GemmOptions& options) {
  const char* op = "mxfp8_gemm_emulated";
  check_defined(c, op, "c");
  TESSERA_CHECK(!is_fp8(c.dtype()), op, ": the emulated MXFP8 GEMM writes F32 or BF16, not FP8 (c is ", c.describe(),
                ")");
  check_fp8_output_options(c, options, op);
  // op(A) as [M, K] and op(B)^T as [N, K]: both with their blocks along K.
  const Tensor a_mk = dequantize(ctx, a, DType::BF16, transpose_a);
  const Tensor b_nk = dequantize(ctx, b, DType::BF16, !transpose_b);
  TESSERA_CHECK(a_mk.size(1) == b_nk.size(1), op, ": op(A) is [", a_mk.size(0), ", ", a_mk.size(1), "] and op(B) [",
                b_nk.size(1), ", ", b_nk.size(0), "]: K differs");
  GemmOptions g;
  g.transpose_b = true;
  g.alpha = options.alpha;
  g.beta = options.beta;
  gemm(ctx, a_mk, b_nk, c, g, options.bias);
}

}  // namespace tessera::fp8
