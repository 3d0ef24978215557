// Norm: LayerNorm (weight and bias) or RMSNorm (weight only) over the last dimension.
// The norm kernel computes the input gradient and the weight gradients in one pass, so
// backward_input also accumulates the weight gradients; backward_weight has nothing left.
#pragma once

#include "tessera/nn/fp8_scaling.h"
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

  // forward / forward_add for a norm feeding an FP8 linear layer: the output cast to FP8 as
  // the input (Fp8Scaling::kInput) of the layer `binding` names, with its transposed copy,
  // and never written in x's dtype (ops/norm.h's *_forward_fp8: on CUDA the cast is part of
  // the norm's pass). saved is filled as by forward / forward_add, so backward_input(_add)
  // apply unchanged. Delayed scaling casts with the state's scale and records the amax in
  // its pending slot; current scaling takes the amax in a statistics pass, makes the scale
  // and casts in a second pass over x. x is 2-D, the recipe's forward format E4M3.
  fp8::QuantizedTensor forward_fp8(Context& ctx, const Tensor& x, const Fp8Binding& binding, Saved& saved) const;
  fp8::QuantizedTensor forward_add_fp8(Context& ctx, const Tensor& x, const Tensor& residual,
                                       const Fp8Binding& binding, Saved& saved) const;
  void parameters(ParameterList& out);

  NormKind kind;
  Parameter weight, bias;  // bias only for LayerNorm

 private:
  float eps_;
  fp8::QuantizedTensor cast_fp8(Context& ctx, const Tensor& x, const Tensor* residual, const Fp8Binding& binding,
                                Saved& saved) const;
};

}  // namespace tessera::nn
