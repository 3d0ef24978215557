#include "tessera/ops/optimizer.h"

#include <omp.h>

#include <cmath>
#include <cstring>
#include <string>

#include "tessera/nn/parameter.h"
#include "tessera/ops/elementwise.h"
#include "tessera/ops/gemm.h"
#include "tessera/train/optimizer.h"
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

// ---- Multi-tensor AdamW and the global gradient norm --------------------------------------

namespace {

// A list of parameter tensors with their gradients, moments, optional BF16 values and
// weight decays: what the training optimizer hands the multi-tensor ops.
struct TensorList {
  std::vector<Tensor> params, grads, exp_avgs, exp_avg_sqs, values;
  std::vector<float> weight_decays;

  TensorList clone() const {
    TensorList c;
    auto copy = [](const std::vector<Tensor>& from, std::vector<Tensor>& to) {
      for (const Tensor& t : from) to.push_back(t.defined() ? t.clone() : Tensor());
    };
    copy(params, c.params);
    copy(grads, c.grads);
    copy(exp_avgs, c.exp_avgs);
    copy(exp_avg_sqs, c.exp_avg_sqs);
    copy(values, c.values);
    c.weight_decays = weight_decays;
    return c;
  }
};

Shape shape_for(int64_t n, size_t k) {
  if (n > 0 && n % 4 == 0 && k % 2 == 0) return {4, n / 4};
  return {n};
}

// Parameters in [-2, 2), moments as after some steps, a BF16 value on two tensors of three
// (poisoned: the step must write every element), decays 0 / 0.1 / 0.01 in turn.
TensorList make_list(const std::vector<int64_t>& sizes, DType param_dtype, uint64_t seed, bool with_values) {
  TensorList l;
  for (size_t k = 0; k < sizes.size(); ++k) {
    const Shape shape = shape_for(sizes[k], k);
    l.params.push_back(random_tensor(shape, param_dtype, seed++, -2.0f, 2.0f));
    l.grads.push_back(Tensor::zeros(shape, param_dtype));
    l.exp_avgs.push_back(random_tensor(shape, param_dtype, seed++, -0.1f, 0.1f));
    l.exp_avg_sqs.push_back(random_tensor(shape, param_dtype, seed++, 0.0f, 0.01f));
    Tensor value;
    if (with_values && k % 3 != 1) {
      value = Tensor::empty(shape, DType::BF16);
      poison(value);
    }
    l.values.push_back(value);
    l.weight_decays.push_back(k % 3 == 0 ? 0.0f : k % 3 == 1 ? 0.1f : 0.01f);
  }
  return l;
}

// Fresh gradients in [-scale, scale), a few of them tiny so that eps matters.
void fill_grads(TensorList& l, uint64_t seed, float scale) {
  for (Tensor& g : l.grads) {
    g.copy_from(random_tensor(g.shape(), g.dtype(), seed++, -scale, scale));
    for (int64_t i = 0; i < g.numel(); i += 7) g.set_item(i, g.item(i) * 1e-6);
  }
}

// The training optimizer's earlier step, one parameter at a time: each gradient's sum of
// squares into its own slot of one tensor (F32, or F64 for F64 gradients), the slots added
// on the host, then per parameter scale (in place) by the clip factor, adamw_step and the
// cast of the weights to the BF16 value. Returns the norm.
// It runs on one OpenMP thread: the CPU ops give the same bits for any thread count, and
// hundreds of tiny per-tensor parallel regions crawl on a loaded two-core machine.
double per_parameter_step(Context& ctx, TensorList& l, const AdamWOptions& base, double max_norm) {
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  struct Restore {
    int threads;
    ~Restore() { omp_set_num_threads(threads); }
  } restore{threads};
  const int64_t n = static_cast<int64_t>(l.params.size());
  const DType acc = n > 0 && l.grads[0].dtype() == DType::F64 ? DType::F64 : DType::F32;
  Tensor partials = Tensor::empty({std::max<int64_t>(n, 1)}, acc);
  for (int64_t i = 0; i < n; ++i) {
    Tensor slot = partials.slice(0, i, i + 1);
    sum_of_squares(ctx, l.grads[i], slot);
  }
  double total = 0;
  for (int64_t i = 0; i < n; ++i) total += partials.item(i);
  const double norm = std::sqrt(total);
  const double clip = (max_norm > 0 && norm > max_norm) ? max_norm / (norm + 1e-6) : 1.0;
  for (int64_t i = 0; i < n; ++i) {
    if (clip != 1.0) scale(ctx, l.grads[i], static_cast<float>(clip), l.grads[i]);
    AdamWOptions o = base;
    o.weight_decay = l.weight_decays[i];
    adamw_step(ctx, l.params[i], l.grads[i], l.exp_avgs[i], l.exp_avg_sqs[i], o);
    if (l.values[i].defined()) cast(ctx, l.params[i], l.values[i]);
  }
  return norm;
}

double multi_step(Context& ctx, TensorList& l, const AdamWOptions& o, double max_norm, DType norm_dtype = DType::F64) {
  Tensor norm = Tensor::empty({1}, norm_dtype);
  poison(norm);
  global_grad_norm(ctx, l.grads, norm);
  adamw_step_multi(ctx, l.params, l.grads, l.exp_avgs, l.exp_avg_sqs, l.values, o, l.weight_decays, norm, max_norm);
  return norm.item(0);
}

// Same bytes, except that any NaN matches any NaN (the payload is not part of the contract).
void expect_same(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.defined(), want.defined()) << what;
  if (!got.defined()) return;
  ASSERT_EQ(got.dtype(), want.dtype()) << what;
  ASSERT_EQ(got.numel(), want.numel()) << what;
  const std::vector<double> a = got.to_doubles(), b = want.to_doubles();
  const auto* ga = static_cast<const unsigned char*>(got.raw_data());
  const auto* wa = static_cast<const unsigned char*>(want.raw_data());
  const size_t es = dtype_size(got.dtype());
  int64_t mismatches = 0, first = -1;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const bool same = (std::isnan(a[i]) && std::isnan(b[i])) || std::memcmp(ga + i * es, wa + i * es, es) == 0;
    if (!same && mismatches++ == 0) first = i;
  }
  EXPECT_EQ(mismatches, 0) << what << ": first difference at " << first << ": "
                           << (first >= 0 ? std::to_string(a[first]) + " vs " + std::to_string(b[first]) : "");
}

void expect_same_lists(const TensorList& got, const TensorList& want, const std::string& what) {
  for (size_t k = 0; k < got.params.size(); ++k) {
    const std::string w = what + " tensor " + std::to_string(k) + " (" + got.params[k].shape_string() + ")";
    expect_same(got.params[k], want.params[k], w + " param");
    expect_same(got.exp_avgs[k], want.exp_avgs[k], w + " exp_avg");
    expect_same(got.exp_avg_sqs[k], want.exp_avg_sqs[k], w + " exp_avg_sq");
    expect_same(got.values[k], want.values[k], w + " bf16 value");
  }
}

std::vector<int64_t> odd_sizes(size_t count, uint64_t seed) {
  // Degenerate and boundary sizes first, then a spread of small odd ones.
  std::vector<int64_t> sizes = {0, 1, 7, 8, 9, 33, 1000, 16384, 16385, 40000, 0, 1};
  Tensor r = random_tensor({static_cast<int64_t>(count)}, DType::F64, seed, 0.0f, 300.0f);
  for (size_t i = 0; sizes.size() < count; ++i) sizes.push_back(static_cast<int64_t>(r.item(i)));
  return sizes;
}

}  // namespace

TEST(GlobalGradNorm, IsTheL2NormOverEveryTensor) {
  Context ctx = Context::cpu();
  for (DType out_dtype : {DType::F32, DType::F64}) {
    Tensor norm = Tensor::empty({1}, out_dtype);
    std::vector<Tensor> grads = {Tensor::from_doubles({3, 4}, {2}, DType::F32), Tensor::zeros({0}, DType::F32),
                                 Tensor::from_doubles({12}, {1, 1}, DType::BF16)};
    poison(norm);
    global_grad_norm(ctx, grads, norm);
    EXPECT_EQ(norm.item(0), 13.0) << dtype_name(out_dtype);
    std::vector<Tensor> none;
    poison(norm);
    global_grad_norm(ctx, none, norm);
    EXPECT_EQ(norm.item(0), 0.0) << "an empty list";
    std::vector<Tensor> f64 = {Tensor::from_doubles({1e-3, 2e-3}, {2}), Tensor::from_doubles({0.1}, {1})};
    global_grad_norm(ctx, f64, norm);
    EXPECT_NEAR(norm.item(0), std::sqrt(1e-6 + 4e-6 + 1e-2), 1e-7 * 0.1);
  }
  // A NaN or Inf gradient makes the norm NaN or Inf.
  Tensor norm = Tensor::empty({1}, DType::F64);
  std::vector<Tensor> nan = {Tensor::from_floats({1, NAN}, {2}), Tensor::from_floats({1}, {1})};
  global_grad_norm(ctx, nan, norm);
  EXPECT_TRUE(std::isnan(norm.item(0)));
  std::vector<Tensor> inf = {Tensor::from_floats({1, INFINITY}, {2})};
  global_grad_norm(ctx, inf, norm);
  EXPECT_EQ(norm.item(0), INFINITY);
}

TEST(AdamWMulti, MatchesThePerParameterPathBitForBit) {
  Context ctx = Context::cpu();
  uint64_t seed = 9000;
  for (DType pt : {DType::F32, DType::F64}) {
    for (bool with_values : {true, false}) {
      // max_norm: clipping off, on but not reached, on and clipping.
      for (double max_norm : {0.0, 1e9, 0.5}) {
        // Hundreds of tensors once, the boundary sizes and a few more otherwise.
        const bool many = pt == DType::F32 && with_values && max_norm == 0.5;
        TensorList multi = make_list(odd_sizes(many ? 300 : 40, seed++), pt, seed, with_values);
        seed += 2000;
        TensorList ref = multi.clone();
        AdamWOptions o;
        o.beta1 = 0.9f;
        o.beta2 = 0.95f;
        o.eps = 1e-8f;
        o.weight_decay = 123.0f;  // not used by the multi-tensor op: the per-tensor decays are
        const std::vector<std::pair<int64_t, float>> steps = {{1, 1e-3f}, {2, 3e-4f}, {1000, 1e-4f}};
        for (auto [step, lr] : steps) {
          fill_grads(multi, seed, 0.05f);
          fill_grads(ref, seed, 0.05f);
          seed += 1000;
          o.step = step;
          o.lr = lr;
          const std::string what = std::string(dtype_name(pt)) + (with_values ? " with values" : "") +
                                   " max_norm " + std::to_string(max_norm) + " step " + std::to_string(step);
          const double got = multi_step(ctx, multi, o, max_norm);
          const double want = per_parameter_step(ctx, ref, o, max_norm);
          EXPECT_EQ(got, want) << what << ": norm";
          if (max_norm == 0.5) EXPECT_GT(want, 2 * max_norm) << what << ": the test must clip";
          expect_same_lists(multi, ref, what);
        }
      }
    }
  }
}

TEST(AdamWMulti, F32NormGivesTheRoundedNorm) {
  Context ctx = Context::cpu();
  TensorList l = make_list({5, 17, 300}, DType::F32, 31, true);
  fill_grads(l, 40, 1.0f);
  Tensor n32 = Tensor::empty({1}, DType::F32), n64 = Tensor::empty({1}, DType::F64);
  global_grad_norm(ctx, l.grads, n32);
  global_grad_norm(ctx, l.grads, n64);
  EXPECT_EQ(n32.item(0), static_cast<double>(static_cast<float>(n64.item(0))));
  // The F32 norm gives its own clip factor: the same as the per-parameter path fed that norm.
  TensorList ref = l.clone();
  AdamWOptions o;
  adamw_step_multi(ctx, l.params, l.grads, l.exp_avgs, l.exp_avg_sqs, l.values, o, l.weight_decays, n32, 1.0);
  const double clip = 1.0 / (n32.item(0) + 1e-6);
  ASSERT_LT(clip, 1.0);
  for (size_t k = 0; k < ref.params.size(); ++k) {
    scale(ctx, ref.grads[k], static_cast<float>(clip), ref.grads[k]);
    AdamWOptions ok = o;
    ok.weight_decay = ref.weight_decays[k];
    adamw_step(ctx, ref.params[k], ref.grads[k], ref.exp_avgs[k], ref.exp_avg_sqs[k], ok);
    if (ref.values[k].defined()) cast(ctx, ref.params[k], ref.values[k]);
  }
  expect_same_lists(l, ref, "F32 norm");
}

// NaN norm: no clipping, and the NaN stays in its element. Inf norm: clip = 0, finite
// gradients count as zero, the Inf element becomes NaN. Both as the per-parameter path.
TEST(AdamWMulti, NanAndInfGradientsBehaveAsThePerParameterPath) {
  Context ctx = Context::cpu();
  for (float bad : {NAN, INFINITY}) {
    TensorList multi = make_list({9, 4, 20000}, DType::F32, 77, true);
    fill_grads(multi, 78, 1.0f);
    multi.grads[2].set_item(5, bad);
    TensorList ref = multi.clone();
    AdamWOptions o;
    const double got = multi_step(ctx, multi, o, 1.0);
    const double want = per_parameter_step(ctx, ref, o, 1.0);
    EXPECT_EQ(std::isnan(got), std::isnan(bad));
    EXPECT_EQ(std::isnan(want), std::isnan(bad));
    expect_same_lists(multi, ref, std::isnan(bad) ? "NaN gradient" : "Inf gradient");
    const std::vector<double> p = multi.params[2].to_doubles(), p0 = multi.params[0].to_doubles();
    EXPECT_TRUE(std::isnan(p[5]));
    EXPECT_FALSE(std::isnan(p[4]));
    EXPECT_FALSE(std::isnan(p0[0]));
  }
}

TEST(AdamWMulti, EmptyListsAndUndefinedNormWithoutClipping) {
  Context ctx = Context::cpu();
  std::vector<Tensor> none;
  std::vector<float> no_decays;
  Tensor norm = Tensor::zeros({1}, DType::F32);
  EXPECT_NO_THROW(adamw_step_multi(ctx, none, none, none, none, none, {}, no_decays, norm, 1.0));
  // bf16_values may be an empty list; grad_norm may be undefined when max_norm is 0.
  TensorList l = make_list({3, 0, 1}, DType::F32, 5, false);
  fill_grads(l, 6, 1.0f);
  TensorList ref = l.clone();
  std::vector<Tensor> no_values;
  adamw_step_multi(ctx, l.params, l.grads, l.exp_avgs, l.exp_avg_sqs, no_values, {}, l.weight_decays, Tensor(), 0.0);
  per_parameter_step(ctx, ref, {}, 0.0);
  expect_same_lists(l, ref, "no values, no clipping");
}

TEST(AdamWMulti, BadArgumentsThrow) {
  Context ctx = Context::cpu();
  TensorList l = make_list({4, 6}, DType::F32, 11, true);
  Tensor norm = Tensor::zeros({1}, DType::F32);
  AdamWOptions o;
  auto run = [&](TensorList& t, const Tensor& n, double max_norm, const AdamWOptions& opt) {
    adamw_step_multi(ctx, t.params, t.grads, t.exp_avgs, t.exp_avg_sqs, t.values, opt, t.weight_decays, n, max_norm);
  };
  EXPECT_NO_THROW(run(l, norm, 1.0, o));
  {
    TensorList bad = l;  // shares the tensors: only the lists differ
    bad.grads.pop_back();
    EXPECT_THROW(run(bad, norm, 1.0, o), Error);
  }
  {
    TensorList bad = l;
    bad.weight_decays.pop_back();
    EXPECT_THROW(run(bad, norm, 1.0, o), Error);
  }
  {
    TensorList bad = l;
    bad.values.pop_back();
    EXPECT_THROW(run(bad, norm, 1.0, o), Error);
  }
  {
    TensorList bad = l;
    bad.values[0] = Tensor::zeros(bad.params[0].shape(), DType::F32);
    EXPECT_THROW(run(bad, norm, 1.0, o), Error);  // values must be BF16
    bad.values[0] = Tensor::zeros({5}, DType::BF16);
    EXPECT_THROW(run(bad, norm, 1.0, o), Error);  // of the param's shape
  }
  {
    TensorList bad = l;
    bad.weight_decays[1] = -0.1f;
    EXPECT_THROW(run(bad, norm, 1.0, o), Error);
  }
  {
    TensorList bad = l;
    bad.params[1] = bad.params[0];  // one tensor stepped twice
    bad.grads[1] = bad.grads[0];
    bad.exp_avgs[1] = Tensor::zeros(bad.params[0].shape(), DType::F32);
    bad.exp_avg_sqs[1] = Tensor::zeros(bad.params[0].shape(), DType::F32);
    bad.values[1] = Tensor();
    EXPECT_THROW(run(bad, norm, 1.0, o), Error);
  }
  {
    TensorList bad = l;
    bad.exp_avgs[0] = bad.grads[0];  // a moment that is a gradient
    EXPECT_THROW(run(bad, norm, 1.0, o), Error);
  }
  {
    TensorList bad = l;
    bad.grads[1] = Tensor::zeros(bad.params[1].shape(), DType::I32);
    EXPECT_THROW(run(bad, norm, 1.0, o), Error);
  }
  EXPECT_THROW(run(l, norm, -1.0, o), Error);
  EXPECT_THROW(run(l, Tensor(), 1.0, o), Error);                            // clipping needs the norm
  EXPECT_THROW(run(l, Tensor::zeros({2}, DType::F32), 1.0, o), Error);      // norm is [1]
  EXPECT_THROW(run(l, Tensor::zeros({1}, DType::BF16), 1.0, o), Error);     // F32 or F64
  EXPECT_THROW(run(l, l.params[0].slice(0, 0, 1).reshape({1}), 1.0, o), Error);  // read while written
  AdamWOptions bad_step;
  bad_step.step = 0;
  EXPECT_THROW(run(l, norm, 1.0, bad_step), Error);
  // global_grad_norm
  Tensor out_i32 = Tensor::zeros({1}, DType::I32), out2 = Tensor::zeros({2}, DType::F32);
  EXPECT_THROW(global_grad_norm(ctx, l.grads, out_i32), Error);
  EXPECT_THROW(global_grad_norm(ctx, l.grads, out2), Error);
  std::vector<Tensor> with_int = {l.grads[0], Tensor::zeros({3}, DType::I32)};
  EXPECT_THROW(global_grad_norm(ctx, with_int, norm), Error);
  std::vector<Tensor> with_undefined = {l.grads[0], Tensor()};
  EXPECT_THROW(global_grad_norm(ctx, with_undefined, norm), Error);
  Tensor inside = l.grads[0].reshape({-1}).slice(0, 1, 2);
  EXPECT_THROW(global_grad_norm(ctx, l.grads, inside), Error);  // written over a gradient
}

// The training optimizer on the multi-tensor ops: the same norm, weights, BF16 values and
// moments as its earlier per-parameter step, with BF16 (FP32 master) and F32 parameters
// mixed, decay on some, clipping active.
TEST(TrainOptimizer, MatchesItsEarlierPerParameterStepBitForBit) {
  Context ctx = Context::cpu();
  std::vector<nn::Parameter> params;
  const std::vector<std::pair<Shape, DType>> specs = {
      {{33, 17}, DType::BF16}, {{17}, DType::BF16}, {{1}, DType::F32}, {{128, 130}, DType::BF16},
      {{9}, DType::F32},       {{0}, DType::BF16},  {{8, 8}, DType::F32}};
  for (size_t k = 0; k < specs.size(); ++k)
    params.emplace_back("p" + std::to_string(k), specs[k].first, specs[k].second, k % 2 == 0);
  nn::ParameterList list;
  TensorList ref;
  uint64_t seed = 4000;
  for (nn::Parameter& p : params) {
    p.weights().copy_from(random_tensor(p.weights().shape(), DType::F32, seed++, -1.0f, 1.0f));
    p.refresh_value(ctx);
    list.push_back(&p);
    ref.params.push_back(p.weights().clone());
    ref.grads.push_back(Tensor::zeros(p.grad.shape(), p.grad.dtype()));
    ref.exp_avgs.push_back(Tensor::zeros(p.weights().shape(), DType::F32));
    ref.exp_avg_sqs.push_back(Tensor::zeros(p.weights().shape(), DType::F32));
    ref.values.push_back(p.master.defined() ? p.value.clone() : Tensor());
  }
  train::OptimizerConfig config;
  config.grad_clip = 1.0;
  config.weight_decay = 0.1;
  for (nn::Parameter& p : params) ref.weight_decays.push_back(p.weight_decay ? float(config.weight_decay) : 0.0f);
  train::Optimizer optimizer(list, config);
  for (int step = 1; step <= 4; ++step) {
    const double lr = 1e-3 / step;
    for (size_t k = 0; k < params.size(); ++k) {
      Tensor g = random_tensor(params[k].grad.shape(), DType::F32, seed++, -0.1f, 0.1f);
      params[k].grad.copy_from(g);
      ref.grads[k].copy_from(g);
    }
    const double got = optimizer.step(ctx, lr);
    AdamWOptions o{.lr = float(lr), .beta1 = float(config.beta1), .beta2 = float(config.beta2),
                   .eps = float(config.eps), .weight_decay = 0.0f, .step = step};
    const double want = per_parameter_step(ctx, ref, o, config.grad_clip);
    EXPECT_EQ(got, want) << "step " << step;
    EXPECT_GT(want, config.grad_clip) << "the test must clip";
    const auto state = optimizer.state();
    for (size_t k = 0; k < params.size(); ++k) {
      const std::string what = "step " + std::to_string(step) + " " + params[k].name;
      expect_same(params[k].weights(), ref.params[k], what + " weights");
      if (params[k].master.defined()) expect_same(params[k].value, ref.values[k], what + " bf16 value");
      expect_same(state[2 * k].second, ref.exp_avgs[k], what + " exp_avg");
      expect_same(state[2 * k + 1].second, ref.exp_avg_sqs[k], what + " exp_avg_sq");
    }
  }
  EXPECT_EQ(optimizer.steps_taken(), 4);
}
