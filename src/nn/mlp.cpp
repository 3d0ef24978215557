#include "tessera/nn/mlp.h"

#include "tessera/ops/activation.h"
#include "tessera/ops/gemm.h"

namespace tessera::nn {

MLP::MLP(const std::string& name, int64_t hidden, int64_t ffn, Activation act, bool bias, DType dtype,
         const ParallelContext& parallel)
    : activation(act),
      fc(name + ".fc", hidden, act == Activation::SwiGLU ? 2 * ffn : ffn, bias, dtype, parallel),
      proj(name + ".proj", ffn, hidden, bias, dtype, parallel) {}

Tensor MLP::forward(Context& ctx, const Tensor& x, Saved& saved) const {
  Tensor h = Tensor::empty({x.size(0), proj.in_features()}, x.dtype(), ctx.device);
  if (activation == Activation::GELU && fc.runs_fp8(x)) {
    // In FP8 the GEMM writes h_pre and the activation is its own pass (no FP8 GELU epilogue).
    saved.h_pre = fc.forward(ctx, x, saved.fc_in);
    gelu_forward(ctx, saved.h_pre, h);
  } else if (activation == Activation::GELU) {
    // fc and GELU in one GEMM (the epilogue applies the activation and keeps h_pre).
    TESSERA_CHECK(x.dim() == 2 && x.size(1) == fc.in_features(), "MLP ", fc.weight.name, ": input must be [N, ",
                  fc.in_features(), "], got ", x.describe());
    saved.fc_in.x = x;
    saved.h_pre = Tensor::empty(h.shape(), x.dtype(), ctx.device);
    gemm_bias_gelu(ctx, x, fc.weight.value, fc.bias.value, saved.h_pre, h, {.transpose_b = true});
  } else {
    saved.h_pre = fc.forward(ctx, x, saved.fc_in);
    swiglu_forward(ctx, saved.h_pre, h);
  }
  return proj.forward(ctx, h, saved.proj_in);
}

Tensor MLP::forward(Context& ctx, const fp8::QuantizedTensor& x, Saved& saved) const {
  saved.h_pre = fc.forward(ctx, x, saved.fc_in);
  Tensor h = Tensor::empty({x.rows(), proj.in_features()}, saved.h_pre.dtype(), ctx.device);
  if (activation == Activation::GELU) gelu_forward(ctx, saved.h_pre, h);  // as forward's FP8 branch
  else swiglu_forward(ctx, saved.h_pre, h);
  return proj.forward(ctx, h, saved.proj_in);
}

Tensor MLP::backward_input(Context& ctx, const Tensor& dy, Saved& saved) const {
  saved.d_h_pre = Tensor::empty(saved.h_pre.shape(), dy.dtype(), ctx.device);
  if (activation == Activation::GELU && saved.proj_in.fp8) {
    const Tensor d_h = proj.backward_input(ctx, dy, saved.proj_in);
    gelu_backward(ctx, saved.h_pre, d_h, saved.d_h_pre);
  } else if (activation == Activation::GELU) {
    gemm_gelu_backward(ctx, dy, proj.weight.value, saved.h_pre, saved.d_h_pre);  // (dy W) * gelu'(h_pre)
  } else {
    const Tensor d_h = proj.backward_input(ctx, dy, saved.proj_in);
    swiglu_backward(ctx, saved.h_pre, d_h, saved.d_h_pre);
  }
  // The model keeps every layer's Saved until its whole backward ends: what nothing reads
  // again goes now. h_pre is read by the activation's backward above only. In FP8, fc's
  // weight gradient reads its own cast of d_h_pre (dy_fp8), so without a bias (whose
  // gradient sums d_h_pre) d_h_pre goes too: N x 2 ffn BF16 per SwiGLU layer.
  saved.h_pre = Tensor();
  Tensor dx = fc.backward_input(ctx, saved.d_h_pre, saved.fc_in);
  if (saved.fc_in.fp8 && !fc.bias.value.defined()) saved.d_h_pre = Tensor();
  return dx;
}

void MLP::backward_weight(Context& ctx, const Tensor& dy, const Saved& saved) {
  proj.backward_weight(ctx, dy, saved.proj_in);
  fc.backward_weight(ctx, saved.d_h_pre, saved.fc_in);  // d_h_pre undefined in FP8 without bias: unread
}

void MLP::parameters(ParameterList& out) {
  fc.parameters(out);
  proj.parameters(out);
}

}  // namespace tessera::nn
