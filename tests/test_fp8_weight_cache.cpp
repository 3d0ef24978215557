// FP8 weight casts made once per optimizer step (fp8.cache_weights, fp8/weight_cache.h).
// Checked: the cache makes an entry once while open and nothing while closed, and open /
// close drop what it holds; Fp8Scaling opens it for a step of several micro-batches only and
// closes it after the last one; training with gradient accumulation gives the same bits with
// the cache as without, under every recipe, for a dense Llama and a Mixtral (whose experts
// cache every expert, also those the first micro-batch sent no token to), while the cache
// really serves the later micro-batches.
#include "fp8_weight_cache_testing.h"

using namespace tessera;
using namespace tessera::testing;

TEST(Fp8WeightCache, MakesOncePerOpenWindowAndNothingWhenClosed) {
  fp8::WeightCache cache;
  int made = 0;
  int key = 0;
  auto make = [&] { return ++made; };
  EXPECT_EQ(cache.get_or_make<int>(&key, make), 1);
  EXPECT_EQ(cache.get_or_make<int>(&key, make), 2);  // closed: made every time, nothing kept
  EXPECT_EQ(cache.size(), 0);
  cache.open();
  EXPECT_EQ(cache.get_or_make<int>(&key, make), 3);
  EXPECT_EQ(cache.get_or_make<int>(&key, make), 3);
  EXPECT_EQ(cache.get_or_make<int>(&key, make), 3);
  EXPECT_EQ(cache.hits(), 2);
  EXPECT_EQ(cache.size(), 1);
  cache.open();  // a new step: the old entry is gone
  EXPECT_EQ(cache.get_or_make<int>(&key, make), 4);
  cache.close();
  EXPECT_EQ(cache.size(), 0);
  EXPECT_EQ(cache.get_or_make<int>(&key, make), 5);
}

TEST(Fp8WeightCache, ScalingOpensForSeveralMicroBatchesAndClosesAfterTheLast) {
  Context ctx = Context::cpu();
  for (bool enabled : {true, false}) {
    fp8::Recipe recipe = fp8::Recipe::from_json({{"recipe", "delayed"}, {"cache_weights", enabled}});
    EXPECT_EQ(recipe.cache_weights, enabled);
    EXPECT_EQ(fp8::Recipe::from_json(recipe.to_json()).cache_weights, enabled);
    nn::Fp8Scaling scaling(ctx, recipe, 1);
    scaling.begin_step(1);  // one micro-batch: nothing to reuse
    EXPECT_FALSE(scaling.weight_cache()->is_open());
    scaling.begin_step(3);
    for (int micro = 0; micro < 3; ++micro) {
      EXPECT_EQ(scaling.weight_cache()->is_open(), enabled) << micro;
      scaling.end_micro_batch(ctx);
    }
    EXPECT_FALSE(scaling.weight_cache()->is_open());  // before the optimizer
    scaling.begin_step(2);
    scaling.end_step(ctx);
    EXPECT_FALSE(scaling.weight_cache()->is_open());
  }
  EXPECT_THROW(fp8::Recipe::from_json({{"recipe", "current"}, {"cache_weights", "yes"}}), Error);
}

TEST(Fp8WeightCache, LlamaTrainsTheSameBitsWithTheCache) {
  Context ctx = Context::cpu();
  expect_cache_changes_no_bit(ctx, tiny_model_config("llama", 32, 64, 16));
}

TEST(Fp8WeightCache, MixtralTrainsTheSameBitsWithTheCache) {
  Context ctx = Context::cpu();
  expect_cache_changes_no_bit(ctx, tiny_mixtral_config());
}

TEST(Fp8WeightCache, ExpertsWithoutRowsInTheFirstMicroBatchAreCachedToo) {
  Context ctx = Context::cpu();
  expect_experts_cached_whatever_the_splits(ctx);
}

TEST(Fp8WeightCache, ACacheServingPrimedCastsCastsEveryExpert) {
  Context ctx = Context::cpu();
  expect_a_serving_cache_casts_every_expert(ctx);
}

TEST(Fp8WeightCache, DeferredExpertWeightGradientsMatchThePerMicroBatchOnes) {
  Context ctx = Context::cpu();
  expect_deferred_expert_wgrad_matches(ctx);
}

TEST(Fp8WeightCache, DeferredExpertWeightGradientsTrainAlike) {
  Context ctx = Context::cpu();
  expect_deferred_expert_wgrad_trains_alike(ctx);
}

TEST(Fp8WeightCache, DeferralNeedsDelayedScalingAndItsWorkMustBeFlushed) {
  EXPECT_THROW(fp8::Recipe::from_json({{"recipe", "current"}, {"defer_expert_wgrad", true}}), Error);
  EXPECT_THROW(fp8::Recipe::from_json({{"recipe", "delayed"}, {"defer_expert_wgrad", true}, {"cache_weights", false}}),
               Error);
  const fp8::Recipe r = fp8::Recipe::from_json({{"recipe", "delayed"}, {"defer_expert_wgrad", true}});
  EXPECT_TRUE(fp8::Recipe::from_json(r.to_json()).defer_expert_wgrad);
  // Work deferred past the window is an error, not silently lost or late.
  Context ctx = Context::cpu();
  nn::Fp8Scaling scaling(ctx, r, 1);
  scaling.begin_step(2);
  int ran = 0;
  scaling.weight_cache()->defer([&](Context&) { ++ran; });
  EXPECT_THROW(scaling.begin_step(2), Error);
  EXPECT_THROW(scaling.end_step(ctx), Error);
  EXPECT_EQ(ran, 1);  // end_step still ran it, then said so
  scaling.begin_step(2);
  scaling.weight_cache()->defer([&](Context&) { ++ran; });
  scaling.end_micro_batch(ctx);
  EXPECT_EQ(ran, 1);
  scaling.end_micro_batch(ctx);  // the last one: flushed before the optimizer
  EXPECT_EQ(ran, 2);
  EXPECT_FALSE(scaling.weight_cache()->is_open());
}
