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

// The part of self-attention between its two projections, shared by SelfAttention and its
// tensor-parallel form (nn/parallel_linear.h): Q, K and V stay in the fused QKV output, RoPE
// rotates Q and K there in place in one pass, attention reads the head slices; backward
// writes dQ, dK, dV straight into the fused gradient and undoes the rotation in place.
struct AttentionCoreSaved {
  Tensor q, k, v, out, lse;  // head slices of the fused QKV output (q and k after RoPE)
  Tensor d_qkv;              // filled by the backward, consumed by the QKV weight gradient
};
// fused: the QKV projection's output [B*T, (hq + 2 hkv) * D]; returns out [B*T, hq * D].
Tensor attention_core_forward(Context& ctx, const AttentionConfig& config, const Tensor& fused, int64_t batch,
                              int64_t seq, int64_t hq, int64_t hkv, AttentionCoreSaved& saved);
// d_out [B*T, hq * D]; returns (and keeps in saved.d_qkv) the gradient of the fused output.
Tensor attention_core_backward(Context& ctx, const AttentionConfig& config, const Tensor& d_out, int64_t hq,
                               int64_t hkv, AttentionCoreSaved& saved);

class SelfAttention {
 public:
  struct Saved : AttentionCoreSaved {
    Linear::Saved qkv_in, out_in;
  };
  SelfAttention(const std::string& name, const AttentionConfig& config, DType dtype, const ParallelContext& parallel = {});

  Tensor forward(Context& ctx, const Tensor& x, int64_t batch, int64_t seq, Saved& saved) const;
  Tensor backward_input(Context& ctx, const Tensor& dy, Saved& saved) const;
  void backward_weight(Context& ctx, const Tensor& dy, const Saved& saved);
  void parameters(ParameterList& out);

  Linear qkv, proj;  // qkv rows: [q heads | k heads | v heads] x head_dim

 private:
  AttentionConfig config_;
};

}  // namespace tessera::nn
