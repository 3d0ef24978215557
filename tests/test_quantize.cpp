// Tests of amax, the scale formula, per-tensor and block scaling: hand-computed cases bit
// for bit, the reference recipes of quantize_testing.h on odd shapes, round-trip error
// bounds, saturation, zero blocks, NaN propagation and argument checks.
#include "tessera/ops/quantize.h"

#include "quantize_testing.h"

using namespace tessera;
using namespace tessera::testing;
// ---- Scale computation ----------------------------------------------------------------

TEST(QuantizeScale, FormulaAndSpecialCases) {
  EXPECT_EQ(fp8_max(DType::E4M3), 448.0f);
  EXPECT_EQ(fp8_max(DType::E5M2), 57344.0f);
  EXPECT_EQ(fp8_max_exponent(DType::E4M3), 8);
  EXPECT_EQ(fp8_max_exponent(DType::E5M2), 15);
  EXPECT_EQ(fp8_scale_from_amax(448.0f, DType::E4M3), 1.0f);
  EXPECT_EQ(fp8_scale_from_amax(1.0f, DType::E4M3), 448.0f);
  EXPECT_EQ(fp8_scale_from_amax(3.0f, DType::E4M3), 448.0f / 3.0f);
  EXPECT_EQ(fp8_scale_from_amax(1.0f, DType::E4M3, 1.0f), 224.0f);
  EXPECT_EQ(fp8_scale_from_amax(1.0f, DType::E4M3, 2.0f, true), 64.0f);  // 112 -> 64
  EXPECT_EQ(fp8_scale_from_amax(1.0f, DType::E4M3, 0.0f, true), 256.0f);
  EXPECT_EQ(fp8_scale_from_amax(1.0f, DType::E5M2), 57344.0f);
  EXPECT_EQ(fp8_scale_from_amax(1.0f, DType::E5M2, 0.0f, true), 32768.0f);
  EXPECT_EQ(fp8_scale_from_amax(1000.0f, DType::E4M3, 0.0f, true), 0.25f);  // 0.448 -> 0.25
  EXPECT_EQ(fp8_scale_from_amax(0.0f, DType::E4M3), 1.0f);
  EXPECT_EQ(fp8_scale_from_amax(NAN, DType::E4M3), 1.0f);
  EXPECT_EQ(fp8_scale_from_amax(INFINITY, DType::E5M2), 1.0f);
  EXPECT_EQ(fp8_scale_from_amax(-2.0f, DType::E4M3), 1.0f);
  EXPECT_EQ(fp8_scale_from_amax(1e-44f, DType::E4M3), FLT_MAX);  // 448 / 1e-44 overflows float
  EXPECT_EQ(fp8_scale_from_amax(1e-44f, DType::E4M3, 0.0f, true), 0x1p127f);
  EXPECT_THROW(fp8_max(DType::F32), Error);
  EXPECT_THROW(fp8_max_exponent(DType::BF16), Error);
  EXPECT_THROW(fp8_scale_from_amax(1.0f, DType::F16), Error);
  // Power-of-two scales are always at most the exact scale and more than half of it.
  for (float a : {0.001f, 0.3f, 1.7f, 5.0f, 448.0f, 1e5f, 3e38f}) {
    const float exact = fp8_scale_from_amax(a, DType::E4M3), p = fp8_scale_from_amax(a, DType::E4M3, 0, true);
    EXPECT_LE(p, exact);
    EXPECT_GT(2.0f * p, exact);
    EXPECT_EQ(std::exp2(std::round(std::log2(p))), p);
  }
}

// ---- amax ----------------------------------------------------------------------------

TEST(Amax, MaxAbsoluteValueInEveryDtype) {
  Context ctx = Context::cpu();
  for (DType t : {DType::F64, DType::F32, DType::BF16, DType::F16, DType::E4M3, DType::E5M2}) {
    Tensor x = random_tensor({17, 33}, t, 5, -3.0f, 3.0f);
    x.set_item(200, -7.0);  // the largest magnitude is negative
    Tensor out = Tensor::empty({1}, DType::F32);
    poison(out);
    amax(ctx, x, out);
    double want = 0;
    for (double v : x.to_doubles()) want = std::max(want, std::fabs(v));
    EXPECT_EQ(out.item(0), static_cast<double>(static_cast<float>(want))) << dtype_name(t);
    EXPECT_EQ(out.item(0), 7.0) << dtype_name(t);
  }
}

TEST(Amax, NanPropagatesAndZerosGiveZero) {
  Context ctx = Context::cpu();
  Tensor out = Tensor::empty({1}, DType::F32);
  Tensor zeros = Tensor::zeros({4, 5}, DType::BF16);
  amax(ctx, zeros, out);
  EXPECT_EQ(out.item(0), 0.0);
  for (int64_t where : {0, 1000, 4095}) {
    Tensor x = random_tensor({4096}, DType::F32, 6);
    x.set_item(where, NAN);
    amax(ctx, x, out);
    EXPECT_TRUE(std::isnan(out.item(0))) << "NaN at " << where;
  }
  Tensor x = random_tensor({100}, DType::F32, 7);
  x.set_item(50, -INFINITY);
  amax(ctx, x, out);
  EXPECT_EQ(out.item(0), INFINITY);
  Tensor empty = Tensor::empty({0}, DType::F32);
  amax(ctx, empty, out);
  EXPECT_EQ(out.item(0), 0.0);
}

TEST(Amax, RejectsBadArguments) {
  Context ctx = Context::cpu();
  Tensor x = Tensor::zeros({3, 4}, DType::F32), out = Tensor::zeros({1}, DType::F32);
  Tensor wrong_shape = Tensor::zeros({2}, DType::F32), wrong_dtype = Tensor::zeros({1}, DType::F64);
  Tensor ints = Tensor::zeros({3, 4}, DType::I32), undefined;
  EXPECT_THROW(amax(ctx, x, wrong_shape), Error);
  EXPECT_THROW(amax(ctx, x, wrong_dtype), Error);
  EXPECT_THROW(amax(ctx, ints, out), Error);
  EXPECT_THROW(amax(ctx, undefined, out), Error);
  EXPECT_THROW(amax(ctx, x, undefined), Error);
  EXPECT_THROW(amax(ctx, x.transpose(0, 1), out), Error);
  Context cuda = Context::cuda(0);
  EXPECT_THROW(amax(cuda, x, out), Error);
}

// ---- Per-tensor ----------------------------------------------------------------------

TEST(QuantizePerTensor, HandComputedCase) {
  Context ctx = Context::cpu();
  // x * 0.5 = [0.5, -1, 0.15, 500, -500, 0, 0.0009765625]:
  //  0.5 = 2^-1 -> exp field 6 -> 0x30; -1 -> 0xB8;
  //  0.15 = 1.2 * 2^-3: mantissa 1.6 of 8ths rounds to 2 -> 1.25 * 2^-3 -> (4 << 3) | 2 = 0x22;
  //  +-500 saturates to +-448 = 0x7E / 0xFE; 0 -> 0x00;
  //  2^-10 is halfway between 0 and the smallest subnormal 2^-9 -> ties to 0.
  Tensor x = Tensor::from_floats({1.0f, -2.0f, 0.3f, 1000.0f, -1000.0f, 0.0f, 0x1p-9f}, {7});
  Tensor out = Tensor::empty({7}, DType::E4M3), amax_out = Tensor::empty({1}, DType::F32);
  poison(out);
  poison(amax_out);
  quantize_per_tensor(ctx, x, scalar(0.5f), out, amax_out);
  EXPECT_EQ(codes_of(out), (std::vector<uint8_t>{0x30, 0xB8, 0x22, 0x7E, 0xFE, 0x00, 0x00}));
  EXPECT_EQ(amax_out.item(0), 1000.0);
  // E5M2: 0.15 = 1.2 * 2^-3, mantissa 0.8 of quarters rounds to 1 -> 1.25 * 2^-3 = (12 << 2) | 1 = 0x31;
  // 500 = 1.953125 * 2^8 rounds up to 2^9 = (24 << 2) = 0x60; 2^-10 = (5 << 2) = 0x14.
  Tensor out5 = Tensor::empty({7}, DType::E5M2);
  poison(out5);
  quantize_per_tensor(ctx, x, scalar(0.5f), out5);
  EXPECT_EQ(codes_of(out5), (std::vector<uint8_t>{0x38, 0xBC, 0x31, 0x60, 0xE0, 0x00, 0x14}));
  // Dequantize: float(q) * scale_inv.
  Tensor back = Tensor::empty({7}, DType::F32);
  poison(back);
  dequantize_per_tensor(ctx, out, scalar(2.0f), back);
  EXPECT_EQ(back.to_floats(), (std::vector<float>{1.0f, -2.0f, 0.3125f, 896.0f, -896.0f, 0.0f, 0.0f}));
}

TEST(QuantizePerTensor, SaturatesInfinitiesAndKeepsNan) {
  Context ctx = Context::cpu();
  Tensor x = Tensor::from_floats({INFINITY, -INFINITY, NAN, 1e30f, 2.0f}, {5});
  Tensor amax_out = Tensor::empty({1}, DType::F32);
  for (DType t : {DType::E4M3, DType::E5M2}) {
    Tensor out = Tensor::empty({5}, t);
    quantize_per_tensor(ctx, x, scalar(1.0f), out, amax_out);
    const uint8_t max_code = t == DType::E4M3 ? 0x7E : 0x7B;
    const std::vector<uint8_t> q = codes_of(out);
    EXPECT_EQ(q[0], max_code);
    EXPECT_EQ(q[1], max_code | 0x80);
    EXPECT_TRUE(std::isnan(out.item(2)));
    EXPECT_EQ(q[3], max_code);
    EXPECT_EQ(out.item(4), 2.0);
    EXPECT_TRUE(std::isnan(amax_out.item(0)));  // NaN beats the infinities
  }
}

TEST(QuantizePerTensor, RoundTripWithinFp8Bounds) {
  Context ctx = Context::cpu();
  for (DType fp8 : {DType::E4M3, DType::E5M2}) {
    for (DType in_type : {DType::F32, DType::BF16, DType::F16, DType::F64}) {
      Tensor x = random_tensor({37, 53}, in_type, 11, -3.0f, 3.0f);
      Tensor a = Tensor::empty({1}, DType::F32);
      amax(ctx, x, a);
      const float scale = fp8_scale_from_amax(static_cast<float>(a.item(0)), fp8);
      Tensor q = Tensor::empty(x.shape(), fp8), amax_out = Tensor::empty({1}, DType::F32);
      poison(q);
      quantize_per_tensor(ctx, x, scalar(scale), q, amax_out);
      EXPECT_EQ(amax_out.item(0), a.item(0));
      std::vector<uint8_t> want;
      for (float v : x.to_floats()) want.push_back(encode(v * scale, fp8));
      ASSERT_EQ(codes_of(q), want) << dtype_name(fp8) << " from " << dtype_name(in_type);
      for (DType out_type : {DType::F32, DType::F64}) {
        Tensor back = Tensor::empty(x.shape(), out_type);
        poison(back);
        dequantize_per_tensor(ctx, q, scalar(1.0f / scale), back);
        const std::vector<double> xs = x.to_doubles(), bs = back.to_doubles();
        for (size_t i = 0; i < xs.size(); ++i) {
          const double bound = 1.001 * (fp8_half_ulp(fp8) * std::fabs(xs[i]) + fp8_half_quantum(fp8) / scale);
          ASSERT_LE(std::fabs(bs[i] - xs[i]), bound) << dtype_name(fp8) << " element " << i;
        }
        EXPECT_LT(relative_error(back, x), fp8 == DType::E4M3 ? 6e-2 : 1.2e-1);
      }
    }
  }
}

// Every input dtype is converted to float first: F64 rounds, the others are exact.
TEST(QuantizePerTensor, InputDtypesActLikeTheirFloatValues) {
  Context ctx = Context::cpu();
  for (DType in_type : {DType::F64, DType::BF16, DType::F16, DType::E5M2}) {
    Tensor x = random_tensor({9, 31}, in_type, 12, -100.0f, 100.0f);
    Tensor as_f32 = Tensor::from_floats(x.to_floats(), x.shape());
    Tensor q = Tensor::empty(x.shape(), DType::E4M3), want = Tensor::empty(x.shape(), DType::E4M3);
    quantize_per_tensor(ctx, x, scalar(3.7f), q);
    quantize_per_tensor(ctx, as_f32, scalar(3.7f), want);
    EXPECT_EQ(codes_of(q), codes_of(want)) << dtype_name(in_type);
  }
  // Dequantizing into BF16 / F16 rounds float(q) * scale_inv once.
  Tensor q = Tensor::empty({64}, DType::E4M3);
  for (int i = 0; i < 64; ++i) q.data<uint8_t>()[i] = static_cast<uint8_t>(i * 4 + 1);
  for (DType out_type : {DType::BF16, DType::F16}) {
    Tensor back = Tensor::empty({64}, out_type);
    dequantize_per_tensor(ctx, q, scalar(0.3f), back);
    for (int i = 0; i < 64; ++i) {
      const float v = e4m3_to_float(static_cast<uint8_t>(i * 4 + 1)) * 0.3f;
      const float want = out_type == DType::BF16 ? bf16_bits_to_float(float_to_bf16_bits(v))
                                                 : fp16_bits_to_float(float_to_fp16_bits(v));
      if (std::isnan(v)) EXPECT_TRUE(std::isnan(back.item(i)));
      else EXPECT_EQ(back.item(i), want) << i;
    }
  }
}

TEST(QuantizePerTensor, ZeroTensorAndEmptyTensor) {
  Context ctx = Context::cpu();
  Tensor x = Tensor::zeros({3, 5}, DType::F32), q = Tensor::empty({3, 5}, DType::E4M3);
  Tensor a = Tensor::empty({1}, DType::F32);
  poison(q);
  quantize_per_tensor(ctx, x, scalar(fp8_scale_from_amax(0.0f, DType::E4M3)), q, a);
  EXPECT_EQ(codes_of(q), std::vector<uint8_t>(15, 0));
  EXPECT_EQ(a.item(0), 0.0);
  Tensor e = Tensor::empty({0, 4}, DType::F32), eq = Tensor::empty({0, 4}, DType::E4M3);
  quantize_per_tensor(ctx, e, scalar(1.0f), eq, a);
  EXPECT_EQ(a.item(0), 0.0);
}

TEST(QuantizePerTensor, RejectsBadArguments) {
  Context ctx = Context::cpu();
  Tensor x = Tensor::zeros({4, 6}, DType::F32), q = Tensor::zeros({4, 6}, DType::E4M3), s = scalar(1.0f);
  Tensor a = Tensor::zeros({1}, DType::F32), undefined;
  EXPECT_NO_THROW(quantize_per_tensor(ctx, x, s, q, undefined));
  Tensor bf16_out = Tensor::zeros({4, 6}, DType::BF16);
  EXPECT_THROW(quantize_per_tensor(ctx, x, s, bf16_out, a), Error);  // not FP8
  Tensor e8_out = Tensor::zeros({4, 6}, DType::E8M0);
  EXPECT_THROW(quantize_per_tensor(ctx, x, s, e8_out, a), Error);
  Tensor wrong_shape_out = Tensor::zeros({6, 4}, DType::E4M3);
  EXPECT_THROW(quantize_per_tensor(ctx, x, s, wrong_shape_out, a), Error);
  Tensor two_scales = Tensor::zeros({2}, DType::F32), scale_2d = Tensor::zeros({1, 1}, DType::F32);
  Tensor f64_scale = Tensor::zeros({1}, DType::F64);
  EXPECT_THROW(quantize_per_tensor(ctx, x, two_scales, q, a), Error);
  EXPECT_THROW(quantize_per_tensor(ctx, x, scale_2d, q, a), Error);
  EXPECT_THROW(quantize_per_tensor(ctx, x, f64_scale, q, a), Error);
  EXPECT_THROW(quantize_per_tensor(ctx, x, undefined, q, a), Error);
  Tensor bad_amax = Tensor::zeros({2}, DType::F32);
  EXPECT_THROW(quantize_per_tensor(ctx, x, s, q, bad_amax), Error);
  Tensor ints = Tensor::zeros({4, 6}, DType::I32);
  EXPECT_THROW(quantize_per_tensor(ctx, ints, s, q, a), Error);
  EXPECT_THROW(quantize_per_tensor(ctx, x.transpose(0, 1), s, q, a), Error);
  Context cuda = Context::cuda(0);
  EXPECT_THROW(quantize_per_tensor(cuda, x, s, q, a), Error);
  Tensor out = Tensor::zeros({4, 6}, DType::F32);
  EXPECT_THROW(dequantize_per_tensor(ctx, x, s, out), Error);  // q not FP8
  Tensor fp8_out = Tensor::zeros({4, 6}, DType::E5M2);
  EXPECT_THROW(dequantize_per_tensor(ctx, q, s, fp8_out), Error);
  EXPECT_THROW(dequantize_per_tensor(ctx, q, two_scales, out), Error);
  Tensor out_wrong = Tensor::zeros({24}, DType::F32);
  EXPECT_THROW(dequantize_per_tensor(ctx, q, s, out_wrong), Error);
}

// ---- Block scaling -------------------------------------------------------------------

TEST(QuantizeBlockwise, ScaleShapes) {
  EXPECT_EQ(block_scale_shape(3, 130, BlockScaling::tile_1x128()), (Shape{3, 2}));
  EXPECT_EQ(block_scale_shape(3, 130, BlockScaling::tile_128x128()), (Shape{1, 2}));
  EXPECT_EQ(block_scale_shape(129, 257, BlockScaling::tile_128x128()), (Shape{2, 3}));
  EXPECT_EQ(block_scale_shape(128, 128, BlockScaling::tile_128x128()), (Shape{1, 1}));
  EXPECT_EQ(block_scale_shape(1, 1, BlockScaling::tile_1x128()), (Shape{1, 1}));
  EXPECT_EQ(block_scale_shape(0, 5, BlockScaling::tile_1x128()), (Shape{0, 1}));
  EXPECT_TRUE(BlockScaling{}.power_of_two_scales);
  EXPECT_THROW(block_scale_shape(4, 4, BlockScaling{0, 128, true}), Error);
}

TEST(QuantizeBlockwise, HandComputedCase) {
  Context ctx = Context::cpu();
  // 1x4 blocks over a [2, 6] tensor: blocks (0,0) [1 2 3 4], (0,1) [5 6], (1,0) zeros, (1,1) [-0.5 0.25].
  Tensor x = Tensor::from_floats({1, 2, 3, 4, 5, 6, 0, 0, 0, 0, -0.5f, 0.25f}, {2, 6});
  const BlockScaling b{1, 4, true};
  Tensor q = Tensor::empty({2, 6}, DType::E4M3), inv = Tensor::empty({2, 2}, DType::F32);
  poison(q);
  poison(inv);
  quantize_blockwise(ctx, x, q, inv, b);
  // amax 4: 448 / 4 = 112 -> 64: [64 128 192 256] = [0x68 0x70 0x74 0x78];
  // amax 6: 74.67 -> 64: [320 384] = [0x7A 0x7C]; zero block: scale 1;
  // amax 0.5: 896 -> 512: [-256 128] = [0xF8 0x70].
  EXPECT_EQ(codes_of(q), (std::vector<uint8_t>{0x68, 0x70, 0x74, 0x78, 0x7A, 0x7C, 0, 0, 0, 0, 0xF8, 0x70}));
  EXPECT_EQ(inv.to_floats(), (std::vector<float>{1.0f / 64, 1.0f / 64, 1.0f, 1.0f / 512}));
  Tensor back = Tensor::empty({2, 6}, DType::F32);
  poison(back);
  dequantize_blockwise(ctx, q, inv, back, b);
  EXPECT_EQ(back.to_floats(), x.to_floats());  // every value fits E4M3 exactly after a power-of-two scale
  // Without power-of-two scales, block (0,0) uses 112: [112 224 336 448]; 336 = 10.5 * 32
  // ties to 10 * 32 = 320 (0x7A). Block (1,1): 896 -> [-448 224] = [0xFE 0x76].
  const BlockScaling exact{1, 4, false};
  quantize_blockwise(ctx, x, q, inv, exact);
  const std::vector<uint8_t> c = codes_of(q);
  EXPECT_EQ(std::vector<uint8_t>(c.begin(), c.begin() + 4), (std::vector<uint8_t>{0x6E, 0x76, 0x7A, 0x7E}));
  EXPECT_EQ(c[10], 0xFE);
  EXPECT_EQ(c[11], 0x76);
  EXPECT_EQ(inv.item(0), static_cast<double>(1.0f / 112.0f));
  EXPECT_EQ(inv.item(3), static_cast<double>(1.0f / 896.0f));
}

TEST(QuantizeBlockwise, MatchesReferenceOnOddShapes) {
  Context ctx = Context::cpu();
  uint64_t seed = 20;
  for (auto [rows, cols] : kOddShapes) {
    for (BlockScaling b : {BlockScaling::tile_1x128(), BlockScaling::tile_128x128(), BlockScaling::tile_1x128(false),
                           BlockScaling::tile_128x128(false)}) {
      for (DType fp8 : {DType::E4M3, DType::E5M2}) {
        Tensor x = wide_range_tensor(rows, cols, ++seed);
        Tensor q = Tensor::empty({rows, cols}, fp8), inv = Tensor::empty(block_scale_shape(rows, cols, b), DType::F32);
        poison(q);
        poison(inv);
        quantize_blockwise(ctx, x, q, inv, b);
        const BlockReference ref = reference_blockwise(x.to_floats(), rows, cols, fp8, b);
        const std::string what = std::to_string(rows) + "x" + std::to_string(cols) + " block " +
                                 std::to_string(b.block_rows) + "x" + std::to_string(b.block_cols) +
                                 (b.power_of_two_scales ? " pow2 " : " exact ") + dtype_name(fp8);
        ASSERT_EQ(codes_of(q), ref.codes) << what;
        ASSERT_EQ(inv.to_floats(), ref.scale_inv) << what;
        // Round trip: each element within half an FP8 ulp of its block's scaled value.
        Tensor back = Tensor::empty({rows, cols}, DType::F32);
        poison(back);
        dequantize_blockwise(ctx, q, inv, back, b);
        const std::vector<float> xs = x.to_floats(), bs = back.to_floats(), invs = inv.to_floats();
        const int64_t grid_cols = inv.size(1);
        double worst_block_relative = 0;
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < cols; ++c) {
            const double s_inv = invs[(r / b.block_rows) * grid_cols + c / b.block_cols];
            const double err = std::fabs(double(bs[r * cols + c]) - xs[r * cols + c]);
            const double bound = 1.001 * (fp8_half_ulp(fp8) * std::fabs(xs[r * cols + c]) + fp8_half_quantum(fp8) * s_inv);
            ASSERT_LE(err, bound) << what << " at " << r << "," << c;
            // Relative to the block's amax scale (amax ~ fp8_max * s_inv).
            worst_block_relative = std::max(worst_block_relative, err / (fp8_max(fp8) * s_inv));
          }
        EXPECT_LT(worst_block_relative, fp8 == DType::E4M3 ? 6e-2 : 1.2e-1) << what;
      }
    }
  }
}

TEST(QuantizeBlockwise, InputDtypesAndOutputDtypes) {
  Context ctx = Context::cpu();
  const BlockScaling b = BlockScaling::tile_1x128();
  for (DType in_type : {DType::BF16, DType::F16, DType::F64}) {
    Tensor x = wide_range_tensor(5, 200, 31, in_type);
    Tensor as_f32 = Tensor::from_floats(x.to_floats(), x.shape());
    Tensor q = Tensor::empty({5, 200}, DType::E4M3), want = Tensor::empty({5, 200}, DType::E4M3);
    Tensor inv = Tensor::empty({5, 2}, DType::F32), want_inv = Tensor::empty({5, 2}, DType::F32);
    quantize_blockwise(ctx, x, q, inv, b);
    quantize_blockwise(ctx, as_f32, want, want_inv, b);
    EXPECT_EQ(codes_of(q), codes_of(want)) << dtype_name(in_type);
    EXPECT_EQ(inv.to_floats(), want_inv.to_floats()) << dtype_name(in_type);
    Tensor back = Tensor::empty({5, 200}, in_type), back_f32 = Tensor::empty({5, 200}, DType::F32);
    dequantize_blockwise(ctx, q, inv, back, b);
    dequantize_blockwise(ctx, q, inv, back_f32, b);
    Tensor rounded = Tensor::from_floats(back_f32.to_floats(), {5, 200}, in_type);
    EXPECT_EQ(relative_error(back, rounded), 0.0) << dtype_name(in_type);
  }
}

TEST(QuantizeBlockwise, ZeroBlocksSaturationAndNan) {
  Context ctx = Context::cpu();
  const int64_t rows = 3, cols = 300;
  std::vector<float> v = wide_range_tensor(rows, cols, 41).to_floats();
  for (int64_t c = 0; c < 128; ++c) v[1 * cols + c] = 0.0f;  // block (1, 0) all zeros
  v[1 * cols + 140] = NAN;                                    // block (1, 1) holds a NaN
  v[0 * cols + 290] = INFINITY;                               // block (0, 2) holds an Inf
  Tensor x = Tensor::from_floats(v, {rows, cols});
  Tensor q = Tensor::empty({rows, cols}, DType::E4M3), inv = Tensor::empty({rows, 3}, DType::F32);
  poison(q);
  poison(inv);
  quantize_blockwise(ctx, x, q, inv, BlockScaling::tile_1x128());
  const BlockReference ref = reference_blockwise(v, rows, cols, DType::E4M3, BlockScaling::tile_1x128());
  EXPECT_EQ(codes_of(q), ref.codes);
  EXPECT_EQ(inv.item(1 * 3 + 0), 1.0);
  EXPECT_EQ(inv.item(1 * 3 + 1), 1.0);
  EXPECT_EQ(inv.item(0 * 3 + 2), 1.0);
  for (int64_t c = 0; c < 128; ++c) ASSERT_EQ(q.data<uint8_t>()[1 * cols + c], 0);
  EXPECT_EQ(q.data<uint8_t>()[1 * cols + 140], 0x7F);  // NaN stays NaN
  EXPECT_EQ(q.data<uint8_t>()[0 * cols + 290], 0x7E);  // Inf saturates
  // The other blocks are unaffected: their scales are the usual ones (these blocks hold small values).
  for (int64_t b : {0, 5, 6}) EXPECT_LT(inv.item(b), 1.0) << b;
  Tensor back = Tensor::empty({rows, cols}, DType::F32);
  dequantize_blockwise(ctx, q, inv, back, BlockScaling::tile_1x128());
  EXPECT_TRUE(std::isnan(back.item(1 * cols + 140)));
  EXPECT_EQ(back.item(0 * cols + 290), 448.0);
}

TEST(QuantizeBlockwise, RejectsBadArguments) {
  Context ctx = Context::cpu();
  const BlockScaling b = BlockScaling::tile_1x128();
  Tensor x = Tensor::zeros({3, 130}, DType::F32), q = Tensor::zeros({3, 130}, DType::E4M3);
  Tensor inv = Tensor::zeros({3, 2}, DType::F32), undefined;
  EXPECT_NO_THROW(quantize_blockwise(ctx, x, q, inv, b));
  Tensor inv_128 = Tensor::zeros({1, 2}, DType::F32), inv_f64 = Tensor::zeros({3, 2}, DType::F64);
  EXPECT_THROW(quantize_blockwise(ctx, x, q, inv_128, b), Error);  // the 128x128 shape for a 1x128 recipe
  EXPECT_THROW(quantize_blockwise(ctx, x, q, inv_f64, b), Error);
  EXPECT_THROW(quantize_blockwise(ctx, x, q, inv, BlockScaling::tile_128x128()), Error);
  Tensor x1d = Tensor::zeros({390}, DType::F32), q1d = Tensor::zeros({390}, DType::E4M3);
  EXPECT_THROW(quantize_blockwise(ctx, x1d, q1d, inv, b), Error);
  Tensor x3d = Tensor::zeros({1, 3, 130}, DType::F32), q3d = Tensor::zeros({1, 3, 130}, DType::E4M3);
  EXPECT_THROW(quantize_blockwise(ctx, x3d, q3d, inv, b), Error);
  Tensor f16_out = Tensor::zeros({3, 130}, DType::F16);
  EXPECT_THROW(quantize_blockwise(ctx, x, f16_out, inv, b), Error);
  Tensor q_wrong = Tensor::zeros({3, 129}, DType::E4M3);
  EXPECT_THROW(quantize_blockwise(ctx, x, q_wrong, inv, b), Error);
  EXPECT_THROW(quantize_blockwise(ctx, undefined, q, inv, b), Error);
  EXPECT_THROW(quantize_blockwise(ctx, x, q, undefined, b), Error);
  EXPECT_THROW(quantize_blockwise(ctx, x, q, inv, BlockScaling{1, 0, true}), Error);
  EXPECT_THROW(quantize_blockwise(ctx, x, q, inv, BlockScaling{-1, 128, true}), Error);
  Context cuda = Context::cuda(0);
  EXPECT_THROW(quantize_blockwise(cuda, x, q, inv, b), Error);
  Tensor out = Tensor::zeros({3, 130}, DType::F32);
  EXPECT_NO_THROW(dequantize_blockwise(ctx, q, inv, out, b));
  EXPECT_THROW(dequantize_blockwise(ctx, q, inv_128, out, b), Error);
  EXPECT_THROW(dequantize_blockwise(ctx, x, inv, out, b), Error);  // q not FP8
  EXPECT_THROW(dequantize_blockwise(ctx, q1d, inv, out, b), Error);
  Tensor e4_out = Tensor::zeros({3, 130}, DType::E4M3);
  EXPECT_THROW(dequantize_blockwise(ctx, q, inv, e4_out, b), Error);
}
