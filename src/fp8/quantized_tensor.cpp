#include "tessera/fp8/quantized_tensor.h"

#include <cmath>

#include "fp8_common.h"
#include "ops/dispatch.h"
#include "tessera/core/error.h"
#include "tessera/ops/elementwise.h"
#include "tessera/ops/quantize.h"
#if TESSERA_WITH_CUDA
#include "backend/cuda/cast_transpose.h"
#include "backend/cuda/gemm_fp8.h"
#endif

namespace tessera::fp8 {

namespace {

// need_data / need_data_t: which copies the caller reads. A layer may drop the copy its
// backward does not read (nn::Linear keeps only the transposed ones of x and W, the only
// ones its backward GEMMs use); when both are present they must be each other's transpose.
void check_quantized(const QuantizedTensor& q, const char* op, const char* name, bool need_data = true,
                     bool need_data_t = true) {
  TESSERA_CHECK((q.data.defined() || !need_data) && (q.data_t.defined() || !need_data_t) &&
                    (q.data.defined() || q.data_t.defined()) && q.scale_inv.defined(),
                op, ": ", name, " is not a quantized tensor (undefined scale_inv, or an undefined copy, data or ",
                "data_t, that this call reads)");
  TESSERA_CHECK((!q.data.defined() || q.data.dim() == 2) && (!q.data_t.defined() || q.data_t.dim() == 2), op, ": ",
                name, " must be 2-D");
  if (q.data.defined() && q.data_t.defined())
    TESSERA_CHECK(q.data.size(0) == q.data_t.size(1) && q.data.size(1) == q.data_t.size(0), op, ": ", name, ".data ",
                  q.data.describe(), " and ", name, ".data_t ", q.data_t.describe(), " are not each other's transpose");
}

}  // namespace

namespace {

// quantize_with_transpose, and when dbias is non-null the bias gradient of x into it: fused
// into the cast kernel on CUDA (F32 / BF16 x, F32 dbias), else bias_grad after the cast.
QuantizedTensor cast_with_transpose(Context& ctx, const Tensor& x, const Tensor& scale, DType fp8, Tensor* amax_out,
                                    Tensor* dbias, const char* op);

}  // namespace

QuantizedTensor quantize_with_transpose(Context& ctx, const Tensor& x, const Tensor& scale, DType fp8,
                                        Tensor* amax_out) {
  return cast_with_transpose(ctx, x, scale, fp8, amax_out, nullptr, "quantize_with_transpose");
}

QuantizedTensor quantize_with_transpose_and_bias_grad(Context& ctx, const Tensor& x, const Tensor& scale, DType fp8,
                                                      Tensor& dbias, Tensor* amax_out) {
  const char* op = "quantize_with_transpose_and_bias_grad";
  check_defined(dbias, op, "dbias");
  return cast_with_transpose(ctx, x, scale, fp8, amax_out, &dbias, op);
}

namespace {

QuantizedTensor cast_with_transpose(Context& ctx, const Tensor& x, const Tensor& scale, DType fp8, Tensor* amax_out,
                                    Tensor* dbias, const char* op) {
  check_defined(x, op, "x");
  TESSERA_CHECK(x.dim() == 2, op, ": x must be 2-D, got ", x.describe());
  TESSERA_CHECK(fp8 == DType::E4M3 || fp8 == DType::E5M2, op, ": fp8 must be E4M3 or E5M2, got ",
                dtype_name(fp8));
  check_defined(scale, op, "scale");
  check_dtype(scale, DType::F32, op, "scale");
  check_shape(scale, {1}, op, "scale");

  QuantizedTensor q;
  q.dtype = fp8;
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    Tensor no_amax;
    Tensor& amax = amax_out ? *amax_out : no_amax;
    check_on_device(ctx, op, {&x, &scale, &amax});
    q.data = Tensor::empty({x.size(0), x.size(1)}, fp8, ctx.device);
    q.data_t = Tensor::empty({x.size(1), x.size(0)}, fp8, ctx.device);
    q.scale_inv = Tensor::empty({1}, DType::F32, ctx.device);
    // Before the cast: amax_out may be the scale tensor itself, which the cast overwrites.
    cuda::fp8_reciprocal_scale(ctx.stream, scale, q.scale_inv);
    // The column sums ride along where dbias is the FP32 master gradient (else bias_grad below).
    const bool fused_bias = dbias != nullptr && dbias->dtype() == DType::F32 && dbias->is_contiguous() &&
                            dbias->dim() == 1 && dbias->size(0) == x.size(1) && dbias->device() == ctx.device;
    if (x.is_contiguous() && scale.is_contiguous() && cuda::cast_transpose_supported(x.dtype())) {
      // Both copies from one read of x (backend/cuda/cast_transpose.cu), the same bytes.
      if (amax.defined()) {
        check_contiguous(amax, op, "amax_out");
        check_dtype(amax, DType::F32, op, "amax_out");
        check_shape(amax, {1}, op, "amax_out");
      }
      cuda::cast_transpose(ctx.stream, x, scale, q.data, q.data_t, amax, fused_bias ? dbias : nullptr);
      if (dbias != nullptr && !fused_bias) bias_grad(ctx, x, *dbias);
    } else {
      quantize_per_tensor(ctx, x, scale, q.data, amax);
      transpose_2d(ctx, q.data, q.data_t);
      if (dbias != nullptr) bias_grad(ctx, x, *dbias);
    }
    return q;
#else
    fail_no_kernel(op, ctx);
#endif
  }
  const float s = host_scalar(scale, op, "scale");
  // 0 or Inf would give a non-finite scale_inv; fp8_scale_from_amax never produces them.
  TESSERA_CHECK(s > 0 && std::isfinite(s), op, ": scale must be finite and > 0, got ", s);
  q.data = Tensor::empty({x.size(0), x.size(1)}, fp8, ctx.device);
  q.data_t = Tensor::empty({x.size(1), x.size(0)}, fp8, ctx.device);
  Tensor no_amax;
  quantize_per_tensor(ctx, x, scale, q.data, amax_out ? *amax_out : no_amax);
  transpose_2d(ctx, q.data, q.data_t);
  q.scale_inv = Tensor::from_floats({1.0f / s}, {1}).to(ctx.device);
  if (dbias != nullptr) bias_grad(ctx, x, *dbias);
  return q;
}

}  // namespace

QuantizedTensor quantize_transposed(Context& ctx, const Tensor& x, const Tensor& scale, DType fp8) {
#if TESSERA_WITH_CUDA
  if (ctx.device.is_cuda() && x.defined() && x.dim() == 2 && x.is_contiguous() && scale.defined() &&
      scale.dtype() == DType::F32 && scale.shape() == Shape{1} && scale.is_contiguous() &&
      (fp8 == DType::E4M3 || fp8 == DType::E5M2) && cuda::cast_transpose_supported(x.dtype())) {
    Tensor no_row_wise, no_amax;
    check_on_device(ctx, "quantize_transposed", {&x, &scale});
    QuantizedTensor q;
    q.dtype = fp8;
    q.data_t = Tensor::empty({x.size(1), x.size(0)}, fp8, ctx.device);
    q.scale_inv = Tensor::empty({1}, DType::F32, ctx.device);
    cuda::fp8_reciprocal_scale(ctx.stream, scale, q.scale_inv);
    cuda::cast_transpose(ctx.stream, x, scale, no_row_wise, q.data_t, no_amax);
    return q;
  }
#endif
  // Everywhere else (and for the argument checks): both copies, then the row-wise one dropped.
  QuantizedTensor q = quantize_with_transpose(ctx, x, scale, fp8);
  q.data = Tensor();
  return q;
}

QuantizedTensor quantized_from_codes(Context& ctx, const Tensor& data, const Tensor& scale) {
  const char* op = "quantized_from_codes";
  check_defined(data, op, "data");
  TESSERA_CHECK(data.dim() == 2 && data.is_contiguous() && is_fp8(data.dtype()), op,
                ": data must be a contiguous 2-D E4M3 or E5M2 tensor, got ", data.describe());
  check_defined(scale, op, "scale");
  check_dtype(scale, DType::F32, op, "scale");
  check_shape(scale, {1}, op, "scale");
  check_on_device(ctx, op, {&data, &scale});
  QuantizedTensor q;
  q.dtype = data.dtype();
  q.data = data;
  q.data_t = Tensor::empty({data.size(1), data.size(0)}, data.dtype(), ctx.device);
  transpose_2d(ctx, q.data, q.data_t);
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    q.scale_inv = Tensor::empty({1}, DType::F32, ctx.device);
    cuda::fp8_reciprocal_scale(ctx.stream, scale, q.scale_inv);
    return q;
#else
    fail_no_kernel(op, ctx);
#endif
  }
  const float s = host_scalar(scale, op, "scale");
  TESSERA_CHECK(s > 0 && std::isfinite(s), op, ": scale must be finite and > 0, got ", s);
  q.scale_inv = Tensor::from_floats({1.0f / s}, {1}).to(ctx.device);
  return q;
}

Tensor dequantize(Context& ctx, const QuantizedTensor& q, DType out_dtype) {
  check_quantized(q, "dequantize", "q", true, false);
  Tensor out = Tensor::empty(q.data.shape(), out_dtype, ctx.device);
  dequantize_per_tensor(ctx, q.data, q.scale_inv, out);
  return out;
}

void fp8_gemm(Context& ctx, const QuantizedTensor& a, bool transpose_a, const QuantizedTensor& b, bool transpose_b,
              Tensor& c, const Fp8GemmOptions& options) {
  const char* op = "fp8_gemm";
  // Only the copies this orientation reads must be present (see below).
  check_quantized(a, op, "a", !transpose_a, transpose_a);
  check_quantized(b, op, "b", transpose_b, !transpose_b);
  check_defined(c, op, "c");
  const Tensor& a_mk = transpose_a ? a.data_t : a.data;  // op(A) as [M, K]
  const Tensor& b_nk = transpose_b ? b.data : b.data_t;  // op(B)^T as [N, K]
  check_fp8_output_options(c, options, op);
  check_on_device(ctx, op,
                  {&a.data, &a.data_t, &a.scale_inv, &b.data, &b.data_t, &b.scale_inv, &c, &options.bias,
                   &options.out_scale, &options.amax_out});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    const cuda::Fp8Operand ca{a_mk, a.scale_inv, cuda::Fp8ScaleMode::Tensor};
    const cuda::Fp8Operand cb{b_nk, b.scale_inv, cuda::Fp8ScaleMode::Tensor};
    cuda::fp8_gemm(ctx.stream, ca, cb, c, to_cuda_params(options));
    return;
#else
    fail_no_kernel(op, ctx);
#endif
  }
  GemmOptions g;
  g.transpose_a = false;
  g.transpose_b = true;
  g.alpha = options.alpha;
  g.beta = options.beta;
  g.a_scale_inv = host_scalar(a.scale_inv, op, "a.scale_inv");
  g.b_scale_inv = host_scalar(b.scale_inv, op, "b.scale_inv");
  gemm_maybe_fp8_out(ctx, a_mk, b_nk, c, g, options);
}

void fp8_gemm(Context& ctx, const QuantizedTensor& a, bool transpose_a, const QuantizedTensor& b, bool transpose_b,
              Tensor& c, float alpha, float beta) {
  Fp8GemmOptions options;
  options.alpha = alpha;
  options.beta = beta;
  fp8_gemm(ctx, a, transpose_a, b, transpose_b, c, options);
}

}  // namespace tessera::fp8
