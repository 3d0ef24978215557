// TransformerLayer: pre-norm block, x1 = x + attn(norm1(x)), then x1 + mlp(norm2(x1)).
// Both residual adds run inside a norm (add_layernorm / add_rmsnorm): x + attn(...) inside
// norm2, and the block's own output x1 + mlp(...) inside the NEXT block's norm1 (or the
// model's final norm), so a block hands on the two summands instead of their sum and no
// separate add pass over the residual stream is left. In backward each norm adds the
// residual path's gradient to its input gradient in the same pass. The math, and on the
// CPU every bit, is that of the unfused block.
//
// norm1 and the attention's QKV projection run as one LayerNormLinear, norm2 and the MLP (for
// dense models) as one LayerNormMLP: the same modules call for call in BF16/F32, and in FP8
// the norms write the GEMMs' FP8 inputs directly (nn/layernorm_linear.h). The modules keep
// their places and names (norm1, attn.qkv, norm2, mlp), so parameters and checkpoints are
// unchanged.
#pragma once

#include <memory>

#include "tessera/models/config.h"
#include "tessera/nn/attention.h"
#include "tessera/nn/layernorm_linear.h"
#include "tessera/nn/layernorm_mlp.h"
#include "tessera/nn/mlp.h"
#include "tessera/nn/moe.h"
#include "tessera/nn/norm.h"

namespace tessera::nn {

class TransformerLayer {
 public:
  struct Saved {
    Norm::Saved norm1, norm2;  // norm2.x is x1, the residual stream between attention and MLP
    SelfAttention::Saved attn;
    MLP::Saved mlp;
    MoELayer::Saved moe;  // mixtral: the FFN is `moe`
    Tensor d_x1;  // gradient at the residual between attention and MLP
  };
  TransformerLayer(const std::string& name, const models::ModelConfig& config, DType dtype,
                   const ParallelContext& parallel = {});
  // The fused modules below hold pointers to this layer's own members.
  TransformerLayer(const TransformerLayer&) = delete;
  TransformerLayer& operator=(const TransformerLayer&) = delete;

  // The block's output, x1 + mlp(norm2(x1)), as its two summands: the residual stream x1
  // and the MLP's output. The next norm adds them (Norm::forward_add).
  struct Output {
    Tensor residual, branch;
  };
  // The block's input is x + branch when `branch` is defined (the previous block's two
  // summands, added inside norm1), else x. Tensors are [B*T, C].
  Output forward(Context& ctx, const Tensor& x, const Tensor& branch, int64_t batch, int64_t seq, Saved& saved) const;
  // The same with the output added up, for callers that want one tensor.
  Tensor forward(Context& ctx, const Tensor& x, int64_t batch, int64_t seq, Saved& saved) const;
  // dy is the gradient w.r.t. the block's output (the sum); returns the gradient w.r.t. its
  // input (the sum x + branch, which both summands receive).
  Tensor backward_input(Context& ctx, const Tensor& dy, Saved& saved);
  void backward_weight(Context& ctx, const Tensor& dy, const Saved& saved);
  void parameters(ParameterList& out);

  // The FFN: `mlp`, or for a mixture-of-experts model (config.is_moe()) `moe`; `mlp` then
  // is a 1-unit placeholder that is never run and owns no listed parameters.
  bool is_moe() const { return moe != nullptr; }

  Norm norm1, norm2;
  SelfAttention attn;
  MLP mlp;
  std::unique_ptr<MoELayer> moe;

 private:
  AttentionConfig attn_config_;
  LayerNormLinear norm1_qkv_;  // norm1 -> attn.qkv
  LayerNormMLP norm2_mlp_;     // norm2 -> mlp (dense models)
};

}  // namespace tessera::nn
