#include "tessera/ops/norm.h"

#include <cmath>

#include "backend/cpu/norm.h"
#include "dispatch.h"
#if TESSERA_WITH_CUDA
#include "backend/cuda/norm.h"
#endif

namespace tessera {
namespace {

// x: contiguous, floating, at least 1-D with a non-empty last dimension. Returns C.
int64_t check_normalized_input(const Tensor& x, const char* op, const char* name) {
  check_contiguous(x, op, name);
  check_floating(x, op, name);
  TESSERA_CHECK(x.dim() >= 1, op, ": ", name, " must have at least one dimension, got ", x.describe());
  TESSERA_CHECK(x.size(-1) >= 1, op, ": ", name, " must have a non-empty last dimension, got ", x.describe());
  return x.size(-1);
}

// An activation-shaped tensor (y, dy, dx): contiguous, floating, x's shape.
void check_like_x(const Tensor& t, const Tensor& x, const char* op, const char* name) {
  check_contiguous(t, op, name);
  check_floating(t, op, name);
  check_shape(t, x.shape(), op, name);
}

// A per-channel parameter or its gradient: contiguous, floating, [C].
void check_channel_vector(const Tensor& t, int64_t cols, const char* op, const char* name) {
  check_contiguous(t, op, name);
  check_floating(t, op, name);
  check_shape(t, {cols}, op, name);
}

// Row statistics: F32 (F64 for F64 x), shaped [rows] or like x without its last dimension.
void check_row_stats(const Tensor& t, const Tensor& x, const char* op, const char* name) {
  check_contiguous(t, op, name);
  check_dtype(t, x.dtype() == DType::F64 ? DType::F64 : DType::F32, op, name);
  const Shape leading(x.shape().begin(), x.shape().end() - 1);
  const int64_t rows = shape_numel(leading);
  TESSERA_CHECK(t.shape() == leading || t.shape() == Shape{rows}, op, ": ", name, " must have shape ",
                shape_to_string(leading), " or [", rows, "] (one value per row of x ", x.describe(), "), got ",
                t.describe());
}

void check_eps(float eps, const char* op) {
  TESSERA_CHECK(std::isfinite(eps) && eps >= 0.0f, op, ": eps must be finite and >= 0, got ", eps);
}

bool overlaps(const Tensor& a, const Tensor& b) {
  if (!a.defined() || !b.defined() || !a.shares_storage(b) || a.numel() == 0 || b.numel() == 0) return false;
  const char* a0 = static_cast<const char*>(a.raw_data());
  const char* b0 = static_cast<const char*>(b.raw_data());
  return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

// The fused ops' kernels read each element before they write it, so an output may be one of
// its inputs exactly (same memory, same dtype), but must not overlap it any other way.
void check_same_or_disjoint(const Tensor& out, const Tensor& in, const char* op, const char* out_name,
                            const char* in_name) {
  if (!overlaps(out, in)) return;
  TESSERA_CHECK(out.raw_data() == in.raw_data() && out.dtype() == in.dtype(), op, ": ", out_name, " ",
                out.describe(), " must be ", in_name, " itself or not overlap it; it partly overlaps ", in.describe());
}

void check_disjoint(const Tensor& out, const Tensor& in, const char* op, const char* out_name, const char* in_name) {
  TESSERA_CHECK(!overlaps(out, in), op, ": ", out_name, " ", out.describe(), " must not overlap ", in_name, " ",
                in.describe());
}

// The checks shared by the fused forward ops, before the norm's own: the sum is x's dtype
// and may replace x or residual in place; y must not overwrite the sum.
void check_add_inputs(const Tensor& x, const Tensor& residual, const Tensor& sum_out, const Tensor& y, const char* op) {
  check_normalized_input(x, op, "x");
  check_like_x(residual, x, op, "residual");
  check_like_x(sum_out, x, op, "sum_out");
  check_dtype(sum_out, x.dtype(), op, "sum_out");
  check_like_x(y, x, op, "y");
  check_same_or_disjoint(sum_out, x, op, "sum_out", "x");
  check_same_or_disjoint(sum_out, residual, op, "sum_out", "residual");
  check_same_or_disjoint(y, x, op, "y", "x");
  check_same_or_disjoint(y, residual, op, "y", "residual");
  check_disjoint(y, sum_out, op, "y", "sum_out");
}

// dx may be dy, x or d_residual_in in place.
void check_backward_add_aliasing(const Tensor& dx, const Tensor& dy, const Tensor& x, const Tensor& d_residual_in,
                                 const char* op) {
  check_same_or_disjoint(dx, dy, op, "dx", "dy");
  check_same_or_disjoint(dx, x, op, "dx", "x");
  check_same_or_disjoint(dx, d_residual_in, op, "dx", "d_residual_in");
}

}  // namespace

void layernorm_forward(Context& ctx, const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps, Tensor& y,
                       Tensor& mean, Tensor& rstd) {
  const char* op = "layernorm_forward";
  const int64_t cols = check_normalized_input(x, op, "x");
  check_channel_vector(gamma, cols, op, "gamma");
  if (beta.defined()) check_channel_vector(beta, cols, op, "beta");
  check_like_x(y, x, op, "y");
  check_row_stats(mean, x, op, "mean");
  check_row_stats(rstd, x, op, "rstd");
  check_eps(eps, op);
  check_on_device(ctx, op, {&x, &gamma, &beta, &y, &mean, &rstd});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::norm_supported({&x, &y}, {&gamma, &beta}, {&mean, &rstd})) {
      cuda::layernorm_forward(ctx.stream, x, gamma, beta, eps, y, mean, rstd);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  if (!ctx.device.is_cpu()) fail_no_kernel(op, ctx);
  cpu::layernorm_forward(x, gamma, beta, eps, y, mean, rstd);
}

void layernorm_backward(Context& ctx, const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                        const Tensor& rstd, Tensor& dx, Tensor& dgamma, Tensor& dbeta) {
  const char* op = "layernorm_backward";
  const int64_t cols = check_normalized_input(x, op, "x");
  check_like_x(dy, x, op, "dy");
  check_channel_vector(gamma, cols, op, "gamma");
  check_row_stats(mean, x, op, "mean");
  check_row_stats(rstd, x, op, "rstd");
  check_like_x(dx, x, op, "dx");
  check_channel_vector(dgamma, cols, op, "dgamma");
  if (dbeta.defined()) check_channel_vector(dbeta, cols, op, "dbeta");
  check_on_device(ctx, op, {&dy, &x, &gamma, &mean, &rstd, &dx, &dgamma, &dbeta});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::norm_supported({&x, &dy, &dx}, {&gamma, &dgamma, &dbeta}, {&mean, &rstd})) {
      cuda::layernorm_backward(ctx.stream, dy, x, gamma, mean, rstd, dx, dgamma, dbeta);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  if (!ctx.device.is_cpu()) fail_no_kernel(op, ctx);
  cpu::layernorm_backward(dy, x, gamma, mean, rstd, dx, dgamma, dbeta);
}

void rmsnorm_forward(Context& ctx, const Tensor& x, const Tensor& gamma, float eps, Tensor& y, Tensor& rstd) {
  const char* op = "rmsnorm_forward";
  const int64_t cols = check_normalized_input(x, op, "x");
  check_channel_vector(gamma, cols, op, "gamma");
  check_like_x(y, x, op, "y");
  check_row_stats(rstd, x, op, "rstd");
  check_eps(eps, op);
  check_on_device(ctx, op, {&x, &gamma, &y, &rstd});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::norm_supported({&x, &y}, {&gamma}, {&rstd})) {
      cuda::rmsnorm_forward(ctx.stream, x, gamma, eps, y, rstd);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  if (!ctx.device.is_cpu()) fail_no_kernel(op, ctx);
  cpu::rmsnorm_forward(x, gamma, eps, y, rstd);
}

void rmsnorm_backward(Context& ctx, const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& rstd,
                      Tensor& dx, Tensor& dgamma) {
  const char* op = "rmsnorm_backward";
  const int64_t cols = check_normalized_input(x, op, "x");
  check_like_x(dy, x, op, "dy");
  check_channel_vector(gamma, cols, op, "gamma");
  check_row_stats(rstd, x, op, "rstd");
  check_like_x(dx, x, op, "dx");
  check_channel_vector(dgamma, cols, op, "dgamma");
  check_on_device(ctx, op, {&dy, &x, &gamma, &rstd, &dx, &dgamma});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::norm_supported({&x, &dy, &dx}, {&gamma, &dgamma}, {&rstd})) {
      cuda::rmsnorm_backward(ctx.stream, dy, x, gamma, rstd, dx, dgamma);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  if (!ctx.device.is_cpu()) fail_no_kernel(op, ctx);
  cpu::rmsnorm_backward(dy, x, gamma, rstd, dx, dgamma);
}

void add_layernorm_forward(Context& ctx, const Tensor& x, const Tensor& residual, const Tensor& gamma,
                           const Tensor& beta, float eps, Tensor& sum_out, Tensor& y, Tensor& mean, Tensor& rstd) {
  const char* op = "add_layernorm_forward";
  check_add_inputs(x, residual, sum_out, y, op);
  const int64_t cols = x.size(-1);
  check_channel_vector(gamma, cols, op, "gamma");
  if (beta.defined()) check_channel_vector(beta, cols, op, "beta");
  check_row_stats(mean, x, op, "mean");
  check_row_stats(rstd, x, op, "rstd");
  check_eps(eps, op);
  check_on_device(ctx, op, {&x, &residual, &gamma, &beta, &sum_out, &y, &mean, &rstd});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::norm_supported({&x, &residual, &sum_out, &y}, {&gamma, &beta}, {&mean, &rstd})) {
      cuda::add_layernorm_forward(ctx.stream, x, residual, gamma, beta, eps, sum_out, y, mean, rstd);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  if (!ctx.device.is_cpu()) fail_no_kernel(op, ctx);
  cpu::add_layernorm_forward(x, residual, gamma, beta, eps, sum_out, y, mean, rstd);
}

void add_rmsnorm_forward(Context& ctx, const Tensor& x, const Tensor& residual, const Tensor& gamma, float eps,
                         Tensor& sum_out, Tensor& y, Tensor& rstd) {
  const char* op = "add_rmsnorm_forward";
  check_add_inputs(x, residual, sum_out, y, op);
  check_channel_vector(gamma, x.size(-1), op, "gamma");
  check_row_stats(rstd, x, op, "rstd");
  check_eps(eps, op);
  check_on_device(ctx, op, {&x, &residual, &gamma, &sum_out, &y, &rstd});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::norm_supported({&x, &residual, &sum_out, &y}, {&gamma}, {&rstd})) {
      cuda::add_rmsnorm_forward(ctx.stream, x, residual, gamma, eps, sum_out, y, rstd);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  if (!ctx.device.is_cpu()) fail_no_kernel(op, ctx);
  cpu::add_rmsnorm_forward(x, residual, gamma, eps, sum_out, y, rstd);
}

void layernorm_backward_add(Context& ctx, const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                            const Tensor& rstd, const Tensor& d_residual_in, Tensor& dx, Tensor& dgamma,
                            Tensor& dbeta) {
  const char* op = "layernorm_backward_add";
  const int64_t cols = check_normalized_input(x, op, "x");
  check_like_x(dy, x, op, "dy");
  check_channel_vector(gamma, cols, op, "gamma");
  check_row_stats(mean, x, op, "mean");
  check_row_stats(rstd, x, op, "rstd");
  check_like_x(d_residual_in, x, op, "d_residual_in");
  check_like_x(dx, x, op, "dx");
  check_channel_vector(dgamma, cols, op, "dgamma");
  if (dbeta.defined()) check_channel_vector(dbeta, cols, op, "dbeta");
  check_backward_add_aliasing(dx, dy, x, d_residual_in, op);
  check_on_device(ctx, op, {&dy, &x, &gamma, &mean, &rstd, &d_residual_in, &dx, &dgamma, &dbeta});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::norm_supported({&x, &dy, &d_residual_in, &dx}, {&gamma, &dgamma, &dbeta}, {&mean, &rstd})) {
      cuda::layernorm_backward_add(ctx.stream, dy, x, gamma, mean, rstd, d_residual_in, dx, dgamma, dbeta);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  if (!ctx.device.is_cpu()) fail_no_kernel(op, ctx);
  cpu::layernorm_backward_add(dy, x, gamma, mean, rstd, d_residual_in, dx, dgamma, dbeta);
}

void rmsnorm_backward_add(Context& ctx, const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& rstd,
                          const Tensor& d_residual_in, Tensor& dx, Tensor& dgamma) {
  const char* op = "rmsnorm_backward_add";
  const int64_t cols = check_normalized_input(x, op, "x");
  check_like_x(dy, x, op, "dy");
  check_channel_vector(gamma, cols, op, "gamma");
  check_row_stats(rstd, x, op, "rstd");
  check_like_x(d_residual_in, x, op, "d_residual_in");
  check_like_x(dx, x, op, "dx");
  check_channel_vector(dgamma, cols, op, "dgamma");
  check_backward_add_aliasing(dx, dy, x, d_residual_in, op);
  check_on_device(ctx, op, {&dy, &x, &gamma, &rstd, &d_residual_in, &dx, &dgamma});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::norm_supported({&x, &dy, &d_residual_in, &dx}, {&gamma, &dgamma}, {&rstd})) {
      cuda::rmsnorm_backward_add(ctx.stream, dy, x, gamma, rstd, d_residual_in, dx, dgamma);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  if (!ctx.device.is_cpu()) fail_no_kernel(op, ctx);
  cpu::rmsnorm_backward_add(dy, x, gamma, rstd, d_residual_in, dx, dgamma);
}

}  // namespace tessera
