// Delayed scaling of the MoE experts on the CPU (tessera/ops/moe.h, MoEFp8Options::delayed):
// the casts read their scales from a DeviceDelayedScaling state and record the amax of what
// they cast into its pending slots. Checked: the recorded amaxes are those of x, h, dy,
// d_h_pre and each expert's weight (experts without rows record nothing); once the state
// holds the amaxes current scaling computes (step 3 on the same data), a delayed step gives
// the current-scaling step's bits; the fused SwiGLU backward cast is the backward then the cast; a tiny Mixtral bound to
// the delayed recipe trains, and its experts' state goes through the checkpoint dict.
#include <cmath>
#include <memory>

#include "tessera/fp8/device_scaling.h"
#include "tessera/fp8/recipe.h"
#include "tessera/models/fp8_model.h"
#include "tessera/models/transformer_lm.h"
#include "tessera/nn/moe.h"
#include "tessera/ops/moe.h"
#include "tessera/ops/quantize.h"
#include "model_testing.h"
#include "moe_testing.h"
#include "testing.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

float amax_of(const Tensor& x) {
  Context ctx = Context::cpu();
  Tensor a = Tensor::empty({1}, DType::F32);
  amax(ctx, x, a);
  return a.data<float>()[0];
}

struct Pair {
  nn::GroupedMLP current, delayed;
  std::shared_ptr<fp8::DeviceDelayedScaling> state;
};

std::unique_ptr<Pair> make_pair(Context& ctx, int64_t e, int64_t hidden, int64_t ffn, bool keep_wt, uint64_t seed) {
  auto p = std::unique_ptr<Pair>(new Pair{nn::GroupedMLP("m", e, hidden, ffn, DType::BF16),
                                          nn::GroupedMLP("m", e, hidden, ffn, DType::BF16), nullptr});
  const Tensor wfc = random_tensor(p->current.fc.weight.value.shape(), DType::BF16, seed, -0.3f, 0.3f);
  const Tensor wproj = random_tensor(p->current.proj.weight.value.shape(), DType::BF16, seed + 1, -0.3f, 0.3f);
  for (nn::GroupedMLP* m : {&p->current, &p->delayed}) {
    m->fc.weight.value.copy_from(wfc);
    m->proj.weight.value.copy_from(wproj);
  }
  MoEFp8Options o;
  o.keep_weight_transpose = keep_wt;
  p->current.use_fp8(o);
  // The latest amax only (see the test below for why).
  fp8::DelayedScalingConfig config;
  config.amax_compute = fp8::DelayedScalingConfig::AmaxCompute::MostRecent;
  p->state = std::make_shared<fp8::DeviceDelayedScaling>(ctx, config, p->delayed.delayed_roles());
  o.delayed = p->state;
  p->delayed.use_fp8(o);
  return p;
}

}  // namespace

TEST(MoeFp8Delayed, SlotsAndRoles) {
  nn::GroupedMLP mlp("m", 3, 16, 32, DType::BF16);
  EXPECT_EQ(mlp.delayed_slots(), 2 * (2 + 3));
  const std::vector<fp8::Role> roles = mlp.delayed_roles();
  ASSERT_EQ(static_cast<int64_t>(roles.size()), mlp.delayed_slots());
  for (int64_t base : {int64_t{0}, int64_t{5}}) {
    EXPECT_EQ(roles[static_cast<size_t>(base + MoEFp8Options::kDelayedInput)], fp8::Role::Forward);
    EXPECT_EQ(roles[static_cast<size_t>(base + MoEFp8Options::kDelayedGradOutput)], fp8::Role::Gradient);
    for (int64_t e = 0; e < 3; ++e)
      EXPECT_EQ(roles[static_cast<size_t>(base + MoEFp8Options::kDelayedWeight + e)], fp8::Role::Forward);
  }
  // A state too small for the layer is refused with a clear error.
  Context ctx = Context::cpu();
  MoEFp8Options o;
  o.delayed = std::make_shared<fp8::DeviceDelayedScaling>(ctx, fp8::DelayedScalingConfig{},
                                                          MoEFp8Options::delayed_roles(2));
  EXPECT_THROW(moe_fp8_quantize_weights(ctx, mlp.fc.weight3d(), {1, 1, 1}, o), Error);
}

TEST(MoeFp8Delayed, RecordsTheAmaxOfEveryCastAndMatchesCurrentScalingOnceTheHistoryHoldsIt) {
  Context ctx = Context::cpu();
  const int64_t e = 4, hidden = 32, ffn = 48, rows = 40;
  for (bool keep_wt : {false, true}) {
    for (const std::vector<int64_t>& splits : {std::vector<int64_t>{9, 0, 14, 13}, std::vector<int64_t>{0, 0, 40, 0}}) {
      auto p = make_pair(ctx, e, hidden, ffn, keep_wt, 41);
      const Tensor x = rows_input(rows, hidden, splits, 43);
      const Tensor prob = random_tensor({rows}, DType::BF16, 44, 0.2f, 1.0f);
      const Tensor dy = rows_input(rows, hidden, splits, 45);

      // Step 1 with the fresh state's scales of 1: the pending amaxes afterwards.
      (void)run_mlp(p->delayed, ctx, x, prob, dy, splits);
      const Tensor pending = p->state->pending_amaxes().clone();
      const int64_t proj0 = MoEFp8Options::delayed_slots(e);
      EXPECT_EQ(pending.item(MoEFp8Options::kDelayedInput), amax_of(x));
      EXPECT_EQ(pending.item(proj0 + MoEFp8Options::kDelayedGradOutput), amax_of(dy));
      const Tensor wfc = p->delayed.fc.weight3d(), wproj = p->delayed.proj.weight3d();
      for (int64_t i = 0; i < e; ++i) {
        const bool used = splits[static_cast<size_t>(i)] > 0;
        EXPECT_EQ(pending.item(MoEFp8Options::kDelayedWeight + i), used ? amax_of(wfc.select(0, i)) : 0.0f) << i;
        EXPECT_EQ(pending.item(proj0 + MoEFp8Options::kDelayedWeight + i), used ? amax_of(wproj.select(0, i)) : 0.0f)
            << i;
      }
      // h and d_h_pre: positive and finite (their exact values are what step 2 checks).
      EXPECT_GT(pending.item(proj0 + MoEFp8Options::kDelayedInput), 0.0);
      EXPECT_GT(pending.item(MoEFp8Options::kDelayedGradOutput), 0.0);

      // The amaxes of x, dy and the weights do not depend on any scale, so step 2 casts them
      // with current scaling's scales; h and d_h_pre come from those casts, so step 2 records
      // current scaling's amaxes for them too, and step 3 (the latest amax rule) casts every
      // tensor with current scaling's scale: the same bits everywhere.
      p->state->update(ctx);
      (void)run_mlp(p->delayed, ctx, x, prob, dy, splits);
      const Tensor pending2 = p->state->pending_amaxes().clone();
      p->state->update(ctx);
      const MlpRun d = run_mlp(p->delayed, ctx, x, prob, dy, splits), c = run_mlp(p->current, ctx, x, prob, dy, splits);
      EXPECT_EQ(d.y.to_doubles(), c.y.to_doubles());
      EXPECT_EQ(d.dx.to_doubles(), c.dx.to_doubles());
      EXPECT_EQ(d.d_scale.to_doubles(), c.d_scale.to_doubles());
      EXPECT_EQ(d.dfc.to_doubles(), c.dfc.to_doubles());
      EXPECT_EQ(d.dproj.to_doubles(), c.dproj.to_doubles());
      // And step 3 records step 2's amaxes.
      EXPECT_EQ(p->state->pending_amaxes().to_doubles(), pending2.to_doubles());
    }
  }
}

TEST(MoeFp8Delayed, FusedSwigluBackwardCastIsTheBackwardThenTheCast) {
  Context ctx = Context::cpu();
  const int64_t rows = 37, f = 24;
  const std::vector<int64_t> splits = {10, 0, 21};  // 6 rows past the split sum, not zero here
  const Tensor x = random_tensor({rows, 2 * f}, DType::BF16, 51, -2.0f, 2.0f);
  const Tensor prob = random_tensor({rows}, DType::BF16, 52, 0.1f, 1.0f);
  const Tensor dy = random_tensor({rows, f}, DType::BF16, 53);
  const Tensor scale = Tensor::from_floats({37.5f}, {1});
  Tensor amax_slot = Tensor::from_floats({0.25f}, {1});  // folded into, not overwritten
  Tensor d_scale = Tensor::empty({rows}, DType::BF16);
  const MoEFp8Rows got =
      moe_swiglu_scaled_backward_cast(ctx, x, prob, dy, scale, splits, DType::E5M2, d_scale, &amax_slot);

  Tensor dx = Tensor::empty(x.shape(), DType::BF16), d_scale_want = Tensor::empty({rows}, DType::BF16);
  moe_swiglu_scaled_backward(ctx, x, prob, dy, dx, d_scale_want);
  const MoEFp8Rows want = moe_fp8_cast_rows(ctx, dx, scale, splits, DType::E5M2);
  EXPECT_TRUE(same_bits(got.data, want.data));
  EXPECT_TRUE(same_bits(got.data_t, want.data_t));
  EXPECT_EQ(d_scale.to_doubles(), d_scale_want.to_doubles());
  EXPECT_EQ(got.scale_inv.item(0), want.scale_inv.item(0));
  EXPECT_EQ(amax_slot.item(0), std::max(0.25f, amax_of(dx.slice(0, 0, 31))));

  // A NaN stays in the slot.
  Tensor nan_slot = Tensor::from_floats({NAN}, {1});
  (void)moe_swiglu_scaled_backward_cast(ctx, x, prob, dy, scale, splits, DType::E5M2, d_scale, &nan_slot);
  EXPECT_TRUE(std::isnan(nan_slot.item(0)));
  // Bad input: a scale of the wrong shape.
  EXPECT_THROW(moe_swiglu_scaled_backward_cast(ctx, x, prob, dy, Tensor::from_floats({1, 2}, {2}), splits,
                                               DType::E5M2, d_scale, &amax_slot),
               Error);
}

TEST(MoeFp8Delayed, TinyMixtralTrainsAndKeepsTheExpertStateInTheCheckpoint) {
  Context ctx = Context::cpu();
  const models::ModelConfig c = tiny_mixtral_config();
  models::TransformerLM model(c, DType::BF16);
  model.init(ctx, 3);
  fp8::Recipe recipe;
  fp8::DelayedScalingConfig config;
  config.history_len = 4;
  recipe.config = config;
  const auto scaling = models::enable_fp8(ctx, model, recipe);
  ASSERT_TRUE(scaling->expert_state());
  int64_t slots = 0;
  for (auto& layer : model.layers) {
    ASSERT_TRUE(layer->moe);
    const auto& o = layer->moe->experts.fc.fp8_options();
    ASSERT_TRUE(o.has_value() && o->delayed == scaling->expert_state());
    EXPECT_EQ(o->delayed_base, slots);
    EXPECT_EQ(layer->moe->experts.proj.fp8_options()->delayed_base,
              slots + MoEFp8Options::delayed_slots(layer->moe->experts.fc.num_experts()));
    slots += layer->moe->experts.delayed_slots();
  }
  EXPECT_EQ(scaling->expert_state()->size(), slots);

  const Tensor inputs = random_ids({2, 16}, c.vocab_size, 5);
  const Tensor targets = random_ids({2, 16}, c.vocab_size, 6);
  double first = 0, last = 0;
  for (int step = 0; step < 30; ++step) {
    model.zero_grad();
    const double loss = model.forward_backward(ctx, inputs, targets);
    ASSERT_TRUE(std::isfinite(loss));
    scaling->end_micro_batch(ctx);
    scaling->end_step(ctx);
    if (step == 0) first = loss;
    last = loss;
    sgd_step(ctx, model, 0.5);
  }
  EXPECT_LT(last, first - 0.5);
  // The experts' scales moved off 1 (their amaxes are far from the FP8 range's top).
  const Tensor scales = scaling->expert_state()->scales();
  int64_t moved = 0;
  for (int64_t i = 0; i < scales.numel(); ++i) moved += scales.item(i) != 1.0;
  EXPECT_GT(moved, slots / 2);

  // The checkpoint dict carries the experts' state; loading it restores it.
  const std::map<std::string, Tensor> saved = scaling->state_dict();
  ASSERT_TRUE(saved.count("fp8.experts.amax_history") && saved.count("fp8.experts.scale") &&
              saved.count("fp8.amax_history"));
  const std::vector<double> before = scales.to_doubles();
  model.zero_grad();
  (void)model.forward_backward(ctx, inputs, targets);
  scaling->end_step(ctx);
  scaling->load_state_dict(ctx, saved);
  EXPECT_EQ(scaling->expert_state()->scales().to_doubles(), before);
  // A checkpoint from before the experts had delayed scales (no fp8.experts.*) still loads.
  std::map<std::string, Tensor> old = saved;
  for (const char* k : {"fp8.experts.amax_history", "fp8.experts.scale", "fp8.experts.scale_inv", "fp8.experts.position"})
    old.erase(k);
  EXPECT_NO_THROW(scaling->load_state_dict(ctx, old));
  models::disable_fp8(model);
}
