// TransformerLayer: pre-norm block, x1 = x + attn(norm1(x)), then x1 + mlp(norm2(x1)).
// The residual add x + attn(...) runs inside norm2 (add_layernorm/add_rmsnorm), and in
// backward each norm adds the residual path's gradient to its input gradient in the same
// pass; the math, and on the CPU every bit, is that of the unfused block.
#pragma once

#include "tessera/models/config.h"
#include "tessera/nn/attention.h"
#include "tessera/nn/mlp.h"
#include "tessera/nn/norm.h"

namespace tessera::nn {

class TransformerLayer {
 public:
  struct Saved {
    Norm::Saved norm1, norm2;  // norm2.x is x1, the residual stream between attention and MLP
    SelfAttention::Saved attn;
    MLP::Saved mlp;
    Tensor d_x1;  // gradient at the residual between attention and MLP
  };
  TransformerLayer(const std::string& name, const models::ModelConfig& config, DType dtype,
                   const ParallelContext& parallel = {});

  Tensor forward(Context& ctx, const Tensor& x, int64_t batch, int64_t seq, Saved& saved) const;  // [B*T, C]
  Tensor backward_input(Context& ctx, const Tensor& dy, Saved& saved);
  void backward_weight(Context& ctx, const Tensor& dy, const Saved& saved);
  void parameters(ParameterList& out);

  Norm norm1, norm2;
  SelfAttention attn;
  MLP mlp;
};

}  // namespace tessera::nn
