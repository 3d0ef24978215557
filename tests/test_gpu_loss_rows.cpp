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

#include "gpu_testing.h"
#include "tessera/ops/loss.h"
#if TESSERA_WITH_CUDA
#include "backend/cuda/softmax_tuning.h"
#endif

using namespace tessera;
using namespace tessera::testing;

namespace {

// Targets in [0, vocab), every fourth row ignore_index.
Tensor make_targets(int64_t rows, int64_t vocab, DType t, uint64_t seed, int64_t ignore_index = -100) {
  Tensor u = random_tensor({rows}, DType::F64, seed, 0.0f, 1.0f);
  std::vector<int64_t> v(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i)
    v[i] = i % 4 == 2 ? ignore_index : std::min<int64_t>(vocab - 1, static_cast<int64_t>(u.item(i) * vocab));
  return Tensor::from_ints(v, {rows}, t);
}

// NaN exactly where the reference has NaN, and a small relative error elsewhere.
void expect_close(const Tensor& got_device, const Tensor& want, double tol, const std::string& what) {
  const std::vector<double> got = got_device.contiguous().to(Device::cpu()).to_doubles(), ref = want.to_doubles();
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

double tolerance(DType t) { return t == DType::BF16 ? 1e-2 : 1e-5; }

}  // namespace

TEST(GpuCrossEntropyRows, EveryKernelChoiceMatchesTheCpuReference) {
  REQUIRE_GPU();
#if TESSERA_WITH_CUDA
  Context cpu = Context::cpu(), gpu = Context::cuda();
  struct Choice {
    const char* name;
    cuda::RowTuning tuning;
  };
  const Choice choices[] = {{"previous", {1, 1, 1, 0, 0}},          {"warp-row auto, flat 4", {}},
                            {"warp-row 4 lanes, flat 8", {0, 0, 0, 4, 8}}, {"warp-row 8 lanes", {0, 0, 0, 8, 0}},
                            {"warp-row 16 lanes", {0, 0, 0, 16, 0}},   {"warp-row 32 lanes", {0, 0, 0, 32, 8}}};
  uint64_t seed = 1300;
  for (const Choice& choice : choices) {
    cuda::set_row_tuning(choice.tuning);
    for (DType t : {DType::F32, DType::BF16}) {
      for (auto [rows, vocab] : std::vector<std::pair<int64_t, int64_t>>{
               {37, 7}, {37, 768}, {33, 1000}, {9, 4096}, {6, 8192}, {6, 50304}, {1, 8}, {131, 64}}) {
        for (bool padded : {false, true}) {
          const DType target_t = seed % 2 ? DType::I64 : DType::I32;
          const std::string what = std::string(choice.name) + " " + dtype_name(t) + " [" + std::to_string(rows) +
                                   ", " + std::to_string(vocab) + "]" + (padded ? " padded stride" : "");
          Tensor logits = random_tensor({rows, vocab}, t, seed++, -8.0f, 8.0f);
          const Tensor targets = make_targets(rows, vocab, target_t, seed++);
          if (rows >= 6) {
            for (int64_t v = 0; v < vocab - 1; v += 2)  // row 0: masked entries (not its target)
              if (v != targets.item(0)) logits.set_item(v, -INFINITY);
            for (int64_t v = 0; v < vocab; ++v) logits.set_item(1 * vocab + v, -INFINITY);  // row 1: all masked
            logits.set_item(3 * vocab + vocab / 3, NAN);                                     // row 3: NaN
            for (int64_t v = 0; v < vocab; ++v)                                                // row 4: large
              logits.set_item(4 * vocab + v, 1000.0 * logits.item(4 * vocab + v));
          }
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
          expect_close(lse_d, lse, 1e-5, "lse " + what);
          expect_close(loss_d, loss, 1e-5, "loss " + what);  // NaN here: row 3's target is valid
          // Without the special rows' NaN: a finite loss to compare.
          if (rows >= 6) {
            std::vector<int64_t> tv(static_cast<size_t>(rows));
            for (int64_t i = 0; i < rows; ++i) tv[i] = (i == 1 || i == 3) ? -100 : int64_t(targets.item(i));
            const Tensor t2 = Tensor::from_ints(tv, {rows}, target_t);
            Tensor loss2 = Tensor::empty({1}, DType::F64), loss2_d = poisoned_device({1}, DType::F64);
            cross_entropy_forward(cpu, logits, t2, loss2, lse);
            cross_entropy_forward(gpu, logits_d, t2.to(kCuda), loss2_d, lse_d);
            EXPECT_TRUE(std::isfinite(loss2.item(0))) << what;
            expect_close(loss2_d, loss2, 1e-5, "finite f64 loss " + what);
          }

          const float d_loss = 0.75f;
          for (DType out_t : {t, DType::F32}) {
            Tensor want = Tensor::empty({rows, vocab}, out_t);
            cross_entropy_backward(cpu, logits, targets, lse, d_loss, want);
            Tensor got = poisoned_device({rows, vocab}, out_t);
            cross_entropy_backward(gpu, logits_d, targets_d, lse_d, d_loss, got);
            expect_close(got, want, tolerance(out_t), std::string("d_logits ") + dtype_name(out_t) + " " + what);
          }
          // In place, into the (possibly padded) logits view.
          Tensor want = Tensor::empty({rows, vocab}, t);
          cross_entropy_backward(cpu, logits, targets, lse, d_loss, want);
          cross_entropy_backward(gpu, logits_d, targets_d, lse_d, d_loss, logits_d);
          expect_close(logits_d, want, tolerance(t), "in-place d_logits " + what);
        }
      }
    }
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
  }
  cuda::set_row_tuning({});
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
