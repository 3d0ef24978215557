// Tests of QuantizedTensor: the transposed FP8 copy is the exact byte transpose, the amax
// matches the amax op, fp8_gemm in all four orientations matches an FP32 GEMM of the
// dequantized inputs, bias and FP8 output (with its amax), zero tensors, argument checks,
// and three steps of delayed scaling. (The CUDA path: tests/test_gpu_fp8_gemm.cpp.)
#include "tessera/fp8/quantized_tensor.h"

#include <gtest/gtest.h>

#include <cmath>

#include "quantize_testing.h"
#include "tessera/core/error.h"
#include "tessera/fp8/recipe.h"
#include "tessera/ops/gemm.h"
#include "tessera/ops/quantize.h"
#include "testing.h"

using namespace tessera;
using namespace tessera::fp8;
using namespace tessera::testing;

namespace {

constexpr DType kFp8[] = {DType::E4M3, DType::E5M2};

float amax_of(Context& ctx, const Tensor& x) {
  Tensor a = Tensor::empty({1}, DType::F32);
  amax(ctx, x, a);
  return a.to_floats()[0];
}

// Quantizes x with the scale its own amax gives (current scaling).
QuantizedTensor quantize_current(Context& ctx, const Tensor& x, DType fp8) {
  return quantize_with_transpose(ctx, x, scalar(fp8_scale_from_amax(amax_of(ctx, x), fp8)), fp8);
}

void expect_byte_transpose(const QuantizedTensor& q) {
  const int64_t m = q.data.size(0), k = q.data.size(1);
  ASSERT_EQ(q.data_t.shape(), (Shape{k, m}));
  const std::vector<uint8_t> d = codes_of(q.data), t = codes_of(q.data_t);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < k; ++j) ASSERT_EQ(t[j * m + i], d[i * k + j]) << "at (" << i << ", " << j << ")";
}

}  // namespace

TEST(Fp8QuantizedTensor, DataTransposeAndAmax) {
  Context ctx = Context::cpu();
  const Shape shapes[] = {{1, 1}, {17, 33}, {64, 128}, {5, 1}, {1, 7}};
  uint64_t seed = 1;
  for (DType fp8 : kFp8) {
    for (const Shape& s : shapes) {
      const Tensor x = wide_range_tensor(s[0], s[1], seed++);
      const float sc = fp8_scale_from_amax(amax_of(ctx, x), fp8);
      Tensor a = Tensor::empty({1}, DType::F32);
      poison(a);
      const QuantizedTensor q = quantize_with_transpose(ctx, x, scalar(sc), fp8, &a);
      EXPECT_EQ(q.dtype, fp8);
      EXPECT_EQ(q.data.dtype(), fp8);
      EXPECT_EQ(q.data_t.dtype(), fp8);
      expect_byte_transpose(q);
      EXPECT_EQ(a.to_floats()[0], amax_of(ctx, x));
      // data is exactly what quantize_per_tensor gives on its own.
      Tensor ref = Tensor::empty(s, fp8);
      quantize_per_tensor(ctx, x, scalar(sc), ref);
      EXPECT_EQ(codes_of(q.data), codes_of(ref));
      EXPECT_EQ(q.scale_inv.dtype(), DType::F32);
      EXPECT_EQ(q.scale_inv.to_floats()[0], 1.0f / sc);
    }
  }
}

TEST(Fp8QuantizedTensor, GemmMatchesFp32GemmOfDequantized) {
  Context ctx = Context::cpu();
  struct Dims { int64_t m, k, n; };
  const Dims dims[] = {{1, 1, 1}, {17, 33, 9}, {32, 64, 48}, {3, 1, 5}};
  uint64_t seed = 100;
  for (DType fp8 : kFp8) {
    for (const Dims& d : dims) {
      for (int ta = 0; ta < 2; ++ta) {
        for (int tb = 0; tb < 2; ++tb) {
          // Logical A is [M, K] (stored [K, M] when transposed), B is [K, N] ([N, K]).
          const Tensor xa = random_tensor(ta ? Shape{d.k, d.m} : Shape{d.m, d.k}, DType::F32, seed++, -3, 3);
          const Tensor xb = random_tensor(tb ? Shape{d.n, d.k} : Shape{d.k, d.n}, DType::F32, seed++, -0.01f, 0.01f);
          const QuantizedTensor qa = quantize_current(ctx, xa, fp8);
          const QuantizedTensor qb = quantize_current(ctx, xb, fp8);
          Tensor c = Tensor::empty({d.m, d.n}, DType::F32);
          poison(c);
          fp8_gemm(ctx, qa, ta != 0, qb, tb != 0, c);

          Tensor want = Tensor::empty({d.m, d.n}, DType::F32);
          gemm(ctx, dequantize(ctx, qa), dequantize(ctx, qb), want,
               {.transpose_a = ta != 0, .transpose_b = tb != 0});
          // Both accumulate in float from the same FP8 codes, but the FP32 reference rounds
          // every dequantized element (q * scale_inv) and the FP8 GEMM applies the two
          // scale_inv factors once to the accumulated sum, and the orientations may sum in
          // different orders, so the results can differ in the last bits.
          EXPECT_LT(relative_error(c, want), 1e-6)
              << dtype_name(fp8) << " m=" << d.m << " k=" << d.k << " n=" << d.n << " ta=" << ta << " tb=" << tb;
        }
      }
    }
  }
}

TEST(Fp8QuantizedTensor, AccumulatesWithBeta) {
  Context ctx = Context::cpu();
  const QuantizedTensor qa = quantize_current(ctx, random_tensor({6, 10}, DType::F32, 7), DType::E4M3);
  const QuantizedTensor qb = quantize_current(ctx, random_tensor({10, 4}, DType::F32, 8), DType::E5M2);
  Tensor c = random_tensor({6, 4}, DType::F32, 9);
  const Tensor c0 = c.clone();
  fp8_gemm(ctx, qa, false, qb, false, c, 0.5f, 1.0f);
  Tensor prod = Tensor::empty({6, 4}, DType::F32);
  gemm(ctx, dequantize(ctx, qa), dequantize(ctx, qb), prod);
  std::vector<double> want = c0.to_doubles();
  const std::vector<double> p = prod.to_doubles();
  for (size_t i = 0; i < want.size(); ++i) want[i] += 0.5 * p[i];
  EXPECT_LT(relative_error(c.to_doubles(), want), 1e-6);
}

TEST(Fp8QuantizedTensor, ZeroTensor) {
  Context ctx = Context::cpu();
  for (DType fp8 : kFp8) {
    const Tensor x = Tensor::zeros({4, 3}, DType::F32);
    Tensor a = Tensor::empty({1}, DType::F32);
    poison(a);
    const float sc = fp8_scale_from_amax(0.0f, fp8);
    EXPECT_EQ(sc, 1.0f);  // nothing to scale
    const QuantizedTensor q = quantize_with_transpose(ctx, x, scalar(sc), fp8, &a);
    EXPECT_EQ(a.to_floats()[0], 0.0f);
    EXPECT_EQ(q.scale_inv.to_floats()[0], 1.0f);
    for (uint8_t code : codes_of(q.data)) EXPECT_EQ(code, 0);
    expect_byte_transpose(q);
    for (float v : dequantize(ctx, q).to_floats()) EXPECT_EQ(v, 0.0f);
    const QuantizedTensor qb = quantize_current(ctx, random_tensor({3, 5}, DType::F32, 3), fp8);
    Tensor c = Tensor::empty({4, 5}, DType::F32);
    poison(c);
    fp8_gemm(ctx, q, false, qb, false, c);
    for (float v : c.to_floats()) EXPECT_EQ(v, 0.0f);
  }
}

TEST(Fp8QuantizedTensor, RejectsBadArguments) {
  Context ctx = Context::cpu();
  const Tensor x = random_tensor({4, 3}, DType::F32, 1);
  EXPECT_THROW(quantize_with_transpose(ctx, x, scalar(0.0f), DType::E4M3), Error);
  EXPECT_THROW(quantize_with_transpose(ctx, x, scalar(INFINITY), DType::E4M3), Error);
  EXPECT_THROW(quantize_with_transpose(ctx, x, scalar(1.0f), DType::BF16), Error);
  EXPECT_THROW(quantize_with_transpose(ctx, random_tensor({2, 3, 4}, DType::F32, 2), scalar(1.0f), DType::E4M3),
               Error);
  EXPECT_THROW(quantize_with_transpose(ctx, x, Tensor::from_floats({1, 1}, {2}), DType::E4M3), Error);
  // Inner dimensions that do not match are gemm's error.
  const QuantizedTensor qa = quantize_current(ctx, x, DType::E4M3);
  Tensor c = Tensor::empty({4, 4}, DType::F32);
  EXPECT_THROW(fp8_gemm(ctx, qa, false, qa, false, c), Error);
}

// A quantized tensor that kept one copy only (nn::Linear drops the row-wise ones after the
// forward): fp8_gemm takes it wherever its orientation reads that copy, with the bits of
// the full tensor, and refuses it where it reads the missing one.
TEST(Fp8QuantizedTensor, GemmReadsOnlyTheCopyItsOrientationNeeds) {
  Context ctx = Context::cpu();
  const QuantizedTensor a = quantize_current(ctx, random_tensor({8, 16}, DType::F32, 3), DType::E4M3);
  const QuantizedTensor b = quantize_current(ctx, random_tensor({12, 16}, DType::F32, 4), DType::E4M3);
  auto only = [](QuantizedTensor q, bool keep_data) {
    (keep_data ? q.data_t : q.data) = Tensor();
    return q;
  };
  EXPECT_EQ(only(a, false).rows(), 8);
  EXPECT_EQ(only(a, false).cols(), 16);
  Tensor full = Tensor::empty({8, 12}, DType::F32), part = Tensor::empty({8, 12}, DType::F32);
  fp8_gemm(ctx, a, false, b, true, full);  // reads a.data and b.data
  fp8_gemm(ctx, only(a, true), false, only(b, true), true, part);
  EXPECT_EQ(full.to_doubles(), part.to_doubles());
  Tensor full_t = Tensor::empty({16, 16}, DType::F32), part_t = Tensor::empty({16, 16}, DType::F32);
  fp8_gemm(ctx, a, true, a, false, full_t);  // a^T a: reads a.data_t twice
  fp8_gemm(ctx, only(a, false), true, only(a, false), false, part_t);
  EXPECT_EQ(full_t.to_doubles(), part_t.to_doubles());
  EXPECT_THROW(fp8_gemm(ctx, only(a, false), false, b, true, full), Error);  // needs a.data
  EXPECT_THROW(fp8_gemm(ctx, a, false, only(b, false), true, full), Error);  // needs b.data
  EXPECT_THROW(fp8_gemm(ctx, only(a, true), true, only(a, false), false, full_t), Error);  // needs a.data_t
  EXPECT_THROW(dequantize(ctx, only(a, false)), Error);
  EXPECT_EQ(dequantize(ctx, only(a, true)).to_doubles(), dequantize(ctx, a).to_doubles());
}

// The options: a bias on every row, and an E4M3 output whose amax is the unscaled product's
// (bias included) and whose codes are quantize_per_tensor's of that product.
TEST(Fp8QuantizedTensor, BiasAndFp8Output) {
  Context ctx = Context::cpu();
  const QuantizedTensor qa = quantize_current(ctx, random_tensor({7, 32}, DType::F32, 21), DType::E4M3);
  const QuantizedTensor qb = quantize_current(ctx, random_tensor({16, 32}, DType::F32, 22), DType::E4M3);
  Fp8GemmOptions o;
  o.alpha = 0.75f;
  o.bias = random_tensor({16}, DType::BF16, 23);
  Tensor c = Tensor::empty({7, 16}, DType::F32);
  poison(c);
  fp8_gemm(ctx, qa, false, qb, true, c, o);
  Tensor want = Tensor::empty({7, 16}, DType::F32);
  gemm(ctx, dequantize(ctx, qa), dequantize(ctx, qb), want, {.transpose_b = true, .alpha = 0.75f}, o.bias);
  EXPECT_LT(relative_error(c, want), 1e-6);

  o.out_scale = scalar(37.0f);
  o.amax_out = Tensor::empty({1}, DType::F32);
  poison(o.amax_out);
  Tensor q = Tensor::empty({7, 16}, DType::E4M3);
  fp8_gemm(ctx, qa, false, qb, true, q, o);
  Tensor want_q = Tensor::empty({7, 16}, DType::E4M3), want_amax = Tensor::empty({1}, DType::F32);
  quantize_per_tensor(ctx, c, scalar(37.0f), want_q, want_amax);  // c is the same F32 product
  EXPECT_EQ(codes_of(q), codes_of(want_q));
  EXPECT_EQ(o.amax_out.to_floats()[0], want_amax.to_floats()[0]);

  // Without out_scale the scale is 1; amax is optional.
  Fp8GemmOptions plain;
  Tensor q1 = Tensor::empty({7, 16}, DType::E4M3);
  fp8_gemm(ctx, qa, false, qb, true, q1, plain);
  Tensor c1 = Tensor::empty({7, 16}, DType::F32), want_q1 = Tensor::empty({7, 16}, DType::E4M3);
  fp8_gemm(ctx, qa, false, qb, true, c1);
  quantize_per_tensor(ctx, c1, scalar(1.0f), want_q1);
  EXPECT_EQ(codes_of(q1), codes_of(want_q1));
}

TEST(Fp8QuantizedTensor, RejectsBadOutputOptions) {
  Context ctx = Context::cpu();
  const QuantizedTensor qa = quantize_current(ctx, random_tensor({4, 16}, DType::F32, 1), DType::E4M3);
  Tensor q = Tensor::empty({4, 4}, DType::E4M3), c = Tensor::empty({4, 4}, DType::F32);
  EXPECT_THROW(fp8_gemm(ctx, qa, false, qa, true, q, 1.0f, 1.0f), Error);  // an FP8 output cannot accumulate
  Fp8GemmOptions o;
  o.amax_out = Tensor::empty({1}, DType::F32);
  EXPECT_THROW(fp8_gemm(ctx, qa, false, qa, true, c, o), Error);  // amax_out needs an FP8 output
  o.amax_out = Tensor::empty({2}, DType::F32);
  EXPECT_THROW(fp8_gemm(ctx, qa, false, qa, true, q, o), Error);  // and must be F32 [1]
  Tensor e5 = Tensor::empty({4, 4}, DType::E5M2);
  EXPECT_THROW(fp8_gemm(ctx, qa, false, qa, true, e5), Error);  // E4M3 is the only FP8 output
}

// Three steps of the delayed recipe: quantize with the current scale, record the amax,
// update. Every step's largest input stays within the window's max amax, so nothing may
// saturate from the second step on, and the first step's scale of 1 is safe too.
TEST(Fp8QuantizedTensor, DelayedScalingLoop) {
  Context ctx = Context::cpu();
  for (Format format : {Format::E4M3, Format::Hybrid}) {
    DelayedScalingConfig config;
    config.history_len = 4;
    config.format = format;
    DelayedScalingState state(config, {Role::Forward, Role::Gradient});
    const float amplitude[] = {3.0f, 2.0f, 2.5f};
    float window_max[2] = {0, 0};
    for (int step = 0; step < 3; ++step) {
      for (int64_t i = 0; i < 2; ++i) {
        const DType fp8 = state.dtype(i);
        const Tensor x = random_tensor({17, 33}, DType::F32, 1000 + step * 2 + i, -amplitude[step], amplitude[step]);
        Tensor a = Tensor::empty({1}, DType::F32);
        const float sc = state.scale(i);
        const QuantizedTensor q = quantize_with_transpose(ctx, x, scalar(sc), fp8, &a);
        const float amax_x = a.to_floats()[0];
        EXPECT_EQ(amax_x, amax_of(ctx, x));
        if (step > 0) EXPECT_EQ(sc, fp8_scale_from_amax(window_max[i], fp8));
        // No saturation: every scaled value fits, so the codes round-trip within half an ulp.
        EXPECT_LE(amax_x * sc, fp8_max(fp8)) << "step " << step;
        const std::vector<float> xs = x.to_floats(), back = dequantize(ctx, q).to_floats();
        for (size_t j = 0; j < xs.size(); ++j) {
          EXPECT_LE(std::fabs(back[j]) * sc, fp8_max(fp8));
          EXPECT_LE(std::fabs(back[j] - xs[j]),
                    (fp8_half_ulp(fp8) * std::fabs(xs[j]) + fp8_half_quantum(fp8) / sc) * (1 + 1e-6))
              << "step " << step << " element " << j;
        }
        expect_byte_transpose(q);
        state.record(i, amax_x);
        window_max[i] = std::max(window_max[i], amax_x);
      }
      state.update();
      for (int64_t i = 0; i < 2; ++i) {
        EXPECT_EQ(state.scale(i), fp8_scale_from_amax(window_max[i], state.dtype(i)));
        EXPECT_EQ(state.scale_inv(i), 1.0f / state.scale(i));
      }
    }
  }
}
