#include "tessera/fp8/quantized_tensor.h"

#include <cmath>

#include "tessera/core/error.h"
#include "tessera/ops/elementwise.h"
#include "tessera/ops/quantize.h"

namespace tessera::fp8 {

namespace {

// 1 / scale as a host float; the F32 [1] tensor may live on any device.
float host_scalar(const Tensor& t, const char* op, const char* name) {
  check_defined(t, op, name);
  check_dtype(t, DType::F32, op, name);
  check_shape(t, {1}, op, name);
  return t.to_floats()[0];
}

void check_quantized(const QuantizedTensor& q, const char* op, const char* name) {
  TESSERA_CHECK(q.data.defined() && q.data_t.defined() && q.scale_inv.defined(), op, ": ", name,
                " is not a quantized tensor (undefined data, data_t or scale_inv)");
  TESSERA_CHECK(q.data.dim() == 2 && q.data_t.dim() == 2 && q.data.size(0) == q.data_t.size(1) &&
                    q.data.size(1) == q.data_t.size(0),
                op, ": ", name, ".data ", q.data.describe(), " and ", name, ".data_t ", q.data_t.describe(),
                " are not each other's transpose");
}

}  // namespace

QuantizedTensor quantize_with_transpose(Context& ctx, const Tensor& x, const Tensor& scale, DType fp8,
                                        Tensor* amax_out) {
  const char* op = "quantize_with_transpose";
  check_defined(x, op, "x");
  TESSERA_CHECK(x.dim() == 2, op, ": x must be 2-D, got ", x.describe());
  TESSERA_CHECK(fp8 == DType::E4M3 || fp8 == DType::E5M2, op, ": fp8 must be E4M3 or E5M2, got ",
                dtype_name(fp8));
  const float s = host_scalar(scale, op, "scale");
  // 0 or Inf would give a non-finite scale_inv; fp8_scale_from_amax never produces them.
  TESSERA_CHECK(s > 0 && std::isfinite(s), op, ": scale must be finite and > 0, got ", s);

  QuantizedTensor q;
  q.dtype = fp8;
  q.data = Tensor::empty({x.size(0), x.size(1)}, fp8, ctx.device);
  q.data_t = Tensor::empty({x.size(1), x.size(0)}, fp8, ctx.device);
  Tensor no_amax;
  quantize_per_tensor(ctx, x, scale, q.data, amax_out ? *amax_out : no_amax);
  transpose_2d(ctx, q.data, q.data_t);
  q.scale_inv = Tensor::from_floats({1.0f / s}, {1}).to(ctx.device);
  return q;
}

Tensor dequantize(Context& ctx, const QuantizedTensor& q, DType out_dtype) {
  check_quantized(q, "dequantize", "q");
  Tensor out = Tensor::empty(q.data.shape(), out_dtype, ctx.device);
  dequantize_per_tensor(ctx, q.data, q.scale_inv, out);
  return out;
}

void fp8_gemm(Context& ctx, const QuantizedTensor& a, bool transpose_a, const QuantizedTensor& b, bool transpose_b,
              Tensor& c, float alpha, float beta) {
  const char* op = "fp8_gemm";
  check_quantized(a, op, "a");
  check_quantized(b, op, "b");
  GemmOptions options;
  options.transpose_a = false;
  options.transpose_b = true;
  options.alpha = alpha;
  options.beta = beta;
  options.a_scale_inv = host_scalar(a.scale_inv, op, "a.scale_inv");
  options.b_scale_inv = host_scalar(b.scale_inv, op, "b.scale_inv");
  const Tensor& a_mk = transpose_a ? a.data_t : a.data;  // op(A) as [M, K]
  const Tensor& b_nk = transpose_b ? b.data : b.data_t;  // op(B)^T as [N, K]
  gemm(ctx, a_mk, b_nk, c, options);
}

}  // namespace tessera::fp8
