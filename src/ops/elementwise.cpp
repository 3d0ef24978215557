#include "tessera/ops/elementwise.h"

#include "backend/cpu/elementwise.h"
#include "dispatch.h"
#if TESSERA_WITH_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

namespace tessera {

void add(Context& ctx, const Tensor& a, const Tensor& b, Tensor& out) {
  const char* op = "add";
  check_contiguous(a, op, "a");
  check_contiguous(b, op, "b");
  check_contiguous(out, op, "out");
  check_floating(a, op, "a");
  check_floating(b, op, "b");
  check_floating(out, op, "out");
  TESSERA_CHECK(a.shape() == b.shape() && a.shape() == out.shape(), op, ": shapes differ: a ", a.describe(), ", b ",
                b.describe(), ", out ", out.describe());
  check_on_device(ctx, op, {&a, &b, &out});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::elementwise_supported({&a, &b, &out})) {
      cuda::add(ctx.stream, a, b, out);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  cpu::add(a, b, out);
}

void scale(Context& ctx, const Tensor& in, float alpha, Tensor& out) {
  const char* op = "scale";
  check_contiguous(in, op, "in");
  check_contiguous(out, op, "out");
  check_floating(in, op, "in");
  check_floating(out, op, "out");
  TESSERA_CHECK(in.shape() == out.shape(), op, ": in ", in.describe(), " and out ", out.describe(), " differ in shape");
  check_on_device(ctx, op, {&in, &out});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::elementwise_supported({&in, &out})) {
      cuda::scale(ctx.stream, in, alpha, out);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  cpu::scale(in, alpha, out);
}

void cast(Context& ctx, const Tensor& in, Tensor& out) {
  const char* op = "cast";
  check_contiguous(in, op, "in");
  check_contiguous(out, op, "out");
  TESSERA_CHECK(in.shape() == out.shape(), op, ": in ", in.describe(), " and out ", out.describe(),
                " differ in shape");
  check_on_device(ctx, op, {&in, &out});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    cuda::cast(ctx.stream, in, out);  // every dtype pair
    return;
#endif
    fail_no_kernel(op, ctx);
  }
  cpu::cast(in, out);
}

void transpose_2d(Context& ctx, const Tensor& in, Tensor& out) {
  const char* op = "transpose_2d";
  check_contiguous(in, op, "in");
  check_contiguous(out, op, "out");
  TESSERA_CHECK(in.dim() == 2, op, ": in must be 2-D, got ", in.describe());
  check_shape(out, {in.size(1), in.size(0)}, op, "out");
  check_dtype(out, in.dtype(), op, "out");
  check_on_device(ctx, op, {&in, &out});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::transpose_2d_supported(in)) {
      cuda::transpose_2d(ctx.stream, in, out);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  cpu::transpose_2d(in, out);
}

}  // namespace tessera
