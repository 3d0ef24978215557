// Shared by test_fp8_weight_transpose.cpp (CPU) and test_gpu_fp8_linear.cpp (CUDA): a small
// FP8 layer stack (RMSNorm -> SwiGLU MLP without bias through LayerNormMLP, then a Linear
// with a bias) trained for a few steps on ctx's device, with fp8.keep_weight_transpose on
// or off. Everything a step produces (outputs, input gradients, every weight gradient, the
// delayed-scaling state after each step) comes back on the host, so that the two settings
// can be compared bit for bit: the weight's transposed codes are either kept from the
// forward or re-cast in backward with the forward's scale, the same bytes either way.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "testing.h"
#include "tessera/nn/layernorm_mlp.h"
#include "tessera/nn/linear.h"
#include "tessera/nn/mlp.h"
#include "tessera/nn/norm.h"

namespace tessera::testing {

// The results of `steps` steps, in order: per step y, dx, the grads of all parameters and
// (delayed scaling) the state's tensors. `keep` sets Fp8Scaling::keep_weight_transpose.
inline std::vector<Tensor> run_fp8_stack(Context& ctx, const std::string& recipe_name, bool keep, int steps) {
  const int64_t n = 48, hidden = 64, ffn = 96, out = 80;
  nn::Norm norm("n", nn::NormKind::RMSNorm, hidden, 1e-5f, DType::BF16);
  nn::MLP mlp("m", hidden, ffn, nn::Activation::SwiGLU, false, DType::BF16);
  nn::Linear top("t", hidden, out, true, DType::BF16);
  nn::ParameterList params;
  norm.parameters(params);
  mlp.parameters(params);
  top.parameters(params);
  for (nn::Parameter* p : params) p->to(ctx.device);
  const fp8::Recipe recipe = fp8::Recipe::from_json({{"recipe", recipe_name}, {"keep_weight_transpose", keep}});
  auto scaling = std::make_shared<nn::Fp8Scaling>(ctx, recipe, 3);
  mlp.fc.use_fp8({scaling, 0});
  mlp.proj.use_fp8({scaling, 1});
  top.use_fp8({scaling, 2});
  nn::LayerNormMLP block(norm, mlp);
  std::vector<Tensor> results;
  for (int step = 0; step < steps; ++step) {
    // New weights each step (as an optimizer would make), the same for both settings.
    uint64_t seed = 100 * step + 1;
    for (nn::Parameter* p : params) {
      p->value.copy_from(random_tensor(p->value.shape(), p->value.dtype(), seed++, -0.3f, 0.3f).to(ctx.device));
      p->grad.fill_zero();
    }
    const Tensor x = random_tensor({n, hidden}, DType::BF16, 1000 + step, -2, 2).to(ctx.device);
    const Tensor dy = random_tensor({n, out}, DType::BF16, 2000 + step).to(ctx.device);
    nn::LayerNormMLP::Saved bs;
    nn::Linear::Saved ts;
    const Tensor h = block.forward(ctx, x, bs);
    const Tensor y = top.forward(ctx, h, ts);
    const Tensor dh = top.backward_input(ctx, dy, ts);
    top.backward_weight(ctx, dy, ts);
    const Tensor dx = block.backward_input(ctx, dh, bs.norm, bs.mlp);
    block.backward_weight(ctx, dh, bs.mlp);
    scaling->end_micro_batch(ctx);
    scaling->end_step(ctx);
    results.push_back(y.to(Device::cpu()));
    results.push_back(dx.to(Device::cpu()));
    for (nn::Parameter* p : params) results.push_back(p->grad.to(Device::cpu()));
    for (const auto& [name, t] : scaling->state_dict()) results.push_back(t.to(Device::cpu()));
  }
  return results;
}

}  // namespace tessera::testing
