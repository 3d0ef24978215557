// The CUDA softmax forward under every kernel choice (cuda::RowTuning: the previous kernels,
// the warp-row kernel with automatic and forced lanes per row) against the CPU reference:
// widths 7 (scalar fallback), 768, 1000, 4096 (warp-row), 8192 and 50304 (too wide for a
// warp's registers: the fallback), row counts that leave a block partly empty, F32 and BF16,
// with a masked entry, a fully masked row, a NaN row, a +inf row and large logits (NaN rows
// must be NaN on both sides, and nothing else may be); the backward once per choice (it has
// one kernel). Outputs poisoned first. Skipped without a GPU.
#include <cmath>
#include <string>
#include <vector>

#include "gpu_rows_testing.h"
#include "tessera/ops/softmax.h"

using namespace tessera;
using namespace tessera::testing;

TEST(GpuSoftmaxRows, EveryKernelChoiceMatchesTheCpuReference) {
  REQUIRE_GPU();
#if TESSERA_WITH_CUDA
  Context cpu = Context::cpu(), gpu = Context::cuda();
  const std::vector<RowChoice> choices = {
      {"previous", {1, 1, 1, 0, 0}},           {"warp-row auto", {}},
      {"warp-row 4 lanes", {0, 0, 0, 4, 0}},   {"warp-row 8 lanes", {0, 0, 0, 8, 0}},
      {"warp-row 16 lanes", {0, 0, 0, 16, 0}}, {"warp-row 32 lanes", {0, 0, 0, 32, 0}}};
  uint64_t seed = 900;
  for_each_row_choice(choices, [&](const RowChoice& choice) {
    for_each_row_shape([&](DType t, int64_t rows, int64_t cols) {
      const std::string what = row_case_name(choice.name, t, rows, cols);
      Tensor x = random_tensor({rows, cols}, t, seed++, -8.0f, 8.0f);
      if (rows >= 6) {
        x.set_item(1, -INFINITY);                                            // row 0: one masked entry
        for (int64_t c = 0; c < cols; ++c) x.set_item(cols + c, -INFINITY);  // row 1: fully masked
        x.set_item(2 * cols + cols / 2, NAN);                                // row 2: NaN
        x.set_item(3 * cols + cols - 1, INFINITY);                           // row 3: +inf (NaN, as on the CPU)
        for (int64_t c = 0; c < cols; ++c)                                   // row 4: large logits
          x.set_item(4 * cols + c, 1000.0 * x.item(4 * cols + c));
      }
      const double tol = row_tolerance(t);
      Tensor want = Tensor::empty({rows, cols}, t);
      softmax_forward(cpu, x, want);
      Tensor got = poisoned_device({rows, cols}, t);
      softmax_forward(gpu, x.to(kCuda), got);
      expect_close_nan_exact(got, want, tol, "forward " + what);
      // Misaligned rows take the previous kernels whatever the choice.
      Tensor got_mis = poisoned_device({rows, cols}, t, true);
      softmax_forward(gpu, to_device(x, true), got_mis);
      expect_close_nan_exact(got_mis, want, tol, "misaligned forward " + what);
      if (choice.tuning.group == 0 && choice.tuning.softmax_forward == 0) {
        Tensor y = random_tensor({rows, cols}, t, seed++, 0.0f, 1.0f), dy = random_tensor({rows, cols}, t, seed++);
        Tensor dwant = Tensor::empty({rows, cols}, t);
        softmax_backward(cpu, y, dy, dwant);
        Tensor dgot = poisoned_device({rows, cols}, t);
        softmax_backward(gpu, y.to(kCuda), dy.to(kCuda), dgot);
        expect_close_nan_exact(dgot, dwant, tol, "backward " + what);
      }
    });
  });
#endif
}

// The forward is deterministic: the same bits from two runs (and on every lane of a row).
TEST(GpuSoftmaxRows, WarpRowKernelIsDeterministic) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  const Tensor x = random_tensor({257, 768}, DType::BF16, 77, -6.0f, 6.0f).to(kCuda);
  Tensor a = poisoned_device({257, 768}, DType::BF16), b = poisoned_device({257, 768}, DType::BF16);
  softmax_forward(gpu, x, a);
  softmax_forward(gpu, x, b);
  EXPECT_EQ(bytes_of(a), bytes_of(b));
}
