#include "tessera/ops/softmax.h"

#include "backend/cpu/softmax.h"
#include "dispatch.h"
#if TESSERA_WITH_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

namespace tessera {
namespace {

void check_rows_tensor(const Tensor& t, const char* op, const char* name) {
  check_contiguous(t, op, name);
  check_floating(t, op, name);
  TESSERA_CHECK(t.dim() >= 1, op, ": ", name, " must have at least one dimension, got ", t.describe());
}

}  // namespace

void softmax_forward(Context& ctx, const Tensor& x, Tensor& y) {
  const char* op = "softmax_forward";
  check_rows_tensor(x, op, "x");
  check_rows_tensor(y, op, "y");
  check_shape(y, x.shape(), op, "y");
  check_on_device(ctx, op, {&x, &y});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::elementwise_supported({&x, &y})) {
      cuda::softmax_forward(ctx.stream, x, y);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  cpu::softmax_forward(x, y);
}

void softmax_backward(Context& ctx, const Tensor& y, const Tensor& dy, Tensor& dx) {
  const char* op = "softmax_backward";
  check_rows_tensor(y, op, "y");
  check_rows_tensor(dy, op, "dy");
  check_rows_tensor(dx, op, "dx");
  check_shape(dy, y.shape(), op, "dy");
  check_shape(dx, y.shape(), op, "dx");
  check_on_device(ctx, op, {&y, &dy, &dx});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::elementwise_supported({&y, &dy, &dx})) {
      cuda::softmax_backward(ctx.stream, y, dy, dx);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  cpu::softmax_backward(y, dy, dx);
}

}  // namespace tessera
