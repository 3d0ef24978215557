#include "tessera/nn/layernorm_linear.h"

namespace tessera::nn {

bool LayerNormLinear::runs_fp8(const Tensor& x) const {
  // The norm's output has x's shape and dtype. Only per-tensor recipes fuse the cast into the
  // norm; under block and mxfp8 the norm runs unfused and the linear layer casts its input.
  return linear_->runs_fp8(x) && linear_->fp8_binding().scaling->per_tensor();
}

Tensor LayerNormLinear::forward(Context& ctx, const Tensor& x, Norm::Saved& norm_saved,
                                Linear::Saved& linear_saved) const {
  if (runs_fp8(x))
    return linear_->forward(ctx, norm_->forward_fp8(ctx, x, linear_->fp8_binding(), norm_saved), linear_saved);
  return linear_->forward(ctx, norm_->forward(ctx, x, norm_saved), linear_saved);
}

Tensor LayerNormLinear::forward_add(Context& ctx, const Tensor& x, const Tensor& residual, Norm::Saved& norm_saved,
                                    Linear::Saved& linear_saved) const {
  if (runs_fp8(x))
    return linear_->forward(ctx, norm_->forward_add_fp8(ctx, x, residual, linear_->fp8_binding(), norm_saved),
                            linear_saved);
  return linear_->forward(ctx, norm_->forward_add(ctx, x, residual, norm_saved), linear_saved);
}

Tensor LayerNormLinear::backward_input(Context& ctx, const Tensor& dy, const Norm::Saved& norm_saved,
                                       const Linear::Saved& linear_saved) {
  return norm_->backward_input(ctx, linear_->backward_input(ctx, dy, linear_saved), norm_saved);
}

Tensor LayerNormLinear::backward_input_add(Context& ctx, const Tensor& dy, const Tensor& d_residual,
                                           const Norm::Saved& norm_saved, const Linear::Saved& linear_saved) {
  return norm_->backward_input_add(ctx, linear_->backward_input(ctx, dy, linear_saved), d_residual, norm_saved);
}

void LayerNormLinear::backward_weight(Context& ctx, const Tensor& dy, const Linear::Saved& linear_saved) {
  linear_->backward_weight(ctx, dy, linear_saved);
}

void LayerNormLinear::parameters(ParameterList& out) {
  norm_->parameters(out);
  linear_->parameters(out);
}

}  // namespace tessera::nn
