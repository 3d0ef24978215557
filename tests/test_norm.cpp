#include "tessera/ops/norm.h"

#include <cmath>

#include "testing.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

// The same values in another dtype (rounded to nearest even when narrowing).
Tensor converted(const Tensor& t, DType dtype) { return Tensor::from_doubles(t.to_doubles(), t.shape(), dtype); }

DType stats_dtype(DType x) { return x == DType::F64 ? DType::F64 : DType::F32; }

int64_t rows_of(const Shape& shape) { return shape_numel(shape) / shape.back(); }

struct LayerNormResult {
  Tensor y, mean, rstd;
};

LayerNormResult run_layernorm(const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps, DType y_dtype) {
  Context ctx = Context::cpu();
  const int64_t rows = rows_of(x.shape());
  LayerNormResult r{Tensor::empty(x.shape(), y_dtype), Tensor::empty({rows}, stats_dtype(x.dtype())),
                    Tensor::empty({rows}, stats_dtype(x.dtype()))};
  poison(r.y);
  poison(r.mean);
  poison(r.rstd);
  layernorm_forward(ctx, x, gamma, beta, eps, r.y, r.mean, r.rstd);
  return r;
}

// Checks every gradient of LayerNorm against finite differences of L = sum(y * W) in FP64.
void check_layernorm_gradients(const Shape& shape, bool with_beta, uint64_t seed) {
  SCOPED_TRACE("layernorm shape " + shape_to_string(shape) + (with_beta ? " with beta" : " without beta"));
  Context ctx = Context::cpu();
  const int64_t cols = shape.back();
  const float eps = 1e-5f;
  Tensor x = random_tensor(shape, DType::F64, seed);
  Tensor gamma = random_tensor({cols}, DType::F64, seed + 1, 0.5f, 1.5f);
  Tensor beta = with_beta ? random_tensor({cols}, DType::F64, seed + 2) : Tensor();
  Tensor w = random_tensor(shape, DType::F64, seed + 3);

  LayerNormResult fwd = run_layernorm(x, gamma, beta, eps, DType::F64);
  Tensor dx = Tensor::empty(shape, DType::F64);
  poison(dx);
  // Parameter gradients accumulate: start from nonzero values and subtract them afterwards.
  Tensor dgamma_start = random_tensor({cols}, DType::F64, seed + 4);
  Tensor dbeta_start = random_tensor({cols}, DType::F64, seed + 5);
  Tensor dgamma = dgamma_start.clone();
  Tensor dbeta = with_beta ? dbeta_start.clone() : Tensor();
  layernorm_backward(ctx, w, x, gamma, fwd.mean, fwd.rstd, dx, dgamma, dbeta);

  auto loss = [&] { return weighted_sum(run_layernorm(x, gamma, beta, eps, DType::F64).y, w); };
  auto added = [](const Tensor& after, const Tensor& before) {
    Tensor d = after.clone();
    for (int64_t i = 0; i < d.numel(); ++i) d.set_item(i, after.item(i) - before.item(i));
    return d;
  };
  expect_gradient(dx, x, loss, "dx");
  expect_gradient(added(dgamma, dgamma_start), gamma, loss, "dgamma");
  if (with_beta) expect_gradient(added(dbeta, dbeta_start), beta, loss, "dbeta");
}

struct RmsNormResult {
  Tensor y, rstd;
};

RmsNormResult run_rmsnorm(const Tensor& x, const Tensor& gamma, float eps, DType y_dtype) {
  Context ctx = Context::cpu();
  RmsNormResult r{Tensor::empty(x.shape(), y_dtype), Tensor::empty({rows_of(x.shape())}, stats_dtype(x.dtype()))};
  poison(r.y);
  poison(r.rstd);
  rmsnorm_forward(ctx, x, gamma, eps, r.y, r.rstd);
  return r;
}

void check_rmsnorm_gradients(const Shape& shape, uint64_t seed) {
  SCOPED_TRACE("rmsnorm shape " + shape_to_string(shape));
  Context ctx = Context::cpu();
  const int64_t cols = shape.back();
  // With one column y = gamma * x / sqrt(x^2 + eps) is a smoothed sign function whose
  // curvature near 0 grows like eps^-1.5; a larger eps keeps central differences accurate.
  const float eps = cols == 1 ? 0.05f : 1e-6f;
  Tensor x = random_tensor(shape, DType::F64, seed);
  Tensor gamma = random_tensor({cols}, DType::F64, seed + 1, 0.5f, 1.5f);
  Tensor w = random_tensor(shape, DType::F64, seed + 2);

  RmsNormResult fwd = run_rmsnorm(x, gamma, eps, DType::F64);
  Tensor dx = Tensor::empty(shape, DType::F64);
  poison(dx);
  Tensor dgamma_start = random_tensor({cols}, DType::F64, seed + 3);
  Tensor dgamma = dgamma_start.clone();
  rmsnorm_backward(ctx, w, x, gamma, fwd.rstd, dx, dgamma);
  for (int64_t i = 0; i < cols; ++i) dgamma.set_item(i, dgamma.item(i) - dgamma_start.item(i));

  auto loss = [&] { return weighted_sum(run_rmsnorm(x, gamma, eps, DType::F64).y, w); };
  expect_gradient(dx, x, loss, "dx");
  expect_gradient(dgamma, gamma, loss, "dgamma");
}

}  // namespace

// ---- LayerNorm ---------------------------------------------------------------------------

TEST(LayerNorm, HandComputedRow) {
  // x = [1, 2, 3]: mean 2, biased variance 2/3, rstd = sqrt(3/2); xhat = [-sqrt(1.5), 0, sqrt(1.5)].
  const double s = std::sqrt(1.5);
  for (DType t : {DType::F64, DType::F32}) {
    Tensor x = Tensor::from_doubles({1, 2, 3}, {1, 3}, t);
    Tensor gamma = Tensor::from_doubles({1, 2, 0.5}, {3}, t), beta = Tensor::from_doubles({0, 1, -1}, {3}, t);
    LayerNormResult r = run_layernorm(x, gamma, beta, 0.0f, t);
    const double tol = t == DType::F64 ? 1e-14 : 1e-6;
    EXPECT_LT(relative_error(r.y.to_doubles(), {-s, 1.0, 0.5 * s - 1.0}), tol) << dtype_name(t);
    EXPECT_NEAR(r.mean.item(0), 2.0, tol);
    EXPECT_NEAR(r.rstd.item(0), s, tol);
    // Without beta the shift is zero.
    LayerNormResult nb = run_layernorm(x, gamma, Tensor(), 0.0f, t);
    EXPECT_LT(relative_error(nb.y.to_doubles(), {-s, 0.0, 0.5 * s}), tol) << dtype_name(t);
  }
}

TEST(LayerNorm, EpsEntersUnderTheSquareRoot) {
  // A constant row has zero variance: rstd = 1/sqrt(eps) and y = beta.
  Tensor x = Tensor::from_doubles({4, 4, 4, 4}, {1, 4});
  Tensor gamma = Tensor::from_doubles({1, 1, 1, 1}, {4}), beta = Tensor::from_doubles({1, 2, 3, 4}, {4});
  LayerNormResult r = run_layernorm(x, gamma, beta, 0.25f, DType::F64);
  EXPECT_DOUBLE_EQ(r.rstd.item(0), 2.0);
  EXPECT_EQ(r.y.to_doubles(), (std::vector<double>{1, 2, 3, 4}));
}

TEST(LayerNorm, GradientsMatchFiniteDifferences) {
  uint64_t seed = 100;
  for (const Shape& shape : std::vector<Shape>{{1, 1}, {5, 1}, {1, 7}, {3, 7}, {2, 3, 33}, {1, 33}, {70, 5}, {7}}) {
    check_layernorm_gradients(shape, true, seed += 10);
    check_layernorm_gradients(shape, false, seed += 10);
  }
}

TEST(LayerNorm, SingleColumnGivesBeta) {
  // C = 1: every value is its own mean, so y = beta and no gradient reaches x or gamma.
  Context ctx = Context::cpu();
  Tensor x = random_tensor({4, 1}, DType::F64, 7), gamma = Tensor::from_doubles({3}, {1});
  Tensor beta = Tensor::from_doubles({0.25}, {1});
  LayerNormResult r = run_layernorm(x, gamma, beta, 1e-5f, DType::F64);
  EXPECT_EQ(r.y.to_doubles(), std::vector<double>(4, 0.25));
  Tensor dy = random_tensor({4, 1}, DType::F64, 8), dx = Tensor::empty({4, 1}, DType::F64);
  Tensor dgamma = Tensor::zeros({1}, DType::F64), dbeta = Tensor::zeros({1}, DType::F64);
  poison(dx);
  layernorm_backward(ctx, dy, x, gamma, r.mean, r.rstd, dx, dgamma, dbeta);
  EXPECT_EQ(dx.to_doubles(), std::vector<double>(4, 0.0));
  EXPECT_EQ(dgamma.item(0), 0.0);
  double sum_dy = 0;
  for (double v : dy.to_doubles()) sum_dy += v;
  EXPECT_NEAR(dbeta.item(0), sum_dy, 1e-15);
}

TEST(LayerNorm, LowPrecisionMatchesDouble) {
  Context ctx = Context::cpu();
  const Shape shape{3, 5, 96};
  const int64_t cols = 96;
  for (DType t : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(dtype_name(t));
    const double tol = t == DType::F32 ? 1e-5 : 1e-2;
    // Mixed parameter dtypes: gamma F32, beta BF16, whatever x is.
    Tensor x = random_tensor(shape, t, 1, -2.0f, 3.0f), dy = random_tensor(shape, t, 2);
    Tensor gamma = random_tensor({cols}, DType::F32, 3, 0.5f, 1.5f), beta = random_tensor({cols}, DType::BF16, 4);
    Tensor x64 = converted(x, DType::F64), dy64 = converted(dy, DType::F64);
    Tensor gamma64 = converted(gamma, DType::F64), beta64 = converted(beta, DType::F64);

    LayerNormResult low = run_layernorm(x, gamma, beta, 1e-5f, t);
    LayerNormResult ref = run_layernorm(x64, gamma64, beta64, 1e-5f, DType::F64);
    EXPECT_EQ(low.mean.dtype(), DType::F32);
    EXPECT_LT(relative_error(low.y, ref.y), tol);
    EXPECT_LT(relative_error(low.mean, ref.mean), 1e-6);
    EXPECT_LT(relative_error(low.rstd, ref.rstd), 1e-6);

    // Nonzero starting gradients in a converted dtype: the accumulation must read them back.
    Tensor dgamma = random_tensor({cols}, t, 7), dbeta = random_tensor({cols}, DType::BF16, 8);
    Tensor dgamma64 = converted(dgamma, DType::F64), dbeta64 = converted(dbeta, DType::F64);
    Tensor dx = Tensor::empty(shape, t);
    poison(dx);
    layernorm_backward(ctx, dy, x, gamma, low.mean, low.rstd, dx, dgamma, dbeta);
    Tensor dx64 = Tensor::empty(shape, DType::F64);
    layernorm_backward(ctx, dy64, x64, gamma64, ref.mean, ref.rstd, dx64, dgamma64, dbeta64);
    EXPECT_LT(relative_error(dx, dx64), tol);
    EXPECT_LT(relative_error(dgamma, dgamma64), tol);
    EXPECT_LT(relative_error(dbeta, dbeta64), 1e-2);
  }
}

TEST(LayerNorm, AcceptsStatsShapedLikeLeadingDims) {
  Context ctx = Context::cpu();
  Tensor x = random_tensor({2, 3, 8}, DType::F32, 5), gamma = random_tensor({8}, DType::F32, 6);
  Tensor y = Tensor::empty({2, 3, 8}, DType::F32), mean = Tensor::empty({2, 3}, DType::F32);
  Tensor rstd = Tensor::empty({2, 3}, DType::F32);
  poison(mean);
  layernorm_forward(ctx, x, gamma, Tensor(), 1e-5f, y, mean, rstd);
  LayerNormResult flat = run_layernorm(x, gamma, Tensor(), 1e-5f, DType::F32);
  EXPECT_EQ(mean.to_doubles(), flat.mean.to_doubles());
  EXPECT_EQ(y.to_doubles(), flat.y.to_doubles());
}

TEST(LayerNorm, RejectsBadArguments) {
  Context ctx = Context::cpu();
  Tensor x = Tensor::zeros({4, 8}, DType::F32), gamma = Tensor::zeros({8}, DType::F32);
  Tensor beta = Tensor::zeros({8}, DType::F32), y = Tensor::zeros({4, 8}, DType::F32);
  Tensor mean = Tensor::zeros({4}, DType::F32), rstd = Tensor::zeros({4}, DType::F32);
  EXPECT_NO_THROW(layernorm_forward(ctx, x, gamma, beta, 1e-5f, y, mean, rstd));

  Tensor gamma7 = Tensor::zeros({7}, DType::F32), beta9 = Tensor::zeros({9}, DType::F32);
  EXPECT_THROW(layernorm_forward(ctx, x, gamma7, beta, 1e-5f, y, mean, rstd), Error);
  EXPECT_THROW(layernorm_forward(ctx, x, gamma, beta9, 1e-5f, y, mean, rstd), Error);
  Tensor y_bad = Tensor::zeros({4, 7}, DType::F32);
  EXPECT_THROW(layernorm_forward(ctx, x, gamma, beta, 1e-5f, y_bad, mean, rstd), Error);
  Tensor mean_f64 = Tensor::zeros({4}, DType::F64), mean_short = Tensor::zeros({3}, DType::F32);
  EXPECT_THROW(layernorm_forward(ctx, x, gamma, beta, 1e-5f, y, mean_f64, rstd), Error);
  EXPECT_THROW(layernorm_forward(ctx, x, gamma, beta, 1e-5f, y, mean, mean_short), Error);
  Tensor undefined;
  EXPECT_THROW(layernorm_forward(ctx, undefined, gamma, beta, 1e-5f, y, mean, rstd), Error);
  EXPECT_THROW(layernorm_forward(ctx, x, undefined, beta, 1e-5f, y, mean, rstd), Error);
  Tensor ints = Tensor::zeros({4, 8}, DType::I32);
  EXPECT_THROW(layernorm_forward(ctx, ints, gamma, beta, 1e-5f, y, mean, rstd), Error);
  Tensor strided = Tensor::zeros({8, 4}, DType::F32).transpose(0, 1);
  EXPECT_THROW(layernorm_forward(ctx, strided, gamma, beta, 1e-5f, y, mean, rstd), Error);
  EXPECT_THROW(layernorm_forward(ctx, x, gamma, beta, -1.0f, y, mean, rstd), Error);
  EXPECT_THROW(layernorm_forward(ctx, x, gamma, beta, NAN, y, mean, rstd), Error);
  Tensor empty_cols = Tensor::zeros({4, 0}, DType::F32), gamma0 = Tensor::zeros({0}, DType::F32);
  EXPECT_THROW(layernorm_forward(ctx, empty_cols, gamma0, Tensor(), 1e-5f, empty_cols, mean, rstd), Error);
  Context gpu = Context::cuda(0);
  EXPECT_THROW(layernorm_forward(gpu, x, gamma, beta, 1e-5f, y, mean, rstd), Error);

  Tensor dx = Tensor::zeros({4, 8}, DType::F32), dgamma = Tensor::zeros({8}, DType::F32);
  Tensor dbeta = Tensor::zeros({8}, DType::F32);
  EXPECT_NO_THROW(layernorm_backward(ctx, y, x, gamma, mean, rstd, dx, dgamma, dbeta));
  EXPECT_NO_THROW(layernorm_backward(ctx, y, x, gamma, mean, rstd, dx, dgamma, undefined));
  EXPECT_THROW(layernorm_backward(ctx, y, x, gamma, mean, rstd, dx, gamma7, dbeta), Error);
  EXPECT_THROW(layernorm_backward(ctx, y, x, gamma, mean, rstd, dx, dgamma, beta9), Error);
  EXPECT_THROW(layernorm_backward(ctx, y_bad, x, gamma, mean, rstd, dx, dgamma, dbeta), Error);
  EXPECT_THROW(layernorm_backward(ctx, y, x, gamma, mean, rstd, y_bad, dgamma, dbeta), Error);
  EXPECT_THROW(layernorm_backward(ctx, y, x, gamma, mean, rstd, dx, undefined, dbeta), Error);
  EXPECT_THROW(layernorm_backward(ctx, y, x, gamma7, mean, rstd, dx, dgamma, dbeta), Error);
  EXPECT_THROW(layernorm_backward(ctx, y, x, gamma, mean_f64, rstd, dx, dgamma, dbeta), Error);
}

// ---- RMSNorm -----------------------------------------------------------------------------

TEST(RmsNorm, HandComputedRows) {
  // [3, 4]: mean square 12.5. [1, -1, 1, -1]: mean square 1, so y = x * gamma.
  for (DType t : {DType::F64, DType::F32}) {
    const double tol = t == DType::F64 ? 1e-14 : 1e-6;
    Tensor x = Tensor::from_doubles({3, 4}, {1, 2}, t), gamma = Tensor::from_doubles({1, 2}, {2}, t);
    RmsNormResult r = run_rmsnorm(x, gamma, 0.0f, t);
    const double rs = 1.0 / std::sqrt(12.5);
    EXPECT_NEAR(r.rstd.item(0), rs, tol);
    EXPECT_LT(relative_error(r.y.to_doubles(), {3 * rs, 8 * rs}), tol);

    Tensor x2 = Tensor::from_doubles({1, -1, 1, -1}, {4}, t), gamma2 = Tensor::from_doubles({2, 3, 4, 5}, {4}, t);
    RmsNormResult r2 = run_rmsnorm(x2, gamma2, 0.0f, t);
    EXPECT_EQ(r2.y.to_doubles(), (std::vector<double>{2, -3, 4, -5}));
    // eps enters under the square root: mean square 1 + eps 3 -> rstd 1/2.
    RmsNormResult r3 = run_rmsnorm(x2, gamma2, 3.0f, t);
    EXPECT_EQ(r3.rstd.item(0), 0.5);
  }
}

TEST(RmsNorm, GradientsMatchFiniteDifferences) {
  uint64_t seed = 500;
  for (const Shape& shape : std::vector<Shape>{{1, 1}, {5, 1}, {1, 7}, {3, 7}, {2, 3, 33}, {1, 33}, {70, 5}, {9}})
    check_rmsnorm_gradients(shape, seed += 10);
}

TEST(RmsNorm, LowPrecisionMatchesDouble) {
  Context ctx = Context::cpu();
  const Shape shape{2, 7, 80};
  const int64_t cols = 80;
  for (DType t : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(dtype_name(t));
    const double tol = t == DType::F32 ? 1e-5 : 1e-2;
    Tensor x = random_tensor(shape, t, 11, -3.0f, 2.0f), dy = random_tensor(shape, t, 12);
    Tensor gamma = random_tensor({cols}, DType::BF16, 13, 0.5f, 1.5f);
    Tensor x64 = converted(x, DType::F64), dy64 = converted(dy, DType::F64), gamma64 = converted(gamma, DType::F64);

    RmsNormResult low = run_rmsnorm(x, gamma, 1e-6f, t);
    RmsNormResult ref = run_rmsnorm(x64, gamma64, 1e-6f, DType::F64);
    EXPECT_LT(relative_error(low.y, ref.y), tol);
    EXPECT_LT(relative_error(low.rstd, ref.rstd), 1e-6);

    Tensor dx = Tensor::empty(shape, t), dgamma = Tensor::zeros({cols}, DType::F32);
    poison(dx);
    rmsnorm_backward(ctx, dy, x, gamma, low.rstd, dx, dgamma);
    Tensor dx64 = Tensor::empty(shape, DType::F64), dgamma64 = Tensor::zeros({cols}, DType::F64);
    rmsnorm_backward(ctx, dy64, x64, gamma64, ref.rstd, dx64, dgamma64);
    EXPECT_LT(relative_error(dx, dx64), tol);
    EXPECT_LT(relative_error(dgamma, dgamma64), 1e-5);
  }
}

TEST(RmsNorm, DgammaAccumulatesOverCalls) {
  Context ctx = Context::cpu();
  Tensor x = random_tensor({6, 10}, DType::F64, 21), gamma = random_tensor({10}, DType::F64, 22);
  Tensor dy = random_tensor({6, 10}, DType::F64, 23);
  RmsNormResult fwd = run_rmsnorm(x, gamma, 1e-6f, DType::F64);
  Tensor dx = Tensor::empty({6, 10}, DType::F64), once = Tensor::zeros({10}, DType::F64);
  rmsnorm_backward(ctx, dy, x, gamma, fwd.rstd, dx, once);
  Tensor twice = Tensor::zeros({10}, DType::F64);
  rmsnorm_backward(ctx, dy, x, gamma, fwd.rstd, dx, twice);
  rmsnorm_backward(ctx, dy, x, gamma, fwd.rstd, dx, twice);
  for (int64_t i = 0; i < 10; ++i) EXPECT_NEAR(twice.item(i), 2 * once.item(i), 1e-14);
}

TEST(RmsNorm, RejectsBadArguments) {
  Context ctx = Context::cpu();
  Tensor x = Tensor::zeros({4, 8}, DType::BF16), gamma = Tensor::zeros({8}, DType::F32);
  Tensor y = Tensor::zeros({4, 8}, DType::BF16), rstd = Tensor::zeros({4}, DType::F32);
  EXPECT_NO_THROW(rmsnorm_forward(ctx, x, gamma, 1e-6f, y, rstd));
  Tensor gamma7 = Tensor::zeros({7}, DType::F32), y_bad = Tensor::zeros({8, 4}, DType::BF16);
  EXPECT_THROW(rmsnorm_forward(ctx, x, gamma7, 1e-6f, y, rstd), Error);
  EXPECT_THROW(rmsnorm_forward(ctx, x, gamma, 1e-6f, y_bad, rstd), Error);
  Tensor rstd_bf16 = Tensor::zeros({4}, DType::BF16), rstd_long = Tensor::zeros({5}, DType::F32);
  EXPECT_THROW(rmsnorm_forward(ctx, x, gamma, 1e-6f, y, rstd_bf16), Error);
  EXPECT_THROW(rmsnorm_forward(ctx, x, gamma, 1e-6f, y, rstd_long), Error);
  Tensor gamma_int = Tensor::zeros({8}, DType::I32), scalar = Tensor::zeros({}, DType::F32);
  EXPECT_THROW(rmsnorm_forward(ctx, x, gamma_int, 1e-6f, y, rstd), Error);
  EXPECT_THROW(rmsnorm_forward(ctx, scalar, gamma, 1e-6f, scalar, rstd), Error);

  Tensor dx = Tensor::zeros({4, 8}, DType::F32), dgamma = Tensor::zeros({8}, DType::F32);
  EXPECT_NO_THROW(rmsnorm_backward(ctx, y, x, gamma, rstd, dx, dgamma));
  Tensor undefined;
  EXPECT_THROW(rmsnorm_backward(ctx, y, x, gamma, rstd, dx, undefined), Error);
  EXPECT_THROW(rmsnorm_backward(ctx, y, x, gamma, rstd, dx, gamma7), Error);
  EXPECT_THROW(rmsnorm_backward(ctx, y_bad, x, gamma, rstd, dx, dgamma), Error);
  EXPECT_THROW(rmsnorm_backward(ctx, y, x, gamma, rstd_long, dx, dgamma), Error);
}

// ---- The threaded path -------------------------------------------------------------------

namespace {

// Rows [begin, end) of x viewed as [rows, C], as a packed copy.
Tensor row_block(const Tensor& x, int64_t begin, int64_t end) {
  return x.reshape({-1, x.size(-1)}).slice(0, begin, end).contiguous();
}

}  // namespace

TEST(LayerNorm, ThreadedMatchesSmallSerialBlocks) {
  // 300 x 131 is above the threshold where the kernels go parallel; 30-row blocks are below
  // it. Row results must agree bit for bit, and the column sums up to rounding.
  Context ctx = Context::cpu();
  const int64_t rows = 300, cols = 131, block = 30;
  Tensor x = random_tensor({rows, cols}, DType::F64, 31), dy = random_tensor({rows, cols}, DType::F64, 32);
  Tensor gamma = random_tensor({cols}, DType::F64, 33), beta = random_tensor({cols}, DType::F64, 34);
  LayerNormResult whole = run_layernorm(x, gamma, beta, 1e-5f, DType::F64);
  Tensor dx = Tensor::empty({rows, cols}, DType::F64), dgamma = Tensor::zeros({cols}, DType::F64);
  Tensor dbeta = Tensor::zeros({cols}, DType::F64);
  layernorm_backward(ctx, dy, x, gamma, whole.mean, whole.rstd, dx, dgamma, dbeta);

  Tensor dgamma_blocks = Tensor::zeros({cols}, DType::F64), dbeta_blocks = Tensor::zeros({cols}, DType::F64);
  for (int64_t b = 0; b < rows; b += block) {
    Tensor xb = row_block(x, b, b + block), dyb = row_block(dy, b, b + block);
    LayerNormResult part = run_layernorm(xb, gamma, beta, 1e-5f, DType::F64);
    EXPECT_EQ(part.y.to_doubles(), row_block(whole.y, b, b + block).to_doubles());
    Tensor dxb = Tensor::empty({block, cols}, DType::F64);
    layernorm_backward(ctx, dyb, xb, gamma, part.mean, part.rstd, dxb, dgamma_blocks, dbeta_blocks);
    EXPECT_EQ(dxb.to_doubles(), row_block(dx, b, b + block).to_doubles());
  }
  EXPECT_LT(relative_error(dgamma, dgamma_blocks), 1e-13);
  EXPECT_LT(relative_error(dbeta, dbeta_blocks), 1e-13);
}

TEST(RmsNorm, ThreadedMatchesSmallSerialBlocks) {
  Context ctx = Context::cpu();
  const int64_t rows = 300, cols = 131, block = 30;
  Tensor x = random_tensor({rows, cols}, DType::F32, 41), dy = random_tensor({rows, cols}, DType::F32, 42);
  Tensor gamma = random_tensor({cols}, DType::F32, 43);
  RmsNormResult whole = run_rmsnorm(x, gamma, 1e-6f, DType::F32);
  Tensor dx = Tensor::empty({rows, cols}, DType::F32), dgamma = Tensor::zeros({cols}, DType::F64);
  rmsnorm_backward(ctx, dy, x, gamma, whole.rstd, dx, dgamma);

  Tensor dgamma_blocks = Tensor::zeros({cols}, DType::F64);
  for (int64_t b = 0; b < rows; b += block) {
    Tensor xb = row_block(x, b, b + block), dyb = row_block(dy, b, b + block);
    RmsNormResult part = run_rmsnorm(xb, gamma, 1e-6f, DType::F32);
    EXPECT_EQ(part.y.to_doubles(), row_block(whole.y, b, b + block).to_doubles());
    Tensor dxb = Tensor::empty({block, cols}, DType::F32);
    rmsnorm_backward(ctx, dyb, xb, gamma, part.rstd, dxb, dgamma_blocks);
    EXPECT_EQ(dxb.to_doubles(), row_block(dx, b, b + block).to_doubles());
  }
  EXPECT_LT(relative_error(dgamma, dgamma_blocks), 1e-6);
}
