// fp8.cache_weights on the GPU (fp8/weight_cache.h): training a Llama and a Mixtral with
// gradient accumulation gives the same bits with the cache as without under every recipe,
// and the experts are cached whatever the first micro-batch's splits (the one-launch expert
// cast with both copies). The checks are fp8_weight_cache_testing.h's, which
// test_fp8_weight_cache runs on the CPU. Skipped where no GPU is present.
#include "fp8_weight_cache_testing.h"
#include "gpu_testing.h"

using namespace tessera;
using namespace tessera::testing;

TEST(GpuFp8WeightCache, LlamaTrainsTheSameBitsWithTheCache) {
  REQUIRE_GPU();
  Context ctx = Context::cuda();
  expect_cache_changes_no_bit(ctx, tiny_model_config("llama", 64, 128, 16));
}

TEST(GpuFp8WeightCache, MixtralTrainsTheSameBitsWithTheCache) {
  REQUIRE_GPU();
  Context ctx = Context::cuda();
  expect_cache_changes_no_bit(ctx, tiny_mixtral_config());
}

TEST(GpuFp8WeightCache, ExpertsWithoutRowsInTheFirstMicroBatchAreCachedToo) {
  REQUIRE_GPU();
  Context ctx = Context::cuda();
  expect_experts_cached_whatever_the_splits(ctx);
}

TEST(GpuFp8WeightCache, ACacheServingPrimedCastsCastsEveryExpert) {
  REQUIRE_GPU();
  Context ctx = Context::cuda();
  expect_a_serving_cache_casts_every_expert(ctx);
}

TEST(GpuFp8WeightCache, DeferredExpertWeightGradientsMatchThePerMicroBatchOnes) {
  REQUIRE_GPU();
  Context ctx = Context::cuda();
  expect_deferred_expert_wgrad_matches(ctx);
}

TEST(GpuFp8WeightCache, DeferredExpertWeightGradientsTrainAlike) {
  REQUIRE_GPU();
  Context ctx = Context::cuda();
  expect_deferred_expert_wgrad_trains_alike(ctx);
}
