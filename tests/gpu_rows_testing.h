// Helpers shared by the GPU tests of the row kernels (softmax and cross-entropy:
// test_gpu_loss.cpp, test_gpu_loss_rows.cpp, test_gpu_softmax_rows.cpp): targets with ignored
// rows, a comparison that demands NaN exactly where the reference has it, and the loop over
// every kernel choice (cuda::RowTuning), dtype and row shape.
#pragma once

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "gpu_testing.h"
#include "tessera/ops/loss.h"
#if TESSERA_WITH_CUDA
#include "backend/cuda/softmax_tuning.h"
#endif

namespace tessera::testing {

// Targets in [0, vocab), every fourth row ignore_index.
inline Tensor make_targets(int64_t rows, int64_t vocab, DType t, uint64_t seed, int64_t ignore_index = -100) {
  Tensor u = random_tensor({rows}, DType::F64, seed, 0.0f, 1.0f);
  std::vector<int64_t> v(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i)
    v[i] = i % 4 == 2 ? ignore_index : std::min<int64_t>(vocab - 1, static_cast<int64_t>(u.item(i) * vocab));
  return Tensor::from_ints(v, {rows}, t);
}

// The rows every row-kernel test plants in its logits (rows >= 5): row 0 has every other
// entry but its target masked to -inf, row 1 is all -inf, row 3 holds one NaN, row 4 is
// scaled by 1000 (exp overflows without the max subtracted).
inline void set_special_rows(Tensor& logits, const Tensor& targets) {
  const int64_t vocab = logits.size(1);
  for (int64_t v = 0; v < vocab - 1; v += 2)
    if (v != targets.item(0)) logits.set_item(v, -INFINITY);
  for (int64_t v = 0; v < vocab; ++v) logits.set_item(1 * vocab + v, -INFINITY);
  logits.set_item(3 * vocab + vocab / 3, NAN);
  for (int64_t v = 0; v < vocab; ++v) logits.set_item(4 * vocab + v, 1000.0 * logits.item(4 * vocab + v));
}

// NaN exactly where the reference has NaN (either way round fails; the first three such
// elements are named), and a relative error below tol over the other elements.
inline void expect_close_nan_exact(const Tensor& got_device, const Tensor& want, double tol, const std::string& what) {
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

// The tolerance for outputs stored as t (DESIGN.md: BF16 1e-2, F32 1e-5).
inline double row_tolerance(DType t) { return t == DType::BF16 ? 1e-2 : 1e-5; }

// The cross-entropy backward (d_loss 0.75) on the GPU against the CPU's: into fresh poisoned
// gradients of the logits' dtype and of F32, then in place into `in_place` (a device copy of
// the logits, which it overwrites; it may be logits_d itself, used last).
inline void expect_cross_entropy_backward_matches(const Tensor& logits, const Tensor& targets, const Tensor& lse,
                                                  const Tensor& logits_d, const Tensor& targets_d,
                                                  const Tensor& lse_d, Tensor& in_place, const std::string& what) {
  Context cpu = Context::cpu(), gpu = Context::cuda();
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const DType t = logits.dtype();
  const float d_loss = 0.75f;
  for (DType out_t : {t, DType::F32}) {
    Tensor want = Tensor::empty({rows, vocab}, out_t);
    cross_entropy_backward(cpu, logits, targets, lse, d_loss, want);
    Tensor got = poisoned_device({rows, vocab}, out_t);
    cross_entropy_backward(gpu, logits_d, targets_d, lse_d, d_loss, got);
    expect_close_nan_exact(got, want, row_tolerance(out_t), std::string("d_logits ") + dtype_name(out_t) + " " + what);
  }
  Tensor want = Tensor::empty({rows, vocab}, t);
  cross_entropy_backward(cpu, logits, targets, lse, d_loss, want);
  cross_entropy_backward(gpu, in_place, targets_d, lse_d, d_loss, in_place);
  expect_close_nan_exact(in_place, want, row_tolerance(t), "in-place d_logits " + what);
}

// The row shapes of the every-choice tests: widths 7 (scalar fallback), 768, 1000, 4096
// (warp-row), 8192 and 50304 (too wide for a warp's registers), row counts that leave a
// block partly empty.
inline const std::vector<std::pair<int64_t, int64_t>> kRowShapes = {{37, 7},  {37, 768}, {33, 1000}, {9, 4096},
                                                                     {6, 8192}, {6, 50304}, {1, 8},     {131, 64}};

// body(t, rows, cols) for F32 then BF16, each of kRowShapes in order.
template <typename Body>
void for_each_row_shape(Body&& body) {
  for (DType t : {DType::F32, DType::BF16})
    for (auto [rows, cols] : kRowShapes) body(t, rows, cols);
}

// "<choice> <dtype> [rows, cols]": names a case in a failure message.
inline std::string row_case_name(const char* choice, DType t, int64_t rows, int64_t cols) {
  return std::string(choice) + " " + dtype_name(t) + " [" + std::to_string(rows) + ", " + std::to_string(cols) + "]";
}

#if TESSERA_WITH_CUDA
struct RowChoice {
  const char* name;
  cuda::RowTuning tuning;
};

// body(choice) with each choice's kernel tuning set in turn, then the default tuning again.
template <typename Body>
void for_each_row_choice(const std::vector<RowChoice>& choices, Body&& body) {
  for (const RowChoice& choice : choices) {
    cuda::set_row_tuning(choice.tuning);
    body(choice);
  }
  cuda::set_row_tuning({});
}
#endif

}  // namespace tessera::testing
