// DeviceDelayedScaling on CUDA (one launch per micro-batch and per step) against the host
// reference DelayedScalingState, bit for bit; its device-resident ring position, also when
// record and update are captured into a CUDA graph and replayed. Skipped (saying so) where
// no GPU is present.
#include "fp8_scaling_testing.h"
#include "gpu_testing.h"
#include "tessera/core/stream.h"
#if TESSERA_WITH_CUDA
#include "backend/cuda/graph.h"
#endif

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

TEST(GpuDeviceDelayedScaling, PositionIsATensorThatAdvancesAndWrapsLikeTheHostCounter) {
  REQUIRE_GPU();
  Context ctx = Context::cuda();
  for (const int64_t len : {1, 2, 5, 1024}) check_device_position(ctx, len);
}

// More tensors than the update kernel's one block has threads: each thread loops.
TEST(GpuDeviceDelayedScaling, ManyTensorsMatchTheHostReference) {
  REQUIRE_GPU();
  Context cuda = Context::cuda(), cpu = Context::cpu();
  DelayedScalingConfig c;
  c.history_len = 7;
  std::vector<Role> roles;
  for (int i = 0; i < 2500; ++i) roles.push_back(i % 3 == 2 ? Role::Gradient : Role::Forward);
  DeviceDelayedScaling gpu(cuda, c, roles), host(cpu, c, roles);
  for (int step = 0; step < 9; ++step) {
    std::vector<float> amax;
    for (size_t i = 0; i < roles.size(); ++i) amax.push_back(random_amax(7, step * roles.size() + i));
    const Tensor a = Tensor::from_floats(amax, {static_cast<int64_t>(roles.size())});
    for (size_t i = 0; i < roles.size(); ++i) {
      gpu.pending_amax(static_cast<int64_t>(i)).copy_from(a.slice(0, i, i + 1));
      host.pending_amax(static_cast<int64_t>(i)).copy_from(a.slice(0, i, i + 1));
    }
    gpu.update(cuda);
    host.update(cpu);
    ASSERT_EQ(gpu.position(), host.position());
    ASSERT_EQ(bytes_of(gpu.history()), bytes_of(host.history())) << "step " << step;
    ASSERT_EQ(bytes_of(gpu.scales()), bytes_of(host.scales())) << "step " << step;
    ASSERT_EQ(bytes_of(gpu.scale_invs()), bytes_of(host.scale_invs())) << "step " << step;
  }
}

#if TESSERA_WITH_CUDA
// record and update captured into a CUDA graph once, replayed many times: each replay folds
// into and advances from the position the device holds then, as eager calls would.
TEST(GpuDeviceDelayedScaling, CapturedRecordAndUpdateFollowTheDevicePosition) {
  REQUIRE_GPU();
  const Stream stream = Stream::create(kCuda);
  Context ctx = stream.context();
  const StreamGuard guard(ctx);
  Context cpu = Context::cpu();
  DelayedScalingConfig c;
  c.history_len = 3;
  const std::vector<Role> roles = {Role::Forward, Role::Gradient, Role::Forward};
  DeviceDelayedScaling graph_state(ctx, c, roles), host(cpu, c, roles);
  const Tensor amax = Tensor::empty({3}, DType::F32, ctx.device);  // copied in before each replay
  cuda::CapturedGraph graph;
  graph.begin(0, ctx.stream);
  for (int64_t i = 0; i < 3; ++i) graph_state.pending_amax(i).copy_from(amax.slice(0, i, i + 1));
  graph_state.record(ctx);
  graph_state.update(ctx);
  graph.end();
  for (int step = 0; step < 8; ++step) {
    std::vector<float> values;
    for (int64_t i = 0; i < 3; ++i) values.push_back(random_amax(3, step * 3 + i));
    const Tensor a = Tensor::from_floats(values, {3});
    Tensor(amax).copy_from(a);
    graph.replay();
    for (int64_t i = 0; i < 3; ++i) host.pending_amax(i).copy_from(a.slice(0, i, i + 1));
    host.record(cpu);
    host.update(cpu);
    ASSERT_EQ(graph_state.position(), host.position()) << "step " << step;
    ASSERT_EQ(graph_state.position(), (step + 1) % 3) << "step " << step;
    ASSERT_EQ(bytes_of(graph_state.history()), bytes_of(host.history())) << "step " << step;
    ASSERT_EQ(bytes_of(graph_state.scales()), bytes_of(host.scales())) << "step " << step;
  }
}
#endif
