#include "tessera/ops/norm.h"

#include <cmath>
#include <cstring>

#include "tessera/nn/transformer_layer.h"
#include "tessera/ops/elementwise.h"
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

// ---- Residual add fused into the norm ------------------------------------------------------
//
// The fused ops are defined as add() composed with the plain norm (forward) and the plain
// norm's backward composed with add() (backward); on the CPU they must equal that
// composition bit for bit, in every dtype, in place or not.

namespace {

// Same dtype, same shape, same bytes.

Tensor poisoned(const Shape& shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype);
  poison(t);
  return t;
}

Tensor sum_of(const Tensor& a, const Tensor& b) {
  Context ctx = Context::cpu();
  Tensor out = Tensor::empty(a.shape(), a.dtype());
  add(ctx, a, b, out);
  return out;
}

// Everything one fused forward + backward produces, or its unfused composition.
struct AddNormRun {
  Tensor sum, y, mean, rstd, dx, dgamma, dbeta;
};

struct AddNormInputs {
  bool layer;  // LayerNorm (with beta when beta is defined) or RMSNorm
  Tensor x, residual, gamma, beta, dy, d_residual, dgamma0, dbeta0;
  float eps = 1e-5f;
};

AddNormInputs make_inputs(bool layer, const Shape& shape, DType t, DType param, bool with_beta, uint64_t seed) {
  const int64_t cols = shape.back();
  AddNormInputs in;
  in.layer = layer;
  in.x = random_tensor(shape, t, seed, -2.0f, 3.0f);
  in.residual = random_tensor(shape, t, seed + 1);
  in.gamma = random_tensor({cols}, param, seed + 2, 0.5f, 1.5f);
  if (layer && with_beta) {
    in.beta = random_tensor({cols}, param, seed + 3);
    in.dbeta0 = random_tensor({cols}, stats_dtype(t), seed + 4);
  }
  in.dy = random_tensor(shape, t, seed + 5);
  in.d_residual = random_tensor(shape, t, seed + 6);
  in.dgamma0 = random_tensor({cols}, stats_dtype(t), seed + 7);  // gradients accumulate onto these
  return in;
}

AddNormRun run_unfused(const AddNormInputs& in) {
  Context ctx = Context::cpu();
  const Shape& shape = in.x.shape();
  const DType t = in.x.dtype();
  AddNormRun r;
  r.sum = sum_of(in.x, in.residual);
  r.y = poisoned(shape, t);
  r.rstd = poisoned({rows_of(shape)}, stats_dtype(t));
  r.dgamma = in.dgamma0.clone();
  r.dbeta = in.dbeta0.defined() ? in.dbeta0.clone() : Tensor();
  Tensor through_norm = poisoned(shape, t);
  if (in.layer) {
    r.mean = poisoned({rows_of(shape)}, stats_dtype(t));
    layernorm_forward(ctx, r.sum, in.gamma, in.beta, in.eps, r.y, r.mean, r.rstd);
    layernorm_backward(ctx, in.dy, r.sum, in.gamma, r.mean, r.rstd, through_norm, r.dgamma, r.dbeta);
  } else {
    rmsnorm_forward(ctx, r.sum, in.gamma, in.eps, r.y, r.rstd);
    rmsnorm_backward(ctx, in.dy, r.sum, in.gamma, r.rstd, through_norm, r.dgamma);
  }
  // The residual gradient first, as the unfused Transformer block adds them.
  r.dx = sum_of(in.d_residual, through_norm);
  return r;
}

// The fused ops. Where sum_out/y/dx should alias an input, pass that input's tensor (a
// private copy the caller made) as sum_into/y_into/dx_into.
AddNormRun run_fused(const AddNormInputs& in, Tensor x, Tensor residual, Tensor sum_into = Tensor(),
                     Tensor y_into = Tensor(), Tensor dy = Tensor(), Tensor d_residual = Tensor(),
                     Tensor dx_into = Tensor()) {
  Context ctx = Context::cpu();
  const Shape& shape = in.x.shape();
  const DType t = in.x.dtype();
  AddNormRun r;
  r.sum = sum_into.defined() ? sum_into : poisoned(shape, t);
  r.y = y_into.defined() ? y_into : poisoned(shape, t);
  r.rstd = poisoned({rows_of(shape)}, stats_dtype(t));
  r.dgamma = in.dgamma0.clone();
  r.dbeta = in.dbeta0.defined() ? in.dbeta0.clone() : Tensor();
  if (!dy.defined()) dy = in.dy;
  if (!d_residual.defined()) d_residual = in.d_residual;
  r.dx = dx_into.defined() ? dx_into : poisoned(shape, t);
  if (in.layer) {
    r.mean = poisoned({rows_of(shape)}, stats_dtype(t));
    add_layernorm_forward(ctx, x, residual, in.gamma, in.beta, in.eps, r.sum, r.y, r.mean, r.rstd);
  } else {
    add_rmsnorm_forward(ctx, x, residual, in.gamma, in.eps, r.sum, r.y, r.rstd);
  }
  if (in.layer)
    layernorm_backward_add(ctx, dy, r.sum, in.gamma, r.mean, r.rstd, d_residual, r.dx, r.dgamma, r.dbeta);
  else
    rmsnorm_backward_add(ctx, dy, r.sum, in.gamma, r.rstd, d_residual, r.dx, r.dgamma);
  return r;
}

void expect_same_run(const AddNormRun& got, const AddNormRun& want, const std::string& what) {
  EXPECT_TRUE(same_bits(got.sum, want.sum)) << what << ": sum";
  EXPECT_TRUE(same_bits(got.y, want.y)) << what << ": y";
  EXPECT_TRUE(same_bits(got.mean, want.mean)) << what << ": mean";
  EXPECT_TRUE(same_bits(got.rstd, want.rstd)) << what << ": rstd";
  EXPECT_TRUE(same_bits(got.dx, want.dx)) << what << ": dx";
  EXPECT_TRUE(same_bits(got.dgamma, want.dgamma)) << what << ": dgamma";
  EXPECT_TRUE(same_bits(got.dbeta, want.dbeta)) << what << ": dbeta";
}

}  // namespace

TEST(AddNorm, EqualsAddThenNormBitForBit) {
  // C = 1, odd widths, a [B, T, C] input, many narrow rows, a block above the threading
  // threshold, and wide rows; every floating dtype the CPU takes, parameters of x's dtype or
  // of another one.
  const std::vector<Shape> shapes = {{1, 1}, {7, 1}, {5, 7}, {2, 3, 33}, {70, 5}, {300, 131}, {4, 8192}};
  uint64_t seed = 2000;
  for (DType t : {DType::F64, DType::F32, DType::BF16, DType::F16}) {
    for (size_t i = 0; i < shapes.size(); ++i) {
      const DType param = i % 2 ? DType::F32 : (t == DType::F64 ? DType::F64 : DType::BF16);
      for (int variant = 0; variant < 3; ++variant) {  // LayerNorm with beta, without, RMSNorm
        const AddNormInputs in = make_inputs(variant < 2, shapes[i], t, param, variant == 0, seed += 10);
        const std::string what = std::string(variant == 2 ? "rmsnorm " : variant == 1 ? "layernorm (no beta) " : "layernorm ") +
                                 dtype_name(t) + shape_to_string(shapes[i]) + " params " + dtype_name(param);
        expect_same_run(run_fused(in, in.x, in.residual), run_unfused(in), what);
      }
    }
  }
}

TEST(AddNorm, InPlaceResidualStreamAndGradients) {
  uint64_t seed = 3000;
  for (DType t : {DType::F32, DType::BF16, DType::F64}) {
    for (bool layer : {true, false}) {
      const AddNormInputs in = make_inputs(layer, {6, 40}, t, DType::F32, true, seed += 10);
      const AddNormRun want = run_unfused(in);
      const std::string what = std::string(layer ? "layernorm " : "rmsnorm ") + dtype_name(t);
      {  // sum_out is x: the residual stream updated in place
        Tensor x = in.x.clone();
        expect_same_run(run_fused(in, x, in.residual, x), want, what + ", sum_out = x");
      }
      {  // sum_out is residual
        Tensor residual = in.residual.clone();
        expect_same_run(run_fused(in, in.x, residual, residual), want, what + ", sum_out = residual");
      }
      {  // y overwrites x (the sum goes elsewhere)
        Tensor x = in.x.clone();
        expect_same_run(run_fused(in, x, in.residual, Tensor(), x), want, what + ", y = x");
      }
      {  // dx overwrites the incoming residual gradient
        Tensor d_residual = in.d_residual.clone();
        expect_same_run(run_fused(in, in.x, in.residual, Tensor(), Tensor(), Tensor(), d_residual, d_residual), want,
                        what + ", dx = d_residual_in");
      }
      {  // dx overwrites dy
        Tensor dy = in.dy.clone();
        expect_same_run(run_fused(in, in.x, in.residual, Tensor(), Tensor(), dy, Tensor(), dy), want, what + ", dx = dy");
      }
      {  // dx overwrites x, the forward's sum
        Context ctx = Context::cpu();
        Tensor sum = want.sum.clone(), dgamma = in.dgamma0.clone();
        Tensor dbeta = in.dbeta0.defined() ? in.dbeta0.clone() : Tensor();
        if (layer)
          layernorm_backward_add(ctx, in.dy, sum, in.gamma, want.mean, want.rstd, in.d_residual, sum, dgamma, dbeta);
        else
          rmsnorm_backward_add(ctx, in.dy, sum, in.gamma, want.rstd, in.d_residual, sum, dgamma);
        EXPECT_TRUE(same_bits(sum, want.dx)) << what << ", dx = x: dx";
        EXPECT_TRUE(same_bits(dgamma, want.dgamma)) << what << ", dx = x: dgamma";
        EXPECT_TRUE(same_bits(dbeta, want.dbeta)) << what << ", dx = x: dbeta";
      }
    }
  }
}

// The backward op is the gradient of the forward op: with L = sum(y * W) + sum(sum_out * V),
// dL/dx = dL/dresidual = layernorm_backward_add(dy = W, d_residual_in = V).
TEST(AddNorm, BackwardIsTheGradientOfForward) {
  Context ctx = Context::cpu();
  uint64_t seed = 4000;
  for (const Shape& shape : std::vector<Shape>{{1, 1}, {3, 7}, {2, 2, 5}}) {
    for (bool layer : {true, false}) {
      SCOPED_TRACE(std::string(layer ? "layernorm " : "rmsnorm ") + shape_to_string(shape));
      const int64_t cols = shape.back(), rows = rows_of(shape);
      const float eps = !layer && cols == 1 ? 0.05f : 1e-5f;  // see check_rmsnorm_gradients
      Tensor x = random_tensor(shape, DType::F64, seed += 10), residual = random_tensor(shape, DType::F64, seed + 1);
      Tensor gamma = random_tensor({cols}, DType::F64, seed + 2, 0.5f, 1.5f);
      Tensor beta = random_tensor({cols}, DType::F64, seed + 3);
      const Tensor w = random_tensor(shape, DType::F64, seed + 4), v = random_tensor(shape, DType::F64, seed + 5);
      auto forward = [&](Tensor& sum, Tensor& y, Tensor& mean, Tensor& rstd) {
        sum = Tensor::empty(shape, DType::F64), y = Tensor::empty(shape, DType::F64);
        mean = Tensor::empty({rows}, DType::F64), rstd = Tensor::empty({rows}, DType::F64);
        if (layer) add_layernorm_forward(ctx, x, residual, gamma, beta, eps, sum, y, mean, rstd);
        else add_rmsnorm_forward(ctx, x, residual, gamma, eps, sum, y, rstd);
      };
      auto loss = [&] {
        Tensor sum, y, mean, rstd;
        forward(sum, y, mean, rstd);
        return weighted_sum(y, w) + weighted_sum(sum, v);
      };
      Tensor sum, y, mean, rstd;
      forward(sum, y, mean, rstd);
      Tensor dx = poisoned(shape, DType::F64), dgamma = Tensor::zeros({cols}, DType::F64),
             dbeta = Tensor::zeros({cols}, DType::F64);
      if (layer) layernorm_backward_add(ctx, w, sum, gamma, mean, rstd, v, dx, dgamma, dbeta);
      else rmsnorm_backward_add(ctx, w, sum, gamma, rstd, v, dx, dgamma);
      expect_gradient(dx, x, loss, "dx (as d/dx)");
      expect_gradient(dx, residual, loss, "dx (as d/dresidual)");
      expect_gradient(dgamma, gamma, loss, "dgamma");
      if (layer) expect_gradient(dbeta, beta, loss, "dbeta");
    }
  }
}

TEST(AddNorm, RejectsBadArguments) {
  Context ctx = Context::cpu();
  const Shape shape{4, 8};
  Tensor x = Tensor::zeros(shape, DType::F32), residual = Tensor::zeros(shape, DType::F32);
  Tensor gamma = Tensor::zeros({8}, DType::F32), beta = Tensor::zeros({8}, DType::F32);
  Tensor sum = Tensor::zeros(shape, DType::F32), y = Tensor::zeros(shape, DType::F32);
  Tensor mean = Tensor::zeros({4}, DType::F32), rstd = Tensor::zeros({4}, DType::F32);
  EXPECT_NO_THROW(add_layernorm_forward(ctx, x, residual, gamma, beta, 1e-5f, sum, y, mean, rstd));
  EXPECT_NO_THROW(add_layernorm_forward(ctx, x, residual, gamma, Tensor(), 1e-5f, sum, y, mean, rstd));
  EXPECT_NO_THROW(add_rmsnorm_forward(ctx, x, residual, gamma, 1e-5f, sum, y, rstd));
  // A residual of another floating dtype is read as add() reads it.
  Tensor residual_bf16 = Tensor::zeros(shape, DType::BF16);
  EXPECT_NO_THROW(add_rmsnorm_forward(ctx, x, residual_bf16, gamma, 1e-5f, sum, y, rstd));

  Tensor residual_short = Tensor::zeros({3, 8}, DType::F32), sum_bf16 = Tensor::zeros(shape, DType::BF16);
  EXPECT_THROW(add_layernorm_forward(ctx, x, residual_short, gamma, beta, 1e-5f, sum, y, mean, rstd), Error);
  EXPECT_THROW(add_rmsnorm_forward(ctx, x, residual_short, gamma, 1e-5f, sum, y, rstd), Error);
  EXPECT_THROW(add_rmsnorm_forward(ctx, x, residual, gamma, 1e-5f, sum_bf16, y, rstd), Error);  // sum in x's dtype
  Tensor strided = Tensor::zeros({8, 4}, DType::F32).transpose(0, 1), undefined;
  EXPECT_THROW(add_rmsnorm_forward(ctx, x, strided, gamma, 1e-5f, sum, y, rstd), Error);
  EXPECT_THROW(add_rmsnorm_forward(ctx, x, undefined, gamma, 1e-5f, sum, y, rstd), Error);
  EXPECT_THROW(add_rmsnorm_forward(ctx, x, residual, gamma, 1e-5f, undefined, y, rstd), Error);
  Tensor ints = Tensor::zeros(shape, DType::I32);
  EXPECT_THROW(add_rmsnorm_forward(ctx, x, ints, gamma, 1e-5f, sum, y, rstd), Error);
  Tensor gamma7 = Tensor::zeros({7}, DType::F32), mean_f64 = Tensor::zeros({4}, DType::F64);
  EXPECT_THROW(add_layernorm_forward(ctx, x, residual, gamma7, beta, 1e-5f, sum, y, mean, rstd), Error);
  EXPECT_THROW(add_layernorm_forward(ctx, x, residual, gamma, beta, 1e-5f, sum, y, mean_f64, rstd), Error);
  EXPECT_THROW(add_layernorm_forward(ctx, x, residual, gamma, beta, -1.0f, sum, y, mean, rstd), Error);
  EXPECT_THROW(add_rmsnorm_forward(ctx, x, residual, gamma, NAN, sum, y, rstd), Error);
  // y must not overwrite the sum; an output may be an input exactly, never partly.
  EXPECT_THROW(add_rmsnorm_forward(ctx, x, residual, gamma, 1e-5f, sum, sum, rstd), Error);
  EXPECT_THROW(add_rmsnorm_forward(ctx, x, residual, gamma, 1e-5f, x, x, rstd), Error);
  Tensor rows5 = Tensor::zeros({5, 8}, DType::F32);
  Tensor first4 = rows5.slice(0, 0, 4), last4 = rows5.slice(0, 1, 5);
  EXPECT_THROW(add_rmsnorm_forward(ctx, first4, residual, gamma, 1e-5f, last4, y, rstd), Error);
  EXPECT_THROW(add_rmsnorm_forward(ctx, x, first4, gamma, 1e-5f, last4, y, rstd), Error);
  EXPECT_THROW(add_rmsnorm_forward(ctx, first4, residual, gamma, 1e-5f, sum, last4, rstd), Error);
  Context gpu = Context::cuda(0);
  EXPECT_THROW(add_rmsnorm_forward(gpu, x, residual, gamma, 1e-5f, sum, y, rstd), Error);

  Tensor dy = Tensor::zeros(shape, DType::F32), d_residual = Tensor::zeros(shape, DType::F32);
  Tensor dx = Tensor::zeros(shape, DType::F32), dgamma = Tensor::zeros({8}, DType::F32);
  Tensor dbeta = Tensor::zeros({8}, DType::F32);
  EXPECT_NO_THROW(layernorm_backward_add(ctx, dy, sum, gamma, mean, rstd, d_residual, dx, dgamma, dbeta));
  EXPECT_NO_THROW(layernorm_backward_add(ctx, dy, sum, gamma, mean, rstd, d_residual, dx, dgamma, undefined));
  EXPECT_NO_THROW(rmsnorm_backward_add(ctx, dy, sum, gamma, rstd, d_residual, dx, dgamma));
  EXPECT_NO_THROW(rmsnorm_backward_add(ctx, dy, sum, gamma, rstd, d_residual, d_residual, dgamma));
  EXPECT_THROW(layernorm_backward_add(ctx, dy, sum, gamma, mean, rstd, residual_short, dx, dgamma, dbeta), Error);
  EXPECT_THROW(rmsnorm_backward_add(ctx, dy, sum, gamma, rstd, undefined, dx, dgamma), Error);
  EXPECT_THROW(rmsnorm_backward_add(ctx, dy, sum, gamma, rstd, strided, dx, dgamma), Error);
  EXPECT_THROW(rmsnorm_backward_add(ctx, dy, sum, gamma, rstd, d_residual, residual_short, dgamma), Error);
  EXPECT_THROW(rmsnorm_backward_add(ctx, dy, sum, gamma, rstd, d_residual, dx, gamma7), Error);
  EXPECT_THROW(layernorm_backward_add(ctx, dy, sum, gamma, mean_f64, rstd, d_residual, dx, dgamma, dbeta), Error);
  EXPECT_THROW(rmsnorm_backward_add(ctx, dy, sum, gamma, rstd, first4, last4, dgamma), Error);
  EXPECT_THROW(rmsnorm_backward_add(ctx, first4, sum, gamma, rstd, d_residual, last4, dgamma), Error);
  EXPECT_THROW(rmsnorm_backward_add(gpu, dy, sum, gamma, rstd, d_residual, dx, dgamma), Error);
}

// The Transformer block runs its residual adds inside the norms; it must compute exactly what
// the unfused block computes from the same modules, forward, backward and weight gradients.
TEST(AddNorm, TransformerLayerEqualsTheUnfusedBlock) {
  Context ctx = Context::cpu();
  const int64_t batch = 2, seq = 5;
  for (const char* arch : {"gpt2", "llama"}) {
    for (DType t : {DType::F32, DType::BF16}) {
      SCOPED_TRACE(std::string(arch) + " " + dtype_name(t));
      models::ModelConfig c;
      c.architecture = arch;
      c.hidden_size = 16;
      c.num_heads = 2;
      c.num_kv_heads = c.is_gpt2() ? 2 : 1;
      c.intermediate_size = 24;
      c.max_seq_len = 8;
      c.rope_theta = 100.0f;
      nn::TransformerLayer layer("layers.0", c, t);
      nn::ParameterList params;
      layer.parameters(params);
      uint64_t seed = 5000;
      for (nn::Parameter* p : params) {
        const bool norm = p->name.find("norm") != std::string::npos;
        p->weights().copy_from(random_tensor(p->weights().shape(), p->weights().dtype(), seed++, norm ? 0.5f : -0.3f,
                                             norm ? 1.5f : 0.3f));
        p->refresh_value(ctx);
        p->grad.fill_zero();
      }
      const Tensor x = random_tensor({batch * seq, c.hidden_size}, t, 5100, -1.0f, 1.0f);
      const Tensor dy = random_tensor({batch * seq, c.hidden_size}, t, 5101, -1.0f, 1.0f);

      nn::TransformerLayer::Saved fused;
      const Tensor out = layer.forward(ctx, x, batch, seq, fused);
      const Tensor dx = layer.backward_input(ctx, dy, fused);
      layer.backward_weight(ctx, dy, fused);
      std::vector<Tensor> grads;
      for (nn::Parameter* p : params) {
        grads.push_back(p->grad.clone());
        p->grad.fill_zero();
      }

      nn::TransformerLayer::Saved u;
      const Tensor x1 = sum_of(x, layer.attn.forward(ctx, layer.norm1.forward(ctx, x, u.norm1), batch, seq, u.attn));
      const Tensor out_ref = sum_of(x1, layer.mlp.forward(ctx, layer.norm2.forward(ctx, x1, u.norm2), u.mlp));
      const Tensor d_x1 = sum_of(dy, layer.norm2.backward_input(ctx, layer.mlp.backward_input(ctx, dy, u.mlp), u.norm2));
      const Tensor dx_ref =
          sum_of(d_x1, layer.norm1.backward_input(ctx, layer.attn.backward_input(ctx, d_x1, u.attn), u.norm1));
      layer.mlp.backward_weight(ctx, dy, u.mlp);
      layer.attn.backward_weight(ctx, d_x1, u.attn);

      EXPECT_TRUE(same_bits(fused.norm2.x, x1)) << "x1";
      EXPECT_TRUE(same_bits(out, out_ref)) << "output";
      EXPECT_TRUE(same_bits(fused.d_x1, d_x1)) << "d_x1";
      EXPECT_TRUE(same_bits(dx, dx_ref)) << "dx";
      for (size_t i = 0; i < params.size(); ++i)
        EXPECT_TRUE(same_bits(grads[i], params[i]->grad)) << params[i]->name << " gradient";
    }
  }
}
