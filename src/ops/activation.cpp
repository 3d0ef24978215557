#include "tessera/ops/activation.h"

#include "backend/cpu/activation.h"
#include "dispatch.h"
#include "tessera/ops/quantize.h"
#if TESSERA_WITH_CUDA
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/gemm_fp8.h"
#include "backend/cuda/swiglu_fp8.h"
#endif

namespace tessera {
namespace {

void check_operand(const Tensor& t, const char* op, const char* name) {
  check_contiguous(t, op, name);
  check_floating(t, op, name);
}

// x of SwiGLU: at least 1-D with an even last dimension. Returns the shape of y.
Shape swiglu_output_shape(const Tensor& x, const char* op) {
  TESSERA_CHECK(x.dim() >= 1, op, ": x must have at least one dimension, got ", x.describe());
  TESSERA_CHECK(x.size(-1) % 2 == 0, op, ": x's last dimension holds [gate, up] and must be even, got ",
                x.describe());
  Shape out = x.shape();
  out.back() /= 2;
  return out;
}

}  // namespace

void gelu_forward(Context& ctx, const Tensor& x, Tensor& y) {
  const char* op = "gelu_forward";
  check_operand(x, op, "x");
  check_operand(y, op, "y");
  check_shape(y, x.shape(), op, "y");
  check_on_device(ctx, op, {&x, &y});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::elementwise_supported({&x, &y})) {
      cuda::gelu_forward(ctx.stream, x, y);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  cpu::gelu_forward(x, y);
}

void gelu_backward(Context& ctx, const Tensor& x, const Tensor& dy, Tensor& dx) {
  const char* op = "gelu_backward";
  check_operand(x, op, "x");
  check_operand(dy, op, "dy");
  check_operand(dx, op, "dx");
  check_shape(dy, x.shape(), op, "dy");
  check_shape(dx, x.shape(), op, "dx");
  check_on_device(ctx, op, {&x, &dy, &dx});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::elementwise_supported({&x, &dy, &dx})) {
      cuda::gelu_backward(ctx.stream, x, dy, dx);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  cpu::gelu_backward(x, dy, dx);
}

void swiglu_forward(Context& ctx, const Tensor& x, Tensor& y) {
  const char* op = "swiglu_forward";
  check_operand(x, op, "x");
  check_operand(y, op, "y");
  check_shape(y, swiglu_output_shape(x, op), op, "y");
  check_on_device(ctx, op, {&x, &y});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::elementwise_supported({&x, &y})) {
      cuda::swiglu_forward(ctx.stream, x, y);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  cpu::swiglu_forward(x, y);
}

void swiglu_backward(Context& ctx, const Tensor& x, const Tensor& dy, Tensor& dx, Tensor* y) {
  const char* op = "swiglu_backward";
  check_operand(x, op, "x");
  check_operand(dy, op, "dy");
  check_operand(dx, op, "dx");
  check_shape(dy, swiglu_output_shape(x, op), op, "dy");
  check_shape(dx, x.shape(), op, "dx");
  if (y) {
    check_operand(*y, op, "y");
    check_shape(*y, dy.shape(), op, "y");
    TESSERA_CHECK(!y->shares_storage(x) && !y->shares_storage(dx), op, ": y must not overlap x or dx");
  }
  check_on_device(ctx, op, {&x, &dy, &dx});
  if (y) check_on_device(ctx, op, {y});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::elementwise_supported({&x, &dy, &dx}) && (!y || cuda::elementwise_supported({y}))) {
      cuda::swiglu_backward(ctx.stream, x, dy, dx, y);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  cpu::swiglu_backward(x, dy, dx, y);
}

namespace {

// x [rows, 2F] (and dy [rows, F]) of the fused FP8 forms.
void check_fused_inputs(Context& ctx, const Tensor& x, const Tensor* dy, const char* op) {
  check_defined(x, op, "x");
  check_operand(x, op, "x");
  TESSERA_CHECK(x.dim() == 2, op, ": x must be 2-D [rows, 2F], got ", x.describe());
  const Shape half = swiglu_output_shape(x, op);
  if (dy) {
    check_defined(*dy, op, "dy");
    check_operand(*dy, op, "dy");
    check_shape(*dy, half, op, "dy");
    check_dtype(*dy, x.dtype(), op, "dy");
  }
  check_on_device(ctx, op, {&x});
  if (dy) check_on_device(ctx, op, {dy});
}

// The unfused activation, as the MLP's unfused path writes it.
Tensor unfused_activation(Context& ctx, const Tensor& x, const Tensor* dy) {
  if (!dy) {
    Tensor y = Tensor::empty({x.size(0), x.size(1) / 2}, x.dtype(), ctx.device);
    swiglu_forward(ctx, x, y);
    return y;
  }
  Tensor dx = Tensor::empty(x.shape(), x.dtype(), ctx.device);
  swiglu_backward(ctx, x, *dy, dx);
  return dx;
}

fp8::QuantizedTensor swiglu_fp8(Context& ctx, const Tensor& x, const Tensor* dy, const Tensor& scale, DType fp8,
                                Tensor* amax_out, const char* op) {
  check_fused_inputs(ctx, x, dy, op);
  TESSERA_CHECK(fp8 == DType::E4M3 || fp8 == DType::E5M2, op, ": fp8 must be E4M3 or E5M2, got ", dtype_name(fp8));
  check_f32_scalar(scale, op, "scale");
  if (amax_out) {
    check_f32_scalar(*amax_out, op, "amax_out");
    TESSERA_CHECK(amax_out->raw_data() != scale.raw_data(), op, ": amax_out must not be the scale tensor");
  }
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    check_on_device(ctx, op, {&scale});
    if (amax_out) check_on_device(ctx, op, {amax_out});
    const int64_t rows = x.size(0), cols = dy ? x.size(1) : x.size(1) / 2;
    fp8::QuantizedTensor q;
    q.dtype = fp8;
    q.data = Tensor::empty({rows, cols}, fp8, ctx.device);
    q.data_t = Tensor::empty({cols, rows}, fp8, ctx.device);
    if (scale.is_contiguous() && (!amax_out || amax_out->is_contiguous()) &&
        cuda::swiglu_cast_transpose_supported(x, dy, q.data, q.data_t)) {
      q.scale_inv = Tensor::empty({1}, DType::F32, ctx.device);
      cuda::fp8_reciprocal_scale(ctx.stream, scale, q.scale_inv);  // as quantize_with_transpose
      Tensor no_amax;
      Tensor& amax = amax_out ? *amax_out : no_amax;
      if (dy) cuda::swiglu_backward_cast_transpose(ctx.stream, x, *dy, scale, q.data, q.data_t, amax);
      else cuda::swiglu_forward_cast_transpose(ctx.stream, x, scale, q.data, q.data_t, amax);
      return q;
    }
#endif
  }
  return fp8::quantize_with_transpose(ctx, unfused_activation(ctx, x, dy), scale, fp8, amax_out);
}

void swiglu_amax_op(Context& ctx, const Tensor& x, const Tensor* dy, Tensor& amax_out, const char* op) {
  check_fused_inputs(ctx, x, dy, op);
  check_f32_scalar(amax_out, op, "amax_out");
  check_on_device(ctx, op, {&amax_out});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::swiglu_amax_supported(x, dy, amax_out)) {
      if (dy) cuda::swiglu_backward_amax(ctx.stream, x, *dy, amax_out);
      else cuda::swiglu_forward_amax(ctx.stream, x, amax_out);
      return;
    }
#endif
  }
  amax(ctx, unfused_activation(ctx, x, dy), amax_out);
}

}  // namespace

fp8::QuantizedTensor swiglu_forward_fp8(Context& ctx, const Tensor& x, const Tensor& scale, DType fp8,
                                        Tensor* amax_out) {
  return swiglu_fp8(ctx, x, nullptr, scale, fp8, amax_out, "swiglu_forward_fp8");
}

fp8::QuantizedTensor swiglu_backward_fp8(Context& ctx, const Tensor& x, const Tensor& dy, const Tensor& scale,
                                         DType fp8, Tensor* amax_out) {
  return swiglu_fp8(ctx, x, &dy, scale, fp8, amax_out, "swiglu_backward_fp8");
}

void swiglu_forward_amax(Context& ctx, const Tensor& x, Tensor& amax_out) {
  swiglu_amax_op(ctx, x, nullptr, amax_out, "swiglu_forward_amax");
}

void swiglu_backward_amax(Context& ctx, const Tensor& x, const Tensor& dy, Tensor& amax_out) {
  swiglu_amax_op(ctx, x, &dy, amax_out, "swiglu_backward_amax");
}

}  // namespace tessera
