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

#include "gpu_testing.h"
#include "tessera/ops/softmax.h"
#if TESSERA_WITH_CUDA
#include "backend/cuda/softmax_tuning.h"
#endif

using namespace tessera;
using namespace tessera::testing;

namespace {

// NaN exactly where the reference has NaN, a small relative error elsewhere.
void expect_close(const Tensor& got_device, const Tensor& want, double tol, const std::string& what) {
  const std::vector<double> got = got_device.to(Device::cpu()).to_doubles(), ref = want.to_doubles();
  ASSERT_EQ(got.size(), ref.size()) << what;
  std::vector<double> g, r;
  int64_t nan_mismatch = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(ref[i]) || std::isnan(got[i])) {
      if (std::isnan(ref[i]) != std::isnan(got[i]) && nan_mismatch++ < 3)
        ADD_FAILURE() << what << ": element " << i << " is " << got[i] << ", want " << ref[i];
      continue;
    }
    g.push_back(got[i]);
    r.push_back(ref[i]);
  }
  EXPECT_EQ(nan_mismatch, 0) << what;
  EXPECT_LT(relative_error(g, r), tol) << what;
}

}  // namespace

TEST(GpuSoftmaxRows, EveryKernelChoiceMatchesTheCpuReference) {
  REQUIRE_GPU();
#if TESSERA_WITH_CUDA
  Context cpu = Context::cpu(), gpu = Context::cuda();
  struct Choice {
    const char* name;
    cuda::RowTuning tuning;
  };
  const Choice choices[] = {{"previous", {1, 1, 1, 0, 0}}, {"warp-row auto", {}},
                            {"warp-row 4 lanes", {0, 0, 0, 4, 0}}, {"warp-row 8 lanes", {0, 0, 0, 8, 0}},
                            {"warp-row 16 lanes", {0, 0, 0, 16, 0}}, {"warp-row 32 lanes", {0, 0, 0, 32, 0}}};
  uint64_t seed = 900;
  for (const Choice& choice : choices) {
    cuda::set_row_tuning(choice.tuning);
    for (DType t : {DType::F32, DType::BF16}) {
      for (auto [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{
               {37, 7}, {37, 768}, {33, 1000}, {9, 4096}, {6, 8192}, {6, 50304}, {1, 8}, {131, 64}}) {
        const std::string what = std::string(choice.name) + " " + dtype_name(t) + " [" + std::to_string(rows) +
                                 ", " + std::to_string(cols) + "]";
        Tensor x = random_tensor({rows, cols}, t, seed++, -8.0f, 8.0f);
        if (rows >= 6) {
          x.set_item(1, -INFINITY);                                            // row 0: one masked entry
          for (int64_t c = 0; c < cols; ++c) x.set_item(cols + c, -INFINITY);  // row 1: fully masked
          x.set_item(2 * cols + cols / 2, NAN);                                // row 2: NaN
          x.set_item(3 * cols + cols - 1, INFINITY);                           // row 3: +inf (NaN, as on the CPU)
          for (int64_t c = 0; c < cols; ++c)                                   // row 4: large logits
            x.set_item(4 * cols + c, 1000.0 * x.item(4 * cols + c));
        }
        const double tol = t == DType::BF16 ? 1e-2 : 1e-5;
        Tensor want = Tensor::empty({rows, cols}, t);
        softmax_forward(cpu, x, want);
        Tensor got = poisoned_device({rows, cols}, t);
        softmax_forward(gpu, x.to(kCuda), got);
        expect_close(got, want, tol, "forward " + what);
        // Misaligned rows take the previous kernels whatever the choice.
        Tensor got_mis = poisoned_device({rows, cols}, t, true);
        softmax_forward(gpu, to_device(x, true), got_mis);
        expect_close(got_mis, want, tol, "misaligned forward " + what);
        if (choice.tuning.group == 0 && choice.tuning.softmax_forward == 0) {
          Tensor y = random_tensor({rows, cols}, t, seed++, 0.0f, 1.0f), dy = random_tensor({rows, cols}, t, seed++);
          Tensor dwant = Tensor::empty({rows, cols}, t);
          softmax_backward(cpu, y, dy, dwant);
          Tensor dgot = poisoned_device({rows, cols}, t);
          softmax_backward(gpu, y.to(kCuda), dy.to(kCuda), dgot);
          expect_close(dgot, dwant, tol, "backward " + what);
        }
      }
    }
  }
  cuda::set_row_tuning({});
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
