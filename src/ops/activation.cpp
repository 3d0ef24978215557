#include "tessera/ops/activation.h"

#include "backend/cpu/activation.h"
#include "dispatch.h"
#if TESSERA_WITH_CUDA
#include "backend/cuda/cuda_backend.h"
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

void swiglu_backward(Context& ctx, const Tensor& x, const Tensor& dy, Tensor& dx) {
  const char* op = "swiglu_backward";
  check_operand(x, op, "x");
  check_operand(dy, op, "dy");
  check_operand(dx, op, "dx");
  check_shape(dy, swiglu_output_shape(x, op), op, "dy");
  check_shape(dx, x.shape(), op, "dx");
  check_on_device(ctx, op, {&x, &dy, &dx});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::elementwise_supported({&x, &dy, &dx})) {
      cuda::swiglu_backward(ctx.stream, x, dy, dx);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  cpu::swiglu_backward(x, dy, dx);
}

}  // namespace tessera
