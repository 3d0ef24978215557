// LayerNormLinear: a norm feeding a linear layer, y = linear(norm(x)), or with the residual
// add fused into the norm, y = linear(norm(x + residual)) (Transformer Engine's
// LayerNormLinear; here the pre-norm block's norm1 and QKV projection).
//
// In the model's own dtype it is exactly Norm then Linear, call for call, so BF16 and F32
// results are those of the two modules. When the linear layer runs in FP8 (Linear::runs_fp8
// of the norm's output), the norm writes its output straight as the FP8 input of the GEMM
// (Norm::forward_fp8): on CUDA the cast and its amax are part of the norm's pass, and the
// normalized activation is never stored in x's dtype. The backward needs only what the two
// modules keep anyway: the norm's input and statistics, and the linear layer's FP8 input.
//
// The module binds a Norm and a Linear owned elsewhere (a TransformerLayer's norm1 and its
// attention's qkv), so the parameters, their names, checkpoints and Hugging Face mappings are
// those of the two modules; both must outlive it. The saved state is the two modules' own
// (Norm::Saved, Linear::Saved), passed separately or together as Saved.
#pragma once

#include "tessera/nn/linear.h"
#include "tessera/nn/norm.h"

namespace tessera::nn {

class LayerNormLinear {
 public:
  struct Saved {
    Norm::Saved norm;
    Linear::Saved linear;
  };
  LayerNormLinear(Norm& norm, Linear& linear) : norm_(&norm), linear_(&linear) {}

  // x [N, C] -> [N, out]. The _add forms normalize x + residual; the sum (the residual stream
  // past the norm) is kept in norm_saved.x, as Norm::forward_add keeps it.
  Tensor forward(Context& ctx, const Tensor& x, Norm::Saved& norm_saved, Linear::Saved& linear_saved) const;
  Tensor forward_add(Context& ctx, const Tensor& x, const Tensor& residual, Norm::Saved& norm_saved,
                     Linear::Saved& linear_saved) const;
  // dx of the norm's input (overwritten); the norm's weight gradients accumulate here, as in
  // Norm::backward_input. The _add form adds d_residual, the gradient reaching the sum along
  // the residual path, in the same pass.
  Tensor backward_input(Context& ctx, const Tensor& dy, const Norm::Saved& norm_saved,
                        const Linear::Saved& linear_saved);
  Tensor backward_input_add(Context& ctx, const Tensor& dy, const Tensor& d_residual, const Norm::Saved& norm_saved,
                            const Linear::Saved& linear_saved);
  // The linear layer's weight gradients (after backward_input).
  void backward_weight(Context& ctx, const Tensor& dy, const Linear::Saved& linear_saved);

  Tensor forward(Context& ctx, const Tensor& x, Saved& saved) const {
    return forward(ctx, x, saved.norm, saved.linear);
  }
  Tensor forward_add(Context& ctx, const Tensor& x, const Tensor& residual, Saved& saved) const {
    return forward_add(ctx, x, residual, saved.norm, saved.linear);
  }
  Tensor backward_input(Context& ctx, const Tensor& dy, const Saved& saved) {
    return backward_input(ctx, dy, saved.norm, saved.linear);
  }
  Tensor backward_input_add(Context& ctx, const Tensor& dy, const Tensor& d_residual, const Saved& saved) {
    return backward_input_add(ctx, dy, d_residual, saved.norm, saved.linear);
  }
  void backward_weight(Context& ctx, const Tensor& dy, const Saved& saved) { backward_weight(ctx, dy, saved.linear); }

  // The norm's parameters, then the linear layer's.
  void parameters(ParameterList& out);
  // Whether forward(x) casts the norm's output to FP8 for the GEMM.
  bool runs_fp8(const Tensor& x) const;

  Norm& norm() const { return *norm_; }
  Linear& linear() const { return *linear_; }

 private:
  Norm* norm_;
  Linear* linear_;
};

}  // namespace tessera::nn
