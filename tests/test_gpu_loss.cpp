// CUDA cross-entropy forward and backward against the CPU reference: F32 and BF16 logits,
// I32 and I64 targets, vocabularies from 1 to Llama-3's 128256 and GPT-2's odd 50257,
// misaligned rows (scalar head and tail of the vectorised walk), ignored rows (also with
// ignore_index inside the vocabulary), a batch of pure padding, masked (-inf) and NaN
// logits, large logits, mixed-dtype and in-place gradients, F32 and F64 losses, and bad
// targets reported at the next call. Outputs poisoned first. Skipped without a GPU.
#include <cmath>
#include <string>

#include "tessera/core/allocator.h"
#include "tessera/ops/loss.h"
#include "gpu_rows_testing.h"

using namespace tessera;
using namespace tessera::testing;

TEST(GpuCrossEntropy, MatchesTheCpuReference) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  uint64_t seed = 300;
  // 4096 and 32768: the register kernel with a several-warp row group (BF16: 8 packed vectors a thread).
  const std::pair<int64_t, int64_t> shapes[] = {{1, 1},     {3, 5},     {17, 7},  {64, 1000}, {9, 50257},
                                               {4, 128256}, {0, 10},    {6, 4099}, {5, 4096},  {3, 32768}};
  for (DType t : {DType::F32, DType::BF16}) {
    for (auto [rows, vocab] : shapes) {
      for (bool misaligned : {false, true}) {
        const DType target_t = seed % 2 ? DType::I64 : DType::I32;
        const std::string what = std::string(dtype_name(t)) + " [" + std::to_string(rows) + ", " +
                                 std::to_string(vocab) + "]" + (misaligned ? " misaligned" : "");
        Tensor logits = random_tensor({rows, vocab}, t, seed++, -8.0f, 8.0f);
        const Tensor targets = make_targets(rows, vocab, target_t, seed++);
        if (rows >= 4 && vocab >= 3) {
          // Row 0: masked entries (not its target), so threads start from -inf; row 3: one dominant logit.
          for (int64_t v = 0; v < vocab - 1; v += 2)
            if (v != targets.item(0)) logits.set_item(v, -INFINITY);
          logits.set_item(3 * vocab + vocab / 2, 40.0f);
        }
        const Tensor logits_d = to_device(logits, misaligned), targets_d = targets.to(kCuda);

        Tensor loss = Tensor::empty({1}, DType::F32), lse = Tensor::empty({rows}, DType::F32);
        cross_entropy_forward(cpu, logits, targets, loss, lse);
        Tensor loss_d = poisoned_device({1}, DType::F32), lse_d = poisoned_device({rows}, DType::F32);
        cross_entropy_forward(gpu, logits_d, targets_d, loss_d, lse_d);
        expect_close_nan_exact(lse_d, lse, 1e-5, "lse " + what);
        expect_close_nan_exact(loss_d, loss, 1e-5, "loss " + what);
        Tensor loss64 = Tensor::empty({1}, DType::F64), loss64_d = poisoned_device({1}, DType::F64);
        cross_entropy_forward(cpu, logits, targets, loss64, lse);
        cross_entropy_forward(gpu, logits_d, targets_d, loss64_d, lse_d);
        expect_close_nan_exact(loss64_d, loss64, 1e-5, "f64 loss " + what);

        // In place: the gradient replaces a second device copy of the logits.
        Tensor in_place = to_device(logits, misaligned);
        expect_cross_entropy_backward_matches(logits, targets, lse, logits_d, targets_d, lse_d, in_place, what);
      }
    }
  }
}

TEST(GpuCrossEntropy, IgnoreIndexInsideTheVocabularyAndAllIgnored) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  const int64_t rows = 12, vocab = 33;
  Tensor logits = random_tensor({rows, vocab}, DType::F32, 400, -3.0f, 3.0f);
  for (int64_t ignore : {int64_t{5}, int64_t{-100}}) {
    const Tensor targets = make_targets(rows, vocab, DType::I64, 401, ignore);
    Tensor loss = Tensor::empty({1}, DType::F32), lse = Tensor::empty({rows}, DType::F32);
    cross_entropy_forward(cpu, logits, targets, loss, lse, {.ignore_index = ignore});
    Tensor loss_d = poisoned_device({1}, DType::F32), lse_d = poisoned_device({rows}, DType::F32);
    cross_entropy_forward(gpu, logits.to(kCuda), targets.to(kCuda), loss_d, lse_d, {.ignore_index = ignore});
    expect_close_nan_exact(loss_d, loss, 1e-5, "loss, ignore_index " + std::to_string(ignore));
    Tensor want = Tensor::empty({rows, vocab}, DType::F32), got = poisoned_device({rows, vocab}, DType::F32);
    cross_entropy_backward(cpu, logits, targets, lse, 1.0f, want, {.ignore_index = ignore});
    cross_entropy_backward(gpu, logits.to(kCuda), targets.to(kCuda), lse_d, 1.0f, got, {.ignore_index = ignore});
    expect_close_nan_exact(got, want, 1e-5, "d_logits, ignore_index " + std::to_string(ignore));
  }
  // Pure padding: loss 0, gradient 0, even over NaN logits.
  logits.set_item(7, NAN);
  const Tensor all_ignored = Tensor::from_ints(std::vector<int64_t>(rows, -100), {rows}, DType::I32);
  Tensor loss_d = poisoned_device({1}, DType::F32), lse_d = poisoned_device({rows}, DType::F32);
  cross_entropy_forward(gpu, logits.to(kCuda), all_ignored.to(kCuda), loss_d, lse_d);
  EXPECT_EQ(loss_d.to(Device::cpu()).item(0), 0.0);
  Tensor got = poisoned_device({rows, vocab}, DType::F32);
  cross_entropy_backward(gpu, logits.to(kCuda), all_ignored.to(kCuda), lse_d, 1.0f, got);
  for (double v : got.to(Device::cpu()).to_doubles()) EXPECT_EQ(v, 0.0);
}

TEST(GpuCrossEntropy, NanMaskedAndLargeLogits) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  const int64_t rows = 4, vocab = 1031;
  Tensor logits = random_tensor({rows, vocab}, DType::F32, 500, -1e4f, 1e4f);  // large: must stay finite
  logits.set_item(1 * vocab + 17, NAN);                                         // row 1: NaN
  for (int64_t v = 0; v < vocab; ++v) logits.set_item(2 * vocab + v, -INFINITY);  // row 2: fully masked
  const Tensor targets = Tensor::from_ints({3, 0, 5, 1030}, {rows}, DType::I32);
  Tensor loss = Tensor::empty({1}, DType::F32), lse = Tensor::empty({rows}, DType::F32);
  cross_entropy_forward(cpu, logits, targets, loss, lse);
  Tensor loss_d = poisoned_device({1}, DType::F32), lse_d = poisoned_device({rows}, DType::F32);
  cross_entropy_forward(gpu, logits.to(kCuda), targets.to(kCuda), loss_d, lse_d);
  const Tensor lse_h = lse_d.to(Device::cpu());
  EXPECT_TRUE(std::isfinite(lse_h.item(0)) && std::isfinite(lse_h.item(3)));
  EXPECT_TRUE(std::isnan(lse_h.item(1)) && std::isnan(lse_h.item(2)));
  EXPECT_TRUE(std::isnan(loss_d.to(Device::cpu()).item(0)));  // as on the CPU: a NaN row poisons the mean
  expect_close_nan_exact(lse_d, lse, 1e-6, "lse");
  Tensor want = Tensor::empty({rows, vocab}, DType::F32), got = poisoned_device({rows, vocab}, DType::F32);
  cross_entropy_backward(cpu, logits, targets, lse, 1.0f, want);
  cross_entropy_backward(gpu, logits.to(kCuda), targets.to(kCuda), lse_d, 1.0f, got);
  expect_close_nan_exact(got, want, 1e-5, "d_logits");
}

TEST(GpuCrossEntropy, BadTargetsAreReportedByTheNextCall) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  const int64_t rows = 3, vocab = 10;
  const Tensor logits = random_tensor({rows, vocab}, DType::F32, 600).to(kCuda);
  const Tensor bad = Tensor::from_ints({1, 10, -100}, {rows}, DType::I32).to(kCuda);
  const Tensor good = Tensor::from_ints({1, 2, 3}, {rows}, DType::I32).to(kCuda);
  Tensor loss = Tensor::empty({1}, DType::F32, kCuda), lse = Tensor::empty({rows}, DType::F32, kCuda);
  cross_entropy_forward(gpu, logits, bad, loss, lse);  // no throw here: no host sync
  EXPECT_TRUE(std::isnan(loss.to(Device::cpu()).item(0)));
  try {
    cross_entropy_forward(gpu, logits, good, loss, lse);
    ADD_FAILURE() << "the bad target was not reported";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("target 10"), std::string::npos) << msg;
    EXPECT_NE(msg.find("row 1"), std::string::npos) << msg;
  }
  EXPECT_NO_THROW(cross_entropy_forward(gpu, logits, good, loss, lse));

  Tensor d = poisoned_device({rows, vocab}, DType::F32);
  cross_entropy_backward(gpu, logits, bad, lse, 1.0f, d);
  const Tensor dh = d.to(Device::cpu());
  for (int64_t v = 0; v < vocab; ++v) {
    EXPECT_TRUE(std::isnan(dh.item(vocab + v)));  // the bad row
    EXPECT_EQ(dh.item(2 * vocab + v), 0.0);       // the ignored row
    EXPECT_TRUE(std::isfinite(dh.item(v)));
  }
  EXPECT_THROW(cross_entropy_backward(gpu, logits, good, lse, 1.0f, d), Error);
  EXPECT_NO_THROW(cross_entropy_backward(gpu, logits, good, lse, 1.0f, d));
}

// The LM head's layout on the GPU: logits with a row stride padded to a multiple of 8
// (GPT-2's 50257 -> 50264), the backward in place into the same view.
TEST(GpuCrossEntropy, RowStridedLogitsInPlace) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU present (or no CUDA backend in this build): skipping GPU test";
  Context cpu = Context::cpu(), gpu = Context::cuda();
  for (DType t : {DType::BF16, DType::F32}) {
    const int64_t rows = 9, vocab = 50257, ld = 50264;
    const Tensor host = random_tensor({rows, vocab}, t, 77, -4, 4);
    const Tensor targets = make_targets(rows, vocab, DType::I32, 78);
    Tensor loss = Tensor::empty({1}, DType::F32), lse = Tensor::empty({rows}, DType::F32);
    cross_entropy_forward(cpu, host, targets, loss, lse);
    Tensor d_want = Tensor::empty({rows, vocab}, t);
    cross_entropy_backward(cpu, host, targets, lse, 1.0f, d_want);

    Tensor buf = Tensor::empty({rows, ld}, t, kCuda);
    Tensor logits = buf.slice(1, 0, vocab);
    logits.copy_from(host.to(kCuda));
    const Tensor dev_targets = targets.to(kCuda);
    Tensor g_loss = Tensor::empty({1}, DType::F32, kCuda), g_lse = Tensor::empty({rows}, DType::F32, kCuda);
    cross_entropy_forward(gpu, logits, dev_targets, g_loss, g_lse);
    EXPECT_NEAR(g_loss.to(Device::cpu()).item(0), loss.item(0), 1e-5 * std::abs(loss.item(0))) << dtype_name(t);
    expect_close_nan_exact(g_lse, lse, 1e-5, "lse");
    cross_entropy_backward(gpu, logits, dev_targets, g_lse, 1.0f, logits);
    expect_close_nan_exact(logits.contiguous(), d_want, row_tolerance(t),
                           std::string("in-place strided backward ") + dtype_name(t));
  }
}
