#include "tessera/ops/gemm.h"

#include <cmath>
#include <tuple>

#include "backend/cpu/gemm.h"
#include "tessera/ops/activation.h"
#include "testing.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

// c_ref = alpha * sa * sb * op(a) op(b) + beta * c0 + bias, as a triple loop in double over
// the exact values the tensors hold.
std::vector<double> reference_gemm(const Tensor& a, const Tensor& b, const Tensor& c0, const GemmOptions& o,
                                   const Tensor& bias = Tensor()) {
  const std::vector<double> av = a.to_doubles(), bv = b.to_doubles(), cv = c0.to_doubles();
  const int64_t m = c0.size(0), n = c0.size(1), k = o.transpose_a ? a.size(0) : a.size(1);
  std::vector<double> biasv = bias.defined() ? bias.to_doubles() : std::vector<double>(n, 0.0);
  std::vector<double> out(static_cast<size_t>(m * n));
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (int64_t p = 0; p < k; ++p) {
        const double x = o.transpose_a ? av[p * m + i] : av[i * k + p];
        const double y = o.transpose_b ? bv[j * k + p] : bv[p * n + j];
        s += x * y;
      }
      const double prior = o.beta == 0 ? 0.0 : double(o.beta) * cv[i * n + j];
      out[i * n + j] = double(o.alpha) * o.a_scale_inv * o.b_scale_inv * s + prior + biasv[j];
    }
  return out;
}

Shape a_shape(int64_t m, int64_t k, bool trans) { return trans ? Shape{k, m} : Shape{m, k}; }
Shape b_shape(int64_t k, int64_t n, bool trans) { return trans ? Shape{n, k} : Shape{k, n}; }

using GemmFn = void (*)(const Tensor&, const Tensor&, Tensor&, const GemmOptions&, const Tensor&);

void public_gemm(const Tensor& a, const Tensor& b, Tensor& c, const GemmOptions& o, const Tensor& bias) {
  Context ctx = Context::cpu();
  gemm(ctx, a, b, c, o, bias);
}

}  // namespace

// Runs the public op (BLAS when built with it) and the portable loop through the same checks.
class GemmEngines : public ::testing::TestWithParam<bool> {
 protected:
  GemmFn engine() const { return GetParam() ? &cpu::gemm_portable : &public_gemm; }
};

TEST_P(GemmEngines, MatchesTripleLoopForAllTransposesAndOddSizes) {
  uint64_t seed = 10;
  for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{1, 1, 1}, {3, 5, 7}, {65, 33, 17}}) {
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (DType t : {DType::F64, DType::F32}) {
          GemmOptions o;
          o.transpose_a = ta;
          o.transpose_b = tb;
          Tensor a = random_tensor(a_shape(m, k, ta), t, ++seed), b = random_tensor(b_shape(k, n, tb), t, ++seed);
          Tensor c = Tensor::empty({m, n}, t);
          poison(c);
          engine()(a, b, c, o, Tensor());
          const double err = relative_error(c.to_doubles(), reference_gemm(a, b, c, o));
          EXPECT_LT(err, t == DType::F64 ? 1e-13 : 1e-6)
              << dtype_name(t) << " m=" << m << " n=" << n << " k=" << k << " ta=" << ta << " tb=" << tb;
        }
  }
}

TEST_P(GemmEngines, AlphaBetaAndBias) {
  for (DType t : {DType::F64, DType::F32}) {
    for (bool ta : {false, true}) {
      GemmOptions o;
      o.transpose_a = ta;
      o.transpose_b = !ta;
      o.alpha = -1.5f;
      o.beta = 0.75f;
      const int64_t m = 9, n = 11, k = 6;
      Tensor a = random_tensor(a_shape(m, k, ta), t, 1), b = random_tensor(b_shape(k, n, !ta), t, 2);
      Tensor c = random_tensor({m, n}, t, 3), bias = random_tensor({n}, t, 4);
      const Tensor c0 = c.clone();
      engine()(a, b, c, o, bias);
      EXPECT_LT(relative_error(c.to_doubles(), reference_gemm(a, b, c0, o, bias)), t == DType::F64 ? 1e-13 : 1e-6)
          << dtype_name(t);
    }
  }
}

TEST_P(GemmEngines, BetaZeroIgnoresNaNInOutput) {
  Tensor a = random_tensor({4, 3}, DType::F32, 5), b = random_tensor({3, 6}, DType::F32, 6);
  for (DType ct : {DType::F32, DType::BF16, DType::F64}) {
    Tensor c = Tensor::empty({4, 6}, ct);
    poison(c);
    engine()(a, b, c, GemmOptions{}, Tensor());
    for (double v : c.to_doubles()) EXPECT_FALSE(std::isnan(v)) << dtype_name(ct);
  }
  // alpha = 0 with beta = 0 still overwrites with bias only.
  Tensor c = Tensor::empty({4, 6}, DType::F32), bias = random_tensor({6}, DType::F32, 7);
  poison(c);
  GemmOptions o;
  o.alpha = 0;
  engine()(a, b, c, o, bias);
  for (int64_t i = 0; i < 4; ++i)
    for (int64_t j = 0; j < 6; ++j) EXPECT_EQ(c.item(i * 6 + j), bias.item(j));
}

TEST_P(GemmEngines, BlockBoundariesAreCovered) {
  // Larger than one block in every dimension of the portable loop (64 x 256 x 512).
  const int64_t m = 70, n = 530, k = 260;
  for (bool ta : {false, true}) {
    GemmOptions o;
    o.transpose_a = ta;
    o.transpose_b = ta;
    o.beta = 1;
    Tensor a = random_tensor(a_shape(m, k, ta), DType::F32, 20), b = random_tensor(b_shape(k, n, ta), DType::F32, 21);
    Tensor c = random_tensor({m, n}, DType::F32, 22);
    const Tensor c0 = c.clone();
    engine()(a, b, c, o, Tensor());
    EXPECT_LT(relative_error(c.to_doubles(), reference_gemm(a, b, c0, o)), 1e-6) << "ta=tb=" << ta;
  }
}

TEST_P(GemmEngines, LowPrecisionInputsMatchDequantizedReference) {
  const int64_t m = 13, n = 10, k = 19;
  for (DType t : {DType::BF16, DType::F16, DType::E4M3, DType::E5M2}) {
    for (bool tb : {false, true}) {
      GemmOptions o;
      o.transpose_b = tb;
      // FP8 tensors hold x * scale; scale_inv brings them back.
      const bool fp8 = is_fp8(t);
      o.a_scale_inv = fp8 ? 1.0f / 64 : 1.0f;
      o.b_scale_inv = fp8 ? 1.0f / 16 : 1.0f;
      Tensor a = random_tensor({m, k}, t, 30, fp8 ? -64.0f : -1.0f, fp8 ? 64.0f : 1.0f);
      Tensor b = random_tensor(b_shape(k, n, tb), t, 31, fp8 ? -16.0f : -1.0f, fp8 ? 16.0f : 1.0f);
      Tensor c = Tensor::empty({m, n}, DType::F32), bias = random_tensor({n}, DType::BF16, 32);
      poison(c);
      engine()(a, b, c, o, bias);
      EXPECT_LT(relative_error(c.to_doubles(), reference_gemm(a, b, c, o, bias)), 1e-5)
          << dtype_name(t) << " tb=" << tb;
    }
  }
  // Mixed: E4M3 activations times E5M2 weights into BF16 output.
  GemmOptions o;
  o.transpose_b = true;
  o.a_scale_inv = 0.5f;
  o.b_scale_inv = 0.25f;
  Tensor a = random_tensor({m, k}, DType::E4M3, 33, -2, 2), b = random_tensor({n, k}, DType::E5M2, 34, -4, 4);
  Tensor c = Tensor::empty({m, n}, DType::BF16);
  poison(c);
  engine()(a, b, c, o, Tensor());
  EXPECT_LT(relative_error(c.to_doubles(), reference_gemm(a, b, c, o)), 1e-2);
}

TEST_P(GemmEngines, OutputDtypesAgreeWithF64) {
  const int64_t m = 17, n = 23, k = 31;
  Tensor a64 = random_tensor({m, k}, DType::F64, 40), b64 = random_tensor({k, n}, DType::F64, 41);
  Tensor c64 = random_tensor({m, n}, DType::F64, 42);
  GemmOptions o;
  o.beta = 0.5f;
  const std::vector<double> want = reference_gemm(a64, b64, c64, o);
  for (DType t : {DType::F32, DType::BF16}) {
    Tensor a_t = Tensor::from_doubles(a64.to_doubles(), {m, k}, t), b_t = Tensor::from_doubles(b64.to_doubles(), {k, n}, t);
    Tensor c_t = Tensor::from_doubles(c64.to_doubles(), {m, n}, t);
    engine()(a_t, b_t, c_t, o, Tensor());
    EXPECT_LT(relative_error(c_t.to_doubles(), want), t == DType::F32 ? 1e-5 : 1e-2) << dtype_name(t);
  }
}

TEST_P(GemmEngines, EmptyInnerDimensionGivesBetaCPlusBias) {
  Tensor a = Tensor::empty({3, 0}, DType::F32), b = Tensor::empty({0, 2}, DType::F32);
  Tensor c = random_tensor({3, 2}, DType::F32, 50), bias = random_tensor({2}, DType::F32, 51);
  const Tensor c0 = c.clone();
  GemmOptions o;
  o.beta = 2;
  engine()(a, b, c, o, bias);
  EXPECT_LT(relative_error(c.to_doubles(), reference_gemm(a, b, c0, o, bias)), 1e-7);
}

INSTANTIATE_TEST_SUITE_P(Gemm, GemmEngines, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& info) { return info.param ? "Portable" : "Public"; });

// A linear layer y = x W^T + b built from gemm and bias_grad, checked against finite differences.
TEST(GemmLinear, GradientsMatchFiniteDifferences) {
  Context ctx = Context::cpu();
  for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{5, 3, 7}, {1, 1, 1}, {4, 9, 2}}) {
    Tensor x = random_tensor({m, k}, DType::F64, 60), w = random_tensor({n, k}, DType::F64, 61);
    Tensor b = random_tensor({n}, DType::F64, 62), weights = random_tensor({m, n}, DType::F64, 63);
    GemmOptions forward;
    forward.transpose_b = true;
    auto loss = [&] {
      Tensor y = Tensor::empty({m, n}, DType::F64);
      gemm(ctx, x, w, y, forward, b);
      return weighted_sum(y, weights);
    };
    // dx = dy W (overwritten: poison first).
    Tensor dx = Tensor::empty({m, k}, DType::F64);
    poison(dx);
    gemm(ctx, weights, w, dx);
    // dW += dy^T x and db += sum dy: start from nonzero buffers to check accumulation.
    Tensor dw0 = random_tensor({n, k}, DType::F64, 64), db0 = random_tensor({n}, DType::F64, 65);
    Tensor dw = dw0.clone(), db = db0.clone();
    GemmOptions weight_grad;
    weight_grad.transpose_a = true;
    weight_grad.beta = 1;
    gemm(ctx, weights, x, dw, weight_grad);
    bias_grad(ctx, weights, db);
    Tensor dw_added = Tensor::empty({n, k}, DType::F64), db_added = Tensor::empty({n}, DType::F64);
    for (int64_t i = 0; i < dw.numel(); ++i) dw_added.set_item(i, dw.item(i) - dw0.item(i));
    for (int64_t i = 0; i < db.numel(); ++i) db_added.set_item(i, db.item(i) - db0.item(i));
    expect_gradient(dx, x, loss, "linear dx");
    expect_gradient(dw_added, w, loss, "linear dW");
    expect_gradient(db_added, b, loss, "linear db");
  }
}

TEST(GemmErrors, BadArgumentsThrow) {
  Context ctx = Context::cpu();
  Tensor a = Tensor::zeros({3, 4}, DType::F32), b = Tensor::zeros({4, 5}, DType::F32), c = Tensor::zeros({3, 5}, DType::F32);
  EXPECT_NO_THROW(gemm(ctx, a, b, c));
  Tensor b_bad = Tensor::zeros({5, 5}, DType::F32);
  EXPECT_THROW(gemm(ctx, a, b_bad, c), Error);  // inner dimension 4 vs 5
  GemmOptions ta;
  ta.transpose_a = true;
  EXPECT_THROW(gemm(ctx, a, b, c, ta), Error);  // op(a) = [4, 3]
  Tensor c_bad = Tensor::zeros({5, 3}, DType::F32);
  EXPECT_THROW(gemm(ctx, a, b, c_bad), Error);
  Tensor bias_bad = Tensor::zeros({3}, DType::F32);
  EXPECT_THROW(gemm(ctx, a, b, c, {}, bias_bad), Error);
  Tensor c_int = Tensor::zeros({3, 5}, DType::I32), c_f16 = Tensor::zeros({3, 5}, DType::F16);
  EXPECT_THROW(gemm(ctx, a, b, c_int), Error);
  EXPECT_THROW(gemm(ctx, a, b, c_f16), Error);
  Tensor a_int = Tensor::zeros({3, 4}, DType::I64);
  EXPECT_THROW(gemm(ctx, a_int, b, c), Error);
  Tensor a3 = Tensor::zeros({1, 3, 4}, DType::F32);
  EXPECT_THROW(gemm(ctx, a3, b, c), Error);
  Tensor undefined;
  EXPECT_THROW(gemm(ctx, undefined, b, c), Error);
  Tensor strided = Tensor::zeros({4, 3}, DType::F32).transpose(0, 1);
  EXPECT_THROW(gemm(ctx, strided, b, c), Error);
  // c aliasing an input.
  Tensor square = Tensor::zeros({4, 4}, DType::F32);
  EXPECT_THROW(gemm(ctx, square, square, square), Error);
}

TEST(BiasGrad, AccumulatesColumnSums) {
  Context ctx = Context::cpu();
  Tensor dy = Tensor::from_doubles({1, 2, 3, 4, 5, 6}, {2, 3}, DType::F32);
  Tensor db = Tensor::from_doubles({10, 20, 30}, {3}, DType::F32);
  bias_grad(ctx, dy, db);
  EXPECT_EQ(db.to_doubles(), (std::vector<double>{15, 27, 39}));
  bias_grad(ctx, dy, db);
  EXPECT_EQ(db.to_doubles(), (std::vector<double>{20, 34, 48}));
}

TEST(BiasGrad, LowPrecisionAgreesWithF64) {
  Context ctx = Context::cpu();
  const int64_t m = 37, n = 130;
  Tensor dy64 = random_tensor({m, n}, DType::F64, 70);
  Tensor want = Tensor::zeros({n}, DType::F64);
  bias_grad(ctx, dy64, want);
  for (DType t : {DType::F32, DType::BF16}) {
    Tensor dy = Tensor::from_doubles(dy64.to_doubles(), {m, n}, t);
    Tensor db = Tensor::zeros({n}, t);
    bias_grad(ctx, dy, db);
    EXPECT_LT(relative_error(db, want), t == DType::F32 ? 1e-5 : 1e-2) << dtype_name(t);
  }
  Tensor bad = Tensor::zeros({m + 1}, DType::F32);
  EXPECT_THROW(bias_grad(ctx, dy64, bad), Error);
  Tensor ints = Tensor::zeros({n}, DType::I32);
  EXPECT_THROW(bias_grad(ctx, dy64, ints), Error);
}

TEST(SumOfSquares, HandComputedAndAllDtypes) {
  Context ctx = Context::cpu();
  Tensor x = Tensor::from_doubles({1, -2, 3}, {3}, DType::F32), out = Tensor::empty({1}, DType::F32);
  poison(out);
  sum_of_squares(ctx, x, out);
  EXPECT_EQ(out.item(0), 14.0);

  // Several chunks of the fixed-order reduction.
  Tensor big = random_tensor({7, 5001}, DType::F64, 80);
  double want = 0;
  for (double v : big.to_doubles()) want += v * v;
  Tensor out64 = Tensor::empty({1}, DType::F64);
  poison(out64);
  sum_of_squares(ctx, big, out64);
  EXPECT_NEAR(out64.item(0), want, 1e-10 * want);
  for (DType t : {DType::F32, DType::BF16, DType::E4M3}) {
    Tensor low = Tensor::from_doubles(big.to_doubles(), {7, 5001}, t);
    double exact = 0;
    for (double v : low.to_doubles()) exact += v * v;
    sum_of_squares(ctx, low, out);
    EXPECT_NEAR(out.item(0), exact, 1e-6 * exact) << dtype_name(t);
  }
  Tensor out2 = Tensor::empty({2}, DType::F32), out_bf16 = Tensor::empty({1}, DType::BF16);
  EXPECT_THROW(sum_of_squares(ctx, x, out2), Error);
  EXPECT_THROW(sum_of_squares(ctx, x, out_bf16), Error);
  Tensor ints = Tensor::zeros({3}, DType::I32);
  EXPECT_THROW(sum_of_squares(ctx, ints, out), Error);
}

// The fused GELU variants are the GEMM followed by the activation, and reject beta != 0.
TEST(GemmGelu, EqualsGemmThenActivation) {
  Context ctx = Context::cpu();
  const Tensor x = random_tensor({6, 10}, DType::F32, 1, -2, 2), w = random_tensor({12, 10}, DType::F32, 2);
  const Tensor bias = random_tensor({12}, DType::F32, 3);
  Tensor pre = Tensor::empty({6, 12}, DType::F32), y = Tensor::empty({6, 12}, DType::F32);
  gemm_bias_gelu(ctx, x, w, bias, pre, y, {.transpose_b = true});
  Tensor want_pre = Tensor::empty({6, 12}, DType::F32), want_y = Tensor::empty({6, 12}, DType::F32);
  gemm(ctx, x, w, want_pre, {.transpose_b = true}, bias);
  gelu_forward(ctx, want_pre, want_y);
  EXPECT_EQ(relative_error(pre, want_pre), 0.0);
  EXPECT_EQ(relative_error(y, want_y), 0.0);

  const Tensor dy = random_tensor({6, 12}, DType::F32, 4);
  Tensor dx = Tensor::empty({6, 10}, DType::F32), prod = Tensor::empty({6, 10}, DType::F32);
  const Tensor pre2 = random_tensor({6, 10}, DType::F32, 5, -3, 3);
  gemm_gelu_backward(ctx, dy, w, pre2, dx);
  Tensor want_dx = Tensor::empty({6, 10}, DType::F32);
  gemm(ctx, dy, w, prod);
  gelu_backward(ctx, pre2, prod, want_dx);
  EXPECT_EQ(relative_error(dx, want_dx), 0.0);

  EXPECT_THROW(gemm_bias_gelu(ctx, x, w, bias, pre, y, {.transpose_b = true, .beta = 1}), Error);
  EXPECT_THROW(gemm_bias_gelu(ctx, x, w, bias, pre, pre, {.transpose_b = true}), Error);  // overlap
  Tensor wrong = Tensor::empty({6, 11}, DType::F32);
  EXPECT_THROW(gemm_bias_gelu(ctx, x, w, bias, wrong, y, {.transpose_b = true}), Error);
}

// Row-strided matrices (contiguous rows, padded row stride) give the packed result.
TEST(GemmRowStrided, MatchesPackedOperands) {
  Context ctx = Context::cpu();
  const Tensor a_buf = random_tensor({7, 13}, DType::F32, 31), b_buf = random_tensor({9, 16}, DType::F32, 32);
  const Tensor a = a_buf.slice(1, 0, 11), b = b_buf.slice(1, 0, 11);  // [7, 11] and [9, 11], strides 13 and 16
  Tensor want = Tensor::empty({7, 9}, DType::F32);
  gemm(ctx, a.contiguous(), b.contiguous(), want, {.transpose_b = true});
  Tensor c_buf = Tensor::zeros({7, 12}, DType::F32);
  Tensor c = c_buf.slice(1, 0, 9);
  gemm(ctx, a, b, c, {.transpose_b = true});
  EXPECT_EQ(relative_error(c.contiguous(), want), 0.0);
  EXPECT_EQ(c_buf.item(9), 0.0) << "the padding columns are not written";
  Tensor col_strided = Tensor::empty({9, 7}, DType::F32).transpose(0, 1);
  EXPECT_THROW(gemm(ctx, a, b, col_strided, {.transpose_b = true}), Error);
}

// linear_weight_grad is the weight GEMM plus bias_grad, both accumulating; on the CPU it is
// literally those two ops, bit for bit.
TEST(LinearWeightGrad, EqualsGemmThenBiasGrad) {
  Context ctx = Context::cpu();
  const Tensor dy = random_tensor({37, 11}, DType::F32, 1), x = random_tensor({37, 6}, DType::F32, 2);
  Tensor dw = random_tensor({11, 6}, DType::F32, 3), db = random_tensor({11}, DType::F32, 4);
  Tensor dw_want = dw.contiguous(), db_want = db.contiguous();
  gemm(ctx, dy, x, dw_want, {.transpose_a = true, .beta = 1});
  bias_grad(ctx, dy, db_want);
  linear_weight_grad(ctx, dy, x, dw, db);
  EXPECT_EQ(dw.to_doubles(), dw_want.to_doubles());
  EXPECT_EQ(db.to_doubles(), db_want.to_doubles());
  Tensor none, dw2 = Tensor::zeros({11, 6}, DType::F32), dw2_want = Tensor::zeros({11, 6}, DType::F32);
  linear_weight_grad(ctx, dy, x, dw2, none);
  gemm(ctx, dy, x, dw2_want, {.transpose_a = true, .beta = 1});
  EXPECT_EQ(dw2.to_doubles(), dw2_want.to_doubles());
  Tensor bad = Tensor::zeros({10}, DType::F32);
  EXPECT_THROW(linear_weight_grad(ctx, dy, x, dw, bad), Error);
}
