#include "tessera/ops/softmax.h"

#include <cmath>

#include "testing.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

Tensor converted(const Tensor& t, DType dtype) { return Tensor::from_doubles(t.to_doubles(), t.shape(), dtype); }

Tensor run_softmax(const Tensor& x, DType y_dtype) {
  Context ctx = Context::cpu();
  Tensor y = Tensor::empty(x.shape(), y_dtype);
  poison(y);
  softmax_forward(ctx, x, y);
  return y;
}

void check_softmax_gradient(const Shape& shape, uint64_t seed, bool with_masked_entries) {
  SCOPED_TRACE("softmax shape " + shape_to_string(shape) + (with_masked_entries ? " with -inf entries" : ""));
  Context ctx = Context::cpu();
  Tensor x = random_tensor(shape, DType::F64, seed, -2.0f, 2.0f);
  if (with_masked_entries) {
    // Mask every third element (a masked element stays masked under x +- h).
    for (int64_t i = 0; i < x.numel(); i += 3) x.set_item(i, -INFINITY);
  }
  Tensor w = random_tensor(shape, DType::F64, seed + 1);
  Tensor y = run_softmax(x, DType::F64);
  Tensor dx = Tensor::empty(shape, DType::F64);
  poison(dx);
  softmax_backward(ctx, y, w, dx);
  expect_gradient(dx, x, [&] { return weighted_sum(run_softmax(x, DType::F64), w); }, "dx");
}

}  // namespace

TEST(Softmax, HandComputedRows) {
  const double inf = INFINITY;
  for (DType t : {DType::F64, DType::F32}) {
    const double tol = t == DType::F64 ? 1e-15 : 1e-7;
    // exp(ln 2) = 2, so [0, ln 2] -> [1/3, 2/3].
    Tensor y = run_softmax(Tensor::from_doubles({0.0, std::log(2.0)}, {1, 2}, t), t);
    EXPECT_LT(relative_error(y.to_doubles(), {1.0 / 3, 2.0 / 3}), tol) << dtype_name(t);
    // Large equal logits would overflow exp without the max subtraction.
    y = run_softmax(Tensor::from_doubles({1000, 1000, -1000}, {3}, t), t);
    EXPECT_LT(relative_error(y.to_doubles(), {0.5, 0.5, 0.0}), tol) << dtype_name(t);
    // Masked entries get exactly 0; a fully masked row is all zeros.
    y = run_softmax(Tensor::from_doubles({-inf, 3, -inf, -inf, -inf, -inf}, {2, 3}, t), t);
    EXPECT_EQ(y.to_doubles(), (std::vector<double>{0, 1, 0, 0, 0, 0})) << dtype_name(t);
    // One element: probability 1.
    y = run_softmax(Tensor::from_doubles({-7.5}, {1, 1}, t), t);
    EXPECT_EQ(y.item(0), 1.0);
  }
}

TEST(Softmax, RowsSumToOne) {
  Tensor x = random_tensor({9, 1000}, DType::F32, 3, -30.0f, 30.0f);
  Tensor y = run_softmax(x, DType::F32);
  for (int64_t r = 0; r < 9; ++r) {
    double sum = 0;
    for (int64_t c = 0; c < 1000; ++c) sum += y.item(r * 1000 + c);
    EXPECT_NEAR(sum, 1.0, 1e-6);
  }
}

TEST(Softmax, NanPropagatesToItsRow) {
  Tensor x = Tensor::from_doubles({1, NAN, 2, 1, 2, 3}, {2, 3}, DType::F32);
  Tensor y = run_softmax(x, DType::F32);
  for (int64_t i = 0; i < 3; ++i) EXPECT_TRUE(std::isnan(y.item(i)));
  for (int64_t i = 3; i < 6; ++i) EXPECT_FALSE(std::isnan(y.item(i)));
}

TEST(Softmax, GradientMatchesFiniteDifferences) {
  uint64_t seed = 40;
  for (const Shape& shape : std::vector<Shape>{{1, 1}, {4, 1}, {1, 7}, {3, 7}, {2, 2, 33}, {5}}) {
    check_softmax_gradient(shape, seed += 10, false);
    check_softmax_gradient(shape, seed += 10, true);
  }
}

TEST(Softmax, FullyMaskedRowHasZeroGradient) {
  Context ctx = Context::cpu();
  Tensor x = Tensor::from_doubles({-INFINITY, -INFINITY, -INFINITY, 0.5, -1, 2}, {2, 3});
  Tensor y = run_softmax(x, DType::F64);
  Tensor dy = random_tensor({2, 3}, DType::F64, 9), dx = Tensor::empty({2, 3}, DType::F64);
  poison(dx);
  softmax_backward(ctx, y, dy, dx);
  for (int64_t i = 0; i < 3; ++i) EXPECT_EQ(dx.item(i), 0.0);
  for (int64_t i = 3; i < 6; ++i) EXPECT_TRUE(std::isfinite(dx.item(i)));
}

TEST(Softmax, LowPrecisionMatchesDouble) {
  Context ctx = Context::cpu();
  const Shape shape{3, 4, 77};
  for (DType t : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(dtype_name(t));
    const double tol = t == DType::F32 ? 1e-5 : 1e-2;
    Tensor x = random_tensor(shape, t, 5, -8.0f, 8.0f), dy = random_tensor(shape, t, 6);
    Tensor x64 = converted(x, DType::F64), dy64 = converted(dy, DType::F64);
    Tensor y = run_softmax(x, t), y64 = run_softmax(x64, DType::F64);
    EXPECT_LT(relative_error(y, y64), tol);
    Tensor dx = Tensor::empty(shape, t), dx64 = Tensor::empty(shape, DType::F64);
    poison(dx);
    // Feed both backward passes the same probabilities so only the backward's rounding differs.
    Tensor y_low = converted(y64, t);
    softmax_backward(ctx, y_low, dy, dx);
    softmax_backward(ctx, converted(y_low, DType::F64), dy64, dx64);
    EXPECT_LT(relative_error(dx, dx64), tol);
  }
}

TEST(Softmax, InPlace) {
  Context ctx = Context::cpu();
  for (DType t : {DType::F32, DType::BF16}) {
    Tensor x = random_tensor({5, 19}, t, 7, -4.0f, 4.0f);
    Tensor want = run_softmax(x, t);
    softmax_forward(ctx, x, x);
    EXPECT_EQ(x.to_doubles(), want.to_doubles()) << dtype_name(t);

    Tensor dy = random_tensor({5, 19}, t, 8), dx = Tensor::empty({5, 19}, t);
    softmax_backward(ctx, x, dy, dx);
    softmax_backward(ctx, x, dy, dy);
    EXPECT_EQ(dy.to_doubles(), dx.to_doubles()) << dtype_name(t);
  }
}

TEST(Softmax, RejectsBadArguments) {
  Context ctx = Context::cpu();
  Tensor x = Tensor::zeros({4, 8}, DType::F32), y = Tensor::zeros({4, 8}, DType::BF16);
  EXPECT_NO_THROW(softmax_forward(ctx, x, y));
  Tensor y_bad = Tensor::zeros({4, 7}, DType::F32), flat = Tensor::zeros({32}, DType::F32);
  EXPECT_THROW(softmax_forward(ctx, x, y_bad), Error);
  EXPECT_THROW(softmax_forward(ctx, x, flat), Error);
  Tensor ints = Tensor::zeros({4, 8}, DType::I64), undefined, scalar = Tensor::zeros({}, DType::F32);
  EXPECT_THROW(softmax_forward(ctx, ints, y), Error);
  EXPECT_THROW(softmax_forward(ctx, x, ints), Error);
  EXPECT_THROW(softmax_forward(ctx, undefined, y), Error);
  EXPECT_THROW(softmax_forward(ctx, scalar, scalar), Error);
  Tensor strided = Tensor::zeros({8, 4}, DType::F32).transpose(0, 1);
  EXPECT_THROW(softmax_forward(ctx, strided, y), Error);
  Context gpu = Context::cuda(0);
  EXPECT_THROW(softmax_forward(gpu, x, y), Error);

  Tensor dx = Tensor::zeros({4, 8}, DType::F32);
  EXPECT_NO_THROW(softmax_backward(ctx, x, y, dx));
  EXPECT_THROW(softmax_backward(ctx, x, y_bad, dx), Error);
  EXPECT_THROW(softmax_backward(ctx, x, y, y_bad), Error);
  EXPECT_THROW(softmax_backward(ctx, x, undefined, dx), Error);
  EXPECT_THROW(softmax_backward(ctx, x, y, strided), Error);
}

TEST(Softmax, ThreadedMatchesSmallSerialBlocks) {
  // 300 x 131 runs threaded; 30-row blocks run on one thread. Rows are independent, so the
  // results must agree bit for bit.
  Context ctx = Context::cpu();
  const int64_t rows = 300, cols = 131, block = 30;
  Tensor x = random_tensor({rows, cols}, DType::F32, 51, -5.0f, 5.0f), dy = random_tensor({rows, cols}, DType::F32, 52);
  Tensor y = run_softmax(x, DType::F32), dx = Tensor::empty({rows, cols}, DType::F32);
  softmax_backward(ctx, y, dy, dx);
  for (int64_t b = 0; b < rows; b += block) {
    Tensor yb = run_softmax(x.slice(0, b, b + block).contiguous(), DType::F32);
    EXPECT_EQ(yb.to_doubles(), y.slice(0, b, b + block).contiguous().to_doubles());
    Tensor dxb = Tensor::empty({block, cols}, DType::F32);
    softmax_backward(ctx, yb, dy.slice(0, b, b + block).contiguous(), dxb);
    EXPECT_EQ(dxb.to_doubles(), dx.slice(0, b, b + block).contiguous().to_doubles());
  }
}
