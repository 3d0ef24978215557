#include "tessera/nn/linear.h"

#include "tessera/core/stream.h"
#include "tessera/ops/elementwise.h"
#include "tessera/ops/gemm.h"
#include "tessera/ops/quantize.h"

namespace tessera::nn {

Parameter::Parameter(std::string name_, const Shape& shape, DType dtype, bool decay, Device device)
    : name(std::move(name_)),
      value(Tensor::zeros(shape, dtype, device)),
      grad(Tensor::zeros(shape, master_dtype(dtype), device)),
      weight_decay(decay) {
  TESSERA_CHECK(dtype == DType::F32 || dtype == DType::F64 || dtype == DType::BF16, "Parameter ", name,
                ": compute dtype must be f32, f64 or bf16, got ", dtype_name(dtype));
  if (dtype != master_dtype(dtype)) master = Tensor::zeros(shape, master_dtype(dtype), device);
}

void Parameter::refresh_value(Context& ctx) {
  if (master.defined()) {
    own_value_memory();
    cast(ctx, master, value);
  }
  value_stale = false;
}

void Parameter::own_value_memory() {
  if (!value_memory_lent) return;
  value = Tensor::empty(value.shape(), value.dtype(), value.device());
  value_memory_lent = false;
}

bool Parameter::begin_grad_write(Context& ctx, bool can_overwrite) {
  if (!grad_unwritten) return false;
  grad_unwritten = false;
  if (can_overwrite) return true;
  StreamGuard on_stream(ctx);  // in order with the writer's ops
  grad.fill_zero();
  return false;
}

void Parameter::to(Device device) {
  value = value.to(device);
  grad = grad.to(device);
  if (master.defined()) master = master.to(device);
}

Linear::Linear(const std::string& name, int64_t in_features, int64_t out_features, bool has_bias, DType dtype,
               const ParallelContext& parallel)
    : weight(name + ".weight", {out_features, in_features}, dtype, true), in_(in_features), out_(out_features) {
  TESSERA_CHECK(parallel.tensor_size == 1, "Linear ", name, ": tensor parallelism is handled by dist/ layers");
  TESSERA_CHECK(in_features > 0 && out_features > 0, "Linear ", name, ": sizes must be positive, got ", in_features,
                " -> ", out_features);
  if (has_bias) bias = Parameter(name + ".bias", {out_features}, dtype, false);
  weight.grad_overwrite_ok = true;  // backward_weight is its only gradient writer
  // The bias too, until an FP8 recipe is bound (use_fp8): its casts sum the bias gradient
  // into bias.grad, adding.
  bias.grad_overwrite_ok = has_bias;
}

bool Linear::runs_fp8(const Tensor& x) const {
  return x.dim() == 2 && x.size(1) == in_ && runs_fp8(x.size(0), x.dtype());
}

bool Linear::runs_fp8(int64_t rows, DType dtype) const {
  // cuBLASLt's FP8 GEMMs want every dimension (K of each of the three GEMMs) a multiple of 16;
  // the CPU emulation follows the same rule so that both devices take the same path.
  return fp8_.scaling && dtype == DType::BF16 && weight.value.dtype() == DType::BF16 && rows % 16 == 0 && rows > 0 &&
         in_ % 16 == 0 && out_ % 16 == 0 && (!bias.value.defined() || bias.value.dtype() == DType::BF16);
}

Tensor Linear::forward(Context& ctx, const Tensor& x, Saved& saved) const {
  TESSERA_CHECK(x.dim() == 2 && x.size(1) == in_, "Linear ", weight.name, ": input must be [N, ", in_, "], got ",
                x.describe());
  if (runs_fp8(x)) {
    switch (fp8_.scaling->kind()) {
      case Fp8Scaling::Kind::Block: return forward_block(ctx, x, saved);
      case Fp8Scaling::Kind::Mxfp8: return forward_mx(ctx, x, saved);
      case Fp8Scaling::Kind::PerTensor: break;
    }
    return forward(ctx, fp8_.scaling->quantize(ctx, x, fp8_.layer, Fp8Scaling::kInput), saved);
  }
  saved.fp8 = false;
  Tensor y = Tensor::empty({x.size(0), out_}, weight.value.dtype(), ctx.device);
  gemm(ctx, x, weight.value, y, {.transpose_b = true}, bias.value);
  saved.x = x;
  return y;
}

Tensor Linear::forward(Context& ctx, const fp8::QuantizedTensor& x, Saved& saved) const {
  TESSERA_CHECK(x.data.defined() && x.data.dim() == 2 && x.cols() == in_, "Linear ", weight.name,
                ": FP8 input must be [N, ", in_, "], got ", x.data.describe());
  TESSERA_CHECK(runs_fp8(x.rows(), DType::BF16), "Linear ", weight.name,
                ": an FP8 input needs an FP8 binding, a BF16 weight and rows, in and out multiples of 16 (rows ",
                x.rows(), ", ", in_, " -> ", out_, ")");
  TESSERA_CHECK(fp8_.scaling->per_tensor(), "Linear ", weight.name, ": an input cast outside the layer needs a ",
                "per-tensor recipe, the binding's is \"", fp8_.scaling->recipe().name(), "\"");
  Tensor y = Tensor::empty({x.rows(), out_}, weight.value.dtype(), ctx.device);
  saved.fp8 = true;
  saved.kind = Fp8Scaling::Kind::PerTensor;
  saved.bias_grad_done = false;
  saved.x = Tensor();
  saved.x_fp8 = x;
  // Under gradient accumulation the step's first micro-batch casts W and the later ones reuse
  // its codes (fp8/weight_cache.h); they hold both copies anyway, so the saved ones stay.
  struct CastWeight {
    fp8::QuantizedTensor codes;
    Tensor scale;
  };
  const CastWeight w = fp8_.scaling->weight_cache()->get_or_make<CastWeight>(&weight, [&] {
    CastWeight made;
    made.codes = fp8_.scaling->quantize(ctx, weight.value, fp8_.layer, Fp8Scaling::kWeight, &made.scale);
    return made;
  });
  saved.w_fp8 = w.codes;
  saved.w_scale = w.scale;
  fp8::Fp8GemmOptions options;
  options.fast_accumulate = true;  // forward only, as Transformer Engine does
  options.bias = bias.value;
  fp8::fp8_gemm(ctx, saved.x_fp8, false, saved.w_fp8, true, y, options);  // y = x W^T + b
  // The backward reads only the transposed copies (dx = dy W: W^T from w.data_t; dW = dy^T x:
  // x^T from x.data_t), so the row-wise ones go now instead of living until the backward:
  // N x in + out x in bytes per layer (docs/fp8.md, "Memory"). The GEMM queued above still
  // reads them: their blocks serve later work on the same stream, as every temporary does.
  saved.x_fp8.data = Tensor();
  saved.w_fp8.data = Tensor();
  // Without keep_weight_transpose W^T goes too (out x in bytes per layer, held until the
  // backward otherwise): backward_input re-casts it with w_scale. With it, the scale goes.
  if (keep_weight_transpose() || weights_cached()) saved.w_scale = Tensor();
  else saved.w_fp8 = fp8::QuantizedTensor();
  return y;
}

Tensor Linear::forward_block(Context& ctx, const Tensor& x, Saved& saved) const {
  Tensor y = Tensor::empty({x.size(0), out_}, weight.value.dtype(), ctx.device);
  saved.fp8 = true;
  saved.kind = Fp8Scaling::Kind::Block;
  saved.x = Tensor();
  saved.x_block = fp8_.scaling->quantize_block(ctx, x, fp8_.layer, Fp8Scaling::kInput);          // 1x128
  saved.w_block = fp8_.scaling->weight_cache()->get_or_make<fp8::BlockQuantizedTensor>(&weight, [&] {
    return fp8_.scaling->quantize_block(ctx, weight.value, fp8_.layer, Fp8Scaling::kWeight);  // 128x128
  });
  fp8::Fp8GemmOptions options;
  options.bias = bias.value;
  fp8::fp8_gemm_blockwise(ctx, saved.x_block, false, saved.w_block, true, y, options);  // y = x W^T + b
  // As the per-tensor path: the backward reads x^T (column-wise blocks) and W^T only.
  for (fp8::BlockQuantizedTensor* q : {&saved.x_block, &saved.w_block})
    q->data = q->scale_inv = q->gemm_scale_inv = Tensor();
  if (!keep_weight_transpose() && !weights_cached()) saved.w_block = fp8::BlockQuantizedTensor();  // re-cast in backward_input
  return y;
}

Tensor Linear::forward_mx(Context& ctx, const Tensor& x, Saved& saved) const {
  Tensor y = Tensor::empty({x.size(0), out_}, weight.value.dtype(), ctx.device);
  saved.fp8 = true;
  saved.kind = Fp8Scaling::Kind::Mxfp8;
  saved.x = Tensor();
  saved.x_mx = fp8_.scaling->quantize_mx(ctx, x, fp8_.layer, Fp8Scaling::kInput);
  saved.w_mx = fp8_.scaling->weight_cache()->get_or_make<fp8::MxQuantizedTensor>(
      &weight, [&] { return fp8_.scaling->quantize_mx(ctx, weight.value, fp8_.layer, Fp8Scaling::kWeight); });
  fp8::Fp8GemmOptions options;
  options.bias = bias.value;
  fp8::mxfp8_gemm_emulated(ctx, saved.x_mx, false, saved.w_mx, true, y, options);  // y = x W^T + b
  for (fp8::MxQuantizedTensor* q : {&saved.x_mx, &saved.w_mx}) q->data = q->scales = Tensor();
  if (!keep_weight_transpose() && !weights_cached()) saved.w_mx = fp8::MxQuantizedTensor();  // re-cast in backward_input
  return y;
}

fp8::QuantizedTensor Linear::weight_t(Context& ctx, const Saved& saved) const {
  if (saved.w_fp8.data_t.defined()) return saved.w_fp8;
  TESSERA_CHECK(saved.w_scale.defined(), "Linear ", weight.name, ": backward_input needs an FP8 forward first");
  // The weight is unchanged since the forward (the optimizer steps after the backward) and
  // so is w_scale (delayed scaling's state changes in end_step only; current scaling's is the
  // forward's own tensor): the cast gives the forward's codes and scale_inv, bit for bit. It
  // writes no amax (the forward recorded the weight's), and no row-wise copy.
  return fp8::quantize_transposed(ctx, weight.value, saved.w_scale, fp8_.scaling->dtype(Fp8Scaling::kWeight));
}

fp8::BlockQuantizedTensor Linear::weight_t_block(Context& ctx, const Saved& saved) const {
  if (saved.w_block.data_t.defined()) return saved.w_block;
  // The block cast has no state: the same weight gives the same tiles and scales.
  fp8::BlockQuantizedTensor w = fp8_.scaling->quantize_block(ctx, weight.value, fp8_.layer, Fp8Scaling::kWeight);
  w.data = w.scale_inv = w.gemm_scale_inv = Tensor();
  return w;
}

fp8::MxQuantizedTensor Linear::weight_t_mx(Context& ctx, const Saved& saved) const {
  if (saved.w_mx.data_t.defined()) return saved.w_mx;
  fp8::MxQuantizedTensor w = fp8_.scaling->quantize_mx(ctx, weight.value, fp8_.layer, Fp8Scaling::kWeight);
  w.data = w.scales = Tensor();
  return w;
}

Tensor Linear::backward_input(Context& ctx, const Tensor& dy, const Saved& saved) const {
  if (saved.fp8 && saved.kind == Fp8Scaling::Kind::Block) {
    saved.dy_block = fp8_.scaling->quantize_block(ctx, dy, fp8_.layer, Fp8Scaling::kGradOutput);
    Tensor dx = Tensor::empty({dy.size(0), in_}, weight.value.dtype(), ctx.device);
    fp8::fp8_gemm_blockwise(ctx, saved.dy_block, false, weight_t_block(ctx, saved), false, dx);  // dx = dy W
    saved.dy_block.data = saved.dy_block.scale_inv = saved.dy_block.gemm_scale_inv = Tensor();
    return dx;
  }
  if (saved.fp8 && saved.kind == Fp8Scaling::Kind::Mxfp8) {
    saved.dy_mx = fp8_.scaling->quantize_mx(ctx, dy, fp8_.layer, Fp8Scaling::kGradOutput);
    Tensor dx = Tensor::empty({dy.size(0), in_}, weight.value.dtype(), ctx.device);
    fp8::mxfp8_gemm_emulated(ctx, saved.dy_mx, false, weight_t_mx(ctx, saved), false, dx);  // dx = dy W
    saved.dy_mx.data = saved.dy_mx.scales = Tensor();
    return dx;
  }
  // Per-tensor: dy cast here. With a bias its gradient comes out of the same cast (on CUDA
  // one read of dy gives both FP8 copies and the column sums), not from a second read of the
  // BF16 dy in backward_weight; the scaling is chosen as in Fp8Scaling::quantize.
  if (saved.fp8 && bias.value.defined()) {
    Tensor dbias = bias.grad;  // the same storage: the gradient accumulates into bias.grad
    const DType fp8 = fp8_.scaling->dtype(Fp8Scaling::kGradOutput);
    const fp8::QuantizedTensor dy_fp8 = fp8_.scaling->cast_with(
        ctx, fp8_.layer, Fp8Scaling::kGradOutput, [&](Tensor& dy_amax) { amax(ctx, dy, dy_amax); },
        [&](const Tensor& scale, Tensor* dy_amax) {
          return fp8::quantize_with_transpose_and_bias_grad(ctx, dy, scale, fp8, dbias, dy_amax);
        });
    Tensor dx = backward_input(ctx, dy_fp8, saved);
    saved.bias_grad_done = true;
    return dx;
  }
  if (saved.fp8) return backward_input(ctx, fp8_.scaling->quantize(ctx, dy, fp8_.layer, Fp8Scaling::kGradOutput), saved);
  Tensor dx = Tensor::empty({dy.size(0), in_}, weight.value.dtype(), ctx.device);  // saved.x may be gone (MLP)
  gemm(ctx, dy, weight.value, dx);  // dx = dy W
  return dx;
}

Tensor Linear::backward_input(Context& ctx, const fp8::QuantizedTensor& dy, const Saved& saved) const {
  TESSERA_CHECK(saved.fp8 && saved.kind == Fp8Scaling::Kind::PerTensor, "Linear ", weight.name,
                ": an FP8 output gradient needs a forward that ran in per-tensor FP8");
  TESSERA_CHECK(dy.data.defined() && dy.data_t.defined() && dy.data.dim() == 2 && dy.cols() == out_ &&
                    dy.rows() == saved.x_fp8.rows(),
                "Linear ", weight.name, ": FP8 output gradient must be [", saved.x_fp8.rows(), ", ", out_,
                "] with both copies, got ", dy.data.describe());
  saved.dy_fp8 = dy;
  Tensor dx = Tensor::empty({dy.rows(), in_}, weight.value.dtype(), ctx.device);
  fp8::fp8_gemm(ctx, saved.dy_fp8, false, weight_t(ctx, saved), false, dx);  // dx = dy W
  saved.dy_fp8.data = Tensor();  // backward_weight reads dy^T (data_t) only
  return dx;
}

void Linear::backward_weight(Context& ctx, const Tensor& dy, const Saved& saved) {
  // The first gradient of a step overwrites (beta 0) what zero_grad left unwritten. With no
  // rows there is nothing to sum, so a zero gradient is written instead.
  // (The FP8 paths may pass no dy: they read its saved cast.)
  const bool overwrite = weight.begin_grad_write(ctx, !dy.defined() || dy.size(0) > 0);
  const float beta = overwrite ? 0.0f : 1.0f;  // dW (+)= dy^T x, into the FP32 master gradient
  if (saved.fp8 && saved.kind != Fp8Scaling::Kind::PerTensor) {
    fp8::Fp8GemmOptions options;
    options.beta = beta;
    if (saved.kind == Fp8Scaling::Kind::Block) {
      TESSERA_CHECK(saved.dy_block.data_t.defined(), "Linear ", weight.name,
                    ": backward_weight needs backward_input first");
      fp8::fp8_gemm_blockwise(ctx, saved.dy_block, true, saved.x_block, false, weight.grad, options);
      saved.dy_block = fp8::BlockQuantizedTensor();
    } else {
      TESSERA_CHECK(saved.dy_mx.data_t.defined(), "Linear ", weight.name, ": backward_weight needs backward_input first");
      fp8::mxfp8_gemm_emulated(ctx, saved.dy_mx, true, saved.x_mx, false, weight.grad, options);
      saved.dy_mx = fp8::MxQuantizedTensor();
    }
    if (bias.value.defined()) {
      bias.materialize_grad(ctx);
      bias_grad(ctx, dy, bias.grad);
    }
    return;
  }
  if (saved.fp8) {
    TESSERA_CHECK(saved.dy_fp8.data_t.defined(), "Linear ", weight.name, ": backward_weight needs backward_input first");
    fp8::Fp8GemmOptions options;
    options.beta = beta;
    fp8::fp8_gemm(ctx, saved.dy_fp8, true, saved.x_fp8, false, weight.grad, options);
    // Unless dy's cast summed it already (backward_input(Tensor)): then dy is not read here.
    if (bias.value.defined() && !saved.bias_grad_done) {
      bias.materialize_grad(ctx);
      bias_grad(ctx, dy, bias.grad);
    }
    saved.bias_grad_done = false;
    saved.dy_fp8 = fp8::QuantizedTensor();
    return;
  }
  // dW (+)= dy^T x and db (+)= column sums of dy (one GEMM on CUDA, its epilogue sums the bias)
  const bool overwrite_bias = bias.value.defined() && bias.begin_grad_write(ctx, dy.size(0) > 0);
  linear_weight_grad(ctx, dy, saved.x, weight.grad, bias.grad, /*accumulate_weight=*/!overwrite,
                     /*accumulate_bias=*/!overwrite_bias);
}

void Linear::parameters(ParameterList& out) {
  out.push_back(&weight);
  if (bias.value.defined()) out.push_back(&bias);
}

}  // namespace tessera::nn
