#include "tessera/nn/norm.h"

#include "tessera/ops/norm.h"

namespace tessera::nn {

Norm::Norm(const std::string& name, NormKind kind_, int64_t features, float eps, DType dtype)
    : kind(kind_), weight(name + ".weight", {features}, dtype, false), eps_(eps) {
  if (kind == NormKind::LayerNorm) bias = Parameter(name + ".bias", {features}, dtype, false);
}

Tensor Norm::forward(Context& ctx, const Tensor& x, Saved& saved) const {
  const DType stats = x.dtype() == DType::F64 ? DType::F64 : DType::F32;
  Tensor y = Tensor::empty(x.shape(), x.dtype(), ctx.device);
  saved.x = x;
  saved.rstd = Tensor::empty({x.numel() / x.size(-1)}, stats, ctx.device);
  if (kind == NormKind::LayerNorm) {
    saved.mean = Tensor::empty({x.numel() / x.size(-1)}, stats, ctx.device);
    layernorm_forward(ctx, x, weight.value, bias.value, eps_, y, saved.mean, saved.rstd);
  } else {
    rmsnorm_forward(ctx, x, weight.value, eps_, y, saved.rstd);
  }
  return y;
}

Tensor Norm::backward_input(Context& ctx, const Tensor& dy, const Saved& saved) {
  Tensor dx = Tensor::empty(saved.x.shape(), saved.x.dtype(), ctx.device);
  if (kind == NormKind::LayerNorm)
    layernorm_backward(ctx, dy, saved.x, weight.value, saved.mean, saved.rstd, dx, weight.grad, bias.grad);
  else
    rmsnorm_backward(ctx, dy, saved.x, weight.value, saved.rstd, dx, weight.grad);
  return dx;
}

Tensor Norm::forward_add(Context& ctx, const Tensor& x, const Tensor& residual, Saved& saved) const {
  const DType stats = x.dtype() == DType::F64 ? DType::F64 : DType::F32;
  const int64_t rows = x.numel() / x.size(-1);
  Tensor y = Tensor::empty(x.shape(), x.dtype(), ctx.device);
  saved.x = Tensor::empty(x.shape(), x.dtype(), ctx.device);
  saved.rstd = Tensor::empty({rows}, stats, ctx.device);
  if (kind == NormKind::LayerNorm) {
    saved.mean = Tensor::empty({rows}, stats, ctx.device);
    add_layernorm_forward(ctx, x, residual, weight.value, bias.value, eps_, saved.x, y, saved.mean, saved.rstd);
  } else {
    add_rmsnorm_forward(ctx, x, residual, weight.value, eps_, saved.x, y, saved.rstd);
  }
  return y;
}

Tensor Norm::backward_input_add(Context& ctx, const Tensor& dy, const Tensor& d_residual, const Saved& saved) {
  Tensor dx = Tensor::empty(saved.x.shape(), saved.x.dtype(), ctx.device);
  if (kind == NormKind::LayerNorm)
    layernorm_backward_add(ctx, dy, saved.x, weight.value, saved.mean, saved.rstd, d_residual, dx, weight.grad,
                           bias.grad);
  else
    rmsnorm_backward_add(ctx, dy, saved.x, weight.value, saved.rstd, d_residual, dx, weight.grad);
  return dx;
}

void Norm::parameters(ParameterList& out) {
  out.push_back(&weight);
  if (bias.value.defined()) out.push_back(&bias);
}

}  // namespace tessera::nn
