// cross_entropy_forward_backward: the loss, lse and gradient in one call. On the CPU it is
// the two ops in turn (checked here against them); on CUDA, LM-head vocabularies (16384 to
// 262144, aligned rows) take one pass over the logits (backend/cuda/loss_fused.cu), checked
// against the CPU reference: GPT-2's 50257 (a partial last vector) in a padded buffer,
// Llama-3's 128256, 16384, 32000 and 200000 (the four register depths of the kernel), F32 and
// BF16 logits, I32 and I64 targets, ignored rows, masked entries, a fully masked row, a NaN
// row, large logits, in place and into a separate buffer; the kernel choice that turns the
// fusion off; an all-ignored batch; bad targets reported by the next call. GPU cases are
// skipped without a GPU.
#include <cmath>
#include <string>
#include <vector>

#include "gpu_rows_testing.h"
#include "tessera/ops/loss.h"
#if TESSERA_WITH_CUDA
#include "backend/cuda/loss.h"
#endif

using namespace tessera;
using namespace tessera::testing;

namespace {

// The CPU reference: the forward, then the backward with its lse.
struct Reference {
  Tensor loss, lse, d_logits;
};
#if TESSERA_WITH_CUDA
// The fusion on (whatever the default) for a test's lifetime.
struct FusionOn {
  FusionOn() {
    cuda::RowTuning t;
    t.cross_entropy_fused = 0;
    cuda::set_row_tuning(t);
  }
  ~FusionOn() { cuda::set_row_tuning({}); }
};
#endif

Reference reference(const Tensor& logits, const Tensor& targets, float d_loss) {
  Context cpu = Context::cpu();
  Reference r{Tensor::empty({1}, DType::F64), Tensor::empty({logits.size(0)}, DType::F32),
              Tensor::empty(logits.shape(), logits.dtype())};
  cross_entropy_forward(cpu, logits, targets, r.loss, r.lse);
  cross_entropy_backward(cpu, logits, targets, r.lse, d_loss, r.d_logits);
  return r;
}

}  // namespace

TEST(CrossEntropyForwardBackward, CpuIsTheForwardThenTheBackward) {
  Context cpu = Context::cpu();
  const Tensor logits = random_tensor({12, 300}, DType::F32, 7, -5.0f, 5.0f);
  const Tensor targets = make_targets(12, 300, DType::I64, 8);
  const Reference want = reference(logits, targets, 0.5f);
  Tensor loss = Tensor::empty({1}, DType::F64), lse = Tensor::empty({12}, DType::F32);
  Tensor d_logits = logits.clone();
  cross_entropy_forward_backward(cpu, d_logits, targets, loss, lse, 0.5f, d_logits);  // in place
  EXPECT_EQ(bytes_of(loss), bytes_of(want.loss));
  EXPECT_EQ(bytes_of(lse), bytes_of(want.lse));
  EXPECT_EQ(bytes_of(d_logits), bytes_of(want.d_logits));
  Tensor short_lse = Tensor::empty({11}, DType::F32);
  EXPECT_THROW(cross_entropy_forward_backward(cpu, logits, targets, loss, short_lse, 0.5f, d_logits), Error);
}

TEST(GpuCrossEntropyForwardBackward, OnePassMatchesTheCpuReference) {
  REQUIRE_GPU();
#if TESSERA_WITH_CUDA
  Context gpu = Context::cuda();
  FusionOn fusion_on;
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {37, 50257}, {9, 128256}, {13, 16384}, {6, 32000}, {6, 200000}};
  uint64_t seed = 4100;
  for (DType t : {DType::F32, DType::BF16}) {
    for (auto [rows, vocab] : shapes) {
      for (bool in_place : {true, false}) {
        const DType target_t = seed % 2 ? DType::I64 : DType::I32;
        const std::string what = std::string(dtype_name(t)) + " [" + std::to_string(rows) + ", " +
                                 std::to_string(vocab) + "]" + (in_place ? " in place" : " separate");
        Tensor logits = random_tensor({rows, vocab}, t, seed++, -8.0f, 8.0f);
        const Tensor targets = make_targets(rows, vocab, target_t, seed++);
        set_special_rows(logits, targets);  // masked, all masked, NaN and large rows
        // Rows in a buffer whose stride is rounded up to 8 (+8 when separate), as the LM head's.
        const int64_t ld = (vocab + 7) / 8 * 8 + (in_place ? 0 : 8);
        Tensor buffer = Tensor::zeros({rows, ld}, t, kCuda);
        Tensor logits_d = buffer.slice(1, 0, vocab);
        logits_d.copy_from(logits.to(kCuda));
        Tensor out_buffer = Tensor::zeros({rows, ld}, t, kCuda);
        Tensor d_logits_d = in_place ? logits_d : out_buffer.slice(1, 0, vocab);
        const Tensor targets_d = targets.to(kCuda);
        Tensor loss_d = poisoned_device({1}, DType::F64), lse_d = poisoned_device({rows}, DType::F32);
        ASSERT_TRUE(cuda::cross_entropy_fused_supported(logits_d, loss_d, lse_d, d_logits_d)) << what;

        const float d_loss = 0.75f;
        const Reference want = reference(logits, targets, d_loss);
        cross_entropy_forward_backward(gpu, logits_d, targets_d, loss_d, lse_d, d_loss, d_logits_d);
        expect_close_nan_exact(lse_d, want.lse, 1e-5, "lse " + what);
        expect_close_nan_exact(loss_d, want.loss, 1e-5, "loss " + what);  // NaN: row 3's target is valid
        expect_close_nan_exact(d_logits_d, want.d_logits, row_tolerance(t), "d_logits " + what);
        // The padding columns are left alone (the LM head's GEMMs read them as 0).
        const Tensor rest = (in_place ? buffer : out_buffer).slice(1, vocab, ld).to(Device::cpu());
        for (int64_t i = 0; i < rest.numel(); ++i) ASSERT_EQ(rest.contiguous().item(i), 0.0) << what;

        // A finite loss without the special rows, in F32.
        std::vector<int64_t> tv(static_cast<size_t>(rows));
        for (int64_t i = 0; i < rows; ++i) tv[i] = (i == 1 || i == 3) ? -100 : int64_t(targets.item(i));
        const Tensor t2 = Tensor::from_ints(tv, {rows}, target_t);
        const Reference want2 = reference(logits, t2, 1.0f);
        Tensor loss2_d = poisoned_device({1}, DType::F32);
        logits_d.copy_from(logits.to(kCuda));
        Tensor d2 = in_place ? logits_d : d_logits_d;
        cross_entropy_forward_backward(gpu, logits_d, t2.to(kCuda), loss2_d, lse_d, 1.0f, d2);
        EXPECT_TRUE(std::isfinite(want2.loss.item(0))) << what;
        expect_close_nan_exact(loss2_d, want2.loss, 1e-5, "finite loss " + what);
        expect_close_nan_exact(d2, want2.d_logits, row_tolerance(t), "d_logits (finite) " + what);
      }
    }
  }
#endif
}

// The kernel choice that turns the fusion off gives the two kernels' results; the fused
// result is the same within rounding and deterministic.
TEST(GpuCrossEntropyForwardBackward, FusionOffAndDeterminism) {
  REQUIRE_GPU();
#if TESSERA_WITH_CUDA
  Context gpu = Context::cuda();
  const int64_t rows = 64, vocab = 50304;
  const Tensor logits = random_tensor({rows, vocab}, DType::BF16, 77, -6.0f, 6.0f).to(kCuda);
  const Tensor targets = make_targets(rows, vocab, DType::I64, 78).to(kCuda);
  auto run = [&](int fused) {
    cuda::RowTuning tuning;
    tuning.cross_entropy_fused = fused;
    cuda::set_row_tuning(tuning);
    Reference r{poisoned_device({1}, DType::F64), poisoned_device({rows}, DType::F32),
                poisoned_device({rows, vocab}, DType::BF16)};
    cross_entropy_forward_backward(gpu, logits, targets, r.loss, r.lse, 1.0f, r.d_logits);
    cuda::set_row_tuning({});
    return r;
  };
  const Reference fused = run(0), again = run(0), separate = run(1);
  EXPECT_EQ(bytes_of(fused.loss), bytes_of(again.loss));
  EXPECT_EQ(bytes_of(fused.d_logits), bytes_of(again.d_logits));
  expect_close_nan_exact(fused.loss, separate.loss.to(Device::cpu()), 1e-6, "loss, fused against separate");
  expect_close_nan_exact(fused.d_logits, separate.d_logits.to(Device::cpu()), 1e-2, "d_logits, fused against separate");
  // Separate really is the two ops: the backward's bytes from the forward's lse.
  Tensor d = poisoned_device({rows, vocab}, DType::BF16);
  cross_entropy_backward(gpu, logits, targets, separate.lse, 1.0f, d);
  EXPECT_EQ(bytes_of(d), bytes_of(separate.d_logits));
#endif
}

TEST(GpuCrossEntropyForwardBackward, AllIgnoredAndBadTargets) {
  REQUIRE_GPU();
#if TESSERA_WITH_CUDA
  Context gpu = Context::cuda();
  FusionOn fusion_on;
  const int64_t rows = 40, vocab = 32768;
  const Tensor logits = random_tensor({rows, vocab}, DType::BF16, 91).to(kCuda);
  Tensor loss = poisoned_device({1}, DType::F32), lse = Tensor::empty({rows}, DType::F32, kCuda);
  Tensor d = poisoned_device({rows, vocab}, DType::BF16);
  const Tensor ignored = Tensor::from_ints(std::vector<int64_t>(rows, -100), {rows}, DType::I32).to(kCuda);
  cross_entropy_forward_backward(gpu, logits, ignored, loss, lse, 1.0f, d);
  EXPECT_EQ(loss.to(Device::cpu()).item(0), 0.0);
  const std::vector<double> zeros = d.to(Device::cpu()).to_doubles();
  for (double z : zeros) ASSERT_EQ(z, 0.0);

  std::vector<int64_t> bad_v(rows, 1), good_v(rows, 1);
  bad_v[33] = vocab;
  bad_v[5] = -100;
  const Tensor bad = Tensor::from_ints(bad_v, {rows}, DType::I64).to(kCuda);
  const Tensor good = Tensor::from_ints(good_v, {rows}, DType::I64).to(kCuda);
  cross_entropy_forward_backward(gpu, logits, bad, loss, lse, 1.0f, d);
  EXPECT_TRUE(std::isnan(loss.to(Device::cpu()).item(0)));
  const Tensor dh = d.to(Device::cpu());
  for (int64_t v = 0; v < vocab; v += 97) {
    EXPECT_TRUE(std::isnan(dh.item(33 * vocab + v)));
    EXPECT_EQ(dh.item(5 * vocab + v), 0.0);
    EXPECT_TRUE(std::isfinite(dh.item(v)));
  }
  try {
    cross_entropy_forward_backward(gpu, logits, good, loss, lse, 1.0f, d);
    ADD_FAILURE() << "the bad target was not reported";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("row 33"), std::string::npos) << msg;
  }
  EXPECT_NO_THROW(cross_entropy_forward_backward(gpu, logits, good, loss, lse, 1.0f, d));
#endif
}
