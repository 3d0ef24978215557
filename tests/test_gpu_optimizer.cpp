// CUDA AdamW against the CPU reference, bit for bit: F32 parameters and moments with F32
// and BF16 gradients, sizes below, at and around the 8-element vector, misaligned views
// (scalar path), several steps with weight decay and large step counts, a NaN gradient.
// Skipped (saying so) where no GPU is present.
#include <cmath>
#include <string>

#include "tessera/core/allocator.h"
#include "tessera/ops/optimizer.h"
#include "gpu_testing.h"

using namespace tessera;
using namespace tessera::testing;

TEST(GpuAdamW, MatchesTheCpuBitForBit) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  uint64_t seed = 700;
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{8}, int64_t{9}, int64_t{1000}, int64_t{4099}, int64_t{1} << 18}) {
    for (DType gt : {DType::F32, DType::BF16}) {
      for (bool misaligned : {false, true}) {
        const std::string what =
            "n=" + std::to_string(n) + " grad " + dtype_name(gt) + (misaligned ? " misaligned" : "");
        Tensor p = random_tensor({n}, DType::F32, seed++, -2.0f, 2.0f);
        Tensor m = random_tensor({n}, DType::F32, seed++, -0.1f, 0.1f);
        Tensor v = random_tensor({n}, DType::F32, seed++, 0.0f, 0.01f);
        Tensor pd = to_device(p, misaligned), md = to_device(m, misaligned), vd = to_device(v, misaligned);
        AdamWOptions o;
        o.lr = 3e-4f;
        o.beta1 = 0.9f;
        o.beta2 = 0.95f;
        o.eps = 1e-8f;
        o.weight_decay = 0.1f;
        for (int64_t step : {int64_t{1}, int64_t{2}, int64_t{3}, int64_t{1000}}) {
          // Gradients spanning many magnitudes, so the denominator and eps both matter.
          Tensor g = random_tensor({n}, gt, seed++, -1.0f, 1.0f);
          for (int64_t i = 0; i < n; i += 5) g.set_item(i, g.item(i) * 1e-6);
          o.step = step;
          adamw_step(cpu, p, g, m, v, o);
          adamw_step(gpu, pd, to_device(g, misaligned), md, vd, o);
          EXPECT_EQ(bytes_of(pd), bytes_of(p)) << "param " << what << " step " << step;
          EXPECT_EQ(bytes_of(md), bytes_of(m)) << "exp_avg " << what << " step " << step;
          EXPECT_EQ(bytes_of(vd), bytes_of(v)) << "exp_avg_sq " << what << " step " << step;
        }
      }
    }
  }
}

TEST(GpuAdamW, NanGradientStaysInItsElement) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  Tensor g = Tensor::from_floats({0.5f, NAN, -0.25f, 1.0f, 0, 0, 0, 0, 2.0f}, {9});
  Tensor p = Tensor::zeros({9}, DType::F32, kCuda), m = Tensor::zeros({9}, DType::F32, kCuda),
         v = Tensor::zeros({9}, DType::F32, kCuda);
  AdamWOptions o;
  adamw_step(gpu, p, g.to(kCuda), m, v, o);
  const std::vector<float> got = p.to_floats();
  for (int i = 0; i < 9; ++i) EXPECT_EQ(std::isnan(got[i]), i == 1) << i;
}

TEST(GpuAdamW, F64ParametersAreAClearError) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  Tensor p = Tensor::zeros({4}, DType::F64, kCuda), m = Tensor::zeros({4}, DType::F64, kCuda),
         v = Tensor::zeros({4}, DType::F64, kCuda);
  EXPECT_THROW(adamw_step(gpu, p, Tensor::zeros({4}, DType::F64, kCuda), m, v, {}), Error);
}
