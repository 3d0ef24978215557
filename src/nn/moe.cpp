#include "tessera/nn/moe.h"

#include <algorithm>

#include "tessera/ops/elementwise.h"

namespace tessera::nn {

GroupedLinear::GroupedLinear(const std::string& name, int64_t num_experts, int64_t in_features, int64_t out_features,
                             DType dtype)
    : weight(name + ".weight", {num_experts * out_features, in_features}, dtype, true),
      experts_(num_experts),
      in_(in_features),
      out_(out_features) {
  TESSERA_CHECK(num_experts > 0 && in_features > 0 && out_features > 0, "GroupedLinear ", name,
                ": sizes must be positive");
}

Tensor GroupedLinear::forward(Context& ctx, const Tensor& x, const std::vector<int64_t>& splits) const {
  Tensor y = Tensor::empty({x.size(0), out_}, weight.value.dtype(), ctx.device);
  grouped_linear_forward(ctx, x, weight3d(), splits, y);
  return y;
}

Tensor GroupedLinear::backward_input(Context& ctx, const Tensor& dy, const std::vector<int64_t>& splits) const {
  Tensor dx = Tensor::empty({dy.size(0), in_}, weight.value.dtype(), ctx.device);
  grouped_linear_backward_input(ctx, dy, weight3d(), splits, dx);
  return dx;
}

void GroupedLinear::backward_weight(Context& ctx, const Tensor& dy, const Tensor& x, const std::vector<int64_t>& splits) {
  Tensor dw = weight.grad.reshape({experts_, out_, in_});
  grouped_linear_backward_weight(ctx, dy, x, splits, dw);
}

GroupedMLP::GroupedMLP(const std::string& name, int64_t num_experts, int64_t hidden, int64_t ffn, DType dtype)
    : fc(name + ".fc", num_experts, hidden, 2 * ffn, dtype), proj(name + ".proj", num_experts, ffn, hidden, dtype) {}

Tensor GroupedMLP::forward(Context& ctx, const Tensor& x, const Tensor& scale, const std::vector<int64_t>& splits,
                           Saved& saved) const {
  saved.x = x;
  saved.splits = splits;
  saved.h_pre = fc.forward(ctx, x, splits);
  saved.scale = scale;
  Tensor ones;
  if (!scale.defined()) {
    ones = Tensor::empty({x.size(0)}, x.dtype());
    for (int64_t i = 0; i < ones.numel(); ++i) ones.set_item(i, 1.0);
    ones = ones.to(ctx.device);
  }
  saved.h = Tensor::empty({x.size(0), proj.in_features()}, x.dtype(), ctx.device);
  moe_swiglu_scaled_forward(ctx, saved.h_pre, scale.defined() ? scale : ones, saved.h);
  if (!scale.defined()) saved.scale = ones;
  return proj.forward(ctx, saved.h, splits);
}

Tensor GroupedMLP::backward_input(Context& ctx, const Tensor& dy, Saved& saved) const {
  const Tensor d_h = proj.backward_input(ctx, dy, saved.splits);
  saved.d_h_pre = Tensor::empty(saved.h_pre.shape(), saved.h_pre.dtype(), ctx.device);
  saved.d_scale = Tensor::empty(saved.scale.shape(), saved.scale.dtype(), ctx.device);
  moe_swiglu_scaled_backward(ctx, saved.h_pre, saved.scale, d_h, saved.d_h_pre, saved.d_scale);
  return fc.backward_input(ctx, saved.d_h_pre, saved.splits);
}

void GroupedMLP::backward_weight(Context& ctx, const Tensor& dy, const Saved& saved) {
  proj.backward_weight(ctx, dy, saved.h, saved.splits);
  fc.backward_weight(ctx, saved.d_h_pre, saved.x, saved.splits);
}

void GroupedMLP::parameters(ParameterList& out) {
  fc.parameters(out);
  proj.parameters(out);
}

MoELayer::MoELayer(const std::string& name, const MoEOptions& o, DType dtype)
    : options(o),
      router(name + ".router", o.hidden, o.num_experts, false, dtype),
      experts(name + ".experts", o.num_experts, o.hidden, o.ffn, dtype),
      load(static_cast<size_t>(o.num_experts), 0) {
  if (o.expert_bias_rate > 0) expert_bias = Tensor::zeros({o.num_experts}, DType::F32);
}

Tensor MoELayer::forward(Context& ctx, const Tensor& x, Saved& saved) const {
  const int64_t n = x.size(0), e = options.num_experts, k = options.router.top_k;
  const DType dt = x.dtype(), stats = master_dtype(dt);
  saved.logits = router.forward(ctx, x, saved.router_in);
  saved.scores = Tensor::empty({n, e}, stats, ctx.device);
  saved.probs = Tensor::empty({n, k}, dt, ctx.device);
  saved.indices = Tensor::empty({n, k}, DType::I32, ctx.device);
  saved.counts = Tensor::empty({e}, DType::I32, ctx.device);
  saved.losses = Tensor::empty({2}, stats, ctx.device);
  moe_router_forward(ctx, saved.logits, expert_bias, options.router, saved.scores, saved.probs, saved.indices,
                     saved.counts, saved.losses);
  saved.row_map = Tensor::empty({n, k}, DType::I32, ctx.device);
  saved.offsets = Tensor::empty({e + 1}, DType::I32, ctx.device);
  moe_routing_map(ctx, saved.indices, e, saved.row_map, saved.offsets);
  Tensor permuted = Tensor::empty({n * k, x.size(1)}, dt, ctx.device);
  saved.permuted_probs = Tensor::empty({n * k}, dt, ctx.device);
  moe_permute_forward(ctx, x, saved.row_map, saved.probs, permuted, saved.permuted_probs);
  // The per-expert GEMMs need the row counts on the host (a sync on CUDA).
  saved.splits = saved.counts.to(Device::cpu()).to_ints();
  saved.expert_out = experts.forward(ctx, permuted, saved.permuted_probs, saved.splits, saved.mlp);
  Tensor y = Tensor::empty(x.shape(), dt, ctx.device);
  moe_unpermute_forward(ctx, saved.expert_out, saved.row_map, Tensor(), y);
  return y;
}

Tensor MoELayer::backward_input(Context& ctx, const Tensor& dy, Saved& saved) const {
  const int64_t n = dy.size(0), k = options.router.top_k;
  saved.d_expert_out = Tensor::empty(saved.expert_out.shape(), dy.dtype(), ctx.device);
  Tensor no_probs;
  moe_unpermute_backward(ctx, saved.expert_out, saved.row_map, Tensor(), dy, saved.d_expert_out, no_probs);
  const Tensor d_permuted = experts.backward_input(ctx, saved.d_expert_out, saved.mlp);
  Tensor dx = Tensor::empty(dy.shape(), dy.dtype(), ctx.device);
  Tensor d_probs = Tensor::empty({n, k}, saved.probs.dtype(), ctx.device);
  moe_permute_backward(ctx, saved.row_map, d_permuted, saved.mlp.d_scale, dx, d_probs);
  saved.d_logits = Tensor::empty(saved.logits.shape(), saved.logits.dtype(), ctx.device);
  moe_router_backward(ctx, saved.logits, saved.scores, saved.indices, d_probs, options.router, saved.loss_scale,
                      saved.d_logits);
  const Tensor dx_router = router.backward_input(ctx, saved.d_logits, saved.router_in);
  add(ctx, dx, dx_router, dx);
  return dx;
}

void MoELayer::backward_weight(Context& ctx, const Tensor&, const Saved& saved) {
  experts.backward_weight(ctx, saved.d_expert_out, saved.mlp);
  router.backward_weight(ctx, saved.d_logits, saved.router_in);
}

void MoELayer::parameters(ParameterList& out) {
  router.parameters(out);
  experts.parameters(out);
}

void MoELayer::to(Device device) {
  if (expert_bias.defined()) expert_bias = expert_bias.to(device);
}

void MoELayer::record_load(const Saved& saved) {
  for (size_t e = 0; e < load.size() && e < saved.splits.size(); ++e) load[e] += saved.splits[e];
}

void MoELayer::update_expert_bias(Context& ctx) {
  if (expert_bias.defined()) {
    const Tensor host = Tensor::from_ints(load, {options.num_experts}, DType::I64);
    moe_update_expert_bias(ctx, host.to(expert_bias.device()), options.expert_bias_rate, expert_bias);
  }
  std::fill(load.begin(), load.end(), 0);
}

}  // namespace tessera::nn
