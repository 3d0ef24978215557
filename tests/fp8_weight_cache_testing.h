// The checks of fp8.cache_weights (fp8/weight_cache.h) that run on either device
// (test_fp8_weight_cache on the CPU, test_gpu_fp8_weight_cache on the GPU): training with
// gradient accumulation gives the same bits with the cache as without, and a GroupedMLP
// caches every expert, also one the first micro-batch sent no row to.
#pragma once

#include <algorithm>
#include <cmath>
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
                                               const std::string& recipe_name, bool cache_weights,
                                               bool defer_expert_wgrad = false) {
  models::TransformerLM model(config, DType::BF16);
  if (ctx.device.is_cuda()) model.to(ctx.device);
  model.init(ctx, 7);
  const fp8::Recipe recipe = fp8::Recipe::from_json(
      {{"recipe", recipe_name}, {"cache_weights", cache_weights}, {"defer_expert_wgrad", defer_expert_wgrad}});
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

// A GroupedMLP on ctx's device with the same random BF16 weights on every call.
inline std::unique_ptr<nn::GroupedMLP> seeded_mlp(Context& ctx, int64_t experts, int64_t hidden, int64_t ffn) {
  auto mlp = std::make_unique<nn::GroupedMLP>("m", experts, hidden, ffn, DType::BF16);
  for (nn::Parameter* p : {&mlp->fc.weight, &mlp->proj.weight}) p->to(ctx.device);
  mlp->fc.weight.value.copy_from(random_tensor(mlp->fc.weight.value.shape(), DType::BF16, 3, -0.3f, 0.3f));
  mlp->proj.weight.value.copy_from(random_tensor(mlp->proj.weight.value.shape(), DType::BF16, 4, -0.3f, 0.3f));
  return mlp;
}

// seeded_mlp in FP8 with a weight cache of its own and, for delayed scaling, a delayed state
// of its own (null for current scaling).
struct CachedFp8Mlp {
  std::unique_ptr<nn::GroupedMLP> mlp;
  std::shared_ptr<fp8::WeightCache> cache = std::make_shared<fp8::WeightCache>();
  std::shared_ptr<fp8::DeviceDelayedScaling> state;
};

inline CachedFp8Mlp cached_fp8_mlp(Context& ctx, int64_t experts, int64_t hidden, int64_t ffn, bool delayed,
                                   bool defer_weight_grad = false) {
  CachedFp8Mlp m;
  m.mlp = seeded_mlp(ctx, experts, hidden, ffn);
  MoEFp8Options o;
  o.weight_cache = m.cache;
  o.defer_weight_grad = defer_weight_grad;
  if (delayed) {
    m.state = std::make_shared<fp8::DeviceDelayedScaling>(ctx, fp8::DelayedScalingConfig{}, m.mlp->delayed_roles());
    o.delayed = m.state;
  }
  m.mlp->use_fp8(o);
  return m;
}

// The micro-batch's random inputs: x and dy [rows, hidden] by `splits`, the probabilities.
struct MicroBatch {
  Tensor x, prob, dy;
};

inline MicroBatch random_micro_batch(Context& ctx, int64_t rows, int64_t hidden, const std::vector<int64_t>& splits,
                                     uint64_t seed) {
  return {rows_input(rows, hidden, splits, 10 + seed).to(ctx.device),
          random_tensor({rows}, DType::BF16, 20 + seed, 0.1f, 0.9f).to(ctx.device),
          rows_input(rows, hidden, splits, 30 + seed).to(ctx.device)};
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
      const CachedFp8Mlp m = cached_fp8_mlp(ctx, experts, hidden, ffn, std::string(recipe) == "delayed");
      if (cached) m.cache->open();
      for (size_t i = 0; i < splits.size(); ++i) {
        const MicroBatch b = random_micro_batch(ctx, 32, hidden, splits[i], i);
        const MlpRun r = run_mlp(*m.mlp, ctx, b.x, b.prob, b.dy, splits[i]);
        for (const Tensor* t : {&r.y, &r.dx, &r.d_scale, &r.dfc, &r.dproj}) outputs[cached].push_back(*t);
        if (m.state) m.state->record(ctx);
      }
      if (m.state) outputs[cached].push_back(m.state->history().to(Device::cpu()));
      EXPECT_EQ(m.cache->hits(), cached ? 2 : 0);  // fc and proj in the second micro-batch
    }
    ASSERT_EQ(outputs[0].size(), outputs[1].size());
    for (size_t i = 0; i < outputs[0].size(); ++i) EXPECT_TRUE(same_bits(outputs[0][i], outputs[1][i])) << i;
  }
}

// A cache opened only to serve primed casts (keep_new false: how fp8.cast_in_optimizer opens
// it in a step without them, the first or one after a resume or a rewind) keeps nothing, but
// a cast made there is of every expert: an expert without rows gets its weight amax recorded,
// as the optimizer's casts record it. The outputs and gradients are the uncached cast's bits
// (on the GPU W^T is then not held from the forward to the backward but cast again there, as
// uncached).
inline void expect_a_serving_cache_casts_every_expert(Context& ctx) {
  const int64_t experts = 3, hidden = 32, ffn = 48;
  const std::vector<int64_t> splits = {16, 0, 16};
  std::vector<std::vector<Tensor>> outputs(2);
  std::vector<std::vector<double>> pending(2);
  std::vector<int64_t> weight_slots;  // fc's, then proj's, per expert
  for (int serving = 0; serving < 2; ++serving) {
    const CachedFp8Mlp m = cached_fp8_mlp(ctx, experts, hidden, ffn, /*delayed=*/true);
    if (serving) m.cache->open(/*keep_new=*/false, /*serve_once=*/true);
    const MicroBatch b = random_micro_batch(ctx, 32, hidden, splits, 0);
    const MlpRun r = run_mlp(*m.mlp, ctx, b.x, b.prob, b.dy, splits);
    for (const Tensor* t : {&r.y, &r.dx, &r.d_scale, &r.dfc, &r.dproj}) outputs[serving].push_back(*t);
    EXPECT_EQ(m.cache->size(), 0);
    EXPECT_EQ(m.cache->hits(), 0);
    pending[serving] = m.state->pending_amaxes().to(Device::cpu()).to_doubles();
    weight_slots.clear();
    for (const nn::GroupedLinear* linear : {&m.mlp->fc, &m.mlp->proj})
      for (int64_t e = 0; e < experts; ++e)
        weight_slots.push_back(linear->fp8_options()->delayed_base + MoEFp8Options::kDelayedWeight + e);
  }
  ASSERT_EQ(outputs[0].size(), outputs[1].size());
  for (size_t i = 0; i < outputs[0].size(); ++i) EXPECT_TRUE(same_bits(outputs[0][i], outputs[1][i])) << i;
  for (size_t i = 0; i < weight_slots.size(); ++i) {
    const size_t slot = static_cast<size_t>(weight_slots[i]);
    const bool without_rows = i % experts == 1;
    SCOPED_TRACE(::testing::Message() << "weight slot " << slot);
    EXPECT_GT(pending[1][slot], 0.0);
    if (without_rows) EXPECT_EQ(pending[0][slot], 0.0);  // the uncached cast skips the expert
    else EXPECT_EQ(pending[0][slot], pending[1][slot]);
  }
}

// Largest |a - b| over the largest |b| of two tensors of one shape (on any device).
inline double max_relative_difference(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = a.to(Device::cpu()).to_doubles(), y = b.to(Device::cpu()).to_doubles();
  double diff = 0, scale = 1e-30;
  for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
    diff = std::max(diff, std::abs(x[i] - y[i]));
    scale = std::max(scale, std::abs(y[i]));
  }
  return diff / scale;
}

// fp8.defer_expert_wgrad: the experts' weight gradients computed once per step over the
// micro-batches' rows side by side (one GEMM per expert) against one GEMM per micro-batch
// adding into the FP32 gradient. The splits change between micro-batches and leave an expert
// empty in one of them. The outputs and dx are the same bits (the deferral touches the
// weight gradients only), the gradients agree to FP32 rounding (another summation order),
// nothing is computed before the flush, and the flush leaves nothing behind. Tolerance (max
// |difference| over max |gradient|): the CPU reference sums in FP32 (1e-5 is FP32 rounding);
// cuBLASLt's FP8 GEMMs on Hopper accumulate in the tensor cores with fewer bits between
// their FP32 promotions, so one GEMM over a K of all micro-batches and three added in FP32
// differ by more (2e-4 measured on the H200, 2026-12-02): 1e-3 there.
inline void expect_deferred_expert_wgrad_matches(Context& ctx) {
  const double tolerance = ctx.device.is_cuda() ? 1e-3 : 1e-5;
  const int64_t experts = 3, hidden = 32, ffn = 48, rows = 48;
  const std::vector<std::vector<int64_t>> splits = {{16, 0, 32}, {5, 24, 19}, {40, 8, 0}};
  std::vector<std::vector<Tensor>> outputs(2), grads(2);
  for (int defer = 0; defer < 2; ++defer) {
    const CachedFp8Mlp owned = cached_fp8_mlp(ctx, experts, hidden, ffn, /*delayed=*/true, /*defer_weight_grad=*/defer);
    nn::GroupedMLP& mlp = *owned.mlp;
    fp8::WeightCache* cache = owned.cache.get();
    for (nn::Parameter* p : {&mlp.fc.weight, &mlp.proj.weight}) p->grad_unwritten = true;  // as zero_grad
    cache->open();
    for (size_t m = 0; m < splits.size(); ++m) {
      const MicroBatch b = random_micro_batch(ctx, rows, hidden, splits[m], m);
      nn::GroupedMLP::Saved saved;
      outputs[defer].push_back(mlp.forward(ctx, b.x, b.prob, splits[m], saved).to(Device::cpu()));
      outputs[defer].push_back(mlp.backward_input(ctx, b.dy, saved).to(Device::cpu()));
      mlp.backward_weight(ctx, b.dy, saved);
      owned.state->record(ctx);
    }
    // Deferred: nothing written yet (the gradients still stand for zeros).
    EXPECT_EQ(mlp.fc.weight.grad_unwritten, defer == 1);
    EXPECT_EQ(cache->has_deferred(), defer == 1);
    cache->flush(ctx);
    cache->close();
    EXPECT_FALSE(mlp.fc.weight.grad_unwritten);
    grads[defer] = {mlp.fc.weight.grad.to(Device::cpu()), mlp.proj.weight.grad.to(Device::cpu())};
  }
  ASSERT_EQ(outputs[0].size(), outputs[1].size());
  for (size_t i = 0; i < outputs[0].size(); ++i) EXPECT_TRUE(same_bits(outputs[0][i], outputs[1][i])) << i;
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_LT(max_relative_difference(grads[1][i], grads[0][i]), tolerance) << "gradient " << i;
    EXPECT_GT(max_relative_difference(grads[0][i], Tensor::zeros(grads[0][i].shape(), grads[0][i].dtype())), 0.5);
  }
}

// A tiny Mixtral trained with the deferred expert gradients: the first step's losses are
// those of the plain run (the same weights), and the runs stay close after the updates
// (weights within 1e-4 of their largest on the CPU; 5e-3 on the GPU, where the gradients
// differ as above and Adam's normalised step carries that into small weights: 6e-4 measured).
inline void expect_deferred_expert_wgrad_trains_alike(Context& ctx) {
  const double tolerance = ctx.device.is_cuda() ? 5e-3 : 1e-4;
  const models::ModelConfig config = tiny_mixtral_config();
  const AccumulationRun deferred = train_with_accumulation(ctx, config, "delayed", true, true);
  const AccumulationRun plain = train_with_accumulation(ctx, config, "delayed", true, false);
  ASSERT_EQ(deferred.losses.size(), plain.losses.size());
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(deferred.losses[i], plain.losses[i]) << i;
  for (size_t i = 3; i < plain.losses.size(); ++i) EXPECT_NEAR(deferred.losses[i], plain.losses[i], 1e-3) << i;
  ASSERT_EQ(deferred.finals.size(), plain.finals.size());
  int differ = 0;  // the experts' gradients and weights, in their last bits: the deferral ran
  for (size_t i = 0; i < plain.finals.size(); ++i) {
    if (!plain.finals[i].defined()) continue;
    differ += !same_bits(deferred.finals[i], plain.finals[i]);
    if (plain.finals[i].dtype() == DType::F32)
      EXPECT_LT(max_relative_difference(deferred.finals[i], plain.finals[i]), tolerance) << "tensor " << i;
  }
  EXPECT_GT(differ, 0);
}

}  // namespace tessera::testing
