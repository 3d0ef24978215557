// DeviceDelayedScaling on CUDA (one launch per micro-batch and per step) against the host
// reference DelayedScalingState, bit for bit. Skipped (saying so) where no GPU is present.
#include "fp8_scaling_testing.h"
#include "gpu_testing.h"

using namespace tessera;
using namespace tessera::fp8;
using namespace tessera::testing;

TEST(GpuDeviceDelayedScaling, MatchesTheHostReferenceBitForBit) {
  REQUIRE_GPU();
  Context ctx = Context::cuda();
  uint64_t seed = 100;
  for (const auto rule : {DelayedScalingConfig::AmaxCompute::Max, DelayedScalingConfig::AmaxCompute::MostRecent})
    for (const float margin : {0.0f, 1.0f})
      for (const int len : {1, 4, 1024}) {
        DelayedScalingConfig c;
        c.history_len = len;
        c.amax_compute = rule;
        c.margin = margin;
        check_device_scaling_against_reference(ctx, c, 30, 2, seed++);
      }
}
