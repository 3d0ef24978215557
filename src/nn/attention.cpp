#include "tessera/nn/attention.h"

#include "tessera/ops/attention.h"
#include "tessera/ops/rope.h"

namespace tessera::nn {

SelfAttention::SelfAttention(const std::string& name, const AttentionConfig& c, DType dtype, const ParallelContext& parallel)
    : qkv(name + ".qkv", c.hidden, (c.num_heads + 2 * c.num_kv_heads) * (c.hidden / c.num_heads), c.bias, dtype, parallel),
      proj(name + ".proj", c.hidden, c.hidden, c.bias, dtype, parallel),
      config_(c) {}

Tensor attention_core_forward(Context& ctx, const AttentionConfig& config, const Tensor& fused_rows, int64_t batch,
                              int64_t seq, int64_t hq, int64_t hkv, AttentionCoreSaved& saved) {
  const int64_t d = fused_rows.size(1) / (hq + 2 * hkv);
  const Tensor fused = fused_rows.reshape({batch, seq, hq + 2 * hkv, d});
  if (config.rope) {
    Tensor qk = fused.slice(2, 0, hq + hkv);
    rope_forward(ctx, qk, qk, {.theta = config.rope_theta});
  }
  saved.q = fused.slice(2, 0, hq);
  saved.k = fused.slice(2, hq, hq + hkv);
  saved.v = fused.slice(2, hq + hkv, hq + 2 * hkv);
  const DType stats = fused.dtype() == DType::F64 ? DType::F64 : DType::F32;
  saved.out = Tensor::empty({batch, seq, hq, d}, fused.dtype(), ctx.device);
  saved.lse = Tensor::empty({batch, hq, seq}, stats, ctx.device);
  attention_forward(ctx, saved.q, saved.k, saved.v, saved.out, saved.lse, {.causal = config.causal});
  return saved.out.reshape({batch * seq, hq * d});
}

Tensor attention_core_backward(Context& ctx, const AttentionConfig& config, const Tensor& d_out_rows, int64_t hq,
                               int64_t hkv, AttentionCoreSaved& saved) {
  const int64_t batch = saved.q.size(0), seq = saved.q.size(1), d = saved.q.size(3);
  const Tensor d_out = d_out_rows.reshape({batch, seq, hq, d});
  saved.d_qkv = Tensor::empty({batch, seq, hq + 2 * hkv, d}, d_out.dtype(), ctx.device);
  Tensor dq = saved.d_qkv.slice(2, 0, hq), dk = saved.d_qkv.slice(2, hq, hq + hkv);
  Tensor dv = saved.d_qkv.slice(2, hq + hkv, hq + 2 * hkv);
  attention_backward(ctx, d_out, saved.q, saved.k, saved.v, saved.out, saved.lse, dq, dk, dv, {.causal = config.causal});
  if (config.rope) {
    Tensor d_qk = saved.d_qkv.slice(2, 0, hq + hkv);
    rope_backward(ctx, d_qk, d_qk, {.theta = config.rope_theta});
  }
  saved.d_qkv = saved.d_qkv.reshape({batch * seq, (hq + 2 * hkv) * d});
  return saved.d_qkv;
}

Tensor SelfAttention::forward(Context& ctx, const Tensor& x, int64_t batch, int64_t seq, Saved& saved) const {
  const Tensor fused = qkv.forward(ctx, x, saved.qkv_in);
  const Tensor out = attention_core_forward(ctx, config_, fused, batch, seq, config_.num_heads, config_.num_kv_heads, saved);
  return proj.forward(ctx, out, saved.out_in);
}

Tensor SelfAttention::backward_input(Context& ctx, const Tensor& dy, Saved& saved) const {
  const Tensor d_out = proj.backward_input(ctx, dy, saved.out_in);
  attention_core_backward(ctx, config_, d_out, config_.num_heads, config_.num_kv_heads, saved);
  return qkv.backward_input(ctx, saved.d_qkv, saved.qkv_in);
}

void SelfAttention::backward_weight(Context& ctx, const Tensor& dy, const Saved& saved) {
  proj.backward_weight(ctx, dy, saved.out_in);
  qkv.backward_weight(ctx, saved.d_qkv, saved.qkv_in);
}

void SelfAttention::parameters(ParameterList& out) {
  qkv.parameters(out);
  proj.parameters(out);
}

}  // namespace tessera::nn
