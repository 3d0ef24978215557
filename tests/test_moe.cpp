// MoE ops on the CPU: the router (softmax/sigmoid, top-k, group-limited top-k,
// renormalisation, capacity drops, aux and z losses, the expert-bias update), the routing
// map, permute/unpermute, the scaled SwiGLU and GroupedLinear. Every differentiable piece
// is checked against FP64 central differences.
#include "tessera/ops/moe.h"

#include <algorithm>
#include <numeric>

#include "tessera/ops/gemm.h"
#include "testing.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

struct RouterOut {
  Tensor scores, probs, indices, counts, losses;
};

RouterOut run_router(const Tensor& logits, const RouterOptions& o, const Tensor& bias = Tensor()) {
  Context ctx = Context::cpu();
  const int64_t n = logits.size(0), e = logits.size(1);
  const DType sd = logits.dtype() == DType::F64 ? DType::F64 : DType::F32;
  RouterOut r{Tensor::empty({n, e}, sd), Tensor::empty({n, o.top_k}, logits.dtype()), Tensor::empty({n, o.top_k}, DType::I32),
              Tensor::empty({e}, DType::I32), Tensor::empty({2}, sd)};
  poison(r.scores);
  poison(r.probs);
  moe_router_forward(ctx, logits, bias, o, r.scores, r.probs, r.indices, r.counts, r.losses);
  return r;
}

std::vector<int64_t> ints(const Tensor& t) { return t.to_ints(); }

}  // namespace

TEST(MoeRouter, SoftmaxTopKPicksTheLargestAndRenormalises) {
  const Tensor logits = Tensor::from_doubles({0.1, 2.0, -1.0, 1.5, /**/ 3.0, 3.0, 0.0, -2.0, /**/ -1, -1, -1, 5}, {3, 4});
  RouterOptions o;
  o.top_k = 2;
  const RouterOut r = run_router(logits, o);
  // Ties go to the lower index (row 1: experts 0 and 1 tie).
  EXPECT_EQ(ints(r.indices), (std::vector<int64_t>{1, 3, 0, 1, 3, 0}));
  EXPECT_EQ(ints(r.counts), (std::vector<int64_t>{2, 2, 0, 2}));
  for (int64_t n = 0; n < 3; ++n) EXPECT_NEAR(r.probs.item(2 * n) + r.probs.item(2 * n + 1), 1.0, 1e-12);
  // Row 0: softmax renormalised over the two picks is the softmax of the two logits.
  EXPECT_NEAR(r.probs.item(0), 1.0 / (1.0 + std::exp(1.5 - 2.0)), 1e-12);
  EXPECT_EQ(r.losses.item(0), 0.0);
  EXPECT_EQ(r.losses.item(1), 0.0);
  // Without renormalisation the probabilities are the softmax scores themselves.
  o.normalize = false;
  o.scaling = 2.0f;
  const RouterOut u = run_router(logits, o);
  EXPECT_NEAR(u.probs.item(0), 2.0 * u.scores.item(1), 1e-12);
}

TEST(MoeRouter, LossesMatchTheirDefinitions) {
  const int64_t n = 7, e = 5, k = 2;
  const Tensor logits = random_tensor({n, e}, DType::F64, 3, -2, 2);
  RouterOptions o;
  o.top_k = k;
  o.aux_loss_coeff = 0.01f;
  o.z_loss_coeff = 0.001f;
  const RouterOut r = run_router(logits, o);
  std::vector<double> routed(e, 0), mean(e, 0);
  for (int64_t a : ints(r.indices)) routed[a] += 1;
  double z = 0;
  for (int64_t i = 0; i < n; ++i) {
    double m = -1e300, s = 0;
    for (int64_t j = 0; j < e; ++j) m = std::max(m, logits.item(i * e + j));
    for (int64_t j = 0; j < e; ++j) s += std::exp(logits.item(i * e + j) - m);
    z += std::pow(m + std::log(s), 2);
    for (int64_t j = 0; j < e; ++j) mean[j] += r.scores.item(i * e + j) / n;
  }
  double aux = 0;
  for (int64_t j = 0; j < e; ++j) aux += routed[j] * mean[j];
  aux *= double(o.aux_loss_coeff) * e / double(n * k);
  EXPECT_NEAR(r.losses.item(0), aux, 1e-12);
  EXPECT_NEAR(r.losses.item(1), double(o.z_loss_coeff) * z / n, 1e-12);
}

TEST(MoeRouter, GroupLimitedTopKStaysInTheBestGroups) {
  // 8 experts in 4 groups of 2; keep 2 groups, then top-3 among their 4 experts.
  const Tensor logits = Tensor::from_doubles({5, -5, 1, 1, 0.5, 0.4, 4.9, -5}, {1, 8});
  RouterOptions o;
  o.top_k = 3;
  o.num_groups = 4;
  o.topk_groups = 2;
  o.score = RouterScore::Sigmoid;
  const RouterOut r = run_router(logits, o);
  // Group scores (sum of the two best sigmoids): g0 ~ 0.99+0.007, g1 ~ 1.46, g2 ~ 1.22, g3 ~ 0.99+0.007.
  // Kept: g1 and g2 -> experts 2, 3, 4, 5; the top three are 2, 3, 4.
  EXPECT_EQ(ints(r.indices), (std::vector<int64_t>{2, 3, 4}));
}

TEST(MoeRouter, ExpertBiasChangesTheChoiceButNotTheWeights) {
  const Tensor logits = Tensor::from_doubles({2.0, 1.0, 0.0, -1.0}, {1, 4});
  RouterOptions o;
  o.top_k = 1;
  o.normalize = false;
  const Tensor bias = Tensor::from_floats({0, 0, 0, 0.5f}, {4});
  const RouterOut r = run_router(logits, o, bias);
  EXPECT_EQ(ints(r.indices), (std::vector<int64_t>{0}));  // 0.64 vs 0.0317 + 0.5
  const Tensor big = Tensor::from_floats({0, 0, 0, 1.0f}, {4});
  const RouterOut b = run_router(logits, o, big);
  EXPECT_EQ(ints(b.indices), (std::vector<int64_t>{3}));
  EXPECT_NEAR(b.probs.item(0), b.scores.item(3), 1e-12);  // the unbiased score

  // bias[e] += rate * sign(mean - load[e])
  Context ctx = Context::cpu();
  Tensor upd = Tensor::from_floats({0.1f, 0, 0, 0}, {4});
  moe_update_expert_bias(ctx, Tensor::from_ints({4, 2, 1, 1}, {4}), 0.01f, upd);
  const std::vector<float> got = upd.to_floats();
  EXPECT_FLOAT_EQ(got[0], 0.09f);
  EXPECT_FLOAT_EQ(got[1], 0.0f);  // at the mean: sign 0
  EXPECT_FLOAT_EQ(got[2], 0.01f);
  EXPECT_FLOAT_EQ(got[3], 0.01f);
}

TEST(MoeRouter, CapacityDropsTheLatestTokens) {
  // Every token prefers expert 0, then 1. Capacity factor 1 with N=4, k=1, E=2: 2 per expert.
  const Tensor logits = Tensor::from_doubles({3, 0, 3, 0, 3, 0, 3, 0}, {4, 2});
  RouterOptions o;
  o.top_k = 1;
  o.capacity_factor = 1.0f;
  const RouterOut r = run_router(logits, o);
  EXPECT_EQ(ints(r.indices), (std::vector<int64_t>{0, 0, -1, -1}));
  EXPECT_EQ(ints(r.counts), (std::vector<int64_t>{2, 0}));
  EXPECT_EQ(r.probs.item(2), 0.0);
  EXPECT_EQ(r.probs.item(3), 0.0);
  EXPECT_EQ(r.probs.item(0), 1.0);
}

namespace {

// L = sum(probs * W) + aux + z, differentiated w.r.t. the logits.
void check_router_gradient(const RouterOptions& o, int64_t n, int64_t e, uint64_t seed, const std::string& what) {
  Context ctx = Context::cpu();
  Tensor logits = random_tensor({n, e}, DType::F64, seed, -2, 2);
  const Tensor w = random_tensor({n, o.top_k}, DType::F64, seed + 1);
  const RouterOut r = run_router(logits, o);
  Tensor d_logits = Tensor::empty({n, e}, DType::F64);
  poison(d_logits);
  const float loss_scale = 0.75f;
  moe_router_backward(ctx, logits, r.scores, r.indices, w, o, loss_scale, d_logits);
  expect_gradient(d_logits, logits, [&] {
    const RouterOut p = run_router(logits, o);
    return weighted_sum(p.probs, w) + loss_scale * (p.losses.item(0) + p.losses.item(1));
  }, what, 1e-6);
}

}  // namespace

TEST(MoeRouter, BackwardMatchesFiniteDifferences) {
  RouterOptions o;
  o.top_k = 2;
  o.aux_loss_coeff = 0.1f;
  o.z_loss_coeff = 0.05f;
  check_router_gradient(o, 9, 6, 11, "softmax, renormalised, aux + z");
  o.normalize = false;
  o.scaling = 1.5f;
  check_router_gradient(o, 9, 6, 12, "softmax, not renormalised");
  o.score = RouterScore::Sigmoid;
  check_router_gradient(o, 9, 6, 13, "sigmoid");
  o.normalize = true;
  o.num_groups = 3;
  o.topk_groups = 2;
  o.top_k = 3;
  check_router_gradient(o, 9, 6, 14, "sigmoid, groups, renormalised");
  RouterOptions c;
  c.top_k = 2;
  c.capacity_factor = 0.5f;
  c.aux_loss_coeff = 0.1f;
  check_router_gradient(c, 12, 4, 15, "softmax with capacity drops");
  RouterOptions one;
  one.top_k = 1;
  check_router_gradient(one, 5, 1, 16, "a single expert");
}

TEST(MoeRouter, Bf16AndF32AgreeWithF64) {
  Context ctx = Context::cpu();
  const Tensor l64 = random_tensor({33, 8}, DType::F64, 21, -3, 3);
  Tensor l32 = Tensor::empty({33, 8}, DType::F32);
  l32.copy_from(Tensor::from_doubles(l64.to_doubles(), {33, 8}, DType::F32));
  RouterOptions o;
  o.aux_loss_coeff = 0.01f;
  const RouterOut a = run_router(l64, o), b = run_router(l32, o);
  EXPECT_EQ(ints(a.indices), ints(b.indices));
  EXPECT_LT(relative_error(b.probs, a.probs), 1e-6);
  EXPECT_LT(relative_error(b.losses, a.losses), 1e-6);
}

// ---- Routing map, permute, unpermute ---------------------------------------------------

TEST(MoePermute, RoutingMapIsExpertMajorTokenOrder) {
  Context ctx = Context::cpu();
  // 4 tokens, k=2, 4 experts; expert 2 gets nothing; token 3's second pick was dropped.
  const Tensor indices = Tensor::from_ints({1, 0, 3, 1, 0, 3, 1, -1}, {4, 2});
  Tensor row_map = Tensor::empty({4, 2}, DType::I32), offsets = Tensor::empty({5}, DType::I32);
  moe_routing_map(ctx, indices, 4, row_map, offsets);
  EXPECT_EQ(ints(offsets), (std::vector<int64_t>{0, 2, 5, 5, 7}));
  // expert 0: tokens 0, 2 -> rows 0, 1; expert 1: tokens 0, 1, 3 -> rows 2, 3, 4; expert 3: tokens 1, 2 -> 5, 6
  EXPECT_EQ(ints(row_map), (std::vector<int64_t>{2, 0, 5, 3, 1, 6, 4, -1}));

  // All tokens on one expert.
  const Tensor one = Tensor::from_ints({2, 2, 2}, {3, 1});
  Tensor m1 = Tensor::empty({3, 1}, DType::I32), o1 = Tensor::empty({4}, DType::I32);
  moe_routing_map(ctx, one, 3, m1, o1);
  EXPECT_EQ(ints(o1), (std::vector<int64_t>{0, 0, 0, 3}));
  EXPECT_EQ(ints(m1), (std::vector<int64_t>{0, 1, 2}));
}

TEST(MoePermute, ForwardBackwardMatchDefinitionsAndFiniteDifferences) {
  Context ctx = Context::cpu();
  const int64_t n = 5, k = 2, c = 3, e = 3;
  const Tensor indices = Tensor::from_ints({0, 2, 2, 0, 2, -2, 1, 0, 2, 0}, {n, k});
  Tensor row_map = Tensor::empty({n, k}, DType::I32), offsets = Tensor::empty({e + 1}, DType::I32);
  moe_routing_map(ctx, indices, e, row_map, offsets);
  Tensor x = random_tensor({n, c}, DType::F64, 31);
  Tensor probs = random_tensor({n, k}, DType::F64, 32, 0, 1);
  Tensor perm = Tensor::empty({n * k, c}, DType::F64), pp = Tensor::empty({n * k}, DType::F64);
  poison(perm);
  poison(pp);
  moe_permute_forward(ctx, x, row_map, probs, perm, pp);
  const std::vector<int64_t> map = ints(row_map);
  for (int64_t a = 0; a < n * k; ++a) {
    if (map[a] < 0) continue;
    for (int64_t j = 0; j < c; ++j) EXPECT_EQ(perm.item(map[a] * c + j), x.item((a / k) * c + j));
    EXPECT_EQ(pp.item(map[a]), probs.item(a));
  }
  for (int64_t r = offsets.item(e); r < n * k; ++r) {
    EXPECT_EQ(pp.item(r), 0.0);
    for (int64_t j = 0; j < c; ++j) EXPECT_EQ(perm.item(r * c + j), 0.0);
  }

  // Permute backward against finite differences of L = sum(perm * W) + sum(pp * V).
  const Tensor w = random_tensor({n * k, c}, DType::F64, 33), v = random_tensor({n * k}, DType::F64, 34);
  Tensor dx = Tensor::empty({n, c}, DType::F64), dprobs = Tensor::empty({n, k}, DType::F64);
  poison(dx);
  poison(dprobs);
  moe_permute_backward(ctx, row_map, w, v, dx, dprobs);
  const auto permute_loss = [&] {
    Tensor p1 = Tensor::empty({n * k, c}, DType::F64), p2 = Tensor::empty({n * k}, DType::F64);
    moe_permute_forward(ctx, x, row_map, probs, p1, p2);
    return weighted_sum(p1, w) + weighted_sum(p2, v);
  };
  expect_gradient(dx, x, permute_loss, "permute dx");
  expect_gradient(dprobs, probs, permute_loss, "permute dprobs");

  // Unpermute with and without probabilities.
  Tensor out = random_tensor({n * k, c}, DType::F64, 35);
  const Tensor wy = random_tensor({n, c}, DType::F64, 36);
  for (bool with_probs : {true, false}) {
    const Tensor p = with_probs ? probs : Tensor();
    Tensor y = Tensor::empty({n, c}, DType::F64);
    poison(y);
    moe_unpermute_forward(ctx, out, row_map, p, y);
    for (int64_t t = 0; t < n; ++t)
      for (int64_t j = 0; j < c; ++j) {
        double want = 0;
        for (int64_t s = 0; s < k; ++s)
          if (map[t * k + s] >= 0) want += (with_probs ? probs.item(t * k + s) : 1.0) * out.item(map[t * k + s] * c + j);
        EXPECT_NEAR(y.item(t * c + j), want, 1e-14);
      }
    Tensor dout = Tensor::empty({n * k, c}, DType::F64), dp = with_probs ? Tensor::empty({n, k}, DType::F64) : Tensor();
    poison(dout);
    if (with_probs) poison(dp);
    moe_unpermute_backward(ctx, out, row_map, p, wy, dout, dp);
    const auto unpermute_loss = [&] {
      Tensor y2 = Tensor::empty({n, c}, DType::F64);
      moe_unpermute_forward(ctx, out, row_map, with_probs ? probs : Tensor(), y2);
      return weighted_sum(y2, wy);
    };
    expect_gradient(dout, out, unpermute_loss, "unpermute d_expert_out");
    if (with_probs) expect_gradient(dp, probs, unpermute_loss, "unpermute d_probs");
  }
}

TEST(MoeSwiglu, ScaledForwardBackward) {
  Context ctx = Context::cpu();
  Tensor x = random_tensor({4, 6}, DType::F64, 41, -2, 2), s = random_tensor({4}, DType::F64, 42, 0, 1);
  const Tensor w = random_tensor({4, 3}, DType::F64, 43);
  Tensor y = Tensor::empty({4, 3}, DType::F64), dx = Tensor::empty({4, 6}, DType::F64), ds = Tensor::empty({4}, DType::F64);
  poison(dx);
  poison(ds);
  moe_swiglu_scaled_backward(ctx, x, s, w, dx, ds);
  const auto loss = [&] {
    moe_swiglu_scaled_forward(ctx, x, s, y);
    return weighted_sum(y, w);
  };
  expect_gradient(dx, x, loss, "swiglu scaled dx");
  expect_gradient(ds, s, loss, "swiglu scaled dscale");
}

// ---- GroupedLinear ----------------------------------------------------------------------

TEST(GroupedLinear, MatchesALoopIncludingEmptyExperts) {
  Context ctx = Context::cpu();
  const int64_t e = 4, k_in = 5, n_out = 3, rows = 11;
  const std::vector<int64_t> splits = {3, 0, 6, 0};  // 9 rows used, 2 rows of padding
  Tensor x = random_tensor({rows, k_in}, DType::F64, 51);
  Tensor w = random_tensor({e, n_out, k_in}, DType::F64, 52);
  Tensor y = Tensor::empty({rows, n_out}, DType::F64);
  poison(y);
  grouped_linear_forward(ctx, x, w, splits, y);
  int64_t row = 0;
  for (int64_t g = 0; g < e; ++g) {
    for (int64_t r = row; r < row + splits[g]; ++r)
      for (int64_t o = 0; o < n_out; ++o) {
        double want = 0;
        for (int64_t i = 0; i < k_in; ++i) want += x.item(r * k_in + i) * w.item((g * n_out + o) * k_in + i);
        EXPECT_NEAR(y.item(r * n_out + o), want, 1e-13);
      }
    row += splits[g];
  }
  for (int64_t r = 9; r < rows; ++r)
    for (int64_t o = 0; o < n_out; ++o) EXPECT_EQ(y.item(r * n_out + o), 0.0);

  const Tensor wy = random_tensor({rows, n_out}, DType::F64, 53);
  Tensor dx = Tensor::empty({rows, k_in}, DType::F64);
  poison(dx);
  grouped_linear_backward_input(ctx, wy, w, splits, dx);
  const auto loss = [&] {
    Tensor y2 = Tensor::empty({rows, n_out}, DType::F64);
    grouped_linear_forward(ctx, x, w, splits, y2);
    return weighted_sum(y2, wy);
  };
  expect_gradient(dx, x, loss, "grouped dx");
  // dw accumulates: start from ones, subtract them afterwards.
  Tensor dw = Tensor::empty({e, n_out, k_in}, DType::F64);
  for (int64_t i = 0; i < dw.numel(); ++i) dw.set_item(i, 1.0);
  grouped_linear_backward_weight(ctx, wy, x, splits, dw);
  Tensor delta = Tensor::empty(dw.shape(), DType::F64);
  for (int64_t i = 0; i < dw.numel(); ++i) delta.set_item(i, dw.item(i) - 1.0);
  expect_gradient(delta, w, loss, "grouped dw");
  // Empty experts' slices are untouched.
  for (int64_t i = n_out * k_in; i < 2 * n_out * k_in; ++i) EXPECT_EQ(dw.item(i), 1.0);

  // All rows on one expert.
  const std::vector<int64_t> all_one = {0, 0, rows, 0};
  Tensor y1 = Tensor::empty({rows, n_out}, DType::F64), y_ref = Tensor::empty({rows, n_out}, DType::F64);
  grouped_linear_forward(ctx, x, w, all_one, y1);
  gemm(ctx, x, w.select(0, 2), y_ref, {.transpose_b = true});
  EXPECT_EQ(y1.to_doubles(), y_ref.to_doubles());
}

TEST(GroupedLinear, RejectsBadSplits) {
  Context ctx = Context::cpu();
  Tensor x = Tensor::zeros({4, 2}, DType::F32), w = Tensor::zeros({2, 3, 2}, DType::F32), y = Tensor::zeros({4, 3}, DType::F32);
  EXPECT_THROW(grouped_linear_forward(ctx, x, w, {3, 2}, y), Error);
  EXPECT_THROW(grouped_linear_forward(ctx, x, w, {1}, y), Error);
  EXPECT_THROW(grouped_linear_forward(ctx, x, w, {-1, 2}, y), Error);
}
