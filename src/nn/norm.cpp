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

fp8::QuantizedTensor Norm::forward_fp8(Context& ctx, const Tensor& x, const Fp8Binding& binding, Saved& saved) const {
  return cast_fp8(ctx, x, nullptr, binding, saved);
}

fp8::QuantizedTensor Norm::forward_add_fp8(Context& ctx, const Tensor& x, const Tensor& residual,
                                           const Fp8Binding& binding, Saved& saved) const {
  return cast_fp8(ctx, x, &residual, binding, saved);
}

fp8::QuantizedTensor Norm::cast_fp8(Context& ctx, const Tensor& x, const Tensor* residual, const Fp8Binding& binding,
                                    Saved& saved) const {
  TESSERA_CHECK(binding.scaling, "Norm ", weight.name, ": forward_fp8 needs an FP8 binding");
  TESSERA_CHECK(x.dim() == 2, "Norm ", weight.name, ": forward_fp8 takes a 2-D input, got ", x.describe());
  Fp8Scaling& scaling = *binding.scaling;
  const DType code = scaling.dtype(Fp8Scaling::kInput);
  TESSERA_CHECK(code == DType::E4M3, "Norm ", weight.name, ": the norm casts to E4M3 only, the recipe asks for ",
                dtype_name(code));
  const DType stats = x.dtype() == DType::F64 ? DType::F64 : DType::F32;
  const int64_t rows = x.size(0);
  saved.x = residual ? Tensor::empty(x.shape(), x.dtype(), ctx.device) : x;
  saved.rstd = Tensor::empty({rows}, stats, ctx.device);
  if (kind == NormKind::LayerNorm) saved.mean = Tensor::empty({rows}, stats, ctx.device);

  // Delayed scaling: one pass, the whole cast (with the state's scale and pending amax).
  // Current scaling: the statistics pass (amax, mean, rstd, sum), then the apply pass with
  // the scale made from that amax, writing the codes and their transposed copy together.
  const auto norm_pass = [&](const Tensor& scale, NormFp8Output& out) {
    if (kind == NormKind::LayerNorm) {
      if (residual)
        add_layernorm_forward_fp8(ctx, x, *residual, weight.value, bias.value, eps_, scale, saved.x, out, saved.mean,
                                  saved.rstd);
      else
        layernorm_forward_fp8(ctx, x, weight.value, bias.value, eps_, scale, out, saved.mean, saved.rstd);
    } else {
      if (residual)
        add_rmsnorm_forward_fp8(ctx, x, *residual, weight.value, eps_, scale, saved.x, out, saved.rstd);
      else
        rmsnorm_forward_fp8(ctx, x, weight.value, eps_, scale, out, saved.rstd);
    }
  };
  return scaling.cast_with(
      ctx, binding.layer, Fp8Scaling::kInput,
      [&](Tensor& amax) {
        NormFp8Output out;
        out.amax = amax;
        norm_pass(Tensor(), out);
      },
      [&](const Tensor& scale, Tensor* amax) -> fp8::QuantizedTensor {
        if (amax) {  // delayed: the codes in the same pass
          NormFp8Output out;
          out.amax = *amax;
          out.q = Tensor::empty(x.shape(), code, ctx.device);
          norm_pass(scale, out);
          return fp8::quantized_from_codes(ctx, out.q, scale);
        }
        if (kind == NormKind::LayerNorm)
          return layernorm_apply_fp8_with_transpose(ctx, saved.x, weight.value, bias.value, saved.mean, saved.rstd,
                                                    scale);
        return rmsnorm_apply_fp8_with_transpose(ctx, saved.x, weight.value, saved.rstd, scale);
      });
}

void Norm::parameters(ParameterList& out) {
  out.push_back(&weight);
  if (bias.value.defined()) out.push_back(&bias);
}

}  // namespace tessera::nn
