// The checks of fp8.cast_in_optimizer (include/tessera/ops/moe.h, moe_fp8_adamw_cast_weights;
// nn::GroupedLinear::optimizer_update) that run on either device
// (test_fp8_cast_in_optimizer on the CPU, test_gpu_fp8_cast_in_optimizer on the GPU): the
// fused update gives adamw_step_multi's bits and the codes moe_fp8_quantize_weights makes of
// the new value, and a Mixtral trained with the casts in the optimizer gives the bits of the
// one that casts in its forward, while the primed casts really serve the forwards.
#pragma once

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "tessera/fp8/device_scaling.h"
#include "tessera/models/fp8_model.h"
#include "tessera/nn/moe.h"
#include "tessera/ops/elementwise.h"
#include "tessera/ops/moe.h"
#include "tessera/ops/optimizer.h"
#include "tessera/train/optimizer.h"
#include "model_testing.h"
#include "testing.h"

namespace tessera::testing {

// same_bits of tensors on any device.
inline bool same_bits_on_host(const Tensor& a, const Tensor& b) {
  return same_bits(a.defined() ? a.to(Device::cpu()) : a, b.defined() ? b.to(Device::cpu()) : b);
}

// One weight of E experts [N, K] with its FP32 master, moments, gradient (BF16 or F32) and
// BF16 value, random, on ctx's device: the same numbers on every call with the same seed.
struct ExpertWeightState {
  Tensor param, grad, exp_avg, exp_avg_sq, value;
};

inline ExpertWeightState random_expert_weight(Context& ctx, int64_t e, int64_t n, int64_t k, DType grad_dtype,
                                              uint64_t seed) {
  ExpertWeightState s;
  s.param = random_tensor({e * n, k}, DType::F32, seed, -0.5f, 0.5f).to(ctx.device);
  s.grad = random_tensor({e * n, k}, grad_dtype, seed + 1, -2.0f, 2.0f).to(ctx.device);
  s.exp_avg = random_tensor({e * n, k}, DType::F32, seed + 2, -0.1f, 0.1f).to(ctx.device);
  s.exp_avg_sq = random_tensor({e * n, k}, DType::F32, seed + 3, 0.0f, 0.1f).to(ctx.device);
  s.value = Tensor::empty({e * n, k}, DType::BF16, ctx.device);
  return s;
}

// moe_fp8_adamw_cast_weights against its definition on the same device: adamw_step_multi on
// the one tensor, then moe_fp8_quantize_weights of every expert's new value with a delayed
// state holding the same scales and pending amaxes. Partial 64 x 128 tiles (N = 72, K = 136),
// clipping on, both gradient dtypes and both FP8 formats; every output to the bit.
inline void expect_fused_update_matches_definition(Context& ctx) {
  const int64_t experts = 3, n = 72, k = 136;
  for (DType grad_dtype : {DType::F32, DType::BF16})
    for (fp8::Format format : {fp8::Format::Hybrid, fp8::Format::E4M3})
      for (double max_norm : {0.0, 1.0}) {
        SCOPED_TRACE(std::string(dtype_name(grad_dtype)) + (format == fp8::Format::E4M3 ? " e4m3" : " hybrid") +
                     " max_norm " + std::to_string(max_norm));
        // The delayed state of one GroupedLinear: scales and pending amaxes made non-trivial.
        fp8::DelayedScalingConfig dc;
        dc.format = format;
        auto state = std::make_shared<fp8::DeviceDelayedScaling>(ctx, dc, MoEFp8Options::delayed_roles(experts));
        const int64_t first = MoEFp8Options::kDelayedWeight;
        state->scales().slice(0, first, first + experts).copy_from(Tensor::from_floats({40.0f, 300.0f, 0.5f}, {3}));
        state->scale_invs().slice(0, first, first + experts)  // as the state's update keeps them: 1 / scale
            .copy_from(Tensor::from_floats({1.0f / 40.0f, 1.0f / 300.0f, 1.0f / 0.5f}, {3}));
        state->pending_amaxes().slice(0, first, first + experts).copy_from(Tensor::from_floats({0.0f, 0.7f, 0.01f}, {3}));
        MoEFp8Options o;
        o.format = format;
        o.delayed = state;
        const DType fp8 = o.forward_dtype();
        AdamWOptions adam;
        adam.lr = 1e-2f;
        adam.step = 3;
        Tensor norm = Tensor::from_floats({2.5f}, {1}).to(ctx.device);

        // The definition.
        ExpertWeightState a = random_expert_weight(ctx, experts, n, k, grad_dtype, 11);
        const Tensor pending_before = state->pending_amaxes().to(Device::cpu());
        AdamWTensorStep step{a.param, a.grad, a.exp_avg, a.exp_avg_sq, a.value, adam, 0.1f, norm, max_norm};
        adamw_step_one(ctx, step);
        const MoEFp8Weights want = moe_fp8_quantize_weights(ctx, a.value.reshape({experts, n, k}),
                                                            std::vector<int64_t>(experts, 1), [&] {
                                                              MoEFp8Options all = o;
                                                              all.keep_weight_transpose = true;
                                                              return all;
                                                            }());
        const Tensor pending_want = state->pending_amaxes().to(Device::cpu());

        // The fused update, from the same starting point.
        Tensor pending = state->pending_amaxes();
        pending.copy_from(pending_before.to(ctx.device));
        ExpertWeightState b = random_expert_weight(ctx, experts, n, k, grad_dtype, 11);
        MoEFp8WeightCast cast;
        cast.scale = state->scales().slice(0, first, first + experts);
        cast.amax = state->pending_amaxes().slice(0, first, first + experts);
        cast.data = Tensor::empty({experts, n, k}, fp8, ctx.device);
        cast.data_t = Tensor::empty({experts, k, n}, fp8, ctx.device);
        moe_fp8_adamw_cast_weights(ctx, b.param, b.grad, b.exp_avg, b.exp_avg_sq, b.value, adam, 0.1f, norm, max_norm,
                                   cast);
        EXPECT_TRUE(same_bits_on_host(a.param, b.param));
        EXPECT_TRUE(same_bits_on_host(a.exp_avg, b.exp_avg));
        EXPECT_TRUE(same_bits_on_host(a.exp_avg_sq, b.exp_avg_sq));
        EXPECT_TRUE(same_bits_on_host(a.value, b.value));
        EXPECT_TRUE(same_bits_on_host(pending_want, state->pending_amaxes()));
        for (int64_t e = 0; e < experts; ++e) {
          EXPECT_TRUE(same_bits_on_host(want.experts[e].data, cast.data.select(0, e))) << "expert " << e;
          EXPECT_TRUE(same_bits_on_host(want.experts[e].data_t, cast.data_t.select(0, e))) << "expert " << e;
        }
        // Without a value to write (GroupedLinear's call): the same update, codes and amaxes.
        pending.copy_from(pending_before.to(ctx.device));
        ExpertWeightState c = random_expert_weight(ctx, experts, n, k, grad_dtype, 11);
        MoEFp8WeightCast cast_c = cast;
        cast_c.data = Tensor::empty({experts, n, k}, fp8, ctx.device);
        cast_c.data_t = Tensor::empty({experts, k, n}, fp8, ctx.device);
        Tensor no_value;
        moe_fp8_adamw_cast_weights(ctx, c.param, c.grad, c.exp_avg, c.exp_avg_sq, no_value, adam, 0.1f, norm, max_norm,
                                   cast_c);
        EXPECT_FALSE(no_value.defined());
        EXPECT_TRUE(same_bits_on_host(a.param, c.param));
        EXPECT_TRUE(same_bits_on_host(a.exp_avg, c.exp_avg));
        EXPECT_TRUE(same_bits_on_host(a.exp_avg_sq, c.exp_avg_sq));
        EXPECT_TRUE(same_bits_on_host(pending_want, state->pending_amaxes()));
        EXPECT_TRUE(same_bits_on_host(cast.data, cast_c.data));
        EXPECT_TRUE(same_bits_on_host(cast.data_t, cast_c.data_t));
        // The casts as the GEMMs take them: the state's inverse scales.
        const MoEFp8Weights primed = moe_fp8_weights_from_cast(ctx, cast, o);
        for (int64_t e = 0; e < experts; ++e)
          EXPECT_TRUE(same_bits_on_host(primed.experts[e].scale_inv, want.experts[e].scale_inv)) << "expert " << e;
        // The update moved the weights (a test that can fail).
        EXPECT_FALSE(same_bits_on_host(b.param, random_expert_weight(ctx, experts, n, k, grad_dtype, 11).param));
      }
}

// Three optimizer steps of `micro` micro-batches of a tiny Mixtral under delayed scaling, as
// the trainer runs them (end_step before the optimizer), with the experts' casts made by the
// optimizer or by the forwards, then an evaluation's loss (a forward with no primed casts,
// which must read the BF16 expert weights the fused updates left stale); the losses, every
// parameter and the FP8 state at the end.
struct CastRun {
  std::vector<double> losses;
  std::vector<Tensor> finals;
  int64_t hits = 0;
  int64_t experts_without_tokens = 0;  // summed over the steps and layers
};

// `batch`: each micro-batch's [B, T] tokens; `resume_before`: the step before which the run
// goes on as one resumed from a checkpoint (or rewound) would: without primed casts, its FP8
// state loaded from a saved copy (so without the pending amaxes the update recorded); -1:
// never.
inline CastRun train_mixtral_casting(Context& ctx, int micro, bool cast_in_optimizer, const Shape& batch = {2, 16},
                                     int resume_before = -1) {
  const models::ModelConfig config = tiny_mixtral_config();
  models::TransformerLM model(config, DType::BF16);
  if (ctx.device.is_cuda()) model.to(ctx.device);
  model.init(ctx, 7);
  const fp8::Recipe recipe = fp8::Recipe::from_json({{"recipe", "delayed"}, {"cast_in_optimizer", cast_in_optimizer}});
  const auto scaling = models::enable_fp8(ctx, model, recipe);
  train::OptimizerConfig oc;
  oc.lr = 1e-2;
  oc.grad_clip = 0.5;  // clipping on: the fused update reads the norm too
  train::Optimizer optimizer(model.parameters(), oc);
  if (cast_in_optimizer) EXPECT_EQ(train::use_cast_in_optimizer(model, optimizer), 2 * config.num_layers);
  CastRun run;
  for (int step = 0; step < 3; ++step) {
    if (step == resume_before) {
      scaling->weight_cache()->drop_primed();
      scaling->load_state_dict(ctx, scaling->state_dict());
    }
    model.zero_grad();
    scaling->begin_step(micro);
    for (int m = 0; m < micro; ++m) {
      const uint64_t seed = 100 + 10 * static_cast<uint64_t>(step) + static_cast<uint64_t>(m);
      const Tensor inputs = random_ids(batch, config.vocab_size, seed).to(ctx.device);
      const Tensor targets = random_ids(batch, config.vocab_size, seed + 1000).to(ctx.device);
      run.losses.push_back(model.forward_backward(ctx, inputs, targets, 1.0f / static_cast<float>(micro)));
      scaling->end_micro_batch(ctx);
    }
    scaling->end_step(ctx);
    optimizer.step(ctx, oc.lr);
    for (const std::vector<int64_t>& loads : model.expert_loads())
      run.experts_without_tokens += std::count(loads.begin(), loads.end(), int64_t{0});
    model.update_expert_biases(ctx);  // resets the loads
  }
  for (nn::GroupedLinear* linear : model.expert_linears())
    EXPECT_EQ(linear->weight.value_stale, cast_in_optimizer) << linear->weight.name;
  scaling->weight_cache()->drop_primed();
  const Tensor inputs = random_ids({2, 16}, config.vocab_size, 900).to(ctx.device);
  const Tensor targets = random_ids({2, 16}, config.vocab_size, 901).to(ctx.device);
  run.losses.push_back(model.forward_loss(ctx, inputs, targets));
  for (nn::GroupedLinear* linear : model.expert_linears())
    EXPECT_FALSE(linear->weight.value_stale) << linear->weight.name << " after the evaluation";
  for (const Tensor& t : parameter_state(model)) run.finals.push_back(t.defined() ? t.to(Device::cpu()) : t);
  for (const auto& [name, t] : scaling->state_dict()) run.finals.push_back(t.to(Device::cpu()));
  run.hits = scaling->weight_cache()->hits();
  return run;
}

// How the stale BF16 copy gets written again after a cast_in_optimizer update: refreshed
// from the master (a forward without primed casts, an evaluation), by the plain multi-tensor
// update (the custom update taken away, as in a captured or overlapped step), or by the
// custom update's own fallback (FP8 switched off, so it runs the plain AdamW step).
enum class CopyRewrite { Refresh, PlainUpdate, FallbackUpdate };

// The codes a cast_in_optimizer update primes live in the memory of the BF16 copy it leaves
// stale, so they add none; whatever writes that copy again gives it memory of its own first:
// codes still held (as by a pending backward) keep their bits, and the copy gets the
// master's.
inline void expect_codes_live_in_the_stale_copy(Context& ctx, CopyRewrite rewrite) {
  const models::ModelConfig config = tiny_mixtral_config();
  models::TransformerLM model(config, DType::BF16);
  if (ctx.device.is_cuda()) model.to(ctx.device);
  model.init(ctx, 7);
  const auto scaling =
      models::enable_fp8(ctx, model, fp8::Recipe::from_json({{"recipe", "delayed"}, {"cast_in_optimizer", true}}));
  train::OptimizerConfig oc;
  oc.lr = 1e-2;
  train::Optimizer optimizer(model.parameters(), oc);
  train::use_cast_in_optimizer(model, optimizer);
  model.zero_grad();
  scaling->begin_step(1);
  const Tensor inputs = random_ids({2, 16}, config.vocab_size, 100).to(ctx.device);
  const Tensor targets = random_ids({2, 16}, config.vocab_size, 101).to(ctx.device);
  model.forward_backward(ctx, inputs, targets, 1.0f);
  scaling->end_micro_batch(ctx);
  scaling->end_step(ctx);
  optimizer.step(ctx, oc.lr);

  struct Held {
    nn::Parameter* weight;
    Tensor lent;
    MoEFp8Weights codes;
    std::vector<Tensor> bits;  // host copies of each expert's codes and transposed codes
  };
  std::vector<Held> held;
  fp8::WeightCache& cache = *scaling->weight_cache();
  cache.open(/*keep_new=*/false, /*serve_once=*/true);
  for (nn::GroupedLinear* linear : model.expert_linears()) {
    nn::Parameter& w = linear->weight;
    SCOPED_TRACE(w.name);
    ASSERT_TRUE(w.value_stale);
    ASSERT_TRUE(w.value_memory_lent);
    Held h{&w, w.value, cache.get_or_make<MoEFp8Weights>(&w, [] {
             ADD_FAILURE() << "no primed cast";
             return MoEFp8Weights();
           }), {}};
    ASSERT_FALSE(h.codes.experts.empty());
    for (const fp8::QuantizedTensor& e : h.codes.experts) {
      EXPECT_TRUE(e.data.shares_storage(h.lent) && e.data_t.shares_storage(h.lent));
      h.bits.push_back(e.data.clone().to(Device::cpu()));
      h.bits.push_back(e.data_t.clone().to(Device::cpu()));
    }
    held.push_back(std::move(h));
  }
  cache.close();

  switch (rewrite) {
    case CopyRewrite::Refresh:
      for (Held& h : held) h.weight->refresh_value_if_stale(ctx);
      break;
    case CopyRewrite::PlainUpdate:  // the same gradients again, through the multi-tensor pass
      for (Held& h : held) optimizer.set_custom_update(*h.weight, nullptr);
      optimizer.step(ctx, oc.lr);
      break;
    case CopyRewrite::FallbackUpdate:
      models::disable_fp8(model);
      optimizer.step(ctx, oc.lr);
      break;
  }
  for (Held& h : held) {
    nn::Parameter& w = *h.weight;
    SCOPED_TRACE(w.name);
    EXPECT_FALSE(w.value_stale || w.value_memory_lent);
    EXPECT_FALSE(w.value.shares_storage(h.lent));
    for (size_t e = 0; e < h.codes.experts.size(); ++e) {
      EXPECT_TRUE(same_bits_on_host(h.bits[2 * e], h.codes.experts[e].data)) << "expert " << e;
      EXPECT_TRUE(same_bits_on_host(h.bits[2 * e + 1], h.codes.experts[e].data_t)) << "expert " << e;
    }
    Tensor want = Tensor::empty(w.value.shape(), DType::BF16, ctx.device);
    cast(ctx, w.master, want);
    EXPECT_TRUE(same_bits_on_host(want, w.value));
  }
}

// With several micro-batches the forwards cast every expert once a step anyway (the weight
// cache): the casts in the optimizer give the same bits, and serve steps 2 and 3 (2 weights a
// layer, each micro-batch) where the plain run casts in their first micro-batch.
inline void expect_cast_in_optimizer_changes_no_bit(Context& ctx) {
  const int layers = static_cast<int>(tiny_mixtral_config().num_layers);
  const CastRun fused = train_mixtral_casting(ctx, 3, true);
  const CastRun plain = train_mixtral_casting(ctx, 3, false);
  expect_identical_runs({fused.losses, plain.losses}, {fused.finals, plain.finals});
  // Per step the plain run hits its cache in micro-batches 2 and 3 for 4 weights a layer;
  // the fused run also in micro-batch 1 of steps 2 and 3 for its 2 expert weights a layer.
  EXPECT_EQ(plain.hits, 3 * 2 * 4 * layers);
  EXPECT_EQ(fused.hits, plain.hits + 2 * 2 * layers);
}

// One micro-batch a step: the primed casts serve the one forward (the plain run casts there,
// the experts with tokens only). The same losses and weights; the amax history may differ
// only where an expert got no token (the optimizer records every expert's amax), which these
// batches never leave.
inline void expect_cast_in_optimizer_serves_single_micro_batch(Context& ctx) {
  const int layers = static_cast<int>(tiny_mixtral_config().num_layers);
  const CastRun fused = train_mixtral_casting(ctx, 1, true);
  const CastRun plain = train_mixtral_casting(ctx, 1, false);
  expect_identical_runs({fused.losses, plain.losses}, {fused.finals, plain.finals});
  EXPECT_EQ(plain.hits, 0);
  EXPECT_EQ(fused.hits, 2 * 2 * layers);
}

// A run that loses its primed casts (a resume from a checkpoint, a rewind) repeats the
// uninterrupted one to the bit, even with one micro-batch a step and experts left without
// tokens: its next forward casts every expert, recording every expert's amax, as the
// optimizer's casts would have. One token a micro-batch leaves 2 of the 4 experts without.
inline void expect_a_run_without_its_primed_casts_repeats_the_uninterrupted_one(Context& ctx) {
  const CastRun uninterrupted = train_mixtral_casting(ctx, 1, true, {1, 1});
  const CastRun resumed = train_mixtral_casting(ctx, 1, true, {1, 1}, /*resume_before=*/1);
  EXPECT_GT(resumed.experts_without_tokens, 0);  // what would tell the runs apart
  expect_identical_runs({uninterrupted.losses, resumed.losses}, {uninterrupted.finals, resumed.finals});
  EXPECT_EQ(resumed.hits, uninterrupted.hits - 2 * static_cast<int64_t>(tiny_mixtral_config().num_layers));
}

}  // namespace tessera::testing
