#include "tessera/nn/attention.h"

#include "tessera/ops/attention.h"
#include "tessera/ops/rope.h"

namespace tessera::nn {

SelfAttention::SelfAttention(const std::string& name, const AttentionConfig& c, DType dtype, const ParallelContext& parallel)
    : qkv(name + ".qkv", c.hidden, (c.num_heads + 2 * c.num_kv_heads) * (c.hidden / c.num_heads), c.bias, dtype, parallel),
      proj(name + ".proj", c.hidden, c.hidden, c.bias, dtype, parallel),
      config_(c),
      head_dim_(c.hidden / c.num_heads) {}

Tensor SelfAttention::forward(Context& ctx, const Tensor& x, int64_t batch, int64_t seq, Saved& saved) const {
  const int64_t hq = config_.num_heads, hkv = config_.num_kv_heads, d = head_dim_;
  const Tensor fused = qkv.forward(ctx, x, saved.qkv_in).reshape({batch, seq, hq + 2 * hkv, d});
  // Q, K and V stay where the projection wrote them: the attention op takes head slices of
  // the fused buffer. RoPE rotates Q and K there, in place, in one pass.
  if (config_.rope) {
    Tensor qk = fused.slice(2, 0, hq + hkv);
    rope_forward(ctx, qk, qk, {.theta = config_.rope_theta});
  }
  saved.q = fused.slice(2, 0, hq);
  saved.k = fused.slice(2, hq, hq + hkv);
  saved.v = fused.slice(2, hq + hkv, hq + 2 * hkv);
  const DType stats = x.dtype() == DType::F64 ? DType::F64 : DType::F32;
  saved.out = Tensor::empty({batch, seq, hq, d}, x.dtype(), ctx.device);
  saved.lse = Tensor::empty({batch, hq, seq}, stats, ctx.device);
  attention_forward(ctx, saved.q, saved.k, saved.v, saved.out, saved.lse, {.causal = config_.causal});
  return proj.forward(ctx, saved.out.reshape({batch * seq, hq * d}), saved.out_in);
}

Tensor SelfAttention::backward_input(Context& ctx, const Tensor& dy, Saved& saved) const {
  const int64_t batch = saved.q.size(0), seq = saved.q.size(1);
  const int64_t hq = config_.num_heads, hkv = config_.num_kv_heads, d = head_dim_;
  const Tensor d_out = proj.backward_input(ctx, dy, saved.out_in).reshape({batch, seq, hq, d});
  // dQ, dK and dV are written straight into the fused projection's gradient, and the
  // inverse rotation runs there in place, over dQ and dK in one pass.
  saved.d_qkv = Tensor::empty({batch, seq, hq + 2 * hkv, d}, dy.dtype(), ctx.device);
  Tensor dq = saved.d_qkv.slice(2, 0, hq), dk = saved.d_qkv.slice(2, hq, hq + hkv);
  Tensor dv = saved.d_qkv.slice(2, hq + hkv, hq + 2 * hkv);
  attention_backward(ctx, d_out, saved.q, saved.k, saved.v, saved.out, saved.lse, dq, dk, dv, {.causal = config_.causal});
  if (config_.rope) {
    Tensor d_qk = saved.d_qkv.slice(2, 0, hq + hkv);
    rope_backward(ctx, d_qk, d_qk, {.theta = config_.rope_theta});
  }
  saved.d_qkv = saved.d_qkv.reshape({batch * seq, (hq + 2 * hkv) * d});
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
