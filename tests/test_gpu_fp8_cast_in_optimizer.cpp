// fp8.cast_in_optimizer on the GPU: the fused AdamW + FP8 cast + transpose kernel
// (backend/cuda/multi_tensor.cu, adamw_cast_kernel) against its definition on the GPU, and a
// Mixtral trained with the casts in the optimizer against one casting in its forwards, to the
// bit. The checks are fp8_cast_in_optimizer_testing.h's, which test_fp8_cast_in_optimizer
// runs on the CPU. Skipped where no GPU is present.
#include "fp8_cast_in_optimizer_testing.h"
#include "gpu_testing.h"

using namespace tessera;
using namespace tessera::testing;

TEST(GpuFp8CastInOptimizer, FusedKernelMatchesItsDefinition) {
  REQUIRE_GPU();
  Context ctx = Context::cuda();
  expect_fused_update_matches_definition(ctx);
}

TEST(GpuFp8CastInOptimizer, FusedKernelMatchesTheCpu) {
  REQUIRE_GPU();
  // The same update and casts on both devices: the GPU's kernel against the CPU composition.
  const int64_t experts = 2, n = 136, k = 264;
  std::vector<std::vector<Tensor>> out(2);
  for (int gpu = 0; gpu < 2; ++gpu) {
    Context ctx = gpu ? Context::cuda() : Context::cpu();
    ExpertWeightState s = random_expert_weight(ctx, experts, n, k, DType::F32, 5);
    MoEFp8WeightCast cast;
    cast.scale = Tensor::from_floats({20.0f, 0.25f}, {2}).to(ctx.device);
    cast.amax = Tensor::from_floats({0.0f, 3.0f}, {2}).to(ctx.device);
    cast.data = Tensor::empty({experts, n, k}, DType::E4M3, ctx.device);
    cast.data_t = Tensor::empty({experts, k, n}, DType::E4M3, ctx.device);
    AdamWOptions adam;
    adam.lr = 3e-3f;
    adam.step = 7;
    moe_fp8_adamw_cast_weights(ctx, s.param, s.grad, s.exp_avg, s.exp_avg_sq, s.value, adam, 0.01f, Tensor(), 0.0,
                               cast);
    for (const Tensor* t : {&s.param, &s.exp_avg, &s.exp_avg_sq, &s.value, &cast.amax, &cast.data, &cast.data_t})
      out[gpu].push_back(t->to(Device::cpu()));
  }
  for (size_t i = 0; i < out[0].size(); ++i) EXPECT_TRUE(same_bits(out[0][i], out[1][i])) << "output " << i;
}

TEST(GpuFp8CastInOptimizer, MixtralTrainsTheSameBitsWithSeveralMicroBatches) {
  REQUIRE_GPU();
  Context ctx = Context::cuda();
  expect_cast_in_optimizer_changes_no_bit(ctx);
}

TEST(GpuFp8CastInOptimizer, MixtralTrainsTheSameBitsWithOneMicroBatch) {
  REQUIRE_GPU();
  Context ctx = Context::cuda();
  expect_cast_in_optimizer_serves_single_micro_batch(ctx);
}

TEST(GpuFp8CastInOptimizer, ARunWithoutItsPrimedCastsRepeatsTheUninterruptedOne) {
  REQUIRE_GPU();
  Context ctx = Context::cuda();
  expect_a_run_without_its_primed_casts_repeats_the_uninterrupted_one(ctx);
}

TEST(GpuFp8CastInOptimizer, CodesLiveInTheStaleBf16Copy) {
  REQUIRE_GPU();
  Context ctx = Context::cuda();
  expect_codes_live_in_the_stale_copy(ctx, CopyRewrite::Refresh);
}

TEST(GpuFp8CastInOptimizer, CodesKeepTheirBitsThroughAPlainUpdate) {
  REQUIRE_GPU();
  Context ctx = Context::cuda();
  expect_codes_live_in_the_stale_copy(ctx, CopyRewrite::PlainUpdate);
}

TEST(GpuFp8CastInOptimizer, CodesKeepTheirBitsThroughTheFallbackUpdate) {
  REQUIRE_GPU();
  Context ctx = Context::cuda();
  expect_codes_live_in_the_stale_copy(ctx, CopyRewrite::FallbackUpdate);
}
