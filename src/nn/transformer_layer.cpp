#include "tessera/nn/transformer_layer.h"

#include "tessera/ops/elementwise.h"

namespace tessera::nn {

namespace {
AttentionConfig attention_config(const models::ModelConfig& c) {
  return {.hidden = c.hidden_size, .num_heads = c.num_heads, .num_kv_heads = c.num_kv_heads, .bias = c.is_gpt2(),
          .rope = !c.is_gpt2(), .rope_theta = c.rope_theta, .causal = true};
}
NormKind norm_kind(const models::ModelConfig& c) { return c.is_gpt2() ? NormKind::LayerNorm : NormKind::RMSNorm; }

MoEOptions moe_options(const models::ModelConfig& c) {
  MoEOptions o;
  o.hidden = c.hidden_size;
  o.ffn = c.ffn_size();
  o.num_experts = c.num_experts;
  o.router.top_k = c.num_experts_per_tok;
  o.router.score = c.router_score == "sigmoid" ? RouterScore::Sigmoid : RouterScore::Softmax;
  o.router.normalize = c.router_normalize;
  o.router.num_groups = c.router_num_groups;
  o.router.topk_groups = c.router_topk_groups;
  o.router.scaling = c.router_scaling;
  o.router.aux_loss_coeff = c.router_aux_loss_coef;
  o.router.z_loss_coeff = c.router_z_loss_coef;
  o.router.capacity_factor = c.capacity_factor;
  o.expert_bias_rate = c.expert_bias_rate;
  o.recompute_activation = c.moe_recompute_activation;
  return o;
}

Tensor sum(Context& ctx, const Tensor& a, const Tensor& b) {
  Tensor out = Tensor::empty(a.shape(), a.dtype(), ctx.device);
  add(ctx, a, b, out);
  return out;
}
}  // namespace

TransformerLayer::TransformerLayer(const std::string& name, const models::ModelConfig& c, DType dtype,
                                   const ParallelContext& parallel)
    : norm1(name + ".norm1", norm_kind(c), c.hidden_size, c.norm_eps, dtype),
      norm2(name + ".norm2", norm_kind(c), c.hidden_size, c.norm_eps, dtype),
      attn(name + ".attn", attention_config(c), dtype, parallel),
      mlp(name + ".mlp", c.hidden_size, c.is_moe() ? 1 : c.ffn_size(), c.is_gpt2() ? Activation::GELU : Activation::SwiGLU,
          c.is_gpt2(), dtype, parallel),
      attn_config_(attention_config(c)),
      norm1_qkv_(norm1, attn.qkv),
      norm2_mlp_(norm2, mlp) {
  if (c.is_moe()) moe = std::make_unique<MoELayer>(name + ".moe", moe_options(c), dtype);
  mlp.recompute_activation = c.recompute_activation && !c.is_gpt2();
}

TransformerLayer::Output TransformerLayer::forward(Context& ctx, const Tensor& x, const Tensor& branch, int64_t batch,
                                                  int64_t seq, Saved& saved) const {
  // SelfAttention::forward with its QKV projection done by norm1_qkv_. The block's input
  // (x + branch when there is a branch) ends up in saved.norm1.x.
  const Tensor fused = branch.defined() ? norm1_qkv_.forward_add(ctx, x, branch, saved.norm1, saved.attn.qkv_in)
                                        : norm1_qkv_.forward(ctx, x, saved.norm1, saved.attn.qkv_in);
  const Tensor core = attention_core_forward(ctx, attn_config_, fused, batch, seq, attn_config_.num_heads,
                                             attn_config_.num_kv_heads, saved.attn);
  const Tensor attn_out = attn.proj.forward(ctx, core, saved.attn.out_in);
  // x1 = input + attn_out comes out of norm2's fused add, kept in saved.norm2.x.
  if (moe) {
    const Tensor mlp_in = norm2.forward_add(ctx, saved.norm1.x, attn_out, saved.norm2);
    return {saved.norm2.x, moe->forward(ctx, mlp_in, saved.moe)};
  }
  const Tensor mlp_out = norm2_mlp_.forward_add(ctx, saved.norm1.x, attn_out, saved.norm2, saved.mlp);
  return {saved.norm2.x, mlp_out};
}

Tensor TransformerLayer::forward(Context& ctx, const Tensor& x, int64_t batch, int64_t seq, Saved& saved) const {
  const Output out = forward(ctx, x, Tensor(), batch, seq, saved);
  return sum(ctx, out.residual, out.branch);
}

Tensor TransformerLayer::backward_input(Context& ctx, const Tensor& dy, Saved& saved) {
  // The residual passes dy straight through; each norm adds it to its own input gradient in
  // the same pass (the unfused form: d_x1 = dy + norm2'(...), d_x = d_x1 + norm1'(...)).
  if (moe) saved.d_x1 = norm2.backward_input_add(ctx, moe->backward_input(ctx, dy, saved.moe), dy, saved.norm2);
  else saved.d_x1 = norm2_mlp_.backward_input_add(ctx, dy, dy, saved.norm2, saved.mlp);
  // SelfAttention::backward_input up to its QKV projection, which norm1_qkv_ takes with norm1.
  const Tensor d_core = attn.proj.backward_input(ctx, saved.d_x1, saved.attn.out_in);
  attention_core_backward(ctx, attn_config_, d_core, attn_config_.num_heads, attn_config_.num_kv_heads, saved.attn);
  return norm1_qkv_.backward_input_add(ctx, saved.attn.d_qkv, saved.d_x1, saved.norm1, saved.attn.qkv_in);
}

void TransformerLayer::backward_weight(Context& ctx, const Tensor& dy, const Saved& saved) {
  if (moe) moe->backward_weight(ctx, dy, saved.moe);
  else mlp.backward_weight(ctx, dy, saved.mlp);
  attn.backward_weight(ctx, saved.d_x1, saved.attn);
}

void TransformerLayer::parameters(ParameterList& out) {
  norm1.parameters(out);
  attn.parameters(out);
  norm2.parameters(out);
  if (moe) moe->parameters(out);
  else mlp.parameters(out);
}

}  // namespace tessera::nn
