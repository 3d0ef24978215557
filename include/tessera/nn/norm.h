// Norm: LayerNorm (weight and bias) or RMSNorm (weight only) over the last dimension.
// The norm kernel computes the input gradient and the weight gradients in one pass, so
// backward_input also accumulates the weight gradients; backward_weight has nothing left.
#pragma once

#include "tessera/nn/parameter.h"

namespace tessera::nn {

enum class NormKind { LayerNorm, RMSNorm };

class Norm {
 public:
  struct Saved {
    Tensor x, mean, rstd;
  };
  Norm(const std::string& name, NormKind kind, int64_t features, float eps, DType dtype);

  Tensor forward(Context& ctx, const Tensor& x, Saved& saved) const;
  Tensor backward_input(Context& ctx, const Tensor& dy, const Saved& saved);

  // The residual add before the norm, fused into it: normalizes x + residual. The sum (the
  // residual stream past this point) is kept in saved.x; the return value is the norm's y.
  Tensor forward_add(Context& ctx, const Tensor& x, const Tensor& residual, Saved& saved) const;
  // The input gradient of forward_add's sum: the norm's dx plus d_residual, the gradient that
  // reached the sum along the residual path. Weight gradients accumulate as in backward_input.
  Tensor backward_input_add(Context& ctx, const Tensor& dy, const Tensor& d_residual, const Saved& saved);
  void parameters(ParameterList& out);

  NormKind kind;
  Parameter weight, bias;  // bias only for LayerNorm

 private:
  float eps_;
};

}  // namespace tessera::nn
