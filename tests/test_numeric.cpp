// Exhaustive tests of the scalar number formats in numeric.h.
//
// Every code of every format is decoded and compared with an independent decoder written
// here from the format definitions; rounding is checked on the exact midpoints between all
// adjacent codes and, for random floats, against a nearest-value search over the code
// tables (no bit manipulation shared with the implementation).
#include "tessera/core/numeric.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

using namespace tessera;

namespace {

// ---- An independent description of each format ---------------------------------------

enum class TopExponent { IEEE, FiniteOnly };

struct FormatSpec {
  std::string name;
  int exponent_bits;
  int mantissa_bits;
  TopExponent top;
  bool saturates;  // FP8: out-of-range values clamp to the largest finite value
  std::function<uint32_t(float)> encode;
  std::function<float(uint32_t)> decode;
  int total_bits() const { return 1 + exponent_bits + mantissa_bits; }
  uint32_t num_codes() const { return 1u << total_bits(); }
};

// Value of `code` straight from the definition: (-1)^s * 2^(e - bias) * 1.m, or
// (-1)^s * 2^(1 - bias) * 0.m for e = 0. Computed in double, which holds every value exactly.
double reference_decode(uint32_t code, const FormatSpec& f) {
  const uint32_t mant = code % (1u << f.mantissa_bits);
  const uint32_t exp = (code >> f.mantissa_bits) % (1u << f.exponent_bits);
  const bool negative = (code >> (f.exponent_bits + f.mantissa_bits)) & 1u;
  const int bias = (1 << (f.exponent_bits - 1)) - 1;
  const uint32_t exp_max = (1u << f.exponent_bits) - 1;
  const uint32_t mant_max = (1u << f.mantissa_bits) - 1;
  double value;
  if (f.top == TopExponent::IEEE && exp == exp_max) {
    value = mant == 0 ? std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN();
  } else if (f.top == TopExponent::FiniteOnly && exp == exp_max && mant == mant_max) {
    value = std::numeric_limits<double>::quiet_NaN();
  } else if (exp == 0) {
    value = std::ldexp(static_cast<double>(mant), 1 - bias - f.mantissa_bits);
  } else {
    value = std::ldexp(1.0 + static_cast<double>(mant) / (1u << f.mantissa_bits), static_cast<int>(exp) - bias);
  }
  return negative ? -value : value;
}

uint32_t sign_bit(const FormatSpec& f) { return 1u << (f.exponent_bits + f.mantissa_bits); }

std::vector<FormatSpec> all_formats() {
  return {
      {"E4M3", 4, 3, TopExponent::FiniteOnly, true, [](float x) { return uint32_t{float_to_e4m3(x)}; },
       [](uint32_t c) { return e4m3_to_float(static_cast<uint8_t>(c)); }},
      {"E5M2", 5, 2, TopExponent::IEEE, true, [](float x) { return uint32_t{float_to_e5m2(x)}; },
       [](uint32_t c) { return e5m2_to_float(static_cast<uint8_t>(c)); }},
      {"FP16", 5, 10, TopExponent::IEEE, false, [](float x) { return uint32_t{float_to_fp16_bits(x)}; },
       [](uint32_t c) { return fp16_bits_to_float(static_cast<uint16_t>(c)); }},
      {"BF16", 8, 7, TopExponent::IEEE, false, [](float x) { return uint32_t{float_to_bf16_bits(x)}; },
       [](uint32_t c) { return bf16_bits_to_float(static_cast<uint16_t>(c)); }},
  };
}

// Non-negative finite codes in increasing order of value (for these layouts that is
// increasing code order, but the table is sorted by value so as not to assume it).
struct CodeTable {
  std::vector<std::pair<double, uint32_t>> entries;     // (value, code), value >= 0
  std::vector<std::pair<double, uint32_t>> candidates;  // entries, plus Inf as max + ulp (IEEE overflow)
  double max_finite = 0;
  uint32_t max_code = 0;
};

CodeTable positive_finite_codes(const FormatSpec& f) {
  CodeTable t;
  for (uint32_t c = 0; c < sign_bit(f); ++c) {
    const double v = reference_decode(c, f);
    if (std::isfinite(v)) t.entries.push_back({v, c});
  }
  std::sort(t.entries.begin(), t.entries.end());
  t.max_finite = t.entries.back().first;
  t.max_code = t.entries.back().second;
  t.candidates = t.entries;
  if (!f.saturates) {
    const double ulp = t.max_finite - t.entries[t.entries.size() - 2].first;
    t.candidates.push_back({t.max_finite + ulp, ((1u << f.exponent_bits) - 1) << f.mantissa_bits});
  }
  return t;
}

// The code of the value nearest to x, ties to the code whose last bit is 0 (the even
// mantissa). Beyond the largest finite value: FP8 saturates; FP16/BF16 round to infinity
// when x is at least halfway to the next power of two (IEEE overflow), which is found by
// adding infinity as a virtual code of value max + ulp.
uint32_t brute_force_encode(float x, const FormatSpec& f, const CodeTable& table) {
  const double a = std::fabs(static_cast<double>(x));
  const uint32_t sign = std::signbit(x) ? sign_bit(f) : 0u;
  const std::vector<std::pair<double, uint32_t>>& candidates = table.candidates;
  if (f.saturates && a >= table.max_finite) return sign | table.max_code;
  if (a >= candidates.back().first) return sign | candidates.back().second;
  auto hi = std::lower_bound(candidates.begin(), candidates.end(), std::make_pair(a, uint32_t{0}));
  if (hi == candidates.begin()) return sign | hi->second;
  auto lo = hi - 1;
  const double d_lo = a - lo->first, d_hi = hi->first - a;
  if (d_lo < d_hi) return sign | lo->second;
  if (d_hi < d_lo) return sign | hi->second;
  return sign | ((lo->second & 1u) == 0 ? lo->second : hi->second);
}

// The same search, but over every code with a linear scan (used for FP8 where it is cheap).
uint32_t linear_search_encode(float x, const FormatSpec& f, const std::vector<double>& values) {
  const double a = std::fabs(static_cast<double>(x));
  const uint32_t sign = std::signbit(x) ? sign_bit(f) : 0u;
  double best_dist = INFINITY, max_finite = 0;
  uint32_t best = 0, max_code = 0;
  for (uint32_t c = 0; c < sign_bit(f); ++c) {
    const double v = values[c];
    if (!std::isfinite(v)) continue;
    if (v > max_finite) max_finite = v, max_code = c;
    const double d = std::fabs(v - a);
    if (d < best_dist || (d == best_dist && (c & 1u) == 0)) best_dist = d, best = c;
  }
  if (a >= max_finite) return sign | max_code;  // FP8 saturation
  return sign | best;
}

bool is_nan_code(uint32_t code, const FormatSpec& f) { return std::isnan(reference_decode(code, f)); }

std::string hex(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%X", v);
  return buf;
}

float from_bits(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

}  // namespace

// ---- Every code decodes right and re-encodes to itself -------------------------------

TEST(NumericFormats, EveryCodeDecodesLikeTheDefinition) {
  for (const FormatSpec& f : all_formats()) {
    int nan_codes = 0;
    for (uint32_t c = 0; c < f.num_codes(); ++c) {
      const double want = reference_decode(c, f);
      const float got = f.decode(c);
      if (std::isnan(want)) {
        ++nan_codes;
        EXPECT_TRUE(std::isnan(got)) << f.name << " code " << hex(c);
        continue;
      }
      ASSERT_EQ(static_cast<double>(got), want) << f.name << " code " << hex(c);
      ASSERT_EQ(std::signbit(got), (c & sign_bit(f)) != 0) << f.name << " code " << hex(c);
    }
    // E4M3 has exactly two NaN codes (0x7F, 0xFF); IEEE layouts 2 * (2^m - 1).
    const int want_nans = f.top == TopExponent::FiniteOnly ? 2 : 2 * ((1 << f.mantissa_bits) - 1);
    EXPECT_EQ(nan_codes, want_nans) << f.name;
  }
}

TEST(NumericFormats, EveryCodeReencodesToItself) {
  for (const FormatSpec& f : all_formats()) {
    for (uint32_t c = 0; c < f.num_codes(); ++c) {
      const float v = f.decode(c);
      const uint32_t back = f.encode(v);
      if (is_nan_code(c, f)) {
        EXPECT_TRUE(is_nan_code(back, f)) << f.name << " NaN code " << hex(c) << " re-encoded to " << hex(back);
        EXPECT_EQ(back & sign_bit(f), c & sign_bit(f)) << f.name << " NaN sign lost for " << hex(c);
      } else if (std::isinf(v) && f.saturates) {
        // E5M2 infinities saturate to the largest finite value by design.
        EXPECT_EQ(back, (c & sign_bit(f)) | 0x7Bu) << f.name << " code " << hex(c);
      } else {
        ASSERT_EQ(back, c) << f.name << " code " << hex(c) << " value " << v;
      }
    }
  }
}

TEST(NumericFormats, KnownConstants) {
  EXPECT_EQ(e4m3_to_float(0x7E), 448.0f);
  EXPECT_EQ(e4m3_to_float(0xFE), -448.0f);
  EXPECT_EQ(e4m3_to_float(0x38), 1.0f);
  EXPECT_EQ(e4m3_to_float(0x08), 0.015625f);     // smallest normal 2^-6
  EXPECT_EQ(e4m3_to_float(0x01), 0.001953125f);  // smallest subnormal 2^-9
  EXPECT_TRUE(std::isnan(e4m3_to_float(0x7F)));
  EXPECT_TRUE(std::isnan(e4m3_to_float(0xFF)));
  EXPECT_EQ(e4m3_to_float(0x78), 256.0f);  // the top exponent holds finite values in E4M3
  EXPECT_EQ(e5m2_to_float(0x7B), 57344.0f);
  EXPECT_EQ(e5m2_to_float(0x3C), 1.0f);
  EXPECT_EQ(e5m2_to_float(0x04), std::ldexp(1.0f, -14));
  EXPECT_EQ(e5m2_to_float(0x01), std::ldexp(1.0f, -16));
  EXPECT_EQ(e5m2_to_float(0x7C), INFINITY);
  EXPECT_EQ(e5m2_to_float(0xFC), -INFINITY);
  EXPECT_EQ(fp16_bits_to_float(0x7BFF), 65504.0f);
  EXPECT_EQ(fp16_bits_to_float(0x3C00), 1.0f);
  EXPECT_EQ(fp16_bits_to_float(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(bf16_bits_to_float(0x3F80), 1.0f);
  EXPECT_EQ(bf16_bits_to_float(0x7F7F), from_bits(0x7F7F0000));
  EXPECT_EQ(kE4M3Max, 448.0f);
  EXPECT_EQ(kE5M2Max, 57344.0f);
  EXPECT_EQ(float_to_e4m3(1.0f), 0x38);
  EXPECT_EQ(float_to_e5m2(-1.0f), 0xBC);
  EXPECT_EQ(float_to_fp16_bits(-2.0f), 0xC000);
  EXPECT_EQ(float_to_bf16_bits(1.0f), 0x3F80);
}

// ---- Round to nearest, ties to even ----------------------------------------------------

// For each pair of adjacent finite codes: the exact midpoint rounds to the even code, the
// float just above it to the upper code, the float just below it to the lower code.
TEST(NumericFormats, MidpointsRoundToEvenAndNeighboursToNearest) {
  for (const FormatSpec& f : all_formats()) {
    const CodeTable t = positive_finite_codes(f);
    int ties = 0;
    for (size_t i = 0; i + 1 < t.entries.size(); ++i) {
      const auto [v0, c0] = t.entries[i];
      const auto [v1, c1] = t.entries[i + 1];
      const double mid_d = 0.5 * (v0 + v1);
      const float mid = static_cast<float>(mid_d);
      ASSERT_EQ(static_cast<double>(mid), mid_d) << f.name << ": midpoint must be exact in float";
      const uint32_t even = (c0 & 1u) == 0 ? c0 : c1;
      ASSERT_NE(c0 & 1u, c1 & 1u) << f.name << ": adjacent codes have different parity";
      for (uint32_t s : {0u, sign_bit(f)}) {
        const float sgn = s ? -1.0f : 1.0f;
        ASSERT_EQ(f.encode(sgn * mid), s | even) << f.name << " tie " << mid << " between " << hex(c0) << " and " << hex(c1);
        ASSERT_EQ(f.encode(sgn * std::nextafter(mid, INFINITY)), s | c1) << f.name << " above tie " << mid;
        ASSERT_EQ(f.encode(sgn * std::nextafter(mid, 0.0f)), s | c0) << f.name << " below tie " << mid;
      }
      ++ties;
    }
    EXPECT_GT(ties, 100) << f.name;
  }
}

// Halfway between the largest finite value and the next power of two.
TEST(NumericFormats, OverflowThresholds) {
  // FP16: 65504 is the largest finite, 65520 the midpoint to 65536, which ties to Inf (even).
  EXPECT_EQ(float_to_fp16_bits(65504.0f), 0x7BFF);
  EXPECT_EQ(float_to_fp16_bits(65519.0f), 0x7BFF);
  EXPECT_EQ(float_to_fp16_bits(std::nextafter(65520.0f, 0.0f)), 0x7BFF);
  EXPECT_EQ(float_to_fp16_bits(65520.0f), 0x7C00);
  EXPECT_EQ(float_to_fp16_bits(-65520.0f), 0xFC00);
  EXPECT_EQ(float_to_fp16_bits(1e6f), 0x7C00);
  EXPECT_EQ(float_to_fp16_bits(FLT_MAX), 0x7C00);
  EXPECT_EQ(float_to_fp16_bits(INFINITY), 0x7C00);
  EXPECT_EQ(float_to_fp16_bits(-INFINITY), 0xFC00);
  // BF16: max 0x7F7F; 0x7F7F8000 is halfway to 2^128 and ties to Inf.
  EXPECT_EQ(float_to_bf16_bits(from_bits(0x7F7F7FFF)), 0x7F7F);
  EXPECT_EQ(float_to_bf16_bits(from_bits(0x7F7F8000)), 0x7F80);
  EXPECT_EQ(float_to_bf16_bits(FLT_MAX), 0x7F80);
  EXPECT_EQ(float_to_bf16_bits(-FLT_MAX), 0xFF80);
  EXPECT_EQ(float_to_bf16_bits(INFINITY), 0x7F80);
  EXPECT_EQ(float_to_bf16_bits(-INFINITY), 0xFF80);
}

TEST(NumericFormats, Fp8SaturatesIncludingInfinity) {
  for (float big : {448.0f, 449.0f, 464.0f, 465.0f, 480.0f, 512.0f, 1e6f, FLT_MAX, INFINITY}) {
    EXPECT_EQ(float_to_e4m3(big), 0x7E) << big;
    EXPECT_EQ(float_to_e4m3(-big), 0xFE) << big;
  }
  for (float big : {57344.0f, 60000.0f, 61440.0f, 65536.0f, 1e9f, FLT_MAX, INFINITY}) {
    EXPECT_EQ(float_to_e5m2(big), 0x7B) << big;
    EXPECT_EQ(float_to_e5m2(-big), 0xFB) << big;
  }
  // Just below the top: ordinary rounding. E4M3 416 = 0x7D, 432 ties between 416 (odd 0x7D)
  // and 448 (even 0x7E).
  EXPECT_EQ(float_to_e4m3(416.0f), 0x7D);
  EXPECT_EQ(float_to_e4m3(432.0f), 0x7E);
  EXPECT_EQ(float_to_e4m3(431.0f), 0x7D);
  // E5M2 49152 = 0x7A, 53248 ties between 0x7A (even) and 0x7B.
  EXPECT_EQ(float_to_e5m2(53248.0f), 0x7A);
  EXPECT_EQ(float_to_e5m2(53249.0f), 0x7B);
}

TEST(NumericFormats, NanStaysNanWithItsSign) {
  const std::vector<uint32_t> nan_bits = {0x7FC00000u, 0x7F800001u, 0x7FBFFFFFu, 0x7FFFFFFFu, 0x7F810000u};
  for (const FormatSpec& f : all_formats()) {
    for (uint32_t bits : nan_bits) {
      for (uint32_t s : {0u, 0x80000000u}) {
        const float x = from_bits(bits | s);
        ASSERT_TRUE(std::isnan(x));
        const uint32_t code = f.encode(x);
        EXPECT_TRUE(is_nan_code(code, f)) << f.name << " float bits " << hex(bits | s) << " -> " << hex(code);
        EXPECT_EQ((code & sign_bit(f)) != 0, s != 0) << f.name << " float bits " << hex(bits | s);
        EXPECT_TRUE(std::isnan(f.decode(code))) << f.name;
      }
    }
  }
  EXPECT_EQ(float_to_e4m3(NAN), 0x7F);
  EXPECT_EQ(float_to_e4m3(-NAN), 0xFF);
}

// ---- Subnormals ---------------------------------------------------------------------

TEST(NumericFormats, Subnormals) {
  // E4M3: quantum 2^-9, smallest normal 2^-6 (0x08).
  const float q4 = std::ldexp(1.0f, -9);
  EXPECT_EQ(float_to_e4m3(q4), 0x01);
  EXPECT_EQ(float_to_e4m3(0.5f * q4), 0x00);                              // tie with zero -> even (0)
  EXPECT_EQ(float_to_e4m3(-0.5f * q4), 0x80);                             // negative zero
  EXPECT_EQ(float_to_e4m3(std::nextafter(0.5f * q4, 1.0f)), 0x01);        // just above the tie
  EXPECT_EQ(float_to_e4m3(1.5f * q4), 0x02);                              // tie 1|2 -> 2
  EXPECT_EQ(float_to_e4m3(2.5f * q4), 0x02);                              // tie 2|3 -> 2
  EXPECT_EQ(float_to_e4m3(7.0f * q4), 0x07);                              // largest subnormal
  EXPECT_EQ(float_to_e4m3(7.5f * q4), 0x08);                              // tie 7|8 -> smallest normal
  EXPECT_EQ(float_to_e4m3(std::nextafter(7.5f * q4, 0.0f)), 0x07);
  EXPECT_EQ(float_to_e4m3(1e-30f), 0x00);
  EXPECT_EQ(float_to_e4m3(from_bits(1)), 0x00);                           // float subnormal
  // E5M2: quantum 2^-16.
  const float q5 = std::ldexp(1.0f, -16);
  EXPECT_EQ(float_to_e5m2(q5), 0x01);
  EXPECT_EQ(float_to_e5m2(0.5f * q5), 0x00);
  EXPECT_EQ(float_to_e5m2(0.75f * q5), 0x01);
  EXPECT_EQ(float_to_e5m2(3.5f * q5), 0x04);                              // tie 3|4 -> smallest normal
  EXPECT_EQ(e5m2_to_float(0x03), 3.0f * q5);
  // FP16: quantum 2^-24, smallest normal 2^-14.
  const float q16 = std::ldexp(1.0f, -24);
  EXPECT_EQ(float_to_fp16_bits(q16), 0x0001);
  EXPECT_EQ(float_to_fp16_bits(0.5f * q16), 0x0000);
  EXPECT_EQ(float_to_fp16_bits(-0.5f * q16), 0x8000);
  EXPECT_EQ(float_to_fp16_bits(std::nextafter(0.5f * q16, 1.0f)), 0x0001);
  EXPECT_EQ(float_to_fp16_bits(1023.5f * q16), 0x0400);
  EXPECT_EQ(float_to_fp16_bits(1022.5f * q16), 0x03FE);
  EXPECT_EQ(float_to_fp16_bits(from_bits(1)), 0x0000);
  // BF16 shares FP32's exponent range, so float subnormals map onto BF16 subnormals.
  EXPECT_EQ(float_to_bf16_bits(from_bits(0x00010000)), 0x0001);
  EXPECT_EQ(float_to_bf16_bits(from_bits(0x00008000)), 0x0000);  // tie -> 0
  EXPECT_EQ(float_to_bf16_bits(from_bits(0x00018000)), 0x0002);  // tie 1|2 -> 2
  EXPECT_EQ(float_to_bf16_bits(from_bits(0x00008001)), 0x0001);
  EXPECT_EQ(bf16_bits_to_float(0x0001), from_bits(0x00010000));
  // Zeros keep their sign.
  for (const FormatSpec& f : all_formats()) {
    EXPECT_EQ(f.encode(0.0f), 0u) << f.name;
    EXPECT_EQ(f.encode(-0.0f), sign_bit(f)) << f.name;
  }
}

// ---- Random floats against the nearest-value search ---------------------------------

// Random floats whose exponents span the format's subnormals to past its largest value.
// Half of them have their low mantissa bits cleared so that exact ties come up often.
std::vector<float> random_floats(const FormatSpec& f, int count, uint32_t seed) {
  std::mt19937 rng(seed);
  const int bias = (1 << (f.exponent_bits - 1)) - 1;
  const int lo = std::max(-149, 1 - bias - f.mantissa_bits - 3);
  const int hi = std::min(127, bias + 3);
  std::uniform_int_distribution<int> exp_dist(lo, hi);
  std::vector<float> out;
  out.reserve(count);
  for (int i = 0; i < count; ++i) {
    const uint32_t r = rng();
    float m = 1.0f + static_cast<float>(r & 0x7FFFFF) / 8388608.0f;
    if (i % 2) m = 1.0f + static_cast<float>(r & 0x7FFFFF & ~((1u << (22 - f.mantissa_bits)) - 1)) / 8388608.0f;
    float x = std::ldexp(m, exp_dist(rng));
    if (rng() & 1u) x = -x;
    out.push_back(x);
  }
  return out;
}

TEST(NumericFormats, RandomFloatsMatchNearestCodeSearch) {
  for (const FormatSpec& f : all_formats()) {
    const CodeTable t = positive_finite_codes(f);
    const bool small = f.total_bits() == 8;
    const std::vector<float> xs = random_floats(f, small ? 50000 : 200000, 1234 + f.mantissa_bits);
    std::vector<double> values(f.num_codes());
    for (uint32_t c = 0; c < f.num_codes(); ++c) values[c] = reference_decode(c, f);
    int mismatches = 0;
    for (float x : xs) {
      const uint32_t want = small ? linear_search_encode(x, f, values) : brute_force_encode(x, f, t);
      if (small) {
        ASSERT_EQ(want, brute_force_encode(x, f, t)) << "the two searches disagree on " << x;
      }
      const uint32_t got = f.encode(x);
      if (got != want && ++mismatches <= 10) {
        ADD_FAILURE() << f.name << ": " << x << " (bits " << hex(float_bits(x)) << ") encoded " << hex(got)
                      << ", nearest code " << hex(want);
      }
    }
    EXPECT_EQ(mismatches, 0) << f.name;
  }
}

// The BF16 search over the full float range, including huge and tiny magnitudes.
TEST(NumericFormats, Bf16RandomBitPatterns) {
  const FormatSpec f = all_formats()[3];
  const CodeTable t = positive_finite_codes(f);
  std::mt19937 rng(99);
  for (int i = 0; i < 300000; ++i) {
    const float x = from_bits(rng());
    if (std::isnan(x)) continue;
    ASSERT_EQ(float_to_bf16_bits(x), brute_force_encode(x, f, t)) << "bits " << hex(float_bits(x));
  }
}

// ---- E8M0 --------------------------------------------------------------------------

TEST(NumericE8M0, CodesArePowersOfTwo) {
  for (int c = 0; c < 255; ++c) {
    EXPECT_EQ(static_cast<double>(e8m0_to_float(static_cast<uint8_t>(c))), std::ldexp(1.0, c - 127)) << c;
    EXPECT_EQ(e8m0{static_cast<uint8_t>(c)}.to_float(), e8m0_to_float(static_cast<uint8_t>(c)));
  }
  EXPECT_TRUE(std::isnan(e8m0_to_float(0xFF)));
  EXPECT_EQ(e8m0_to_float(127), 1.0f);
  EXPECT_EQ(e8m0_to_float(0), std::ldexp(1.0f, -127));  // a float subnormal, kept exactly
  EXPECT_EQ(e8m0_to_float(254), std::ldexp(1.0f, 127));
}

TEST(NumericE8M0, FromExponentClamps) {
  EXPECT_EQ(e8m0_from_exponent(0), 127);
  EXPECT_EQ(e8m0_from_exponent(-127), 0);
  EXPECT_EQ(e8m0_from_exponent(127), 254);
  EXPECT_EQ(e8m0_from_exponent(-128), 0);
  EXPECT_EQ(e8m0_from_exponent(-1000), 0);
  EXPECT_EQ(e8m0_from_exponent(128), 254);  // never the NaN code
  EXPECT_EQ(e8m0_from_exponent(1000), 254);
}

TEST(NumericE8M0, FloorRounding) {
  EXPECT_EQ(float_to_e8m0_floor(1.0f), 127);
  EXPECT_EQ(float_to_e8m0_floor(std::nextafter(2.0f, 0.0f)), 127);
  EXPECT_EQ(float_to_e8m0_floor(2.0f), 128);
  EXPECT_EQ(float_to_e8m0_floor(0.75f), 126);
  EXPECT_EQ(float_to_e8m0_floor(448.0f), 127 + 8);
  EXPECT_EQ(float_to_e8m0_floor(FLT_MAX), 254);
  EXPECT_EQ(float_to_e8m0_floor(std::ldexp(1.0f, -127)), 0);
  EXPECT_EQ(float_to_e8m0_floor(std::ldexp(1.0f, -126)), 1);
  EXPECT_EQ(float_to_e8m0_floor(std::ldexp(1.0f, -140)), 0);  // below the range: clamps to 2^-127
  EXPECT_EQ(float_to_e8m0_floor(from_bits(1)), 0);
  EXPECT_EQ(float_to_e8m0_floor(0.0f), 0);
  EXPECT_EQ(float_to_e8m0_floor(-0.0f), 0);
  EXPECT_EQ(float_to_e8m0_floor(-1.0f), 0xFF);
  EXPECT_EQ(float_to_e8m0_floor(NAN), 0xFF);
  EXPECT_EQ(float_to_e8m0_floor(INFINITY), 0xFF);
  EXPECT_EQ(float_to_e8m0_floor(-INFINITY), 0xFF);
  // Every power of two and every value inside [2^k, 2^(k+1)) floors to code k + 127.
  std::mt19937 rng(7);
  for (int c = 0; c < 255; ++c) {
    const float p = e8m0_to_float(static_cast<uint8_t>(c));
    EXPECT_EQ(float_to_e8m0_floor(p), c);
    const float inside = p * (1.0f + static_cast<float>(rng() % 1000) / 1000.0f);
    EXPECT_EQ(float_to_e8m0_floor(inside), c) << inside;
    EXPECT_EQ(float_to_e8m0_floor(std::nextafter(2.0f * p, 0.0f)), c);
  }
}

// ---- FP8 recipe helpers ---------------------------------------------------------------

TEST(NumericScaling, Fp8ScaleForAmax) {
  EXPECT_EQ(fp8_scale_for_amax(1.0f, kE4M3Max, 0.0f, false), 448.0f);
  EXPECT_EQ(fp8_scale_for_amax(2.0f, kE4M3Max, 1.0f, false), 112.0f);
  EXPECT_EQ(fp8_scale_for_amax(2.0f, kE4M3Max, -1.0f, false), 448.0f);
  EXPECT_EQ(fp8_scale_for_amax(3.0f, kE5M2Max, 0.0f, false), 57344.0f / 3.0f);
  EXPECT_EQ(fp8_scale_for_amax(3.0f, kE5M2Max, 0.0f, true), 16384.0f);
  EXPECT_EQ(fp8_scale_for_amax(0.0f, kE4M3Max, 0.0f, true), 1.0f);
  EXPECT_EQ(fp8_scale_for_amax(-0.0f, kE4M3Max, 0.0f, false), 1.0f);
  EXPECT_EQ(fp8_scale_for_amax(NAN, kE4M3Max, 0.0f, false), 1.0f);
  EXPECT_EQ(fp8_scale_for_amax(INFINITY, kE4M3Max, 0.0f, false), 1.0f);
  EXPECT_EQ(fp8_scale_for_amax(from_bits(1), kE4M3Max, 0.0f, false), FLT_MAX);
  EXPECT_EQ(fp8_scale_for_amax(from_bits(1), kE4M3Max, 0.0f, true), std::ldexp(1.0f, 127));
  EXPECT_EQ(fp8_scale_for_amax(FLT_MAX, kE4M3Max, 0.0f, false), 448.0f / FLT_MAX);
  // Power-of-two scales are the largest power of two not above the exact scale.
  std::mt19937 rng(3);
  for (int i = 0; i < 10000; ++i) {
    const float amax = std::ldexp(1.0f + static_cast<float>(rng() % 100000) / 100000.0f, static_cast<int>(rng() % 200) - 100);
    const float exact = fp8_scale_for_amax(amax, kE4M3Max, 0.0f, false);
    const float p = fp8_scale_for_amax(amax, kE4M3Max, 0.0f, true);
    ASSERT_EQ(exact, kE4M3Max / amax);
    ASSERT_EQ(static_cast<double>(p), std::exp2(std::floor(std::log2(static_cast<double>(exact))))) << amax;
  }
}

TEST(NumericScaling, MxScaleCodeForAmax) {
  EXPECT_EQ(mx_scale_code_for_amax(1.0f, 8), 127 - 8);
  EXPECT_EQ(mx_scale_code_for_amax(448.0f, 8), 127);
  EXPECT_EQ(mx_scale_code_for_amax(511.0f, 8), 127);
  EXPECT_EQ(mx_scale_code_for_amax(512.0f, 8), 128);
  EXPECT_EQ(mx_scale_code_for_amax(57344.0f, 15), 127);
  EXPECT_EQ(mx_scale_code_for_amax(0.0f, 8), 0);
  EXPECT_EQ(mx_scale_code_for_amax(from_bits(1), 8), 0);  // 2^-149 - 8 clamps to -127
  EXPECT_EQ(mx_scale_code_for_amax(FLT_MAX, 8), 127 + 127 - 8);
  EXPECT_EQ(mx_scale_code_for_amax(FLT_MAX, -10), 254);   // clamps at 2^127
  EXPECT_EQ(mx_scale_code_for_amax(NAN, 8), 0xFF);
  EXPECT_EQ(mx_scale_code_for_amax(INFINITY, 8), 0xFF);
  std::mt19937 rng(4);
  for (int i = 0; i < 10000; ++i) {
    const float amax = from_bits(rng() & 0x7FFFFFFFu);
    if (!std::isfinite(amax) || amax == 0.0f) continue;
    const int want = std::clamp(static_cast<int>(std::floor(std::log2(static_cast<double>(amax)))) - 8, -127, 127);
    ASSERT_EQ(mx_scale_code_for_amax(amax, 8), want + 127) << amax;
  }
}

// ---- The value types ----------------------------------------------------------------

TEST(NumericFormats, ValueTypesWrapTheConversions) {
  EXPECT_EQ(bf16::from_float(3.0f).bits, float_to_bf16_bits(3.0f));
  EXPECT_EQ(bf16::from_float(3.0f).to_float(), 3.0f);
  EXPECT_EQ(fp16::from_float(-0.1f).bits, float_to_fp16_bits(-0.1f));
  EXPECT_EQ(fp16{0x3C00}.to_float(), 1.0f);
  EXPECT_EQ(fp8_e4m3::from_float(1000.0f).bits, 0x7E);
  EXPECT_EQ(fp8_e4m3{0x38}.to_float(), 1.0f);
  EXPECT_EQ(fp8_e5m2::from_float(-1e9f).bits, 0xFB);
  EXPECT_EQ(fp8_e5m2{0x3C}.to_float(), 1.0f);
  static_assert(sizeof(bf16) == 2 && sizeof(fp16) == 2 && sizeof(fp8_e4m3) == 1 && sizeof(fp8_e5m2) == 1 &&
                sizeof(e8m0) == 1);
}
