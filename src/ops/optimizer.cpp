#include "tessera/ops/optimizer.h"

#include "backend/cpu/optimizer.h"
#include "dispatch.h"
#if TESSERA_WITH_CUDA
#include "backend/cuda/optimizer.h"
#endif

namespace tessera {
namespace {

// Views of one arena may share a storage; only intersecting bytes are an error.
bool memory_overlaps(const Tensor& x, const Tensor& y) {
  if (x.numel() == 0 || y.numel() == 0) return false;
  const auto* x0 = static_cast<const char*>(x.raw_data());
  const auto* y0 = static_cast<const char*>(y.raw_data());
  return x0 < y0 + y.nbytes() && y0 < x0 + x.nbytes();
}

}  // namespace

void adamw_step(Context& ctx, Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                const AdamWOptions& options) {
  const char* op = "adamw_step";
  check_contiguous(param, op, "param");
  check_contiguous(grad, op, "grad");
  check_contiguous(exp_avg, op, "exp_avg");
  check_contiguous(exp_avg_sq, op, "exp_avg_sq");
  TESSERA_CHECK(param.dtype() == DType::F32 || param.dtype() == DType::F64, op,
                ": param (master weights) must be F32 or F64, got ", param.describe());
  check_floating(grad, op, "grad");
  check_dtype(exp_avg, param.dtype(), op, "exp_avg");
  check_dtype(exp_avg_sq, param.dtype(), op, "exp_avg_sq");
  check_shape(grad, param.shape(), op, "grad");
  check_shape(exp_avg, param.shape(), op, "exp_avg");
  check_shape(exp_avg_sq, param.shape(), op, "exp_avg_sq");
  TESSERA_CHECK(!memory_overlaps(param, exp_avg) && !memory_overlaps(param, exp_avg_sq) &&
                    !memory_overlaps(exp_avg, exp_avg_sq),
                op, ": param, exp_avg and exp_avg_sq must not overlap in memory");
  TESSERA_CHECK(options.step >= 1, op, ": step must be >= 1 (1-based, for bias correction), got ", options.step);
  TESSERA_CHECK(options.lr >= 0.0f, op, ": lr must be >= 0, got ", options.lr);
  TESSERA_CHECK(options.eps >= 0.0f, op, ": eps must be >= 0, got ", options.eps);
  TESSERA_CHECK(options.weight_decay >= 0.0f, op, ": weight_decay must be >= 0, got ", options.weight_decay);
  TESSERA_CHECK(options.beta1 >= 0.0f && options.beta1 < 1.0f, op, ": beta1 must be in [0, 1), got ", options.beta1);
  TESSERA_CHECK(options.beta2 >= 0.0f && options.beta2 < 1.0f, op, ": beta2 must be in [0, 1), got ", options.beta2);
  check_on_device(ctx, op, {&param, &grad, &exp_avg, &exp_avg_sq});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::adamw_step_supported(param, grad)) {
      cuda::adamw_step(ctx.stream, param, grad, exp_avg, exp_avg_sq, options);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  cpu::adamw_step(param, grad, exp_avg, exp_avg_sq, options);
}

}  // namespace tessera
