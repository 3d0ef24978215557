#include "tessera/nn/mlp.h"

#include <atomic>

#include "tessera/ops/activation.h"
#include "tessera/ops/gemm.h"

namespace tessera::nn {

namespace {

std::atomic<bool> g_fused_fp8_activation{true};

bool per_tensor_fp8(const Linear& layer) {
  return layer.fp8_binding().scaling && layer.fp8_binding().scaling->per_tensor();
}

// Tensor `slot` of `layer` cast by `cast(scale, amax_out)` (the fused SwiGLU casts), the
// scaling chosen as for every other cast (Fp8Scaling::cast_with).
template <typename Amax, typename Cast>
fp8::QuantizedTensor cast_as_layer(Context& ctx, const Linear& layer, Fp8Scaling::Slot slot, Amax&& amax, Cast&& cast) {
  return layer.fp8_binding().scaling->cast_with(ctx, layer.fp8_binding().layer, slot, amax, cast);
}

// h = swiglu(h_pre) as proj's FP8 input, never stored in BF16 (when fused_swiglu_forward).
bool fused_swiglu_forward(const MLP& mlp, const Tensor& h_pre) {
  return mlp.activation == Activation::SwiGLU && g_fused_fp8_activation.load(std::memory_order_relaxed) &&
         h_pre.dim() == 2 && per_tensor_fp8(mlp.proj) && mlp.proj.runs_fp8(h_pre.size(0), h_pre.dtype());
}

fp8::QuantizedTensor swiglu_to_fp8(Context& ctx, const MLP& mlp, const Tensor& h_pre) {
  return cast_as_layer(
      ctx, mlp.proj, Fp8Scaling::kInput, [&](Tensor& amax) { swiglu_forward_amax(ctx, h_pre, amax); },
      [&](const Tensor& scale, Tensor* amax) {
        return swiglu_forward_fp8(ctx, h_pre, scale, mlp.proj.fp8_binding().scaling->dtype(Fp8Scaling::kInput), amax);
      });
}

// h = gelu(h_pre) as proj's FP8 input, never stored in BF16 (when fused_gelu_forward): the
// same conditions as SwiGLU's.
bool fused_gelu_forward(const MLP& mlp, const Tensor& h_pre) {
  return mlp.activation == Activation::GELU && g_fused_fp8_activation.load(std::memory_order_relaxed) &&
         h_pre.dim() == 2 && per_tensor_fp8(mlp.proj) && mlp.proj.runs_fp8(h_pre.size(0), h_pre.dtype());
}

fp8::QuantizedTensor gelu_to_fp8(Context& ctx, const MLP& mlp, const Tensor& h_pre) {
  return cast_as_layer(
      ctx, mlp.proj, Fp8Scaling::kInput, [&](Tensor& amax) { gelu_forward_amax(ctx, h_pre, amax); },
      [&](const Tensor& scale, Tensor* amax) {
        return gelu_forward_fp8(ctx, h_pre, scale, mlp.proj.fp8_binding().scaling->dtype(Fp8Scaling::kInput), amax);
      });
}

}  // namespace

void MLP::set_fused_fp8_activation(bool on) { g_fused_fp8_activation.store(on); }
bool MLP::fused_fp8_activation() { return g_fused_fp8_activation.load(); }

MLP::MLP(const std::string& name, int64_t hidden, int64_t ffn, Activation act, bool bias, DType dtype,
         const ParallelContext& parallel)
    : activation(act),
      fc(name + ".fc", hidden, act == Activation::SwiGLU ? 2 * ffn : ffn, bias, dtype, parallel),
      proj(name + ".proj", ffn, hidden, bias, dtype, parallel) {}

Tensor MLP::forward(Context& ctx, const Tensor& x, Saved& saved) const {
  if (activation == Activation::SwiGLU) {
    saved.h_pre = fc.forward(ctx, x, saved.fc_in);
    if (fused_swiglu_forward(*this, saved.h_pre))
      return proj.forward(ctx, swiglu_to_fp8(ctx, *this, saved.h_pre), saved.proj_in);
    Tensor h = Tensor::empty({x.size(0), proj.in_features()}, x.dtype(), ctx.device);
    swiglu_forward(ctx, saved.h_pre, h);
    Tensor y = proj.forward(ctx, h, saved.proj_in);
    if (recompute_activation && !saved.proj_in.fp8) saved.proj_in.x = Tensor();  // backward_input rewrites it
    return y;
  }
  Tensor h;
  if (fc.runs_fp8(x)) {
    // In FP8 the GEMM writes h_pre and the activation is its own pass (no FP8 GELU epilogue),
    // fused with proj's input cast when proj runs per-tensor FP8 (then h is never allocated).
    saved.h_pre = fc.forward(ctx, x, saved.fc_in);
    if (fused_gelu_forward(*this, saved.h_pre))
      return proj.forward(ctx, gelu_to_fp8(ctx, *this, saved.h_pre), saved.proj_in);
    h = Tensor::empty({x.size(0), proj.in_features()}, x.dtype(), ctx.device);
    gelu_forward(ctx, saved.h_pre, h);
  } else {
    // fc and GELU in one GEMM (the epilogue applies the activation and keeps h_pre).
    TESSERA_CHECK(x.dim() == 2 && x.size(1) == fc.in_features(), "MLP ", fc.weight.name, ": input must be [N, ",
                  fc.in_features(), "], got ", x.describe());
    saved.fc_in.x = x;
    h = Tensor::empty({x.size(0), proj.in_features()}, x.dtype(), ctx.device);
    saved.h_pre = Tensor::empty(h.shape(), x.dtype(), ctx.device);
    gemm_bias_gelu(ctx, x, fc.weight.value, fc.bias.value, saved.h_pre, h, {.transpose_b = true});
  }
  return proj.forward(ctx, h, saved.proj_in);
}

Tensor MLP::forward(Context& ctx, const fp8::QuantizedTensor& x, Saved& saved) const {
  saved.h_pre = fc.forward(ctx, x, saved.fc_in);
  if (fused_swiglu_forward(*this, saved.h_pre))
    return proj.forward(ctx, swiglu_to_fp8(ctx, *this, saved.h_pre), saved.proj_in);
  if (fused_gelu_forward(*this, saved.h_pre))
    return proj.forward(ctx, gelu_to_fp8(ctx, *this, saved.h_pre), saved.proj_in);
  Tensor h = Tensor::empty({x.rows(), proj.in_features()}, saved.h_pre.dtype(), ctx.device);
  if (activation == Activation::GELU) gelu_forward(ctx, saved.h_pre, h);  // as forward's FP8 branch
  else swiglu_forward(ctx, saved.h_pre, h);
  return proj.forward(ctx, h, saved.proj_in);
}

Tensor MLP::backward_input(Context& ctx, const Tensor& dy, Saved& saved) const {
  if (activation == Activation::SwiGLU && g_fused_fp8_activation.load(std::memory_order_relaxed) &&
      saved.fc_in.fp8 && saved.fc_in.kind == Fp8Scaling::Kind::PerTensor && per_tensor_fp8(fc) &&
      !fc.bias.value.defined()) {
    // d_h_pre straight to fc's FP8 output gradient (never in BF16); without a bias nothing
    // else reads it (fc's bias gradient would need it in BF16: hence the condition above,
    // which Linear::backward_input(QuantizedTensor) relies on). h_pre goes as below.
    const Tensor d_h = proj.backward_input(ctx, dy, saved.proj_in);
    const fp8::QuantizedTensor d_h_pre = cast_as_layer(
        ctx, fc, Fp8Scaling::kGradOutput, [&](Tensor& amax) { swiglu_backward_amax(ctx, saved.h_pre, d_h, amax); },
        [&](const Tensor& scale, Tensor* amax) {
          return swiglu_backward_fp8(ctx, saved.h_pre, d_h, scale,
                                     fc.fp8_binding().scaling->dtype(Fp8Scaling::kGradOutput), amax);
        });
    saved.h_pre = Tensor();
    saved.d_h_pre = Tensor();
    return fc.backward_input(ctx, d_h_pre, saved.fc_in);
  }
  if (activation == Activation::GELU && g_fused_fp8_activation.load(std::memory_order_relaxed) &&
      saved.proj_in.fp8 && saved.fc_in.fp8 && saved.fc_in.kind == Fp8Scaling::Kind::PerTensor &&
      per_tensor_fp8(fc)) {
    // d_h_pre straight to fc's FP8 output gradient (never in BF16), and with a bias its
    // gradient from the same pass (the column sums of d_h_pre, as fc's own cast would add
    // them: Linear::backward_input(Tensor)), so backward_weight reads no d_h_pre.
    const Tensor d_h = proj.backward_input(ctx, dy, saved.proj_in);
    Tensor dbias = fc.bias.grad;  // undefined without a bias; the same storage otherwise
    const fp8::QuantizedTensor d_h_pre = cast_as_layer(
        ctx, fc, Fp8Scaling::kGradOutput, [&](Tensor& amax) { gelu_backward_amax(ctx, saved.h_pre, d_h, amax); },
        [&](const Tensor& scale, Tensor* amax) {
          return gelu_backward_fp8(ctx, saved.h_pre, d_h, scale,
                                   fc.fp8_binding().scaling->dtype(Fp8Scaling::kGradOutput), amax,
                                   fc.bias.value.defined() ? &dbias : nullptr);
        });
    saved.h_pre = Tensor();
    saved.d_h_pre = Tensor();
    Tensor dx = fc.backward_input(ctx, d_h_pre, saved.fc_in);
    saved.fc_in.bias_grad_done = fc.bias.value.defined();
    return dx;
  }
  saved.d_h_pre = Tensor::empty(saved.h_pre.shape(), dy.dtype(), ctx.device);
  if (activation == Activation::GELU && saved.proj_in.fp8) {
    const Tensor d_h = proj.backward_input(ctx, dy, saved.proj_in);
    gelu_backward(ctx, saved.h_pre, d_h, saved.d_h_pre);
  } else if (activation == Activation::GELU) {
    gemm_gelu_backward(ctx, dy, proj.weight.value, saved.h_pre, saved.d_h_pre);  // (dy W) * gelu'(h_pre)
  } else if (!saved.proj_in.fp8 && !saved.proj_in.x.defined()) {
    // recompute_activation: h for proj's weight gradient, from the same pass.
    const Tensor d_h = proj.backward_input(ctx, dy, saved.proj_in);
    saved.proj_in.x = Tensor::empty(d_h.shape(), saved.h_pre.dtype(), ctx.device);
    swiglu_backward(ctx, saved.h_pre, d_h, saved.d_h_pre, &saved.proj_in.x);
  } else {
    const Tensor d_h = proj.backward_input(ctx, dy, saved.proj_in);
    swiglu_backward(ctx, saved.h_pre, d_h, saved.d_h_pre);
  }
  // The model keeps every layer's Saved until its whole backward ends: what nothing reads
  // again goes now. h_pre is read by the activation's backward above only. In FP8, fc's
  // weight gradient reads its own cast of d_h_pre (dy_fp8), so without a bias (whose
  // gradient sums d_h_pre) d_h_pre goes too: N x 2 ffn BF16 per SwiGLU layer. With a bias
  // under per-tensor FP8 the cast of d_h_pre summed the bias gradient too (bias_grad_done):
  // then nothing reads it either.
  saved.h_pre = Tensor();
  Tensor dx = fc.backward_input(ctx, saved.d_h_pre, saved.fc_in);
  if (saved.fc_in.fp8 && (!fc.bias.value.defined() || saved.fc_in.bias_grad_done)) saved.d_h_pre = Tensor();
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
