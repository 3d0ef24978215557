#include "tessera/ops/activation.h"

#include <cmath>

#include "testing.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

Tensor converted(const Tensor& t, DType dtype) { return Tensor::from_doubles(t.to_doubles(), t.shape(), dtype); }

Tensor run_gelu(const Tensor& x, DType y_dtype) {
  Context ctx = Context::cpu();
  Tensor y = Tensor::empty(x.shape(), y_dtype);
  poison(y);
  gelu_forward(ctx, x, y);
  return y;
}

Shape half_last(Shape shape) {
  shape.back() /= 2;
  return shape;
}

Tensor run_swiglu(const Tensor& x, DType y_dtype) {
  Context ctx = Context::cpu();
  Tensor y = Tensor::empty(half_last(x.shape()), y_dtype);
  poison(y);
  swiglu_forward(ctx, x, y);
  return y;
}

double silu(double g) { return g / (1 + std::exp(-g)); }

}  // namespace

// ---- GELU --------------------------------------------------------------------------------

TEST(Gelu, KnownValues) {
  // Reference values of 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), from Python's math module.
  const std::vector<double> x{1.0, -1.0, 2.0, 0.5, 0.0, 10.0, -10.0};
  const std::vector<double> want{0.841191991, -0.158808009, 1.954597694, 0.345714010, 0.0, 10.0, 0.0};
  for (DType t : {DType::F64, DType::F32}) {
    Tensor y = run_gelu(Tensor::from_doubles(x, {7}, t), t);
    for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(y.item(i), want[i], 1e-7) << dtype_name(t) << " x=" << x[i];
  }
}

TEST(Gelu, GradientMatchesFiniteDifferences) {
  Context ctx = Context::cpu();
  uint64_t seed = 60;
  for (const Shape& shape : std::vector<Shape>{{1}, {7}, {3, 33}, {2, 1, 5}}) {
    SCOPED_TRACE(shape_to_string(shape));
    Tensor x = random_tensor(shape, DType::F64, seed += 10, -4.0f, 4.0f), w = random_tensor(shape, DType::F64, seed + 1);
    Tensor dx = Tensor::empty(shape, DType::F64);
    poison(dx);
    gelu_backward(ctx, x, w, dx);
    expect_gradient(dx, x, [&] { return weighted_sum(run_gelu(x, DType::F64), w); }, "dx");
  }
}

TEST(Gelu, TailsStayFinite) {
  Context ctx = Context::cpu();
  for (DType t : {DType::F32, DType::F64}) {
    Tensor x = Tensor::from_doubles({1e20, -1e20, 3e38, -3e38, 50, -50}, {6}, t);
    Tensor dy = Tensor::from_doubles({1, 1, 1, 1, 1, 1}, {6}, t), dx = Tensor::empty({6}, t);
    poison(dx);
    gelu_backward(ctx, x, dy, dx);
    EXPECT_EQ(dx.to_doubles(), (std::vector<double>{1, 0, 1, 0, 1, 0})) << dtype_name(t);
  }
}

TEST(Gelu, LowPrecisionMatchesDouble) {
  Context ctx = Context::cpu();
  const Shape shape{4, 9, 65};
  for (DType t : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(dtype_name(t));
    const double tol = t == DType::F32 ? 1e-5 : 1e-2;
    Tensor x = random_tensor(shape, t, 1, -5.0f, 5.0f), dy = random_tensor(shape, t, 2);
    Tensor x64 = converted(x, DType::F64), dy64 = converted(dy, DType::F64);
    EXPECT_LT(relative_error(run_gelu(x, t), run_gelu(x64, DType::F64)), tol);
    Tensor dx = Tensor::empty(shape, t), dx64 = Tensor::empty(shape, DType::F64);
    poison(dx);
    gelu_backward(ctx, x, dy, dx);
    gelu_backward(ctx, x64, dy64, dx64);
    EXPECT_LT(relative_error(dx, dx64), tol);
  }
}

TEST(Gelu, InPlace) {
  Context ctx = Context::cpu();
  Tensor x = random_tensor({3, 17}, DType::BF16, 3, -3.0f, 3.0f), dy = random_tensor({3, 17}, DType::BF16, 4);
  Tensor want_dx = Tensor::empty({3, 17}, DType::BF16);
  gelu_backward(ctx, x, dy, want_dx);
  gelu_backward(ctx, x, dy, dy);
  EXPECT_EQ(dy.to_doubles(), want_dx.to_doubles());
  Tensor want_y = run_gelu(x, DType::BF16);
  gelu_forward(ctx, x, x);
  EXPECT_EQ(x.to_doubles(), want_y.to_doubles());
}

TEST(Gelu, RejectsBadArguments) {
  Context ctx = Context::cpu();
  Tensor x = Tensor::zeros({4, 8}, DType::F32), y = Tensor::zeros({4, 8}, DType::F16);
  EXPECT_NO_THROW(gelu_forward(ctx, x, y));
  Tensor y_bad = Tensor::zeros({8, 4}, DType::F32), ints = Tensor::zeros({4, 8}, DType::I32), undefined;
  EXPECT_THROW(gelu_forward(ctx, x, y_bad), Error);
  EXPECT_THROW(gelu_forward(ctx, ints, y), Error);
  EXPECT_THROW(gelu_forward(ctx, x, undefined), Error);
  EXPECT_THROW(gelu_forward(ctx, Tensor::zeros({8, 4}, DType::F32).transpose(0, 1), y), Error);
  Context gpu = Context::cuda(0);
  EXPECT_THROW(gelu_forward(gpu, x, y), Error);
  Tensor dx = Tensor::zeros({4, 8}, DType::F32);
  EXPECT_NO_THROW(gelu_backward(ctx, x, y, dx));
  EXPECT_THROW(gelu_backward(ctx, x, y_bad, dx), Error);
  EXPECT_THROW(gelu_backward(ctx, x, y, y_bad), Error);
  EXPECT_THROW(gelu_backward(ctx, x, ints, dx), Error);
}

// ---- SwiGLU ------------------------------------------------------------------------------

TEST(Swiglu, KnownValues) {
  // silu(1) = 0.731058579, silu(-1) = -0.268941421, silu(0) = 0; gate in the first half.
  for (DType t : {DType::F64, DType::F32}) {
    Tensor x = Tensor::from_doubles({1, -1, 0, 2, 3, 5, /* row 2: */ 2, -30, 40, 1, 1, 1}, {2, 6}, t);
    Tensor y = run_swiglu(x, t);
    const std::vector<double> want{0.731058579 * 2, -0.268941421 * 3, 0.0, silu(2), silu(-30), 40.0};
    for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(y.item(i), want[i], 1e-7) << dtype_name(t) << " i=" << i;
  }
}

TEST(Swiglu, GradientMatchesFiniteDifferences) {
  Context ctx = Context::cpu();
  uint64_t seed = 80;
  for (const Shape& shape : std::vector<Shape>{{1, 2}, {2}, {3, 14}, {2, 2, 66}, {5, 1, 2}}) {
    SCOPED_TRACE(shape_to_string(shape));
    Tensor x = random_tensor(shape, DType::F64, seed += 10, -4.0f, 4.0f);
    Tensor w = random_tensor(half_last(shape), DType::F64, seed + 1);
    Tensor dx = Tensor::empty(shape, DType::F64);
    poison(dx);
    swiglu_backward(ctx, x, w, dx);
    expect_gradient(dx, x, [&] { return weighted_sum(run_swiglu(x, DType::F64), w); }, "dx");
  }
}

TEST(Swiglu, SaturatedGatesStayFinite) {
  Context ctx = Context::cpu();
  Tensor x = Tensor::from_doubles({200, -200, 1e30f, 2, 3, 4}, {1, 6}, DType::F32);
  Tensor dy = Tensor::from_doubles({1, 1, 1}, {1, 3}, DType::F32), dx = Tensor::empty({1, 6}, DType::F32);
  poison(dx);
  swiglu_backward(ctx, x, dy, dx);
  for (double v : dx.to_doubles()) EXPECT_TRUE(std::isfinite(v)) << v;
  EXPECT_NEAR(dx.item(0), 2.0, 1e-6);  // sigmoid(200) = 1: dgate = up
  EXPECT_EQ(dx.item(1), 0.0);
  EXPECT_NEAR(dx.item(3), 200.0, 1e-4);  // dup = silu(gate)
}

TEST(Swiglu, LowPrecisionMatchesDouble) {
  Context ctx = Context::cpu();
  const Shape shape{3, 5, 2 * 43};
  for (DType t : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(dtype_name(t));
    const double tol = t == DType::F32 ? 1e-5 : 1e-2;
    Tensor x = random_tensor(shape, t, 11, -5.0f, 5.0f), dy = random_tensor(half_last(shape), t, 12);
    Tensor x64 = converted(x, DType::F64), dy64 = converted(dy, DType::F64);
    EXPECT_LT(relative_error(run_swiglu(x, t), run_swiglu(x64, DType::F64)), tol);
    Tensor dx = Tensor::empty(shape, t), dx64 = Tensor::empty(shape, DType::F64);
    poison(dx);
    swiglu_backward(ctx, x, dy, dx);
    swiglu_backward(ctx, x64, dy64, dx64);
    EXPECT_LT(relative_error(dx, dx64), tol);
  }
}

TEST(Swiglu, BackwardInPlaceOverInput) {
  Context ctx = Context::cpu();
  Tensor x = random_tensor({4, 10}, DType::F32, 13), dy = random_tensor({4, 5}, DType::F32, 14);
  Tensor want = Tensor::empty({4, 10}, DType::F32);
  swiglu_backward(ctx, x, dy, want);
  swiglu_backward(ctx, x, dy, x);
  EXPECT_EQ(x.to_doubles(), want.to_doubles());
}

// The optional y of the backward is the forward's output, bit for bit, and leaves dx as it was
// (also when dx is x itself).
TEST(Swiglu, BackwardRecomputesTheForwardOutput) {
  Context ctx = Context::cpu();
  for (DType t : {DType::F32, DType::BF16, DType::F64}) {
    const Tensor x = random_tensor({5, 18}, t, 21, -4.0f, 4.0f), dy = random_tensor({5, 9}, t, 22);
    Tensor y_want = Tensor::empty({5, 9}, t), y = Tensor::empty({5, 9}, t);
    Tensor dx_want = Tensor::empty({5, 18}, t), dx = Tensor::empty({5, 18}, t);
    swiglu_forward(ctx, x, y_want);
    swiglu_backward(ctx, x, dy, dx_want);
    swiglu_backward(ctx, x, dy, dx, &y);
    EXPECT_EQ(y.to_doubles(), y_want.to_doubles()) << dtype_name(t);
    EXPECT_EQ(dx.to_doubles(), dx_want.to_doubles()) << dtype_name(t);
    Tensor x_in_place = x.clone();
    Tensor y2 = Tensor::empty({5, 9}, t);
    swiglu_backward(ctx, x_in_place, dy, x_in_place, &y2);
    EXPECT_EQ(y2.to_doubles(), y_want.to_doubles()) << dtype_name(t);
    EXPECT_EQ(x_in_place.to_doubles(), dx_want.to_doubles()) << dtype_name(t);
  }
  const Tensor x = random_tensor({2, 6}, DType::F32, 1), dy = random_tensor({2, 3}, DType::F32, 2);
  Tensor dx = Tensor::empty({2, 6}, DType::F32), wrong = Tensor::empty({2, 6}, DType::F32);
  EXPECT_THROW(swiglu_backward(ctx, x, dy, dx, &wrong), Error);  // y must be [.., F]
  Tensor x_copy = x.clone();
  Tensor y_over_x = x_copy.slice(1, 0, 3);
  EXPECT_THROW(swiglu_backward(ctx, x_copy, dy, dx, &y_over_x), Error);  // y inside x
}

TEST(Swiglu, RejectsBadArguments) {
  Context ctx = Context::cpu();
  Tensor x = Tensor::zeros({4, 8}, DType::BF16), y = Tensor::zeros({4, 4}, DType::BF16);
  EXPECT_NO_THROW(swiglu_forward(ctx, x, y));
  Tensor odd = Tensor::zeros({4, 7}, DType::BF16), y3 = Tensor::zeros({4, 3}, DType::BF16);
  EXPECT_THROW(swiglu_forward(ctx, odd, y3), Error);
  Tensor y_full = Tensor::zeros({4, 8}, DType::BF16), y_rows = Tensor::zeros({2, 4}, DType::BF16);
  EXPECT_THROW(swiglu_forward(ctx, x, y_full), Error);
  EXPECT_THROW(swiglu_forward(ctx, x, y_rows), Error);
  Tensor ints = Tensor::zeros({4, 8}, DType::U8), undefined, scalar = Tensor::zeros({}, DType::F32);
  EXPECT_THROW(swiglu_forward(ctx, ints, y), Error);
  EXPECT_THROW(swiglu_forward(ctx, undefined, y), Error);
  EXPECT_THROW(swiglu_forward(ctx, scalar, scalar), Error);
  Tensor dx = Tensor::zeros({4, 8}, DType::F32);
  EXPECT_NO_THROW(swiglu_backward(ctx, x, y, dx));
  EXPECT_THROW(swiglu_backward(ctx, x, y_full, dx), Error);
  EXPECT_THROW(swiglu_backward(ctx, x, y, y), Error);
  EXPECT_THROW(swiglu_backward(ctx, odd, y3, odd), Error);
}

TEST(Activation, ThreadedMatchesSmallSerialBlocks) {
  // 300 x 132 runs threaded; 30-row blocks run on one thread: results agree bit for bit.
  Context ctx = Context::cpu();
  const int64_t rows = 300, cols = 132, block = 30;
  Tensor x = random_tensor({rows, cols}, DType::F32, 91, -4.0f, 4.0f), dy = random_tensor({rows, cols}, DType::F32, 92);
  Tensor dy_half = random_tensor({rows, cols / 2}, DType::F32, 93);
  Tensor gelu_y = run_gelu(x, DType::F32), gelu_dx = Tensor::empty({rows, cols}, DType::F32);
  gelu_backward(ctx, x, dy, gelu_dx);
  Tensor swiglu_y = run_swiglu(x, DType::F32), swiglu_dx = Tensor::empty({rows, cols}, DType::F32);
  swiglu_backward(ctx, x, dy_half, swiglu_dx);
  auto rows_of = [&](const Tensor& t, int64_t b) { return t.slice(0, b, b + block).contiguous(); };
  for (int64_t b = 0; b < rows; b += block) {
    Tensor xb = rows_of(x, b);
    EXPECT_EQ(run_gelu(xb, DType::F32).to_doubles(), rows_of(gelu_y, b).to_doubles());
    Tensor dxb = Tensor::empty({block, cols}, DType::F32);
    gelu_backward(ctx, xb, rows_of(dy, b), dxb);
    EXPECT_EQ(dxb.to_doubles(), rows_of(gelu_dx, b).to_doubles());
    EXPECT_EQ(run_swiglu(xb, DType::F32).to_doubles(), rows_of(swiglu_y, b).to_doubles());
    swiglu_backward(ctx, xb, rows_of(dy_half, b), dxb);
    EXPECT_EQ(dxb.to_doubles(), rows_of(swiglu_dx, b).to_doubles());
  }
}
