#include "tessera/ops/optimizer.h"

#include <cmath>

#include "testing.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

// The AdamW update written out from its textbook form (bias-corrected moments m_hat and
// v_hat), in double, independently of the kernel's PyTorch-style arrangement.
struct ReferenceAdamW {
  std::vector<double> p, m, v;
  void step(const std::vector<double>& g, double lr, double b1, double b2, double eps, double wd, int t) {
    for (size_t i = 0; i < p.size(); ++i) {
      p[i] -= lr * wd * p[i];
      m[i] = b1 * m[i] + (1 - b1) * g[i];
      v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
      const double m_hat = m[i] / (1 - std::pow(b1, t));
      const double v_hat = v[i] / (1 - std::pow(b2, t));
      p[i] -= lr * m_hat / (std::sqrt(v_hat) + eps);
    }
  }
};

}  // namespace

TEST(AdamW, ThreeStepsMatchHandComputedValues) {
  Context ctx = Context::cpu();
  const std::vector<double> p0 = {0.5, -1.25, 2.0, 0.0, 3.0};
  const std::vector<std::vector<double>> grads = {
      {0.1, -0.2, 0.0, 1.5, -3.0}, {0.3, 0.1, 1e-3, -1.0, -2.0}, {-0.2, 0.4, 0.0, 0.5, 1.0}};
  AdamWOptions o;
  o.lr = 0.01f;
  o.beta1 = 0.8f;
  o.beta2 = 0.95f;
  o.eps = 1e-6f;
  o.weight_decay = 0.1f;
  for (DType pt : {DType::F64, DType::F32}) {
    for (DType gt : {pt, DType::BF16}) {
      Tensor p = Tensor::from_doubles(p0, {5}, pt), m = Tensor::zeros({5}, pt), v = Tensor::zeros({5}, pt);
      ReferenceAdamW ref{p0, std::vector<double>(5, 0.0), std::vector<double>(5, 0.0)};
      for (int t = 1; t <= 3; ++t) {
        Tensor g = Tensor::from_doubles(grads[t - 1], {5}, gt);
        o.step = t;
        adamw_step(ctx, p, g, m, v, o);
        // The reference sees the gradient values the tensor actually holds, and the
        // hyperparameters as the floats the options hold.
        ref.step(g.to_doubles(), o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, t);
        const double tol = pt == DType::F64 ? 1e-13 : 1e-6;
        EXPECT_LT(relative_error(p.to_doubles(), ref.p), tol) << dtype_name(pt) << "/" << dtype_name(gt) << " t=" << t;
        EXPECT_LT(relative_error(m.to_doubles(), ref.m), tol) << dtype_name(pt) << " t=" << t;
        EXPECT_LT(relative_error(v.to_doubles(), ref.v), tol) << dtype_name(pt) << " t=" << t;
      }
    }
  }
  // Step 1 from zero moments moves every parameter with a nonzero gradient by about lr
  // against the sign of its gradient (m_hat / sqrt(v_hat) = sign(g)).
  Tensor p = Tensor::from_doubles({1, 1}, {2}), m = Tensor::zeros({2}, DType::F64), v = Tensor::zeros({2}, DType::F64);
  AdamWOptions first;
  first.lr = 0.1f;
  adamw_step(ctx, p, Tensor::from_doubles({5, -0.01}, {2}), m, v, first);
  EXPECT_NEAR(p.item(0), 1 - 0.1, 1e-7);
  EXPECT_NEAR(p.item(1), 1 + 0.1, 1e-5);
}

TEST(AdamW, WeightDecayIsDecoupled) {
  Context ctx = Context::cpu();
  // Zero gradient and zero moments: only the decay moves the parameters, by exactly
  // p * (1 - lr * wd), independent of the adaptive denominator.
  Tensor p = Tensor::from_doubles({2, -4, 0.5}, {3}), m = Tensor::zeros({3}, DType::F64), v = Tensor::zeros({3}, DType::F64);
  Tensor g = Tensor::zeros({3}, DType::F64);
  AdamWOptions o;
  o.lr = 0.1f;
  o.weight_decay = 0.5f;
  adamw_step(ctx, p, g, m, v, o);
  const double decay = 1 - double(o.lr) * double(o.weight_decay);
  EXPECT_DOUBLE_EQ(p.item(0), 2 * decay);
  EXPECT_DOUBLE_EQ(p.item(1), -4 * decay);
  EXPECT_DOUBLE_EQ(p.item(2), 0.5 * decay);
  // Without decay the same step leaves them alone.
  o.weight_decay = 0;
  Tensor q = Tensor::from_doubles({2, -4, 0.5}, {3});
  adamw_step(ctx, q, g, m, v, o);
  EXPECT_EQ(q.to_doubles(), (std::vector<double>{2, -4, 0.5}));
}

TEST(AdamW, MinimisesAQuadratic) {
  Context ctx = Context::cpu();
  // f(p) = 0.5 * sum_i a_i (p_i - c_i)^2 with curvatures spread over two decades.
  const int64_t n = 37;
  Tensor a = random_tensor({n}, DType::F64, 1, 0.1f, 10.0f), c = random_tensor({n}, DType::F64, 2, -3, 3);
  Tensor p = Tensor::zeros({n}, DType::F32), m = Tensor::zeros({n}, DType::F32), v = Tensor::zeros({n}, DType::F32);
  auto loss = [&] {
    double f = 0;
    for (int64_t i = 0; i < n; ++i) f += 0.5 * a.item(i) * (p.item(i) - c.item(i)) * (p.item(i) - c.item(i));
    return f;
  };
  const double initial = loss();
  AdamWOptions o;
  o.lr = 0.05f;
  o.weight_decay = 0.01f;
  Tensor g = Tensor::empty({n}, DType::BF16);
  double after_ten = 0;
  for (int64_t t = 1; t <= 400; ++t) {
    for (int64_t i = 0; i < n; ++i) g.set_item(i, a.item(i) * (p.item(i) - c.item(i)));
    o.step = t;
    adamw_step(ctx, p, g, m, v, o);
    if (t == 10) after_ten = loss();
  }
  EXPECT_LT(after_ten, initial);
  EXPECT_LT(loss(), 1e-3 * initial);
}

TEST(AdamW, BadArgumentsThrow) {
  Context ctx = Context::cpu();
  Tensor p = Tensor::zeros({4}, DType::F32), g = Tensor::zeros({4}, DType::F32);
  Tensor m = Tensor::zeros({4}, DType::F32), v = Tensor::zeros({4}, DType::F32);
  AdamWOptions o;
  EXPECT_NO_THROW(adamw_step(ctx, p, g, m, v, o));
  for (int64_t bad_step : {int64_t{0}, int64_t{-3}}) {
    AdamWOptions s;
    s.step = bad_step;
    EXPECT_THROW(adamw_step(ctx, p, g, m, v, s), Error);
  }
  Tensor g_short = Tensor::zeros({3}, DType::F32), m_2d = Tensor::zeros({2, 2}, DType::F32);
  EXPECT_THROW(adamw_step(ctx, p, g_short, m, v, o), Error);
  EXPECT_THROW(adamw_step(ctx, p, g, m_2d, v, o), Error);
  Tensor p_bf16 = Tensor::zeros({4}, DType::BF16), m64 = Tensor::zeros({4}, DType::F64), g_int = Tensor::zeros({4}, DType::I32);
  EXPECT_THROW(adamw_step(ctx, p_bf16, g, m, v, o), Error);
  EXPECT_THROW(adamw_step(ctx, p, g, m64, v, o), Error);
  EXPECT_THROW(adamw_step(ctx, p, g_int, m, v, o), Error);
  EXPECT_THROW(adamw_step(ctx, p, g, m, m, o), Error);  // moments aliased
  AdamWOptions beta_one;
  beta_one.beta2 = 1.0f;
  EXPECT_THROW(adamw_step(ctx, p, g, m, v, beta_one), Error);
  AdamWOptions negative_lr;
  negative_lr.lr = -1e-3f;
  EXPECT_THROW(adamw_step(ctx, p, g, m, v, negative_lr), Error);
  Tensor undefined;
  EXPECT_THROW(adamw_step(ctx, p, undefined, m, v, o), Error);
}
