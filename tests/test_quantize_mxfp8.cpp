// Tests of MXFP8 (OCP Microscaling) quantization: hand-computed cases, the reference
// recipe on odd shapes, zero / tiny / huge / NaN blocks, dtypes and argument checks.
#include "tessera/ops/quantize.h"

#include "quantize_testing.h"

using namespace tessera;
using namespace tessera::testing;

TEST(QuantizeMxfp8, HandComputedCase) {
  Context ctx = Context::cpu();
  // One row, 70 columns: blocks [0, 32), [32, 64), [64, 70).
  std::vector<float> v(70, 0.0f);
  v[0] = 3.0f;      // block 0 amax 3: floor(log2 3) = 1, X = 1 - 8 = -7 (code 120): 3 * 2^7 = 384 -> 0x7C
  v[1] = 1.0f;      // 128 -> 0x70
  v[2] = -0.01f;    // -1.28 = -1.25 after rounding (mantissa 2.24 -> 2): exp field 7 -> 0xBA
  v[32] = 500.0f;   // block 1 amax 500: X = 8 - 8 = 0 (code 127): 500 saturates to 448 -> 0x7E
  v[33] = -1.0f;    // -> 0xB8
  v[34] = 0x1p-10f; // 2^-10 ties between 0 and 2^-9 -> 0
  // block 2 all zero: X = -127 (code 0), elements 0.
  Tensor x = Tensor::from_floats(v, {1, 70});
  Tensor q = Tensor::empty({1, 70}, DType::E4M3), s = Tensor::empty({1, 3}, DType::E8M0);
  poison(q);
  poison(s);
  quantize_mxfp8(ctx, x, q, s);
  EXPECT_EQ(codes_of(s), (std::vector<uint8_t>{120, 127, 0}));
  const std::vector<uint8_t> c = codes_of(q);
  EXPECT_EQ(c[0], 0x7C);
  EXPECT_EQ(c[1], 0x70);
  EXPECT_EQ(c[2], 0xBA);
  EXPECT_EQ(c[32], 0x7E);
  EXPECT_EQ(c[33], 0xB8);
  EXPECT_EQ(c[34], 0x00);
  for (int i : {3, 31, 35, 63, 64, 69}) EXPECT_EQ(c[i], 0x00) << i;
  Tensor back = Tensor::empty({1, 70}, DType::F32);
  poison(back);
  dequantize_mxfp8(ctx, q, s, back);
  EXPECT_EQ(back.item(0), 3.0);
  EXPECT_EQ(back.item(2), -0.009765625);  // -1.25 * 2^-7
  EXPECT_EQ(back.item(32), 448.0);
  EXPECT_EQ(back.item(69), 0.0);
  // E5M2: X = 1 - 15 = -14 (code 113); 3 * 2^14 = 49152 = 0x7A. Block 1: X = 8 - 15 = -7 (code 120):
  // 500 * 128 = 64000 saturates to 57344 = 0x7B.
  Tensor q5 = Tensor::empty({1, 70}, DType::E5M2);
  quantize_mxfp8(ctx, x, q5, s);
  EXPECT_EQ(codes_of(s), (std::vector<uint8_t>{113, 120, 0}));
  EXPECT_EQ(codes_of(q5)[0], 0x7A);
  EXPECT_EQ(codes_of(q5)[32], 0x7B);
}

TEST(QuantizeMxfp8, MatchesReferenceOnOddShapes) {
  Context ctx = Context::cpu();
  uint64_t seed = 50;
  for (auto [rows, cols] : kOddShapes) {
    for (DType fp8 : {DType::E4M3, DType::E5M2}) {
      Tensor x = wide_range_tensor(rows, cols, ++seed);
      const int64_t per_row = (cols + 31) / 32;
      Tensor q = Tensor::empty({rows, cols}, fp8), s = Tensor::empty({rows, per_row}, DType::E8M0);
      poison(q);
      poison(s);
      quantize_mxfp8(ctx, x, q, s);
      const MxReference ref = reference_mxfp8(x.to_floats(), rows, cols, fp8);
      const std::string what = std::to_string(rows) + "x" + std::to_string(cols) + " " + dtype_name(fp8);
      ASSERT_EQ(codes_of(s), ref.scales) << what;
      ASSERT_EQ(codes_of(q), ref.codes) << what;
      Tensor back = Tensor::empty({rows, cols}, DType::F32);
      poison(back);
      dequantize_mxfp8(ctx, q, s, back);
      const std::vector<float> xs = x.to_floats(), bs = back.to_floats();
      const std::vector<uint8_t> sc = codes_of(s);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) {
          const double block_scale = std::ldexp(1.0, sc[r * per_row + c / 32] - 127);
          const double a = std::fabs(double(xs[r * cols + c]));
          // Rounding error, plus the clamp of values in (fp8_max, 2^(emax+1)) * 2^X.
          const double bound = 1.001 * (fp8_half_ulp(fp8) * a + fp8_half_quantum(fp8) * block_scale) +
                               std::max(0.0, a - fp8_max(fp8) * block_scale);
          ASSERT_LE(std::fabs(double(bs[r * cols + c]) - xs[r * cols + c]), bound) << what << " at " << r << "," << c;
          const float element = fp8 == DType::E4M3 ? e4m3_to_float(ref.codes[r * cols + c])
                                                   : e5m2_to_float(ref.codes[r * cols + c]);
          ASSERT_EQ(bs[r * cols + c], element * static_cast<float>(block_scale)) << what << " at " << r << "," << c;
        }
    }
  }
}

TEST(QuantizeMxfp8, ZeroBlocksClampingAndNan) {
  Context ctx = Context::cpu();
  const int64_t cols = 130;  // blocks of 32, 32, 32, 32, 2
  std::vector<float> v = wide_range_tensor(2, cols, 61).to_floats();
  for (int64_t c = 0; c < 32; ++c) v[c] = 0.0f;                   // row 0 block 0: zeros
  for (int64_t c = 32; c < 64; ++c) v[c] = 1e-39f * (c - 31);     // row 0 block 1: tiny, X clamps to -127
  v[70] = 3e38f;                                                  // row 0 block 2: huge
  v[cols + 100] = NAN;                                            // row 1 block 3: NaN
  v[cols + 129] = -INFINITY;                                      // row 1 block 4: Inf
  Tensor x = Tensor::from_floats(v, {2, cols});
  Tensor q = Tensor::empty({2, cols}, DType::E4M3), s = Tensor::empty({2, 5}, DType::E8M0);
  poison(q);
  poison(s);
  quantize_mxfp8(ctx, x, q, s);
  const MxReference ref = reference_mxfp8(v, 2, cols, DType::E4M3);
  EXPECT_EQ(codes_of(q), ref.codes);
  EXPECT_EQ(codes_of(s), ref.scales);
  const std::vector<uint8_t> sc = codes_of(s);
  EXPECT_EQ(sc[0], 0);                 // zero block: 2^-127
  EXPECT_EQ(sc[1], 0);                 // floor(log2(3.2e-38)) - 8 = -133, clamped to -127
  EXPECT_EQ(sc[2], 127 + 127 - 8);     // floor(log2(3e38)) = 127
  EXPECT_EQ(sc[5 + 3], 0xFF);
  EXPECT_EQ(sc[5 + 4], 0xFF);
  EXPECT_NE(sc[5 + 0], 0xFF);
  Tensor back = Tensor::empty({2, cols}, DType::F32);
  dequantize_mxfp8(ctx, q, s, back);
  for (int64_t c = 0; c < 32; ++c) EXPECT_EQ(back.item(c), 0.0);
  for (int64_t c = 96; c < 128; ++c) EXPECT_TRUE(std::isnan(back.item(cols + c))) << "NaN scale decodes the block to NaN";
  EXPECT_TRUE(std::isnan(back.item(cols + 129)));
  EXPECT_FALSE(std::isnan(back.item(cols + 0)));
  EXPECT_LT(std::fabs(back.item(70) - 3e38) / 3e38, 0.07);
}

TEST(QuantizeMxfp8, InputDtypesAndOutputDtypes) {
  Context ctx = Context::cpu();
  for (DType in_type : {DType::BF16, DType::F16, DType::F64}) {
    Tensor x = wide_range_tensor(4, 100, 71, in_type);
    Tensor as_f32 = Tensor::from_floats(x.to_floats(), x.shape());
    Tensor q = Tensor::empty({4, 100}, DType::E5M2), want = Tensor::empty({4, 100}, DType::E5M2);
    Tensor s = Tensor::empty({4, 4}, DType::E8M0), want_s = Tensor::empty({4, 4}, DType::E8M0);
    quantize_mxfp8(ctx, x, q, s);
    quantize_mxfp8(ctx, as_f32, want, want_s);
    EXPECT_EQ(codes_of(q), codes_of(want)) << dtype_name(in_type);
    EXPECT_EQ(codes_of(s), codes_of(want_s)) << dtype_name(in_type);
    Tensor back = Tensor::empty({4, 100}, in_type), back_f32 = Tensor::empty({4, 100}, DType::F32);
    dequantize_mxfp8(ctx, q, s, back);
    dequantize_mxfp8(ctx, q, s, back_f32);
    Tensor rounded = Tensor::from_floats(back_f32.to_floats(), {4, 100}, in_type);
    EXPECT_EQ(relative_error(back, rounded), 0.0) << dtype_name(in_type);
  }
}

TEST(QuantizeMxfp8, RejectsBadArguments) {
  Context ctx = Context::cpu();
  Tensor x = Tensor::zeros({3, 70}, DType::F32), q = Tensor::zeros({3, 70}, DType::E4M3);
  Tensor s = Tensor::zeros({3, 3}, DType::E8M0), undefined;
  EXPECT_NO_THROW(quantize_mxfp8(ctx, x, q, s));
  Tensor s_f32 = Tensor::zeros({3, 3}, DType::F32), s_u8 = Tensor::zeros({3, 3}, DType::U8);
  Tensor s_short = Tensor::zeros({3, 2}, DType::E8M0), s_flat = Tensor::zeros({9}, DType::E8M0);
  EXPECT_THROW(quantize_mxfp8(ctx, x, q, s_f32), Error);
  EXPECT_THROW(quantize_mxfp8(ctx, x, q, s_u8), Error);
  EXPECT_THROW(quantize_mxfp8(ctx, x, q, s_short), Error);
  EXPECT_THROW(quantize_mxfp8(ctx, x, q, s_flat), Error);
  Tensor x1d = Tensor::zeros({70}, DType::F32), q1d = Tensor::zeros({70}, DType::E4M3);
  Tensor s1d = Tensor::zeros({1, 3}, DType::E8M0);
  EXPECT_THROW(quantize_mxfp8(ctx, x1d, q1d, s1d), Error);
  Tensor bf16_out = Tensor::zeros({3, 70}, DType::BF16);
  EXPECT_THROW(quantize_mxfp8(ctx, x, bf16_out, s), Error);
  EXPECT_THROW(quantize_mxfp8(ctx, undefined, q, s), Error);
  Context cuda = Context::cuda(0);
  EXPECT_THROW(quantize_mxfp8(cuda, x, q, s), Error);
  Tensor out = Tensor::zeros({3, 70}, DType::F32);
  EXPECT_NO_THROW(dequantize_mxfp8(ctx, q, s, out));
  EXPECT_THROW(dequantize_mxfp8(ctx, q, s_short, out), Error);
  EXPECT_THROW(dequantize_mxfp8(ctx, q1d, s1d, out), Error);
  EXPECT_THROW(dequantize_mxfp8(ctx, x, s, out), Error);
  Tensor e5_out = Tensor::zeros({3, 70}, DType::E5M2);
  EXPECT_THROW(dequantize_mxfp8(ctx, q, s, e5_out), Error);
}
