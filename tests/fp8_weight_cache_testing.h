// The checks of fp8.cache_weights (fp8/weight_cache.h) that run on either device
// (test_fp8_weight_cache on the CPU, test_gpu_fp8_weight_cache on the GPU): training with
// gradient accumulation gives the same bits with the cache as without, and a GroupedMLP
// caches every expert, also one the first micro-batch sent no row to.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "tessera/fp8/device_scaling.h"
#include "tessera/fp8/weight_cache.h"
#include "tessera/models/fp8_model.h"
#include "tessera/nn/moe.h"
#include "model_testing.h"
#include "moe_testing.h"
#include "testing.h"

namespace tessera::testing {

// Two optimizer steps of three micro-batches each (different tokens each), Adam, as the
// trainer runs them on ctx's device; the losses, every parameter and the FP8 state at the end.
struct AccumulationRun {
  std::vector<double> losses;
  std::vector<Tensor> finals;
  int64_t hits = 0, weights = 0;
};

inline AccumulationRun train_with_accumulation(Context& ctx, const models::ModelConfig& config,
                                               const std::string& recipe_name, bool cache_weights) {
  models::TransformerLM model(config, DType::BF16);
  if (ctx.device.is_cuda()) model.to(ctx.device);
  model.init(ctx, 7);
  const fp8::Recipe recipe = fp8::Recipe::from_json({{"recipe", recipe_name}, {"cache_weights", cache_weights}});
  const auto scaling = models::enable_fp8(ctx, model, recipe);
  train::OptimizerConfig oc;
  oc.lr = 1e-2;
  train::Optimizer optimizer(model.parameters(), oc);
  AccumulationRun run;
  constexpr int kMicro = 3;
  for (int step = 0; step < 2; ++step) {
    model.zero_grad();
    scaling->begin_step(kMicro);
    for (int micro = 0; micro < kMicro; ++micro) {
      const uint64_t seed = 100 + 10 * static_cast<uint64_t>(step) + static_cast<uint64_t>(micro);
      const Tensor inputs = random_ids({2, 16}, config.vocab_size, seed).to(ctx.device);
      const Tensor targets = random_ids({2, 16}, config.vocab_size, seed + 1000).to(ctx.device);
      run.losses.push_back(model.forward_backward(ctx, inputs, targets, 1.0f / kMicro));
      scaling->end_micro_batch(ctx);
    }
    optimizer.step(ctx, oc.lr);
    scaling->end_step(ctx);
  }
  for (const Tensor& t : parameter_state(model)) run.finals.push_back(t.defined() ? t.to(Device::cpu()) : t);
  for (const auto& [name, t] : scaling->state_dict()) run.finals.push_back(t.to(Device::cpu()));
  run.hits = scaling->weight_cache()->hits();
  // The FP8 weights of a layer: QKV, attention output and the MLP's two (Llama) or the
  // experts' two GroupedLinears (Mixtral).
  run.weights = 4 * static_cast<int64_t>(model.layers.size());
  return run;
}

// Every recipe, cached against not: the same bits, and every FP8 weight served from the
// cache in the two later micro-batches of both steps.
inline void expect_cache_changes_no_bit(Context& ctx, const models::ModelConfig& config) {
  for (const char* recipe : {"delayed", "current", "block", "mxfp8"}) {
    SCOPED_TRACE(std::string(config.architecture) + " " + recipe);
    const AccumulationRun cached = train_with_accumulation(ctx, config, recipe, true);
    const AccumulationRun plain = train_with_accumulation(ctx, config, recipe, false);
    expect_identical_runs({cached.losses, plain.losses}, {cached.finals, plain.finals});
    EXPECT_EQ(cached.hits, 2 * 2 * cached.weights);
    EXPECT_EQ(plain.hits, 0);
  }
}

// Micro-batch 1 sends no row to expert 1, micro-batch 2 sends it most: its cached codes must
// exist and be those an uncached cast makes. Both micro-batches' outputs, gradients and (for
// "delayed") the amax history, with the cache against without.
inline void expect_experts_cached_whatever_the_splits(Context& ctx) {
  const int64_t experts = 3, hidden = 32, ffn = 48;
  const std::vector<std::vector<int64_t>> splits = {{16, 0, 16}, {4, 24, 4}};
  for (const char* recipe : {"current", "delayed"}) {
    SCOPED_TRACE(recipe);
    std::vector<std::vector<Tensor>> outputs(2);
    for (int cached = 0; cached < 2; ++cached) {
      nn::GroupedMLP mlp("m", experts, hidden, ffn, DType::BF16);
      mlp.fc.weight.to(ctx.device);
      mlp.proj.weight.to(ctx.device);
      mlp.fc.weight.value.copy_from(random_tensor(mlp.fc.weight.value.shape(), DType::BF16, 3, -0.3f, 0.3f));
      mlp.proj.weight.value.copy_from(random_tensor(mlp.proj.weight.value.shape(), DType::BF16, 4, -0.3f, 0.3f));
      MoEFp8Options o;
      auto cache = std::make_shared<fp8::WeightCache>();
      o.weight_cache = cache;
      std::shared_ptr<fp8::DeviceDelayedScaling> state;
      if (std::string(recipe) == "delayed") {
        state = std::make_shared<fp8::DeviceDelayedScaling>(ctx, fp8::DelayedScalingConfig{}, mlp.delayed_roles());
        o.delayed = state;
      }
      mlp.use_fp8(o);
      if (cached) cache->open();
      for (size_t m = 0; m < splits.size(); ++m) {
        const Tensor x = rows_input(32, hidden, splits[m], 10 + m).to(ctx.device);
        const Tensor prob = random_tensor({32}, DType::BF16, 20 + m, 0.1f, 0.9f).to(ctx.device);
        const Tensor dy = rows_input(32, hidden, splits[m], 30 + m).to(ctx.device);
        const MlpRun r = run_mlp(mlp, ctx, x, prob, dy, splits[m]);
        for (const Tensor* t : {&r.y, &r.dx, &r.d_scale, &r.dfc, &r.dproj}) outputs[cached].push_back(*t);
        if (state) state->record(ctx);
      }
      if (state) outputs[cached].push_back(state->history().to(Device::cpu()));
      EXPECT_EQ(cache->hits(), cached ? 2 : 0);  // fc and proj in the second micro-batch
    }
    ASSERT_EQ(outputs[0].size(), outputs[1].size());
    for (size_t i = 0; i < outputs[0].size(); ++i) EXPECT_TRUE(same_bits(outputs[0][i], outputs[1][i])) << i;
  }
}

}  // namespace tessera::testing
