// The tensor-parallel Transformer block (see tessera/nn/parallel_transformer_layer.h).
#include "tessera/nn/parallel_transformer_layer.h"

#include "tessera/dist/process_group.h"

namespace tessera::nn {
namespace {

AttentionConfig attention_config(const models::ModelConfig& c) {
  return {.hidden = c.hidden_size, .num_heads = c.num_heads, .num_kv_heads = c.num_kv_heads, .bias = c.is_gpt2(),
          .rope = !c.is_gpt2(), .rope_theta = c.rope_theta, .causal = true};
}
NormKind norm_kind(const models::ModelConfig& c) { return c.is_gpt2() ? NormKind::LayerNorm : NormKind::RMSNorm; }

const models::ModelConfig& dense(const models::ModelConfig& c, const std::string& name) {
  TESSERA_CHECK(!c.is_moe(), name, ": tensor parallelism is not built for mixture-of-experts models (",
                c.architecture, "); run them with parallel.tensor 1");
  return c;
}

void add_norm_layouts(const Norm& norm, std::vector<ShardLayout>& out) {
  out.push_back(ShardLayout::replicated(norm.weight.value.shape()));
  if (norm.bias.value.defined()) out.push_back(ShardLayout::replicated(norm.bias.value.shape()));
}

}  // namespace

TensorParallelTransformerLayer::TensorParallelTransformerLayer(const std::string& name, const models::ModelConfig& c,
                                                               DType dtype, const ParallelContext& parallel)
    : norm1(name + ".norm1", norm_kind(dense(c, name)), c.hidden_size, c.norm_eps, dtype),
      norm2(name + ".norm2", norm_kind(c), c.hidden_size, c.norm_eps, dtype),
      attn(name + ".attn", attention_config(c), dtype, parallel),
      mlp(name + ".mlp", c.hidden_size, c.ffn_size(), c.is_gpt2() ? Activation::GELU : Activation::SwiGLU, c.is_gpt2(),
          dtype, parallel) {}

TensorParallelTransformerLayer::Output TensorParallelTransformerLayer::forward(Context& ctx, const Tensor& x,
                                                                              const Tensor& branch, int64_t batch,
                                                                              int64_t seq, Saved& saved) const {
  const Tensor attn_in =
      branch.defined() ? norm1.forward_add(ctx, x, branch, saved.norm1) : norm1.forward(ctx, x, saved.norm1);
  const Tensor attn_out = attn.forward(ctx, attn_in, batch, seq, saved.attn);
  const Tensor mlp_in = norm2.forward_add(ctx, saved.norm1.x, attn_out, saved.norm2);
  return {saved.norm2.x, mlp.forward(ctx, mlp_in, saved.mlp)};
}

Tensor TensorParallelTransformerLayer::backward_input(Context& ctx, const Tensor& dy, Saved& saved) {
  const Tensor d_ffn_in = mlp.backward_input(ctx, dy, saved.mlp);
  saved.d_x1 = norm2.backward_input_add(ctx, d_ffn_in, dy, saved.norm2);
  if (attn.proj.comm_overlap() && attn.proj.sequence_parallel()) {
    // Communication overlap: the attention's all-gather of its dy runs beside the MLP's
    // row-parallel weight gradient (it needs only the MLP's gathered dy and saved input),
    // which backward_weight then skips. The same GEMM on the same data: bit-identical.
    std::unique_ptr<dist::Work> work = attn.proj.start_gather_dy(ctx, saved.d_x1, saved.attn.out_in);
    mlp.proj.backward_weight(ctx, dy, saved.mlp.proj_in);
    saved.mlp.proj_in.weight_grad_done = true;
    work->wait();
  }
  return norm1.backward_input_add(ctx, attn.backward_input(ctx, saved.d_x1, saved.attn), saved.d_x1, saved.norm1);
}

void TensorParallelTransformerLayer::backward_weight(Context& ctx, const Tensor& dy, Saved& saved) {
  mlp.backward_weight(ctx, dy, saved.mlp);
  attn.backward_weight(ctx, saved.d_x1, saved.attn);
}

void TensorParallelTransformerLayer::parameters(ParameterList& out) {
  norm1.parameters(out);
  attn.parameters(out);
  norm2.parameters(out);
  mlp.parameters(out);
}

void TensorParallelTransformerLayer::layouts(std::vector<ShardLayout>& out) const {
  add_norm_layouts(norm1, out);
  attn.layouts(out);
  add_norm_layouts(norm2, out);
  mlp.layouts(out);
}

void TensorParallelTransformerLayer::sequence_parallel_parameters(ParameterList& out) {
  norm1.parameters(out);
  norm2.parameters(out);
}

}  // namespace tessera::nn
