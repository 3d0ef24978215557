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
          c.is_gpt2(), dtype, parallel) {
  if (c.is_moe()) moe = std::make_unique<MoELayer>(name + ".moe", moe_options(c), dtype);
}

TransformerLayer::Output TransformerLayer::forward(Context& ctx, const Tensor& x, const Tensor& branch, int64_t batch,
                                                  int64_t seq, Saved& saved) const {
  // The block's input (x + branch when there is a branch) ends up in saved.norm1.x.
  const Tensor attn_in = branch.defined() ? norm1.forward_add(ctx, x, branch, saved.norm1) : norm1.forward(ctx, x, saved.norm1);
  const Tensor attn_out = attn.forward(ctx, attn_in, batch, seq, saved.attn);
  // x1 = input + attn_out comes out of norm2's fused add, kept in saved.norm2.x.
  const Tensor mlp_in = norm2.forward_add(ctx, saved.norm1.x, attn_out, saved.norm2);
  return {saved.norm2.x, moe ? moe->forward(ctx, mlp_in, saved.moe) : mlp.forward(ctx, mlp_in, saved.mlp)};
}

Tensor TransformerLayer::forward(Context& ctx, const Tensor& x, int64_t batch, int64_t seq, Saved& saved) const {
  const Output out = forward(ctx, x, Tensor(), batch, seq, saved);
  return sum(ctx, out.residual, out.branch);
}

Tensor TransformerLayer::backward_input(Context& ctx, const Tensor& dy, Saved& saved) {
  // The residual passes dy straight through; each norm adds it to its own input gradient in
  // the same pass (the unfused form: d_x1 = dy + norm2'(...), d_x = d_x1 + norm1'(...)).
  const Tensor d_ffn_in = moe ? moe->backward_input(ctx, dy, saved.moe) : mlp.backward_input(ctx, dy, saved.mlp);
  saved.d_x1 = norm2.backward_input_add(ctx, d_ffn_in, dy, saved.norm2);
  return norm1.backward_input_add(ctx, attn.backward_input(ctx, saved.d_x1, saved.attn), saved.d_x1, saved.norm1);
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
