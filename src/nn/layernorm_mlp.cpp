#include "tessera/nn/layernorm_mlp.h"

namespace tessera::nn {

// Only per-tensor recipes fuse the cast into the norm; under block and mxfp8 the norm runs
// unfused and fc casts its input (MLP::forward's FP8 branch).
bool LayerNormMLP::runs_fp8(const Tensor& x) const {
  return mlp_->fc.runs_fp8(x) && mlp_->fc.fp8_binding().scaling->per_tensor();
}

Tensor LayerNormMLP::forward(Context& ctx, const Tensor& x, Norm::Saved& norm_saved, MLP::Saved& mlp_saved) const {
  if (runs_fp8(x)) return mlp_->forward(ctx, norm_->forward_fp8(ctx, x, mlp_->fc.fp8_binding(), norm_saved), mlp_saved);
  return mlp_->forward(ctx, norm_->forward(ctx, x, norm_saved), mlp_saved);
}

Tensor LayerNormMLP::forward_add(Context& ctx, const Tensor& x, const Tensor& residual, Norm::Saved& norm_saved,
                                 MLP::Saved& mlp_saved) const {
  if (runs_fp8(x))
    return mlp_->forward(ctx, norm_->forward_add_fp8(ctx, x, residual, mlp_->fc.fp8_binding(), norm_saved), mlp_saved);
  return mlp_->forward(ctx, norm_->forward_add(ctx, x, residual, norm_saved), mlp_saved);
}

Tensor LayerNormMLP::backward_input(Context& ctx, const Tensor& dy, const Norm::Saved& norm_saved,
                                    MLP::Saved& mlp_saved) {
  return norm_->backward_input(ctx, mlp_->backward_input(ctx, dy, mlp_saved), norm_saved);
}

Tensor LayerNormMLP::backward_input_add(Context& ctx, const Tensor& dy, const Tensor& d_residual,
                                        const Norm::Saved& norm_saved, MLP::Saved& mlp_saved) {
  return norm_->backward_input_add(ctx, mlp_->backward_input(ctx, dy, mlp_saved), d_residual, norm_saved);
}

void LayerNormMLP::backward_weight(Context& ctx, const Tensor& dy, const MLP::Saved& mlp_saved) {
  mlp_->backward_weight(ctx, dy, mlp_saved);
}

void LayerNormMLP::parameters(ParameterList& out) {
  norm_->parameters(out);
  mlp_->parameters(out);
}

}  // namespace tessera::nn
