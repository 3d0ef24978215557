// CUDA bias_grad and sum_of_squares against the CPU reference: F32 and BF16 inputs and
// outputs in every combination, shapes from one element to a few million, odd widths and
// misaligned views (scalar paths), row counts past one chunk, accumulation into a non-zero
// dbias, writing into one slot of a larger tensor (as the optimizer does), run-to-run
// bit-identity, NaN. Skipped (saying so) where no GPU is present.
#include <cmath>
#include <string>

#include "tessera/core/allocator.h"
#include "tessera/ops/gemm.h"
#include "gpu_testing.h"

using namespace tessera;
using namespace tessera::testing;

TEST(GpuBiasGrad, AccumulatesColumnSumsLikeTheCpu) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  uint64_t seed = 800;
  const std::pair<int64_t, int64_t> shapes[] = {{1, 1},    {3, 7},     {5, 8},   {1000, 768}, {257, 50},
                                               {5000, 13}, {40000, 24}, {0, 5},  {4, 0},      {130, 2304}};
  for (auto [rows, cols] : shapes) {
    for (DType yt : {DType::F32, DType::BF16}) {
      for (DType bt : {DType::F32, DType::BF16}) {
        for (bool misaligned : {false, true}) {
          const std::string what = std::string("dy ") + dtype_name(yt) + " [" + std::to_string(rows) + ", " +
                                   std::to_string(cols) + "] dbias " + dtype_name(bt) +
                                   (misaligned ? " misaligned" : "");
          const Tensor dy = random_tensor({rows, cols}, yt, seed++);
          const Tensor start = random_tensor({cols}, bt, seed++, -5.0f, 5.0f);  // accumulates onto this
          Tensor want = start.clone();
          bias_grad(cpu, dy, want);
          Tensor got = start.to(kCuda);
          bias_grad(gpu, to_device(dy, misaligned), got);
          // Both sum in double and round once; only the order of the double additions differs.
          const double tol = bt == DType::BF16 ? 1e-2 : 1e-6;
          EXPECT_LT(relative_error(got.to(Device::cpu()), want), tol) << what;
          Tensor again = start.to(kCuda);
          bias_grad(gpu, to_device(dy, misaligned), again);
          EXPECT_EQ(bytes_of(again), bytes_of(got)) << "deterministic " << what;
        }
      }
    }
  }
}

TEST(GpuBiasGrad, NanStaysInItsColumn) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  Tensor dy = random_tensor({300, 16}, DType::BF16, 900);
  dy.set_item(299 * 16 + 3, NAN);
  Tensor dbias = Tensor::zeros({16}, DType::F32, kCuda);
  bias_grad(gpu, dy.to(kCuda), dbias);
  const std::vector<float> got = dbias.to_floats();
  for (int c = 0; c < 16; ++c) EXPECT_EQ(std::isnan(got[c]), c == 3) << c;
}

TEST(GpuSumOfSquares, MatchesTheCpuIntoADeviceSlot) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  uint64_t seed = 1000;
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{8}, int64_t{4099}, (int64_t{1} << 20) + 3,
                    int64_t{5} << 20}) {
    for (DType xt : {DType::F32, DType::BF16}) {
      for (DType ot : {DType::F32, DType::F64}) {
        for (bool misaligned : {false, true}) {
          const std::string what = "n=" + std::to_string(n) + " " + dtype_name(xt) + " -> " + dtype_name(ot) +
                                   (misaligned ? " misaligned" : "");
          const Tensor x = random_tensor({n}, xt, seed++, -3.0f, 3.0f);
          Tensor want = Tensor::empty({1}, ot);
          sum_of_squares(cpu, x, want);
          // Slot 1 of 3, as the optimizer keeps one slot per parameter; its neighbours stay put.
          Tensor slots = Tensor::from_doubles({-1, NAN, -2}, {3}, ot).to(kCuda);
          Tensor slot = slots.slice(0, 1, 2);
          sum_of_squares(gpu, to_device(x, misaligned), slot);
          const Tensor host = slots.to(Device::cpu());
          EXPECT_EQ(host.item(0), -1.0) << what;
          EXPECT_EQ(host.item(2), -2.0) << what;
          const double got = host.item(1), ref = want.item(0);
          EXPECT_NEAR(got, ref, (ot == DType::F64 ? 1e-12 : 1e-6) * std::max(1.0, ref)) << what;
          Tensor again = Tensor::empty({1}, ot, kCuda);
          sum_of_squares(gpu, to_device(x, misaligned), again);
          EXPECT_EQ(bytes_of(again), bytes_of(slot)) << "deterministic " << what;
        }
      }
    }
  }
}

TEST(GpuSumOfSquares, NanAndInfPropagate) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  Tensor out = Tensor::empty({1}, DType::F32, kCuda);
  sum_of_squares(gpu, Tensor::from_floats({1, 2, NAN, 4}, {4}).to(kCuda), out);
  EXPECT_TRUE(std::isnan(out.to(Device::cpu()).item(0)));
  sum_of_squares(gpu, Tensor::from_floats({1, -INFINITY, 3}, {3}).to(kCuda), out);
  EXPECT_EQ(out.to(Device::cpu()).item(0), INFINITY);
}
