#include "tessera/ops/attention.h"

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "tessera/ops/elementwise.h"
#include "testing.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

struct Config {
  const char* name;
  int64_t batch, queries, keys, q_heads, kv_heads, head_dim;
  bool causal;
  float scale = 0;

  Shape q_shape() const { return {batch, queries, q_heads, head_dim}; }
  Shape kv_shape() const { return {batch, keys, kv_heads, head_dim}; }
  Shape lse_shape() const { return {batch, q_heads, queries}; }
  AttentionOptions options() const { return AttentionOptions{causal, scale}; }
  double resolved_scale() const { return scale != 0 ? scale : 1.0 / std::sqrt(static_cast<double>(head_dim)); }
};

// Random data across every layout the op supports.
const std::vector<Config> kForwardConfigs = {
    {"mha", 1, 7, 7, 3, 3, 5, false},
    {"mha_causal", 2, 7, 7, 2, 2, 5, true},
    {"gqa", 3, 6, 6, 6, 2, 8, false},
    {"gqa_causal", 3, 6, 6, 6, 2, 8, true},
    {"mqa_longer_keys", 1, 5, 9, 4, 1, 5, false},
    {"mqa_causal_longer_keys", 1, 5, 9, 4, 1, 5, true},
    {"causal_kv_cache", 2, 4, 11, 2, 2, 3, true},
    {"decode_step", 3, 1, 9, 6, 2, 5, false},
    {"decode_step_causal", 3, 1, 9, 6, 2, 5, true},
    {"one_key", 2, 1, 1, 2, 1, 4, true},
    {"more_queries_than_keys", 1, 8, 3, 2, 2, 4, false},
    {"head_dim_64", 1, 9, 13, 2, 1, 64, true},
    {"head_dim_1", 2, 5, 5, 2, 2, 1, true},
    {"custom_scale", 3, 5, 7, 4, 2, 6, true, 0.3f},
    {"custom_scale_negative", 1, 5, 7, 2, 2, 6, false, -0.7f},
};

// Small enough for finite differences of every element.
const std::vector<Config> kGradientConfigs = {
    {"mha", 1, 4, 4, 2, 2, 3, false},
    {"mha_causal", 2, 4, 4, 2, 2, 3, true},
    {"gqa_causal", 2, 4, 4, 6, 2, 3, true},
    {"mqa", 1, 3, 5, 3, 1, 5, false},
    {"decode_step", 2, 1, 5, 4, 2, 3, true},
    {"causal_longer_keys", 1, 3, 7, 2, 1, 4, true},
    {"longer_keys", 2, 3, 6, 2, 2, 2, false, 0.9f},
    {"head_dim_1", 1, 2, 2, 1, 1, 1, true},
};
// (A single visible key has dq = dk = 0 exactly, which a relative error against finite
// differences cannot judge; OneKeyPassesGradientOnlyToV checks that case.)

DType stats_dtype(DType t) { return t == DType::F64 ? DType::F64 : DType::F32; }

struct Forward {
  Tensor out, lse;
};

Forward run_forward(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionOptions& options) {
  Context ctx = Context::cpu();
  Forward f{Tensor::empty(q.shape(), q.dtype()),
            Tensor::empty({q.size(0), q.size(2), q.size(1)}, stats_dtype(q.dtype()))};
  poison(f.out);
  poison(f.lse);
  attention_forward(ctx, q, k, v, f.out, f.lse, options);
  return f;
}

struct Backward {
  Tensor dq, dk, dv;
};

Backward run_backward(const Tensor& d_out, const Tensor& q, const Tensor& k, const Tensor& v, const Forward& f,
                      const AttentionOptions& options) {
  Context ctx = Context::cpu();
  Backward g{Tensor::empty(q.shape(), q.dtype()), Tensor::empty(k.shape(), k.dtype()),
             Tensor::empty(v.shape(), v.dtype())};
  poison(g.dq);
  poison(g.dk);
  poison(g.dv);
  attention_backward(ctx, d_out, q, k, v, f.out, f.lse, g.dq, g.dk, g.dv, options);
  return g;
}

// Straight from the definition, in double: the full scores matrix of each (b, h) with
// masked entries at -infinity, then softmax, then P V. No max subtraction, so it is only
// meant for moderate scores.
Forward naive_attention(const Config& c, const Tensor& q_t, const Tensor& k_t, const Tensor& v_t) {
  const std::vector<double> q = q_t.to_doubles(), k = k_t.to_doubles(), v = v_t.to_doubles();
  const int64_t T = c.queries, S = c.keys, D = c.head_dim;
  std::vector<double> out(q.size(), 0.0), lse(static_cast<size_t>(c.batch * c.q_heads * T), 0.0);
  const double scale = c.resolved_scale();
  const double minus_inf = -std::numeric_limits<double>::infinity();
  auto q_at = [&](int64_t b, int64_t t, int64_t h, int64_t d) { return ((b * T + t) * c.q_heads + h) * D + d; };
  auto kv_at = [&](int64_t b, int64_t j, int64_t h, int64_t d) { return ((b * S + j) * c.kv_heads + h) * D + d; };
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t h = 0; h < c.q_heads; ++h) {
      const int64_t kvh = h * c.kv_heads / c.q_heads;  // same as h / (Hq / Hkv)
      std::vector<std::vector<double>> scores(T, std::vector<double>(S, minus_inf));
      for (int64_t i = 0; i < T; ++i)
        for (int64_t j = 0; j < S; ++j) {
          if (c.causal && j > i + (S - T)) continue;
          double s = 0;
          for (int64_t d = 0; d < D; ++d) s += q[q_at(b, i, h, d)] * k[kv_at(b, j, kvh, d)];
          scores[i][j] = scale * s;
        }
      for (int64_t i = 0; i < T; ++i) {
        double sum = 0;
        for (int64_t j = 0; j < S; ++j) sum += std::exp(scores[i][j]);
        lse[(b * c.q_heads + h) * T + i] = std::log(sum);
        for (int64_t j = 0; j < S; ++j) {
          const double p = std::exp(scores[i][j]) / sum;
          for (int64_t d = 0; d < D; ++d) out[q_at(b, i, h, d)] += p * v[kv_at(b, j, kvh, d)];
        }
      }
    }
  }
  return Forward{Tensor::from_doubles(out, c.q_shape()), Tensor::from_doubles(lse, c.lse_shape())};
}

Tensor cast_to(const Tensor& x, DType t) {
  Context ctx = Context::cpu();
  Tensor y = Tensor::empty(x.shape(), t);
  cast(ctx, x, y);
  return y;
}

std::string error_message(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

// ---- Forward ------------------------------------------------------------------------------

TEST(AttentionForward, HandComputedCausal) {
  // T = S = 2, one head, D = 1, scale 1: q = [1, 2], k = [0, 1], v = [10, 20].
  // Query 0 sees key 0 only: out = 10, lse = log(exp(0)) = 0.
  // Query 1 sees both: scores [0, 2], out = (10 + 20 e^2) / (1 + e^2), lse = log(1 + e^2).
  Tensor q = Tensor::from_doubles({1, 2}, {1, 2, 1, 1}), k = Tensor::from_doubles({0, 1}, {1, 2, 1, 1});
  Tensor v = Tensor::from_doubles({10, 20}, {1, 2, 1, 1});
  Forward f = run_forward(q, k, v, AttentionOptions{true, 1.0f});
  const double e2 = std::exp(2.0);
  EXPECT_NEAR(f.out.item(0), 10.0, 1e-14);
  EXPECT_NEAR(f.out.item(1), (10 + 20 * e2) / (1 + e2), 1e-13);
  EXPECT_NEAR(f.lse.item(0), 0.0, 1e-15);
  EXPECT_NEAR(f.lse.item(1), std::log(1 + e2), 1e-14);
}

TEST(AttentionForward, CausalMaskIsBottomRightAligned) {
  // T = 2 queries, S = 3 keys, all scores equal: query 0 averages keys 0..1, query 1 keys 0..2.
  Tensor q = Tensor::from_doubles({1, 1}, {1, 2, 1, 1}), k = Tensor::from_doubles({0, 0, 0}, {1, 3, 1, 1});
  Tensor v = Tensor::from_doubles({1, 2, 4}, {1, 3, 1, 1});
  Forward causal = run_forward(q, k, v, AttentionOptions{true, 0});
  EXPECT_NEAR(causal.out.item(0), 1.5, 1e-14);
  EXPECT_NEAR(causal.out.item(1), 7.0 / 3.0, 1e-14);
  EXPECT_NEAR(causal.lse.item(0), std::log(2.0), 1e-14);
  EXPECT_NEAR(causal.lse.item(1), std::log(3.0), 1e-14);
  Forward full = run_forward(q, k, v, AttentionOptions{false, 0});
  EXPECT_NEAR(full.out.item(0), 7.0 / 3.0, 1e-14);
}

TEST(AttentionForward, MatchesNaiveSoftmaxOnRandomData) {
  for (const Config& c : kForwardConfigs) {
    SCOPED_TRACE(c.name);
    Tensor q = random_tensor(c.q_shape(), DType::F64, 11, -2, 2);
    Tensor k = random_tensor(c.kv_shape(), DType::F64, 12, -2, 2);
    Tensor v = random_tensor(c.kv_shape(), DType::F64, 13);
    Forward got = run_forward(q, k, v, c.options());
    Forward want = naive_attention(c, q, k, v);
    EXPECT_LT(relative_error(got.out, want.out), 1e-13);
    EXPECT_LT(relative_error(got.lse, want.lse), 1e-13);
  }
}

TEST(AttentionForward, LseIsLogSumExpOfScaledScores) {
  // Decode step (T = 1) with GQA: every key is visible, so lse is a plain log-sum-exp.
  const Config c{"lse", 2, 1, 6, 4, 2, 3, true, 0.5f};
  Tensor q = random_tensor(c.q_shape(), DType::F64, 21, -3, 3), k = random_tensor(c.kv_shape(), DType::F64, 22, -3, 3);
  Tensor v = random_tensor(c.kv_shape(), DType::F64, 23);
  Forward f = run_forward(q, k, v, c.options());
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t h = 0; h < c.q_heads; ++h) {
      double sum = 0;
      for (int64_t j = 0; j < c.keys; ++j) {
        double s = 0;
        for (int64_t d = 0; d < c.head_dim; ++d)
          s += q.item((b * c.q_heads + h) * c.head_dim + d) *
               k.item(((b * c.keys + j) * c.kv_heads + h / 2) * c.head_dim + d);
        sum += std::exp(0.5 * s);
      }
      EXPECT_NEAR(f.lse.item(b * c.q_heads + h), std::log(sum), 1e-13) << "b " << b << " h " << h;
    }
}

TEST(AttentionForward, GroupedHeadsEqualRepeatedKvHeads) {
  // GQA must equal MHA with each kv head repeated for its query heads; dk and dv of a kv
  // head must be the sum over its group of the repeated heads' gradients.
  const Config c{"gqa_vs_repeat", 2, 9, 12, 6, 2, 16, true};
  const int64_t group = c.q_heads / c.kv_heads;
  Tensor q = random_tensor(c.q_shape(), DType::F64, 31), k = random_tensor(c.kv_shape(), DType::F64, 32);
  Tensor v = random_tensor(c.kv_shape(), DType::F64, 33), w = random_tensor(c.q_shape(), DType::F64, 34);
  const Shape repeated_shape{c.batch, c.keys, c.q_heads, c.head_dim};
  Tensor k_rep = Tensor::empty(repeated_shape, DType::F64), v_rep = Tensor::empty(repeated_shape, DType::F64);
  auto repeated_index = [&](int64_t b, int64_t j, int64_t h, int64_t d) {
    return ((b * c.keys + j) * c.q_heads + h) * c.head_dim + d;
  };
  auto kv_index = [&](int64_t b, int64_t j, int64_t h, int64_t d) {
    return ((b * c.keys + j) * c.kv_heads + h) * c.head_dim + d;
  };
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t j = 0; j < c.keys; ++j)
      for (int64_t h = 0; h < c.q_heads; ++h)
        for (int64_t d = 0; d < c.head_dim; ++d) {
          k_rep.set_item(repeated_index(b, j, h, d), k.item(kv_index(b, j, h / group, d)));
          v_rep.set_item(repeated_index(b, j, h, d), v.item(kv_index(b, j, h / group, d)));
        }
  Forward grouped = run_forward(q, k, v, c.options()), repeated = run_forward(q, k_rep, v_rep, c.options());
  EXPECT_LT(relative_error(grouped.out, repeated.out), 1e-14);
  EXPECT_LT(relative_error(grouped.lse, repeated.lse), 1e-14);

  Backward g = run_backward(w, q, k, v, grouped, c.options());
  Backward r = run_backward(w, q, k_rep, v_rep, repeated, c.options());
  EXPECT_LT(relative_error(g.dq, r.dq), 1e-13);
  Tensor dk_sum = Tensor::zeros(c.kv_shape(), DType::F64), dv_sum = Tensor::zeros(c.kv_shape(), DType::F64);
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t j = 0; j < c.keys; ++j)
      for (int64_t h = 0; h < c.q_heads; ++h)
        for (int64_t d = 0; d < c.head_dim; ++d) {
          const int64_t i = kv_index(b, j, h / group, d);
          dk_sum.set_item(i, dk_sum.item(i) + r.dk.item(repeated_index(b, j, h, d)));
          dv_sum.set_item(i, dv_sum.item(i) + r.dv.item(repeated_index(b, j, h, d)));
        }
  EXPECT_LT(relative_error(g.dk, dk_sum), 1e-13);
  EXPECT_LT(relative_error(g.dv, dv_sum), 1e-13);
}

TEST(AttentionForward, LargeScoresStayFiniteInF32) {
  // Scores above ~88 overflow exp() in float unless the row max is subtracted.
  const Config c{"large", 1, 6, 6, 2, 1, 8, true, 1.0f};
  Tensor q = random_tensor(c.q_shape(), DType::F64, 41, -40, 40);
  Tensor k = random_tensor(c.kv_shape(), DType::F64, 42, -3, 3);
  Tensor v = random_tensor(c.kv_shape(), DType::F64, 43);
  Forward want = run_forward(q, k, v, c.options());
  Forward got = run_forward(cast_to(q, DType::F32), cast_to(k, DType::F32), cast_to(v, DType::F32), c.options());
  double max_lse = 0;
  for (int64_t i = 0; i < want.lse.numel(); ++i) max_lse = std::max(max_lse, std::abs(want.lse.item(i)));
  EXPECT_GT(max_lse, 100.0) << "the test data should give large scores";
  EXPECT_LT(relative_error(got.out, want.out), 1e-5);
  EXPECT_LT(relative_error(got.lse, want.lse), 1e-5);
}

// ---- Backward -----------------------------------------------------------------------------

TEST(AttentionBackward, MatchesFiniteDifferences) {
  Context ctx = Context::cpu();
  for (const Config& c : kGradientConfigs) {
    SCOPED_TRACE(c.name);
    Tensor q = random_tensor(c.q_shape(), DType::F64, 51, -1.5, 1.5);
    Tensor k = random_tensor(c.kv_shape(), DType::F64, 52, -1.5, 1.5);
    Tensor v = random_tensor(c.kv_shape(), DType::F64, 53), w = random_tensor(c.q_shape(), DType::F64, 54);
    Forward f = run_forward(q, k, v, c.options());
    Backward g = run_backward(w, q, k, v, f, c.options());
    Tensor out = Tensor::empty(c.q_shape(), DType::F64), lse = Tensor::empty(c.lse_shape(), DType::F64);
    auto loss = [&] {
      attention_forward(ctx, q, k, v, out, lse, c.options());
      return weighted_sum(out, w);
    };
    expect_gradient(g.dq, q, loss, std::string(c.name) + " dq");
    expect_gradient(g.dk, k, loss, std::string(c.name) + " dk");
    expect_gradient(g.dv, v, loss, std::string(c.name) + " dv");
  }
}

TEST(AttentionBackward, OneKeyPassesGradientOnlyToV) {
  // With a single visible key P = 1 everywhere: out = v, so dv = sum of d_out over the
  // group and the queries, and dq = dk = 0.
  const Config c{"one_key", 1, 1, 1, 2, 1, 3, true};
  Tensor q = random_tensor(c.q_shape(), DType::F64, 61), k = random_tensor(c.kv_shape(), DType::F64, 62);
  Tensor v = random_tensor(c.kv_shape(), DType::F64, 63), w = random_tensor(c.q_shape(), DType::F64, 64);
  Forward f = run_forward(q, k, v, c.options());
  Backward g = run_backward(w, q, k, v, f, c.options());
  for (int64_t d = 0; d < c.head_dim; ++d) {
    EXPECT_NEAR(g.dv.item(d), w.item(d) + w.item(c.head_dim + d), 1e-15);
    EXPECT_NEAR(g.dk.item(d), 0.0, 1e-15);
    EXPECT_NEAR(g.dq.item(d), 0.0, 1e-15);
  }
}

// ---- Lower precision ----------------------------------------------------------------------

TEST(Attention, LowPrecisionAgreesWithF64) {
  for (const Config& c : {Config{"gqa_causal_kv_cache", 2, 9, 13, 4, 2, 64, true},
                          Config{"mqa_decode", 3, 1, 17, 4, 1, 32, false}, Config{"mha", 1, 7, 7, 3, 3, 5, false}}) {
    for (auto [dtype, tol] : {std::pair{DType::F32, 1e-5}, std::pair{DType::BF16, 1e-2}}) {
      SCOPED_TRACE(std::string(c.name) + " " + dtype_name(dtype));
      // Round the inputs to the low dtype first, so the F64 reference sees the same values.
      Tensor q = cast_to(random_tensor(c.q_shape(), DType::F64, 71, -2, 2), dtype);
      Tensor k = cast_to(random_tensor(c.kv_shape(), DType::F64, 72, -2, 2), dtype);
      Tensor v = cast_to(random_tensor(c.kv_shape(), DType::F64, 73), dtype);
      Tensor w = cast_to(random_tensor(c.q_shape(), DType::F64, 74), dtype);
      Tensor q64 = cast_to(q, DType::F64), k64 = cast_to(k, DType::F64), v64 = cast_to(v, DType::F64);
      Tensor w64 = cast_to(w, DType::F64);

      Forward want = run_forward(q64, k64, v64, c.options());
      Forward got = run_forward(q, k, v, c.options());
      EXPECT_EQ(got.lse.dtype(), DType::F32);
      EXPECT_LT(relative_error(got.out, want.out), tol);
      EXPECT_LT(relative_error(got.lse, want.lse), tol);

      Backward want_grad = run_backward(w64, q64, k64, v64, want, c.options());
      Backward got_grad = run_backward(w, q, k, v, got, c.options());
      EXPECT_LT(relative_error(got_grad.dq, want_grad.dq), tol);
      EXPECT_LT(relative_error(got_grad.dk, want_grad.dk), tol);
      EXPECT_LT(relative_error(got_grad.dv, want_grad.dv), tol);
    }
  }
}

TEST(Attention, F64InputsWithF32LseStillWork) {
  const Config c{"mixed_lse", 1, 4, 6, 2, 1, 4, true};
  Tensor q = random_tensor(c.q_shape(), DType::F64, 81), k = random_tensor(c.kv_shape(), DType::F64, 82);
  Tensor v = random_tensor(c.kv_shape(), DType::F64, 83);
  Context ctx = Context::cpu();
  Tensor out = Tensor::empty(c.q_shape(), DType::F64), lse = Tensor::empty(c.lse_shape(), DType::F32);
  poison(out);
  poison(lse);
  attention_forward(ctx, q, k, v, out, lse, c.options());
  Forward want = naive_attention(c, q, k, v);
  EXPECT_LT(relative_error(out, want.out), 1e-13);
  EXPECT_LT(relative_error(lse, want.lse), 1e-6);
}

TEST(Attention, EmptyBatchAndNoQueriesAreNoOps) {
  Context ctx = Context::cpu();
  for (const Config& c : {Config{"no_queries", 2, 0, 4, 2, 1, 3, false}, Config{"no_batch", 0, 3, 4, 2, 1, 3, true}}) {
    SCOPED_TRACE(c.name);
    Tensor q = Tensor::zeros(c.q_shape(), DType::F32), k = random_tensor(c.kv_shape(), DType::F32, 91);
    Tensor v = random_tensor(c.kv_shape(), DType::F32, 92);
    Forward f = run_forward(q, k, v, c.options());
    Backward g = run_backward(q, q, k, v, f, c.options());
    // No query sees the keys, so their gradients are zero (and written: dk, dv were poisoned).
    for (int64_t i = 0; i < g.dk.numel(); ++i) {
      EXPECT_EQ(g.dk.item(i), 0.0);
      EXPECT_EQ(g.dv.item(i), 0.0);
    }
  }
}

// ---- Bad input ----------------------------------------------------------------------------

TEST(Attention, RejectsBadShapesAndDtypes) {
  Context ctx = Context::cpu();
  const DType f32 = DType::F32;
  auto forward = [&](const Shape& qs, const Shape& ks, const Shape& vs, const Shape& os, const Shape& ls,
                     AttentionOptions options = {}, DType lse_dtype = DType::F32, DType kv_dtype = DType::F32) {
    Tensor q = Tensor::zeros(qs, f32), k = Tensor::zeros(ks, kv_dtype), v = Tensor::zeros(vs, kv_dtype);
    Tensor out = Tensor::zeros(os, f32), lse = Tensor::zeros(ls, lse_dtype);
    attention_forward(ctx, q, k, v, out, lse, options);
  };
  const Shape q{2, 5, 4, 8}, kv{2, 7, 2, 8}, lse{2, 4, 5};
  EXPECT_NO_THROW(forward(q, kv, kv, q, lse, {true, 0}));
  EXPECT_THROW(forward({2, 5, 3, 8}, kv, kv, {2, 5, 3, 8}, {2, 3, 5}), Error);  // Hq % Hkv != 0
  EXPECT_THROW(forward(q, {2, 7, 2, 7}, {2, 7, 2, 7}, q, lse), Error);           // head_dim differs
  EXPECT_THROW(forward(q, kv, {2, 7, 2, 9}, q, lse), Error);                     // v unlike k
  EXPECT_THROW(forward(q, {3, 7, 2, 8}, {3, 7, 2, 8}, q, lse), Error);           // batch differs
  EXPECT_THROW(forward(q, kv, kv, q, {2, 5, 4}), Error);                         // lse [B, T, Hq]
  EXPECT_THROW(forward(q, kv, kv, q, lse, {}, DType::BF16), Error);              // lse dtype
  EXPECT_THROW(forward(q, kv, kv, q, lse, {}, DType::F32, DType::BF16), Error);  // k, v dtype
  EXPECT_THROW(forward(q, kv, kv, {2, 5, 4, 7}, lse), Error);                    // out shape
  EXPECT_THROW(forward({5, 4, 8}, {7, 2, 8}, {7, 2, 8}, {5, 4, 8}, {4, 5}), Error);  // 3-D
  EXPECT_THROW(forward(q, {2, 7, 0, 8}, {2, 7, 0, 8}, q, lse), Error);           // no kv heads
  EXPECT_THROW(forward(q, {2, 0, 2, 8}, {2, 0, 2, 8}, q, lse), Error);           // no keys
  EXPECT_THROW(forward(q, kv, kv, q, lse, {false, NAN}), Error);                 // scale
  EXPECT_THROW(forward({2, 5, 4, 0}, {2, 7, 2, 0}, {2, 7, 2, 0}, {2, 5, 4, 0}, lse), Error);  // head_dim 0

  // Causal with fewer keys than queries: the first queries would see no key.
  const Shape short_kv{2, 3, 2, 8};
  EXPECT_NO_THROW(forward(q, short_kv, short_kv, q, lse, {false, 0}));
  const std::string message = error_message([&] { forward(q, short_kv, short_kv, q, lse, {true, 0}); });
  EXPECT_NE(message.find("causal"), std::string::npos) << message;
  EXPECT_NE(message.find("no key"), std::string::npos) << message;

  Tensor qt = Tensor::zeros({2, 4, 5, 8}, f32).transpose(1, 2), k = Tensor::zeros(kv, f32), v = Tensor::zeros(kv, f32);
  Tensor out = Tensor::zeros(q, f32), l = Tensor::zeros(lse, f32), undefined;
  EXPECT_THROW(attention_forward(ctx, qt, k, v, out, l), Error);  // not contiguous
  EXPECT_THROW(attention_forward(ctx, out, undefined, v, out, l), Error);
  Tensor ints = Tensor::zeros(q, DType::I32);
  EXPECT_THROW(attention_forward(ctx, ints, k, v, out, l), Error);
}

TEST(Attention, BackwardRejectsBadGradients) {
  Context ctx = Context::cpu();
  const Shape qs{1, 3, 2, 4}, ks{1, 5, 1, 4}, ls{1, 2, 3};
  Tensor q = Tensor::zeros(qs, DType::F32), k = Tensor::zeros(ks, DType::F32), v = Tensor::zeros(ks, DType::F32);
  Tensor out = Tensor::zeros(qs, DType::F32), lse = Tensor::zeros(ls, DType::F32);
  Tensor d_out = Tensor::zeros(qs, DType::F32), dq = Tensor::zeros(qs, DType::F32);
  Tensor dk = Tensor::zeros(ks, DType::F32), dv = Tensor::zeros(ks, DType::F32);
  EXPECT_NO_THROW(attention_backward(ctx, d_out, q, k, v, out, lse, dq, dk, dv, {true, 0}));
  Tensor wrong_kv = Tensor::zeros({1, 5, 2, 4}, DType::F32), wrong_q = Tensor::zeros(qs, DType::BF16);
  EXPECT_THROW(attention_backward(ctx, d_out, q, k, v, out, lse, dq, wrong_kv, dv), Error);
  EXPECT_THROW(attention_backward(ctx, d_out, q, k, v, out, lse, dq, dk, wrong_kv), Error);
  EXPECT_THROW(attention_backward(ctx, wrong_q, q, k, v, out, lse, dq, dk, dv), Error);
  EXPECT_THROW(attention_backward(ctx, d_out, q, k, v, wrong_q, lse, dq, dk, dv), Error);
  EXPECT_THROW(attention_backward(ctx, d_out, q, k, v, out, lse, wrong_q, dk, dv), Error);
  Tensor wrong_lse = Tensor::zeros({1, 3, 2}, DType::F32), undefined;
  EXPECT_THROW(attention_backward(ctx, d_out, q, k, v, out, wrong_lse, dq, dk, dv), Error);
  EXPECT_THROW(attention_backward(ctx, undefined, q, k, v, out, lse, dq, dk, dv), Error);
  Tensor short_kv = Tensor::zeros({1, 2, 1, 4}, DType::F32);
  EXPECT_THROW(attention_backward(ctx, d_out, q, short_kv, short_kv, out, lse, dq, short_kv, short_kv, {true, 0}),
               Error);
}

// Head slices of one fused [B, T, Hq + 2 Hkv, D] buffer (what the QKV projection writes) are
// attended as they are, and gradients can be written into slices of a fused gradient: the
// results equal those of packed copies, bit for bit.
TEST(AttentionViews, FusedQkvSlicesEqualPackedCopies) {
  Context ctx = Context::cpu();
  const int64_t B = 2, T = 9, hq = 4, hkv = 2, D = 8;
  for (const DType t : {DType::F32, DType::BF16}) {
    const Tensor fused = random_tensor({B, T, hq + 2 * hkv, D}, t, 31, -2, 2);
    const Tensor q = fused.slice(2, 0, hq), k = fused.slice(2, hq, hq + hkv), v = fused.slice(2, hq + hkv, hq + 2 * hkv);
    ASSERT_FALSE(q.is_contiguous());
    const AttentionOptions options{.causal = true};
    Tensor out_view = Tensor::empty({B, T, hq, D}, t), lse_view = Tensor::empty({B, hq, T}, DType::F32);
    Tensor out_packed = Tensor::empty({B, T, hq, D}, t), lse_packed = Tensor::empty({B, hq, T}, DType::F32);
    attention_forward(ctx, q, k, v, out_view, lse_view, options);
    attention_forward(ctx, q.contiguous(), k.contiguous(), v.contiguous(), out_packed, lse_packed, options);
    EXPECT_EQ(out_view.to_doubles(), out_packed.to_doubles());
    EXPECT_EQ(lse_view.to_doubles(), lse_packed.to_doubles());

    const Tensor d_out = random_tensor({B, T, hq, D}, t, 32);
    Tensor d_fused = Tensor::zeros({B, T, hq + 2 * hkv, D}, t);
    Tensor dq = d_fused.slice(2, 0, hq), dk = d_fused.slice(2, hq, hq + hkv), dv = d_fused.slice(2, hq + hkv, hq + 2 * hkv);
    attention_backward(ctx, d_out, q, k, v, out_view, lse_view, dq, dk, dv, options);
    Tensor dq_p = Tensor::empty(dq.shape(), t), dk_p = Tensor::empty(dk.shape(), t), dv_p = Tensor::empty(dv.shape(), t);
    attention_backward(ctx, d_out, q.contiguous(), k.contiguous(), v.contiguous(), out_packed, lse_packed, dq_p, dk_p,
                       dv_p, options);
    EXPECT_EQ(dq.contiguous().to_doubles(), dq_p.to_doubles());
    EXPECT_EQ(dk.contiguous().to_doubles(), dk_p.to_doubles());
    EXPECT_EQ(dv.contiguous().to_doubles(), dv_p.to_doubles());
  }
  // A view whose heads are not packed (a slice along head_dim) is refused with a clear error.
  const Tensor wide = random_tensor({1, 4, 2, 16}, DType::F32, 33);
  const Tensor bad = wide.slice(3, 0, 8);
  Tensor out = Tensor::empty({1, 4, 2, 8}, DType::F32), lse = Tensor::empty({1, 2, 4}, DType::F32);
  EXPECT_THROW(attention_forward(ctx, bad, bad, bad, out, lse), Error);
}
