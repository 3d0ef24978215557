#include "tessera/nn/linear.h"

#include "tessera/ops/elementwise.h"
#include "tessera/ops/gemm.h"

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
  if (master.defined()) cast(ctx, master, value);
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
}

Tensor Linear::forward(Context& ctx, const Tensor& x, Saved& saved) const {
  TESSERA_CHECK(x.dim() == 2 && x.size(1) == in_, "Linear ", weight.name, ": input must be [N, ", in_, "], got ",
                x.describe());
  Tensor y = Tensor::empty({x.size(0), out_}, weight.value.dtype(), ctx.device);
  gemm(ctx, x, weight.value, y, {.transpose_b = true}, bias.value);
  saved.x = x;
  return y;
}

Tensor Linear::backward_input(Context& ctx, const Tensor& dy, const Saved& saved) const {
  Tensor dx = Tensor::empty({saved.x.size(0), in_}, weight.value.dtype(), ctx.device);
  gemm(ctx, dy, weight.value, dx);  // dx = dy W
  return dx;
}

void Linear::backward_weight(Context& ctx, const Tensor& dy, const Saved& saved) {
  // dW += dy^T x and db += column sums of dy (one GEMM on CUDA, its epilogue sums the bias)
  linear_weight_grad(ctx, dy, saved.x, weight.grad, bias.grad);
}

void Linear::parameters(ParameterList& out) {
  out.push_back(&weight);
  if (bias.value.defined()) out.push_back(&bias);
}

}  // namespace tessera::nn
