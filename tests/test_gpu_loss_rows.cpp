// The CUDA cross-entropy under every kernel choice (cuda::RowTuning: the previous kernels;
// the warp-row forward with automatic and forced lanes per row; the flat backward with 4 and
// 8 vectors a thread) against the CPU reference: vocabularies 7 (fallback), 768, 1000, 4096
// (warp-row), 8192 and 50304 (too wide for a warp: the fallback forward, the flat backward),
// row counts that leave a block partly empty, F32 and BF16 logits, I32 and I64 targets,
// ignored rows, a masked entry, a fully masked row, a NaN row, large logits, a padded row
// stride, F32 gradients of BF16 logits and the gradient in place; bad targets reported.
// Outputs poisoned first. Skipped without a GPU.
#include <cmath>
#include <string>
#include <vector>

#include "gpu_rows_testing.h"
#include "tessera/ops/loss.h"

using namespace tessera;
using namespace tessera::testing;

TEST(GpuCrossEntropyRows, EveryKernelChoiceMatchesTheCpuReference) {
  REQUIRE_GPU();
#if TESSERA_WITH_CUDA
  Context cpu = Context::cpu(), gpu = Context::cuda();
  const std::vector<RowChoice> choices = {{"previous", {1, 1, 1, 0, 0}},
                                          {"warp-row auto, flat 4", {}},
                                          {"warp-row 4 lanes, flat 8", {0, 0, 0, 4, 8}},
                                          {"warp-row 8 lanes", {0, 0, 0, 8, 0}},
                                          {"warp-row 16 lanes", {0, 0, 0, 16, 0}},
                                          {"warp-row 32 lanes", {0, 0, 0, 32, 8}}};
  uint64_t seed = 1300;
  for_each_row_choice(choices, [&](const RowChoice& choice) {
    for_each_row_shape([&](DType t, int64_t rows, int64_t vocab) {
      for (bool padded : {false, true}) {
        const DType target_t = seed % 2 ? DType::I64 : DType::I32;
        const std::string what = row_case_name(choice.name, t, rows, vocab) + (padded ? " padded stride" : "");
        Tensor logits = random_tensor({rows, vocab}, t, seed++, -8.0f, 8.0f);
        const Tensor targets = make_targets(rows, vocab, target_t, seed++);
        if (rows >= 6) set_special_rows(logits, targets);  // masked, all masked, NaN and large rows
        // Device logits: contiguous, or rows of `vocab` in a buffer whose stride is rounded up to 8 (+8).
        const int64_t ld = padded ? (vocab + 7) / 8 * 8 + 8 : vocab;
        Tensor buffer = Tensor::zeros({rows, ld}, t, kCuda);
        Tensor logits_d = buffer.slice(1, 0, vocab);
        logits_d.copy_from(logits.to(kCuda));
        const Tensor targets_d = targets.to(kCuda);

        Tensor loss = Tensor::empty({1}, DType::F32), lse = Tensor::empty({rows}, DType::F32);
        cross_entropy_forward(cpu, logits, targets, loss, lse);
        Tensor loss_d = poisoned_device({1}, DType::F32), lse_d = poisoned_device({rows}, DType::F32);
        cross_entropy_forward(gpu, logits_d, targets_d, loss_d, lse_d);
        expect_close_nan_exact(lse_d, lse, 1e-5, "lse " + what);
        expect_close_nan_exact(loss_d, loss, 1e-5, "loss " + what);  // NaN here: row 3's target is valid
        // Without the special rows' NaN: a finite loss to compare.
        if (rows >= 6) {
          std::vector<int64_t> tv(static_cast<size_t>(rows));
          for (int64_t i = 0; i < rows; ++i) tv[i] = (i == 1 || i == 3) ? -100 : int64_t(targets.item(i));
          const Tensor t2 = Tensor::from_ints(tv, {rows}, target_t);
          Tensor loss2 = Tensor::empty({1}, DType::F64), loss2_d = poisoned_device({1}, DType::F64);
          cross_entropy_forward(cpu, logits, t2, loss2, lse);
          cross_entropy_forward(gpu, logits_d, t2.to(kCuda), loss2_d, lse_d);
          EXPECT_TRUE(std::isfinite(loss2.item(0))) << what;
          expect_close_nan_exact(loss2_d, loss2, 1e-5, "finite f64 loss " + what);
        }

        // In place, last, into the (possibly padded) logits view.
        expect_cross_entropy_backward_matches(logits, targets, lse, logits_d, targets_d, lse_d, logits_d, what);
      }
    });
    // Bad targets: a NaN loss and row, reported by the next call, under every choice.
    {
      const int64_t rows = 40, vocab = 768;
      const Tensor logits = random_tensor({rows, vocab}, DType::BF16, seed++).to(kCuda);
      std::vector<int64_t> bad_v(rows, 1), good_v(rows, 1);
      bad_v[33] = vocab;
      bad_v[5] = -100;
      const Tensor bad = Tensor::from_ints(bad_v, {rows}, DType::I32).to(kCuda);
      const Tensor good = Tensor::from_ints(good_v, {rows}, DType::I32).to(kCuda);
      Tensor loss = Tensor::empty({1}, DType::F32, kCuda), lse = Tensor::empty({rows}, DType::F32, kCuda);
      cross_entropy_forward(gpu, logits, bad, loss, lse);
      EXPECT_TRUE(std::isnan(loss.to(Device::cpu()).item(0))) << choice.name;
      EXPECT_THROW(cross_entropy_forward(gpu, logits, good, loss, lse), Error) << choice.name;
      EXPECT_NO_THROW(cross_entropy_forward(gpu, logits, good, loss, lse)) << choice.name;
      Tensor d = poisoned_device({rows, vocab}, DType::BF16);
      cross_entropy_backward(gpu, logits, bad, lse, 1.0f, d);
      const Tensor dh = d.to(Device::cpu());
      for (int64_t v = 0; v < vocab; ++v) {
        EXPECT_TRUE(std::isnan(dh.item(33 * vocab + v))) << choice.name;
        EXPECT_EQ(dh.item(5 * vocab + v), 0.0) << choice.name;
        EXPECT_TRUE(std::isfinite(dh.item(v))) << choice.name;
      }
      try {
        cross_entropy_backward(gpu, logits, good, lse, 1.0f, d);
        ADD_FAILURE() << "the bad target was not reported: " << choice.name;
      } catch (const Error& e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find("row 33"), std::string::npos) << msg;
      }
      EXPECT_NO_THROW(cross_entropy_backward(gpu, logits, good, lse, 1.0f, d)) << choice.name;
    }
  });
#endif
}

// Deterministic: the same loss bits from two runs (fixed-order sums).
TEST(GpuCrossEntropyRows, LossIsDeterministic) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  const int64_t rows = 5000, vocab = 768;
  const Tensor logits = random_tensor({rows, vocab}, DType::BF16, 55, -6.0f, 6.0f).to(kCuda);
  const Tensor targets = make_targets(rows, vocab, DType::I64, 56).to(kCuda);
  Tensor a = poisoned_device({1}, DType::F64), b = poisoned_device({1}, DType::F64);
  Tensor lse = Tensor::empty({rows}, DType::F32, kCuda);
  cross_entropy_forward(gpu, logits, targets, a, lse);
  cross_entropy_forward(gpu, logits, targets, b, lse);
  EXPECT_EQ(bytes_of(a), bytes_of(b));
}
