// GELU fused with the FP8 cast of its output (ops declared in tessera/ops/activation.h):
// on CUDA one kernel (backend/cuda/gelu_fp8.cu) where it applies, else, and on the CPU, the
// unfused composition (gelu_forward / gelu_backward in x's dtype, then
// fp8::quantize_with_transpose[_and_bias_grad]), which defines the bytes.
#include "dispatch.h"
#include "tessera/ops/activation.h"
#include "tessera/ops/gemm.h"
#include "tessera/ops/quantize.h"
#if TESSERA_WITH_CUDA
#include "backend/cuda/gelu_fp8.h"
#include "backend/cuda/gemm_fp8.h"
#endif

namespace tessera {

namespace {

// x 2-D [rows, F] (and dy of the same shape and dtype), contiguous floating.
void check_gelu_fused_inputs(Context& ctx, const Tensor& x, const Tensor* dy, const char* op) {
  check_defined(x, op, "x");
  check_contiguous(x, op, "x");
  check_floating(x, op, "x");
  TESSERA_CHECK(x.dim() == 2, op, ": x must be 2-D [rows, F], got ", x.describe());
  if (dy) {
    check_defined(*dy, op, "dy");
    check_contiguous(*dy, op, "dy");
    check_shape(*dy, x.shape(), op, "dy");
    check_dtype(*dy, x.dtype(), op, "dy");
  }
  check_on_device(ctx, op, {&x});
  if (dy) check_on_device(ctx, op, {dy});
}

// The unfused activation, as the MLP's unfused path writes it.
Tensor unfused_gelu(Context& ctx, const Tensor& x, const Tensor* dy) {
  Tensor out = Tensor::empty(x.shape(), x.dtype(), ctx.device);
  if (dy) gelu_backward(ctx, x, *dy, out);
  else gelu_forward(ctx, x, out);
  return out;
}

fp8::QuantizedTensor gelu_fp8(Context& ctx, const Tensor& x, const Tensor* dy, const Tensor& scale, DType fp8,
                              Tensor* amax_out, Tensor* dbias, const char* op) {
  check_gelu_fused_inputs(ctx, x, dy, op);
  TESSERA_CHECK(fp8 == DType::E4M3 || fp8 == DType::E5M2, op, ": fp8 must be E4M3 or E5M2, got ", dtype_name(fp8));
  check_f32_scalar(scale, op, "scale");
  if (amax_out) {
    check_f32_scalar(*amax_out, op, "amax_out");
    TESSERA_CHECK(amax_out->raw_data() != scale.raw_data(), op, ": amax_out must not be the scale tensor");
  }
  if (dbias) {
    check_defined(*dbias, op, "dbias");
    check_shape(*dbias, {x.size(1)}, op, "dbias");
  }
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    check_on_device(ctx, op, {&scale});
    if (amax_out) check_on_device(ctx, op, {amax_out});
    if (dbias) check_on_device(ctx, op, {dbias});
    const int64_t rows = x.size(0), cols = x.size(1);
    fp8::QuantizedTensor q;
    q.dtype = fp8;
    q.data = Tensor::empty({rows, cols}, fp8, ctx.device);
    q.data_t = Tensor::empty({cols, rows}, fp8, ctx.device);
    if (scale.is_contiguous() && (!amax_out || amax_out->is_contiguous()) &&
        (!dbias || (dbias->dtype() == DType::F32 && dbias->is_contiguous())) &&
        cuda::gelu_cast_transpose_supported(x, dy, q.data, q.data_t)) {
      q.scale_inv = Tensor::empty({1}, DType::F32, ctx.device);
      cuda::fp8_reciprocal_scale(ctx.stream, scale, q.scale_inv);  // as quantize_with_transpose
      Tensor no_amax;
      Tensor& amax = amax_out ? *amax_out : no_amax;
      if (dy) cuda::gelu_backward_cast_transpose(ctx.stream, x, *dy, scale, q.data, q.data_t, amax, dbias);
      else cuda::gelu_forward_cast_transpose(ctx.stream, x, scale, q.data, q.data_t, amax);
      return q;
    }
#endif
  }
  const Tensor act = unfused_gelu(ctx, x, dy);
  if (dbias) return fp8::quantize_with_transpose_and_bias_grad(ctx, act, scale, fp8, *dbias, amax_out);
  return fp8::quantize_with_transpose(ctx, act, scale, fp8, amax_out);
}

void gelu_amax_op(Context& ctx, const Tensor& x, const Tensor* dy, Tensor& amax_out, const char* op) {
  check_gelu_fused_inputs(ctx, x, dy, op);
  check_f32_scalar(amax_out, op, "amax_out");
  check_on_device(ctx, op, {&amax_out});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::gelu_amax_supported(x, dy, amax_out)) {
      if (dy) cuda::gelu_backward_amax(ctx.stream, x, *dy, amax_out);
      else cuda::gelu_forward_amax(ctx.stream, x, amax_out);
      return;
    }
#endif
  }
  amax(ctx, unfused_gelu(ctx, x, dy), amax_out);
}

}  // namespace

fp8::QuantizedTensor gelu_forward_fp8(Context& ctx, const Tensor& x, const Tensor& scale, DType fp8,
                                      Tensor* amax_out) {
  return gelu_fp8(ctx, x, nullptr, scale, fp8, amax_out, nullptr, "gelu_forward_fp8");
}

fp8::QuantizedTensor gelu_backward_fp8(Context& ctx, const Tensor& x, const Tensor& dy, const Tensor& scale,
                                       DType fp8, Tensor* amax_out, Tensor* dbias) {
  return gelu_fp8(ctx, x, &dy, scale, fp8, amax_out, dbias, "gelu_backward_fp8");
}

void gelu_forward_amax(Context& ctx, const Tensor& x, Tensor& amax_out) {
  gelu_amax_op(ctx, x, nullptr, amax_out, "gelu_forward_amax");
}

void gelu_backward_amax(Context& ctx, const Tensor& x, const Tensor& dy, Tensor& amax_out) {
  gelu_amax_op(ctx, x, &dy, amax_out, "gelu_backward_amax");
}

}  // namespace tessera
