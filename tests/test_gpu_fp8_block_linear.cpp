// nn::Linear under the "block" recipe (cuBLASLt's block-scaled FP8 GEMMs, VEC128 / BLK128x128)
// and the "mxfp8" recipe (emulated: CUDA casts, dequantization, BF16 GEMM) against the same
// layer on the CPU. The casts (both copies of x, W and dy, and their scales) are bit-identical
// on both devices; the GEMMs differ in accumulation order only. Sizes: full and partial
// 128-blocks (in 320, out 144, 272 tokens). Skipped (saying so) where no GPU is present.
#include "gpu_testing.h"
#include <cmath>

#include "tessera/nn/linear.h"

using namespace tessera;
using namespace tessera::testing;

TEST(GpuFp8BlockLinear, MatchesTheCpuLayer) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  for (const char* recipe_name : {"block", "mxfp8"}) {
    for (const bool bias : {true, false}) {
      SCOPED_TRACE(std::string(recipe_name) + (bias ? " bias" : " no bias"));
      const bool block = std::string(recipe_name) == "block";
      const fp8::Recipe recipe = fp8::Recipe::from_json({{"recipe", recipe_name}});
      const int64_t n = 272, in = 320, out = 144;
      nn::Linear host("l", in, out, bias, DType::BF16), device("l", in, out, bias, DType::BF16);
      host.weight.value.copy_from(random_tensor({out, in}, DType::BF16, 1, -0.2f, 0.2f));
      device.weight.to(kCuda);
      device.weight.value.copy_from(host.weight.value);
      if (bias) {
        host.bias.value.copy_from(random_tensor({out}, DType::BF16, 2));
        device.bias.to(kCuda);
        device.bias.value.copy_from(host.bias.value);
      }
      auto host_scaling = std::make_shared<nn::Fp8Scaling>(cpu, recipe, 1);
      auto device_scaling = std::make_shared<nn::Fp8Scaling>(gpu, recipe, 1);
      host_scaling->set_keep_weight_transpose(true);  // W^T's kept codes compared below
      device_scaling->set_keep_weight_transpose(true);
      host.use_fp8({host_scaling, 0});
      device.use_fp8({device_scaling, 0});
      // Some rows much larger than the rest: per-block scales matter.
      Tensor x = random_tensor({n, in}, DType::BF16, 10, -3, 3);
      x.slice(0, 5, 6).copy_from(random_tensor({1, in}, DType::BF16, 11, -900, 900));
      const Tensor dy = random_tensor({n, out}, DType::BF16, 20);
      nn::Linear::Saved hs, ds;
      const Tensor y_cpu = host.forward(cpu, x, hs), y_gpu = device.forward(gpu, x.to(kCuda), ds);
      ASSERT_TRUE(hs.fp8 && ds.fp8);
      const Tensor dx_cpu = host.backward_input(cpu, dy, hs), dx_gpu = device.backward_input(gpu, dy.to(kCuda), ds);
      if (block) {
        EXPECT_FALSE(ds.x_block.data.defined() || ds.w_block.data.defined() || ds.dy_block.data.defined());
        EXPECT_EQ(bytes_of(ds.x_block.data_t), bytes_of(hs.x_block.data_t));
        EXPECT_EQ(bytes_of(ds.x_block.scale_inv_t), bytes_of(hs.x_block.scale_inv_t));
        EXPECT_EQ(bytes_of(ds.w_block.data_t), bytes_of(hs.w_block.data_t));
        EXPECT_EQ(bytes_of(ds.w_block.scale_inv_t), bytes_of(hs.w_block.scale_inv_t));
        EXPECT_EQ(bytes_of(ds.dy_block.data_t), bytes_of(hs.dy_block.data_t));
        EXPECT_EQ(bytes_of(ds.dy_block.scale_inv_t), bytes_of(hs.dy_block.scale_inv_t));
      } else {
        EXPECT_FALSE(ds.x_mx.data.defined() || ds.w_mx.data.defined() || ds.dy_mx.data.defined());
        EXPECT_EQ(bytes_of(ds.x_mx.data_t), bytes_of(hs.x_mx.data_t));
        EXPECT_EQ(bytes_of(ds.x_mx.scales_t), bytes_of(hs.x_mx.scales_t));
        EXPECT_EQ(bytes_of(ds.w_mx.data_t), bytes_of(hs.w_mx.data_t));
        EXPECT_EQ(bytes_of(ds.dy_mx.data_t), bytes_of(hs.dy_mx.data_t));
        EXPECT_EQ(bytes_of(ds.dy_mx.scales_t), bytes_of(hs.dy_mx.scales_t));
      }
      // Accumulation into a non-zero gradient (beta = 1).
      const Tensor g0 = random_tensor({out, in}, DType::F32, 30);
      host.weight.grad.copy_from(g0);
      device.weight.grad.copy_from(g0);
      host.backward_weight(cpu, dy, hs);
      device.backward_weight(gpu, dy.to(kCuda), ds);
      EXPECT_LT(relative_error(y_gpu.to(Device::cpu()), y_cpu), 1e-2);
      EXPECT_LT(relative_error(dx_gpu.to(Device::cpu()), dx_cpu), 1e-2);
      EXPECT_LT(relative_error(device.weight.grad.to(Device::cpu()), host.weight.grad), 1e-3);
      if (bias) EXPECT_LT(relative_error(device.bias.grad.to(Device::cpu()), host.bias.grad), 1e-3);
      for (double v : y_gpu.to(Device::cpu()).to_doubles()) ASSERT_TRUE(std::isfinite(v));
    }
  }
}

// A NaN in the input reaches the output (its blocks' scales become 1, the NaN stays NaN).
TEST(GpuFp8BlockLinear, NanPropagates) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  for (const char* recipe_name : {"block", "mxfp8"}) {
    nn::Linear layer("l", 128, 128, false, DType::BF16);
    layer.weight.to(kCuda);
    layer.weight.value.copy_from(random_tensor({128, 128}, DType::BF16, 1));
    layer.use_fp8({std::make_shared<nn::Fp8Scaling>(gpu, fp8::Recipe::from_json({{"recipe", recipe_name}}), 1), 0});
    Tensor x = random_tensor({32, 128}, DType::BF16, 2);
    x.set_item(3 * 128 + 7, std::nan(""));
    nn::Linear::Saved saved;
    const std::vector<double> y = layer.forward(gpu, x.to(kCuda), saved).to(Device::cpu()).to_doubles();
    EXPECT_TRUE(std::isnan(y[3 * 128])) << recipe_name;
    EXPECT_TRUE(std::isfinite(y[0])) << recipe_name;
  }
}
