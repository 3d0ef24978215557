// FP8 linear layers on CUDA (cuBLASLt FP8 GEMMs, casts and scales on the device) against the
// same layers on the CPU (the dequantized reference), current and delayed scaling, over two
// steps so that delayed scaling uses learned scales. The casts are bit-identical on both
// devices (x, W and dy, both copies: on CUDA from the fused cast + transpose kernel); the
// GEMMs differ only in accumulation order (and the forward's fast accumulation).
// Skipped (saying so) where no GPU is present.
#include "fp8_weight_transpose_testing.h"
#include "gpu_testing.h"
#include "tessera/nn/linear.h"

using namespace tessera;
using namespace tessera::testing;

TEST(GpuFp8Linear, MatchesTheCpuLayer) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  for (const char* recipe_name : {"current", "delayed"}) {
    SCOPED_TRACE(recipe_name);
    const fp8::Recipe recipe = fp8::Recipe::from_json({{"recipe", recipe_name}});
    nn::Linear host("l", 256, 384, true, DType::BF16), device("l", 256, 384, true, DType::BF16);
    host.weight.value.copy_from(random_tensor({384, 256}, DType::BF16, 1, -0.2f, 0.2f));
    host.bias.value.copy_from(random_tensor({384}, DType::BF16, 2));
    device.weight.to(kCuda);
    device.bias.to(kCuda);
    device.weight.value.copy_from(host.weight.value);
    device.bias.value.copy_from(host.bias.value);
    auto host_scaling = std::make_shared<nn::Fp8Scaling>(cpu, recipe, 1);
    auto device_scaling = std::make_shared<nn::Fp8Scaling>(gpu, recipe, 1);
    host_scaling->set_keep_weight_transpose(true);  // W^T's kept codes compared below
    device_scaling->set_keep_weight_transpose(true);
    host.use_fp8({host_scaling, 0});
    device.use_fp8({device_scaling, 0});
    for (int step = 0; step < 2; ++step) {
      const Tensor x = random_tensor({512, 256}, DType::BF16, 10 + step, -3, 3);
      const Tensor dy = random_tensor({512, 384}, DType::BF16, 20 + step);
      nn::Linear::Saved hs, ds;
      const Tensor y_cpu = host.forward(cpu, x, hs), y_gpu = device.forward(gpu, x.to(kCuda), ds);
      ASSERT_TRUE(hs.fp8 && ds.fp8);
      const Tensor dx_cpu = host.backward_input(cpu, dy, hs), dx_gpu = device.backward_input(gpu, dy.to(kCuda), ds);
      // dy's cast (E5M2, the fused cast + transpose on CUDA) before backward_weight drops it;
      // only the transposed copies the backward reads are kept (docs/fp8.md, "Memory").
      EXPECT_FALSE(ds.dy_fp8.data.defined() || ds.x_fp8.data.defined() || ds.w_fp8.data.defined()) << "step " << step;
      EXPECT_EQ(bytes_of(ds.dy_fp8.data_t), bytes_of(hs.dy_fp8.data_t)) << "step " << step;
      EXPECT_EQ(bytes_of(ds.w_fp8.data_t), bytes_of(hs.w_fp8.data_t)) << "step " << step;
      host.backward_weight(cpu, dy, hs);
      device.backward_weight(gpu, dy.to(kCuda), ds);
      EXPECT_EQ(bytes_of(ds.x_fp8.data_t), bytes_of(hs.x_fp8.data_t)) << "step " << step;  // the same casts
      EXPECT_LT(relative_error(y_gpu.to(Device::cpu()), y_cpu), 1e-2) << "step " << step;
      EXPECT_LT(relative_error(dx_gpu.to(Device::cpu()), dx_cpu), 1e-2) << "step " << step;
      EXPECT_LT(relative_error(device.weight.grad.to(Device::cpu()), host.weight.grad), 1e-3) << "step " << step;
      host_scaling->end_step(cpu);
      device_scaling->end_step(gpu);
      if (std::string(recipe_name) == "delayed")  // the same scales learned on both devices
        EXPECT_EQ(bytes_of(device_scaling->state_dict().at("fp8.scale")),
                  bytes_of(host_scaling->state_dict().at("fp8.scale")));
    }
  }
}

// fp8.keep_weight_transpose on CUDA: a norm -> SwiGLU MLP -> biased Linear stack over three
// steps gives the same bits with W^T kept from the forward (on) and re-cast in backward
// with the forward's scale (off, the default): outputs, input and weight gradients, and the
// delayed-scaling state (the re-cast records no amax).
TEST(GpuFp8Linear, WeightTransposeRecastIsBitIdentical) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  for (const char* recipe : {"delayed", "current", "block", "mxfp8"}) {
    SCOPED_TRACE(recipe);
    const std::vector<Tensor> kept = run_fp8_stack(gpu, recipe, true, 3);
    const std::vector<Tensor> recast = run_fp8_stack(gpu, recipe, false, 3);
    ASSERT_EQ(kept.size(), recast.size());
    for (size_t i = 0; i < kept.size(); ++i) EXPECT_TRUE(same_bits(kept[i], recast[i])) << "result " << i;
    for (double v : kept[0].to_doubles()) ASSERT_TRUE(std::isfinite(v));
  }
}
