// SelfAttention: fused QKV projection -> (RoPE) -> scaled dot-product attention -> output
// projection. Input and output are [B*T, hidden]; heads are laid out [B, T, H, D].
#pragma once

#include "tessera/nn/linear.h"

namespace tessera::nn {

struct AttentionConfig {
  int64_t hidden = 0, num_heads = 0, num_kv_heads = 0;
  bool bias = false;        // GPT-2 has biases on both projections
  bool rope = false;        // Llama rotates Q and K
  float rope_theta = 10000.0f;
  bool causal = true;
};

class SelfAttention {
 public:
  struct Saved {
    Linear::Saved qkv_in, out_in;
    Tensor q, k, v, out, lse;  // head slices of the fused QKV output (q and k after RoPE)
    Tensor d_qkv;              // filled by backward_input, consumed by backward_weight
  };
  SelfAttention(const std::string& name, const AttentionConfig& config, DType dtype, const ParallelContext& parallel = {});

  Tensor forward(Context& ctx, const Tensor& x, int64_t batch, int64_t seq, Saved& saved) const;
  Tensor backward_input(Context& ctx, const Tensor& dy, Saved& saved) const;
  void backward_weight(Context& ctx, const Tensor& dy, const Saved& saved);
  void parameters(ParameterList& out);

  Linear qkv, proj;  // qkv rows: [q heads | k heads | v heads] x head_dim

 private:
  AttentionConfig config_;
  int64_t head_dim_;
};

}  // namespace tessera::nn
