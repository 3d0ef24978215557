#include "tessera/ops/loss.h"

#include <cmath>
#include <string>

#include "testing.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

struct ForwardResult {
  double loss;
  Tensor lse;
};

ForwardResult run_forward(const Tensor& logits, const Tensor& targets, const CrossEntropyOptions& o = {},
                          DType loss_dtype = DType::F64) {
  Context ctx = Context::cpu();
  Tensor loss = Tensor::empty({1}, loss_dtype);
  Tensor lse = Tensor::empty({logits.size(0)}, logits.dtype() == DType::F64 ? DType::F64 : DType::F32);
  poison(loss);
  poison(lse);
  cross_entropy_forward(ctx, logits, targets, loss, lse, o);
  return {loss.item(0), lse};
}

Tensor run_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, float d_loss, DType grad_dtype,
                    const CrossEntropyOptions& o = {}) {
  Context ctx = Context::cpu();
  Tensor d_logits = Tensor::empty(logits.shape(), grad_dtype);
  poison(d_logits);
  cross_entropy_backward(ctx, logits, targets, lse, d_loss, d_logits, o);
  return d_logits;
}

}  // namespace

TEST(CrossEntropyForward, UniformLogitsGiveLogV) {
  const int64_t n = 3, v = 5;
  Tensor logits = Tensor::from_doubles(std::vector<double>(n * v, 2.0), {n, v}, DType::F32);
  Tensor targets = Tensor::from_ints({0, 4, 2}, {n}, DType::I64);
  ForwardResult r = run_forward(logits, targets, {}, DType::F32);
  EXPECT_NEAR(r.loss, std::log(5.0), 1e-6);
  for (int64_t i = 0; i < n; ++i) EXPECT_NEAR(r.lse.item(i), 2.0 + std::log(5.0), 1e-6);
}

TEST(CrossEntropyForward, HandComputedSmallCase) {
  // Row 0: logits (1, 2, 3), target 2. Row 1: logits (0, -1, 0.5), target 0.
  Tensor logits = Tensor::from_doubles({1, 2, 3, 0, -1, 0.5}, {2, 3}, DType::F64);
  Tensor targets = Tensor::from_ints({2, 0}, {2}, DType::I32);
  const double lse0 = std::log(std::exp(1.0) + std::exp(2.0) + std::exp(3.0));
  const double lse1 = std::log(1.0 + std::exp(-1.0) + std::exp(0.5));
  ForwardResult r = run_forward(logits, targets);
  EXPECT_NEAR(r.lse.item(0), lse0, 1e-14);
  EXPECT_NEAR(r.lse.item(1), lse1, 1e-14);
  EXPECT_NEAR(r.loss, ((lse0 - 3.0) + (lse1 - 0.0)) / 2, 1e-14);
  // d/dx of the mean loss: (softmax - onehot) / 2.
  Tensor d = run_backward(logits, targets, r.lse, 1.0f, DType::F64);
  EXPECT_NEAR(d.item(2), (std::exp(3.0 - lse0) - 1.0) / 2, 1e-14);
  EXPECT_NEAR(d.item(4), std::exp(-1.0 - lse1) / 2, 1e-14);
}

TEST(CrossEntropyBackward, GradientMatchesFiniteDifferences) {
  struct Case {
    int64_t n, v;
    std::vector<int64_t> targets;
    float d_loss;
  };
  for (const Case& k : {Case{4, 7, {3, -100, 6, 0}, 1.0f}, Case{1, 1, {0}, 0.7f}, Case{1, 13, {12}, -2.5f},
                        Case{5, 2, {1, 1, 0, -100, 1}, 3.0f}}) {
    Tensor logits = random_tensor({k.n, k.v}, DType::F64, 1, -3, 3);
    Tensor targets = Tensor::from_ints(k.targets, {k.n}, DType::I64);
    auto loss = [&] { return double(k.d_loss) * run_forward(logits, targets).loss; };
    ForwardResult r = run_forward(logits, targets);
    Tensor d = run_backward(logits, targets, r.lse, k.d_loss, DType::F64);
    expect_gradient(d, logits, loss, "cross-entropy d_logits (n=" + std::to_string(k.n) + ", v=" + std::to_string(k.v) + ")");
  }
}

TEST(CrossEntropy, IgnoredRowsAddNothing) {
  const int64_t n = 6, v = 9;
  for (int64_t ignore : {int64_t{-100}, int64_t{4}}) {
    CrossEntropyOptions o;
    o.ignore_index = ignore;
    Tensor logits = random_tensor({n, v}, DType::F64, 2, -2, 2);
    std::vector<int64_t> t = {1, ignore, 7, ignore, ignore, 0};
    Tensor targets = Tensor::from_ints(t, {n}, DType::I32);
    ForwardResult r = run_forward(logits, targets, o);
    // The mean over the three valid rows, from the saved lse.
    double want = 0;
    for (int64_t i : {0, 2, 5}) want += r.lse.item(i) - logits.item(i * v + t[i]);
    EXPECT_NEAR(r.loss, want / 3, 1e-14);
    Tensor d = run_backward(logits, targets, r.lse, 1.0f, DType::F32, o);
    for (int64_t i : {1, 3, 4})
      for (int64_t j = 0; j < v; ++j) EXPECT_EQ(d.item(i * v + j), 0.0) << "row " << i;
    // A valid row's gradient sums to zero (softmax sums to one) and is nonzero.
    double row_sum = 0, row_abs = 0;
    for (int64_t j = 0; j < v; ++j) {
      row_sum += d.item(j);
      row_abs += std::fabs(d.item(j));
    }
    EXPECT_NEAR(row_sum, 0.0, 1e-7);
    EXPECT_GT(row_abs, 0.01);
  }
}

TEST(CrossEntropy, AllRowsIgnoredGiveZeroLossAndGradient) {
  Tensor logits = random_tensor({3, 4}, DType::F32, 3);
  Tensor targets = Tensor::from_ints({-100, -100, -100}, {3}, DType::I64);
  ForwardResult r = run_forward(logits, targets, {}, DType::F32);
  EXPECT_EQ(r.loss, 0.0);
  for (int64_t i = 0; i < 3; ++i) EXPECT_TRUE(std::isfinite(r.lse.item(i)));
  Tensor d = run_backward(logits, targets, r.lse, 1.0f, DType::F32);
  for (double x : d.to_doubles()) EXPECT_EQ(x, 0.0);
}

TEST(CrossEntropy, LargeLogitsStayFinite) {
  const int64_t n = 4, v = 50;
  Tensor logits64 = random_tensor({n, v}, DType::F64, 4, -1e4f, 1e4f);
  Tensor targets = Tensor::from_ints({0, 10, 49, 25}, {n}, DType::I64);
  ForwardResult want = run_forward(logits64, targets);
  Tensor d_want = run_backward(logits64, targets, want.lse, 1.0f, DType::F64);
  EXPECT_TRUE(std::isfinite(want.loss));
  Tensor logits = Tensor::from_doubles(logits64.to_doubles(), {n, v}, DType::F32);
  ForwardResult r = run_forward(logits, targets, {}, DType::F32);
  EXPECT_TRUE(std::isfinite(r.loss));
  EXPECT_NEAR(r.loss, want.loss, 1e-5 * std::fabs(want.loss));
  Tensor d = run_backward(logits, targets, r.lse, 1.0f, DType::F32);
  for (double x : d.to_doubles()) EXPECT_TRUE(std::isfinite(x));
  EXPECT_LT(relative_error(d, d_want), 1e-5);
}

TEST(CrossEntropy, LowPrecisionAgreesWithF64) {
  const int64_t n = 7, v = 131;
  Tensor logits64 = random_tensor({n, v}, DType::F64, 5, -4, 4);
  Tensor targets = Tensor::from_ints({3, 130, -100, 0, 64, 64, 1}, {n}, DType::I32);
  ForwardResult want = run_forward(logits64, targets);
  Tensor d_want = run_backward(logits64, targets, want.lse, 1.0f, DType::F64);
  for (DType t : {DType::F32, DType::BF16}) {
    const double tol = t == DType::F32 ? 1e-5 : 1e-2;
    Tensor logits = Tensor::from_doubles(logits64.to_doubles(), {n, v}, t);
    ForwardResult r = run_forward(logits, targets, {}, DType::F32);
    EXPECT_LT(std::fabs(r.loss - want.loss) / std::fabs(want.loss), tol) << dtype_name(t);
    EXPECT_LT(relative_error(r.lse, want.lse), tol) << dtype_name(t);
    Tensor d = run_backward(logits, targets, r.lse, 1.0f, t);
    EXPECT_LT(relative_error(d, d_want), tol) << dtype_name(t);
  }
}

TEST(CrossEntropyBackward, InPlaceOverLogits) {
  Context ctx = Context::cpu();
  Tensor logits = random_tensor({5, 17}, DType::F32, 6);
  Tensor targets = Tensor::from_ints({16, 0, 3, -100, 8}, {5}, DType::I64);
  ForwardResult r = run_forward(logits, targets, {}, DType::F32);
  Tensor want = run_backward(logits, targets, r.lse, 0.5f, DType::F32);
  cross_entropy_backward(ctx, logits, targets, r.lse, 0.5f, logits);
  EXPECT_EQ(relative_error(logits, want), 0.0);
}

TEST(CrossEntropyErrors, BadTargetsAndShapesThrow) {
  Context ctx = Context::cpu();
  Tensor logits = Tensor::zeros({3, 4}, DType::F32), loss = Tensor::zeros({1}, DType::F32);
  Tensor lse = Tensor::zeros({3}, DType::F32), d = Tensor::zeros({3, 4}, DType::F32);
  Tensor ok = Tensor::from_ints({0, 3, -100}, {3}, DType::I64);
  EXPECT_NO_THROW(cross_entropy_forward(ctx, logits, ok, loss, lse));
  for (int64_t bad : {int64_t{4}, int64_t{-1}}) {
    Tensor targets = Tensor::from_ints({0, bad, 1}, {3}, DType::I64);
    try {
      cross_entropy_forward(ctx, logits, targets, loss, lse);
      ADD_FAILURE() << "target " << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("target " + std::to_string(bad)), std::string::npos) << e.what();
    }
    EXPECT_THROW(cross_entropy_backward(ctx, logits, targets, lse, 1.0f, d), Error);
  }
  // -100 is only special while it is the ignore_index.
  CrossEntropyOptions other;
  other.ignore_index = 2;
  EXPECT_THROW(cross_entropy_forward(ctx, logits, ok, loss, lse, other), Error);
  Tensor float_targets = Tensor::zeros({3}, DType::F32), short_targets = Tensor::from_ints({0, 1}, {2});
  EXPECT_THROW(cross_entropy_forward(ctx, logits, float_targets, loss, lse), Error);
  EXPECT_THROW(cross_entropy_forward(ctx, logits, short_targets, loss, lse), Error);
  Tensor lse64 = Tensor::zeros({3}, DType::F64), lse_short = Tensor::zeros({2}, DType::F32);
  EXPECT_THROW(cross_entropy_forward(ctx, logits, ok, loss, lse64), Error);
  EXPECT_THROW(cross_entropy_forward(ctx, logits, ok, loss, lse_short), Error);
  Tensor loss2 = Tensor::zeros({2}, DType::F32), loss_bf16 = Tensor::zeros({1}, DType::BF16);
  EXPECT_THROW(cross_entropy_forward(ctx, logits, ok, loss2, lse), Error);
  EXPECT_THROW(cross_entropy_forward(ctx, logits, ok, loss_bf16, lse), Error);
  Tensor logits_1d = Tensor::zeros({12}, DType::F32);
  EXPECT_THROW(cross_entropy_forward(ctx, logits_1d, ok, loss, lse), Error);
  Tensor d_bad = Tensor::zeros({3, 5}, DType::F32);
  EXPECT_THROW(cross_entropy_backward(ctx, logits, ok, lse, 1.0f, d_bad), Error);
  Tensor undefined;
  EXPECT_THROW(cross_entropy_backward(ctx, logits, ok, undefined, 1.0f, d), Error);
}

// Logits in a buffer with a padded row stride (as the LM head uses on the GPU) give the
// packed result; the backward may write in place into the same strided view.
TEST(CrossEntropyRowStrided, MatchesPackedLogits) {
  Context ctx = Context::cpu();
  const Tensor buf = random_tensor({5, 24}, DType::F32, 61, -3, 3);
  const Tensor logits = buf.slice(1, 0, 21);
  const Tensor targets = Tensor::from_ints({3, 20, -100, 0, 7}, {5});
  Tensor loss = Tensor::empty({1}, DType::F32), lse = Tensor::empty({5}, DType::F32);
  Tensor want_loss = Tensor::empty({1}, DType::F32), want_lse = Tensor::empty({5}, DType::F32);
  cross_entropy_forward(ctx, logits, targets, loss, lse);
  cross_entropy_forward(ctx, logits.contiguous(), targets, want_loss, want_lse);
  EXPECT_EQ(loss.item(0), want_loss.item(0));
  EXPECT_EQ(relative_error(lse, want_lse), 0.0);
  Tensor want_d = Tensor::empty({5, 21}, DType::F32);
  cross_entropy_backward(ctx, logits.contiguous(), targets, lse, 0.5f, want_d);
  Tensor in_place = buf.clone().slice(1, 0, 21);
  cross_entropy_backward(ctx, in_place, targets, lse, 0.5f, in_place);
  EXPECT_EQ(relative_error(in_place.contiguous(), want_d), 0.0);
}
