#include "tessera/ops/norm.h"

#include <cmath>

#include "backend/cpu/norm.h"
#include "backend/cpu/quantize.h"
#include "dispatch.h"
#if TESSERA_WITH_CUDA
#include "backend/cuda/gemm_fp8.h"
#include "backend/cuda/norm.h"
#include "backend/cuda/norm_fp8.h"
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

// ---- FP8 output ----------------------------------------------------------------------------

void check_scale(const Tensor& scale, const char* op) {
  check_defined(scale, op, "scale");
  check_contiguous(scale, op, "scale");
  check_dtype(scale, DType::F32, op, "scale");
  check_shape(scale, {1}, op, "scale");
}

void check_fp8_codes(const Tensor& q, const Tensor& x, const char* op, const char* name) {
  check_contiguous(q, op, name);
  check_dtype(q, DType::E4M3, op, name);
  check_shape(q, x.shape(), op, name);
  check_disjoint(q, x, op, name, "x");
}

// out against the norm's input x (and, for the add forms, the residual and sum, given as
// `others`): q and y never overlap an input, amax never the scale (CUDA zeroes it first).
void check_fp8_output(const Tensor& x, const Tensor& scale, const NormFp8Output& out, const char* op,
                      std::initializer_list<const Tensor*> others = {}) {
  if (out.q.defined()) {
    check_fp8_codes(out.q, x, op, "out.q");
    check_scale(scale, op);
  } else {
    TESSERA_CHECK(out.amax.defined(), op, ": without out.q (the statistics pass) out.amax must be given");
  }
  if (out.amax.defined()) {
    check_contiguous(out.amax, op, "out.amax");
    check_dtype(out.amax, DType::F32, op, "out.amax");
    check_shape(out.amax, {1}, op, "out.amax");
    check_disjoint(out.amax, scale, op, "out.amax", "scale");
  }
  if (out.y.defined()) {
    check_like_x(out.y, x, op, "out.y");
    check_dtype(out.y, x.dtype(), op, "out.y");
    check_disjoint(out.y, x, op, "out.y", "x");
  }
  for (const Tensor* t : others) {
    check_disjoint(out.q, *t, op, "out.q", "the residual or sum");
    check_disjoint(out.y, *t, op, "out.y", "the residual or sum");
  }
}

// The CPU reference's y: out.y, or a temporary when no copy is asked for.
Tensor cpu_output(const Tensor& x, const NormFp8Output& out) {
  return out.y.defined() ? out.y : Tensor::empty(x.shape(), x.dtype());
}

// The CPU reference's cast of y: quantize_per_tensor (with the amax), or only the amax.
void cpu_cast(const Tensor& y, const Tensor& scale, NormFp8Output& out) {
  if (out.q.defined()) cpu::quantize_per_tensor(y, scale, out.q, out.amax);
  else cpu::amax(y, out.amax);
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

void layernorm_forward_fp8(Context& ctx, const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps,
                           const Tensor& scale, NormFp8Output& out, Tensor& mean, Tensor& rstd) {
  const char* op = "layernorm_forward_fp8";
  const int64_t cols = check_normalized_input(x, op, "x");
  check_channel_vector(gamma, cols, op, "gamma");
  if (beta.defined()) check_channel_vector(beta, cols, op, "beta");
  check_row_stats(mean, x, op, "mean");
  check_row_stats(rstd, x, op, "rstd");
  check_eps(eps, op);
  check_fp8_output(x, scale, out, op);
  check_on_device(ctx, op, {&x, &gamma, &beta, &scale, &out.q, &out.amax, &out.y, &mean, &rstd});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::norm_fp8_supported(x, out.q, out.y, gamma, beta)) {
      cuda::layernorm_forward_fp8(ctx.stream, x, gamma, beta, eps, scale, out.q, out.amax, out.y, mean, rstd);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  if (!ctx.device.is_cpu()) fail_no_kernel(op, ctx);
  Tensor y = cpu_output(x, out);
  cpu::layernorm_forward(x, gamma, beta, eps, y, mean, rstd);
  cpu_cast(y, scale, out);
}

void rmsnorm_forward_fp8(Context& ctx, const Tensor& x, const Tensor& gamma, float eps, const Tensor& scale,
                         NormFp8Output& out, Tensor& rstd) {
  const char* op = "rmsnorm_forward_fp8";
  const int64_t cols = check_normalized_input(x, op, "x");
  check_channel_vector(gamma, cols, op, "gamma");
  check_row_stats(rstd, x, op, "rstd");
  check_eps(eps, op);
  check_fp8_output(x, scale, out, op);
  check_on_device(ctx, op, {&x, &gamma, &scale, &out.q, &out.amax, &out.y, &rstd});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::norm_fp8_supported(x, out.q, out.y, gamma, Tensor())) {
      cuda::rmsnorm_forward_fp8(ctx.stream, x, gamma, eps, scale, out.q, out.amax, out.y, rstd);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  if (!ctx.device.is_cpu()) fail_no_kernel(op, ctx);
  Tensor y = cpu_output(x, out);
  cpu::rmsnorm_forward(x, gamma, eps, y, rstd);
  cpu_cast(y, scale, out);
}

namespace {
// The add forms' own checks (the sum is x's dtype and may replace x or residual in place).
void check_add_fp8_inputs(const Tensor& x, const Tensor& residual, const Tensor& sum_out, const Tensor& scale,
                          const NormFp8Output& out, const char* op) {
  check_normalized_input(x, op, "x");
  check_like_x(residual, x, op, "residual");
  check_like_x(sum_out, x, op, "sum_out");
  check_dtype(sum_out, x.dtype(), op, "sum_out");
  check_same_or_disjoint(sum_out, x, op, "sum_out", "x");
  check_same_or_disjoint(sum_out, residual, op, "sum_out", "residual");
  check_fp8_output(x, scale, out, op, {&residual, &sum_out});
}
}  // namespace

void add_layernorm_forward_fp8(Context& ctx, const Tensor& x, const Tensor& residual, const Tensor& gamma,
                               const Tensor& beta, float eps, const Tensor& scale, Tensor& sum_out,
                               NormFp8Output& out, Tensor& mean, Tensor& rstd) {
  const char* op = "add_layernorm_forward_fp8";
  check_add_fp8_inputs(x, residual, sum_out, scale, out, op);
  const int64_t cols = x.size(-1);
  check_channel_vector(gamma, cols, op, "gamma");
  if (beta.defined()) check_channel_vector(beta, cols, op, "beta");
  check_row_stats(mean, x, op, "mean");
  check_row_stats(rstd, x, op, "rstd");
  check_eps(eps, op);
  check_on_device(ctx, op,
                  {&x, &residual, &gamma, &beta, &scale, &sum_out, &out.q, &out.amax, &out.y, &mean, &rstd});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::norm_fp8_supported(x, out.q, out.y, gamma, beta) && cuda::norm_supported({&residual, &sum_out}, {}, {})) {
      cuda::add_layernorm_forward_fp8(ctx.stream, x, residual, gamma, beta, eps, scale, sum_out, out.q, out.amax,
                                      out.y, mean, rstd);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  if (!ctx.device.is_cpu()) fail_no_kernel(op, ctx);
  Tensor y = cpu_output(x, out);
  cpu::add_layernorm_forward(x, residual, gamma, beta, eps, sum_out, y, mean, rstd);
  cpu_cast(y, scale, out);
}

void add_rmsnorm_forward_fp8(Context& ctx, const Tensor& x, const Tensor& residual, const Tensor& gamma, float eps,
                             const Tensor& scale, Tensor& sum_out, NormFp8Output& out, Tensor& rstd) {
  const char* op = "add_rmsnorm_forward_fp8";
  check_add_fp8_inputs(x, residual, sum_out, scale, out, op);
  check_channel_vector(gamma, x.size(-1), op, "gamma");
  check_row_stats(rstd, x, op, "rstd");
  check_eps(eps, op);
  check_on_device(ctx, op, {&x, &residual, &gamma, &scale, &sum_out, &out.q, &out.amax, &out.y, &rstd});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::norm_fp8_supported(x, out.q, out.y, gamma, Tensor()) &&
        cuda::norm_supported({&residual, &sum_out}, {}, {})) {
      cuda::add_rmsnorm_forward_fp8(ctx.stream, x, residual, gamma, eps, scale, sum_out, out.q, out.amax, out.y, rstd);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  if (!ctx.device.is_cpu()) fail_no_kernel(op, ctx);
  Tensor y = cpu_output(x, out);
  cpu::add_rmsnorm_forward(x, residual, gamma, eps, sum_out, y, rstd);
  cpu_cast(y, scale, out);
}

namespace {
// mean undefined: RMSNorm.
void norm_apply_fp8(Context& ctx, const char* op, const Tensor& x, const Tensor& gamma, const Tensor& beta,
                    const Tensor& mean, const Tensor& rstd, const Tensor& scale, Tensor& q) {
  const int64_t cols = check_normalized_input(x, op, "x");
  check_channel_vector(gamma, cols, op, "gamma");
  if (beta.defined()) check_channel_vector(beta, cols, op, "beta");
  if (mean.defined()) check_row_stats(mean, x, op, "mean");
  check_row_stats(rstd, x, op, "rstd");
  check_scale(scale, op);
  check_fp8_codes(q, x, op, "q");
  check_on_device(ctx, op, {&x, &gamma, &beta, &mean, &rstd, &scale, &q});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::norm_fp8_supported(x, q, Tensor(), gamma, beta)) {
      cuda::norm_apply_fp8(ctx.stream, x, gamma, beta, mean, rstd, scale, q);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  if (!ctx.device.is_cpu()) fail_no_kernel(op, ctx);
  Tensor y = Tensor::empty(x.shape(), x.dtype()), no_amax;
  cpu::norm_apply(x, gamma, beta, mean, rstd, y);
  cpu::quantize_per_tensor(y, scale, q, no_amax);
}
}  // namespace

void layernorm_apply_fp8(Context& ctx, const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& mean,
                         const Tensor& rstd, const Tensor& scale, Tensor& q) {
  check_defined(mean, "layernorm_apply_fp8", "mean");
  norm_apply_fp8(ctx, "layernorm_apply_fp8", x, gamma, beta, mean, rstd, scale, q);
}

void rmsnorm_apply_fp8(Context& ctx, const Tensor& x, const Tensor& gamma, const Tensor& rstd, const Tensor& scale,
                       Tensor& q) {
  norm_apply_fp8(ctx, "rmsnorm_apply_fp8", x, gamma, Tensor(), Tensor(), rstd, scale, q);
}

namespace {
// mean undefined: RMSNorm. The fused kernel where it applies, else the apply pass then
// quantized_from_codes (the same bytes).
fp8::QuantizedTensor norm_apply_fp8_with_transpose(Context& ctx, const char* op, const Tensor& x, const Tensor& gamma,
                                                   const Tensor& beta, const Tensor& mean, const Tensor& rstd,
                                                   const Tensor& scale) {
  check_defined(x, op, "x");
  // The argument checks of the plain apply (norm_apply_fp8 repeats them when it runs).
  const int64_t cols = check_normalized_input(x, op, "x");
  check_channel_vector(gamma, cols, op, "gamma");
  if (beta.defined()) check_channel_vector(beta, cols, op, "beta");
  if (mean.defined()) check_row_stats(mean, x, op, "mean");
  check_row_stats(rstd, x, op, "rstd");
  check_scale(scale, op);
  check_on_device(ctx, op, {&x, &gamma, &beta, &mean, &rstd, &scale});
  Tensor q = Tensor::empty(x.shape(), DType::E4M3, ctx.device);
  if (ctx.device.is_cuda() && x.dim() == 2) {
#if TESSERA_WITH_CUDA
    fp8::QuantizedTensor out;
    out.dtype = DType::E4M3;
    out.data_t = Tensor::empty({x.size(1), x.size(0)}, DType::E4M3, ctx.device);
    if (scale.is_contiguous() && cuda::norm_apply_fp8_transpose_supported(x, q, out.data_t, gamma, beta)) {
      out.scale_inv = Tensor::empty({1}, DType::F32, ctx.device);
      cuda::fp8_reciprocal_scale(ctx.stream, scale, out.scale_inv);
      cuda::norm_apply_fp8_transpose(ctx.stream, x, gamma, beta, mean, rstd, scale, q, out.data_t);
      out.data = q;
      return out;
    }
#endif
  }
  norm_apply_fp8(ctx, op, x, gamma, beta, mean, rstd, scale, q);
  return fp8::quantized_from_codes(ctx, q, scale);
}
}  // namespace

fp8::QuantizedTensor layernorm_apply_fp8_with_transpose(Context& ctx, const Tensor& x, const Tensor& gamma,
                                                        const Tensor& beta, const Tensor& mean, const Tensor& rstd,
                                                        const Tensor& scale) {
  check_defined(mean, "layernorm_apply_fp8_with_transpose", "mean");
  return norm_apply_fp8_with_transpose(ctx, "layernorm_apply_fp8_with_transpose", x, gamma, beta, mean, rstd, scale);
}

fp8::QuantizedTensor rmsnorm_apply_fp8_with_transpose(Context& ctx, const Tensor& x, const Tensor& gamma,
                                                      const Tensor& rstd, const Tensor& scale) {
  return norm_apply_fp8_with_transpose(ctx, "rmsnorm_apply_fp8_with_transpose", x, gamma, Tensor(), Tensor(), rstd,
                                       scale);
}

}  // namespace tessera
