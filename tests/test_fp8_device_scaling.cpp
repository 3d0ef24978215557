// DeviceDelayedScaling (delayed scaling with its state in tensors, one launch per step on
// CUDA) against the host reference DelayedScalingState, on the CPU: every bit of the
// history, scales and inverse scales after each step, for both amax rules, with and without
// margin, several micro-batches per step; and checkpoints that either class loads.
#include <gtest/gtest.h>

#include "fp8_scaling_testing.h"
#include "tessera/core/error.h"

using namespace tessera;
using namespace tessera::fp8;
using namespace tessera::testing;

namespace {

DelayedScalingConfig config_of(int len, DelayedScalingConfig::AmaxCompute rule, float margin) {
  DelayedScalingConfig c;
  c.history_len = len;
  c.amax_compute = rule;
  c.margin = margin;
  return c;
}

}  // namespace

TEST(DeviceDelayedScaling, MatchesTheHostReferenceBitForBit) {
  Context ctx = Context::cpu();
  uint64_t seed = 1;
  for (const auto rule : {DelayedScalingConfig::AmaxCompute::Max, DelayedScalingConfig::AmaxCompute::MostRecent})
    for (const float margin : {0.0f, 1.0f})
      for (const int len : {1, 4, 16}) check_device_scaling_against_reference(ctx, config_of(len, rule, margin), 40, 3, seed++);
}

TEST(DeviceDelayedScaling, StartsAtScaleOneAndExposesViews) {
  Context ctx = Context::cpu();
  DeviceDelayedScaling state(ctx, config_of(4, DelayedScalingConfig::AmaxCompute::Max, 0), {Role::Forward, Role::Gradient});
  EXPECT_EQ(state.scale(1).to_floats(), std::vector<float>{1.0f});
  EXPECT_EQ(state.dtype(0), DType::E4M3);
  EXPECT_EQ(state.dtype(1), DType::E5M2);  // hybrid: gradients in E5M2
  // A view written by a quantize call is what update folds.
  state.pending_amax(0).copy_from(Tensor::from_floats({2.0f}, {1}));
  state.update(ctx);
  EXPECT_EQ(state.scale(0).to_floats(), std::vector<float>{448.0f / 2.0f});
  EXPECT_EQ(state.scale(1).to_floats(), std::vector<float>{1.0f});  // nothing seen: unchanged
}

TEST(DeviceDelayedScaling, CheckpointsLoadIntoEitherClass) {
  Context ctx = Context::cpu();
  const auto config = config_of(8, DelayedScalingConfig::AmaxCompute::Max, 0);
  const std::vector<Role> roles = {Role::Forward, Role::Gradient, Role::Forward};
  DeviceDelayedScaling a(ctx, config, roles);
  for (int step = 0; step < 5; ++step) {
    for (int64_t i = 0; i < 3; ++i) a.pending_amax(i).copy_from(Tensor::from_floats({float(step + i + 1)}, {1}));
    a.update(ctx);
  }
  DelayedScalingState host(config, roles);
  host.load_state_dict(a.state_dict());
  DeviceDelayedScaling b(ctx, config, roles);
  b.load_state_dict(ctx, host.state_dict());
  EXPECT_EQ(b.position(), a.position());
  EXPECT_EQ(b.history().to_floats(), a.history().to_floats());
  EXPECT_EQ(b.scales().to_floats(), a.scales().to_floats());
  // A checkpoint of another shape is refused, naming the tensor, and leaves the state as it was.
  DeviceDelayedScaling other(ctx, config_of(4, DelayedScalingConfig::AmaxCompute::Max, 0), roles);
  EXPECT_THROW(other.load_state_dict(ctx, a.state_dict()), Error);
  EXPECT_EQ(other.position(), 0);
}

TEST(DeviceDelayedScaling, PositionIsATensorThatAdvancesAndWrapsLikeTheHostCounter) {
  Context ctx = Context::cpu();
  for (const int64_t len : {1, 2, 5, 16}) check_device_position(ctx, len);
}
