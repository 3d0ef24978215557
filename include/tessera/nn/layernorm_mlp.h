// LayerNormMLP: a norm feeding an MLP, y = proj(act(fc(norm(x)))) with GELU or SwiGLU, or
// with the residual add fused into the norm, norm(x + residual) (Transformer Engine's
// LayerNormMLP; here the pre-norm block's norm2 and MLP).
//
// In the model's own dtype it is exactly Norm then MLP, so BF16 and F32 results (GPT-2's
// fused GEMM + GELU epilogue included) are those of the two modules. When the MLP's first
// layer runs in FP8, the norm writes its output straight as that layer's FP8 input
// (Norm::forward_fp8) and the normalized activation is never stored in x's dtype; the
// activation and the second layer then run as MLP's FP8 path does (the activation its own
// pass, proj casting its input with the fused cast + transpose).
//
// Like LayerNormLinear, the module binds a Norm and an MLP owned elsewhere (a
// TransformerLayer's norm2 and mlp): parameters, names and checkpoints are theirs, and both
// must outlive it.
#pragma once

#include "tessera/nn/mlp.h"
#include "tessera/nn/norm.h"

namespace tessera::nn {

class LayerNormMLP {
 public:
  struct Saved {
    Norm::Saved norm;
    MLP::Saved mlp;
  };
  LayerNormMLP(Norm& norm, MLP& mlp) : norm_(&norm), mlp_(&mlp) {}

  // x [N, C] -> [N, C]; the _add form normalizes x + residual and keeps the sum in norm_saved.x.
  Tensor forward(Context& ctx, const Tensor& x, Norm::Saved& norm_saved, MLP::Saved& mlp_saved) const;
  Tensor forward_add(Context& ctx, const Tensor& x, const Tensor& residual, Norm::Saved& norm_saved,
                     MLP::Saved& mlp_saved) const;
  // dx (overwritten), the norm's weight gradients accumulating here; the _add form adds
  // d_residual in the norm's pass. mlp_saved keeps the gradient backward_weight needs.
  Tensor backward_input(Context& ctx, const Tensor& dy, const Norm::Saved& norm_saved, MLP::Saved& mlp_saved);
  Tensor backward_input_add(Context& ctx, const Tensor& dy, const Tensor& d_residual, const Norm::Saved& norm_saved,
                            MLP::Saved& mlp_saved);
  void backward_weight(Context& ctx, const Tensor& dy, const MLP::Saved& mlp_saved);

  Tensor forward(Context& ctx, const Tensor& x, Saved& saved) const { return forward(ctx, x, saved.norm, saved.mlp); }
  Tensor forward_add(Context& ctx, const Tensor& x, const Tensor& residual, Saved& saved) const {
    return forward_add(ctx, x, residual, saved.norm, saved.mlp);
  }
  Tensor backward_input(Context& ctx, const Tensor& dy, Saved& saved) {
    return backward_input(ctx, dy, saved.norm, saved.mlp);
  }
  Tensor backward_input_add(Context& ctx, const Tensor& dy, const Tensor& d_residual, Saved& saved) {
    return backward_input_add(ctx, dy, d_residual, saved.norm, saved.mlp);
  }
  void backward_weight(Context& ctx, const Tensor& dy, const Saved& saved) { backward_weight(ctx, dy, saved.mlp); }

  // The norm's parameters, then the MLP's.
  void parameters(ParameterList& out);
  // Whether forward(x) casts the norm's output to FP8 for the first GEMM.
  bool runs_fp8(const Tensor& x) const;

  Norm& norm() const { return *norm_; }
  MLP& mlp() const { return *mlp_; }

 private:
  Norm* norm_;
  MLP* mlp_;
};

}  // namespace tessera::nn
