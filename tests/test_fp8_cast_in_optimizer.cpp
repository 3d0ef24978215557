// fp8.cast_in_optimizer on the CPU: the experts' FP8 weight casts made by the optimizer's
// update for the next step (fp8/weight_cache.h's primed entries; ops/moe.h's
// moe_fp8_adamw_cast_weights). Checked: primed entries serve the next open only and
// drop_primed discards them; the fused update equals its definition to the bit; a Mixtral
// trained with the casts in the optimizer gives the bits of the one that casts in its
// forwards, with one or three micro-batches a step, and the casts really serve; the config
// key is parsed and refused outside delayed scaling.
#include "fp8_cast_in_optimizer_testing.h"
#include "tessera/fp8/weight_cache.h"

using namespace tessera;
using namespace tessera::testing;

TEST(Fp8CastInOptimizer, PrimedEntriesServeTheNextOpenOnly) {
  fp8::WeightCache cache;
  int key = 0, other = 0, made = 0;
  auto make = [&] { return ++made; };
  cache.prime<int>(&key, 100);
  EXPECT_TRUE(cache.has_primed());
  EXPECT_EQ(cache.get_or_make<int>(&key, make), 1);  // closed: primed entries wait for open
  cache.open(/*keep_new=*/false);
  EXPECT_FALSE(cache.has_primed());
  EXPECT_EQ(cache.get_or_make<int>(&key, make), 100);
  EXPECT_EQ(cache.get_or_make<int>(&other, make), 2);  // not kept
  EXPECT_EQ(cache.get_or_make<int>(&other, make), 3);
  EXPECT_EQ(cache.hits(), 1);
  cache.close();
  cache.open();
  EXPECT_EQ(cache.get_or_make<int>(&key, make), 4);  // used once: gone
  cache.close();
  cache.prime<int>(&key, 200);
  cache.drop_primed();
  cache.open();
  EXPECT_EQ(cache.get_or_make<int>(&key, make), 5);
  cache.close();
  // One forward to serve: the entry leaves the cache as it is handed out.
  cache.prime<int>(&key, 300);
  cache.open(/*keep_new=*/false, /*serve_once=*/true);
  EXPECT_EQ(cache.size(), 1);
  EXPECT_EQ(cache.get_or_make<int>(&key, make), 300);
  EXPECT_EQ(cache.size(), 0);
  EXPECT_EQ(cache.get_or_make<int>(&key, make), 6);
  EXPECT_EQ(cache.hits(), 2);
  cache.close();
}

TEST(Fp8CastInOptimizer, FusedUpdateMatchesItsDefinition) {
  Context ctx = Context::cpu();
  expect_fused_update_matches_definition(ctx);
}

TEST(Fp8CastInOptimizer, MixtralTrainsTheSameBitsWithSeveralMicroBatches) {
  Context ctx = Context::cpu();
  expect_cast_in_optimizer_changes_no_bit(ctx);
}

TEST(Fp8CastInOptimizer, MixtralTrainsTheSameBitsWithOneMicroBatch) {
  Context ctx = Context::cpu();
  expect_cast_in_optimizer_serves_single_micro_batch(ctx);
}

TEST(Fp8CastInOptimizer, ARunWithoutItsPrimedCastsRepeatsTheUninterruptedOne) {
  Context ctx = Context::cpu();
  expect_a_run_without_its_primed_casts_repeats_the_uninterrupted_one(ctx);
}

TEST(Fp8CastInOptimizer, CodesLiveInTheStaleBf16Copy) {
  Context ctx = Context::cpu();
  expect_codes_live_in_the_stale_copy(ctx, CopyRewrite::Refresh);
}

TEST(Fp8CastInOptimizer, CodesKeepTheirBitsThroughAPlainUpdate) {
  Context ctx = Context::cpu();
  expect_codes_live_in_the_stale_copy(ctx, CopyRewrite::PlainUpdate);
}

TEST(Fp8CastInOptimizer, CodesKeepTheirBitsThroughTheFallbackUpdate) {
  Context ctx = Context::cpu();
  expect_codes_live_in_the_stale_copy(ctx, CopyRewrite::FallbackUpdate);
}

TEST(Fp8CastInOptimizer, ConfigKeyNeedsDelayedScaling) {
  EXPECT_TRUE(fp8::Recipe::from_json({{"recipe", "delayed"}, {"cast_in_optimizer", true}}).cast_in_optimizer);
  EXPECT_FALSE(fp8::Recipe::from_json({{"recipe", "delayed"}}).cast_in_optimizer);
  const fp8::Recipe r = fp8::Recipe::from_json({{"recipe", "delayed"}, {"cast_in_optimizer", true}});
  EXPECT_TRUE(fp8::Recipe::from_json(r.to_json()).cast_in_optimizer);
  for (const char* recipe : {"current", "block", "mxfp8"})
    EXPECT_THROW(fp8::Recipe::from_json({{"recipe", recipe}, {"cast_in_optimizer", true}}), Error) << recipe;
  EXPECT_THROW(fp8::Recipe::from_json({{"recipe", "delayed"}, {"cast_in_optimizer", 1}}), Error);
}
