// Scalar number formats: BF16, FP16, FP8 E4M3 / E5M2 and the E8M0 scale type.
//
// One implementation serves the CPU reference and the CUDA kernels (every function is
// __host__ __device__ under nvcc), so both backends round identically. All conversions
// from float round to nearest, ties to even. NaN stays NaN. FP16 and BF16 overflow to
// infinity as IEEE says; the FP8 conversions saturate to the largest finite value
// (E4M3 448, E5M2 57344), infinities included, which is what FP8 training recipes want
// (the "satfinite" mode of the hardware conversions).
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define TESSERA_HD __host__ __device__ __forceinline__
#else
#define TESSERA_HD inline
#endif

namespace tessera {

TESSERA_HD uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
#endif
}

TESSERA_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, 4);
  return x;
#endif
}

// ---- BF16: the upper half of an FP32 ----------------------------------------------------

// The portable rounding, the reference for every backend.
TESSERA_HD uint16_t float_to_bf16_bits_portable(float x) {
  uint32_t u = float_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even; overflow carries into infinity
  return static_cast<uint16_t>(u >> 16);
}

// On sm_80+ the hardware conversion (cvt.rn: nearest even, overflow to infinity, subnormals
// kept) replaces the portable form's ~7 integer instructions a value: the same bits for every
// non-NaN input; a NaN is re-encoded the portable way (sign and payload kept, quieted)
// instead of the hardware's canonical NaN, so both backends agree bit for bit.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define TESSERA_HW_BF16 1
#endif

TESSERA_HD uint16_t float_to_bf16_bits(float x) {
#if defined(TESSERA_HW_BF16)
  uint16_t r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
  return x != x ? static_cast<uint16_t>((float_bits(x) >> 16) | 0x0040u) : r;
#else
  return float_to_bf16_bits_portable(x);
#endif
}

// v[0..N) (N even) as N / 2 BF16 pairs, element 2k in the low half of w[k] (little-endian
// storage order), each as float_to_bf16_bits gives it. On the GPU: one conversion
// instruction a pair and a single NaN test (one branch) for all N, the portable code only
// when a NaN is present.
template <int N>
TESSERA_HD void floats_to_bf16_pairs(const float* v, uint32_t* w) {
  static_assert(N % 2 == 0, "pairs");
#if defined(TESSERA_HW_BF16)
  uint32_t nan = 0;
#pragma unroll
  for (int k = 0; k < N / 2; ++k) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w[k]) : "f"(v[2 * k + 1]), "f"(v[2 * k]));  // 1st -> upper half
    uint32_t n;  // setp.nan tests both operands: one instruction a pair (x != x takes one a value)
    asm("{ .reg .pred p; setp.nan.f32 p, %1, %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(n)
        : "f"(v[2 * k]), "f"(v[2 * k + 1]));
    nan |= n;
  }
  if (nan == 0) return;
#endif
  for (int k = 0; k < N / 2; ++k)
    w[k] = static_cast<uint32_t>(float_to_bf16_bits_portable(v[2 * k])) |
           (static_cast<uint32_t>(float_to_bf16_bits_portable(v[2 * k + 1])) << 16);
}

TESSERA_HD float bf16_bits_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

// ---- Small floats with a sign bit, E exponent bits and M mantissa bits --------------------
//
// A format is described by its bit counts and how its top exponent is used:
//  - IEEE-like (FP16, E5M2): top exponent = Inf (mantissa 0) or NaN;
//  - "fn" (E4M3): no infinities, only the all-ones code is NaN, so the top exponent still
//    holds finite values up to 448.
struct SmallFloatFormat {
  int exponent_bits;
  int mantissa_bits;
  bool has_infinity;   // IEEE top exponent (E5M2, FP16); false for E4M3's "fn" layout
  bool saturate;       // clamp to the largest finite value instead of overflowing
};

constexpr SmallFloatFormat kFormatE4M3{4, 3, false, true};
constexpr SmallFloatFormat kFormatE5M2{5, 2, true, true};
constexpr SmallFloatFormat kFormatFP16{5, 10, true, false};

TESSERA_HD int small_float_bias(SmallFloatFormat f) { return (1 << (f.exponent_bits - 1)) - 1; }

// Largest finite code without the sign bit.
TESSERA_HD uint32_t small_float_max_code(SmallFloatFormat f) {
  const uint32_t all_ones_exp = (1u << f.exponent_bits) - 1u;
  const uint32_t mant_mask = (1u << f.mantissa_bits) - 1u;
  if (f.has_infinity) return ((all_ones_exp - 1u) << f.mantissa_bits) | mant_mask;
  return (all_ones_exp << f.mantissa_bits) | (mant_mask - 1u);  // all-ones is NaN
}

TESSERA_HD uint32_t small_float_nan_code(SmallFloatFormat f) {
  const uint32_t all_ones_exp = (1u << f.exponent_bits) - 1u;
  const uint32_t mant_mask = (1u << f.mantissa_bits) - 1u;
  if (f.has_infinity) return (all_ones_exp << f.mantissa_bits) | (1u << (f.mantissa_bits - 1));
  return (all_ones_exp << f.mantissa_bits) | mant_mask;
}

TESSERA_HD float small_float_decode(uint32_t code, SmallFloatFormat f) {
  const int m = f.mantissa_bits;
  const uint32_t sign = (code >> (f.exponent_bits + m)) & 1u;
  const uint32_t exp_field = (code >> m) & ((1u << f.exponent_bits) - 1u);
  const uint32_t mant = code & ((1u << m) - 1u);
  const uint32_t all_ones_exp = (1u << f.exponent_bits) - 1u;
  float value;
  if (f.has_infinity && exp_field == all_ones_exp) {
    value = mant == 0 ? INFINITY : NAN;
  } else if (!f.has_infinity && exp_field == all_ones_exp && mant == (1u << m) - 1u) {
    value = NAN;
  } else if (exp_field == 0) {
    value = ldexpf(static_cast<float>(mant), 1 - small_float_bias(f) - m);
  } else {
    value = ldexpf(static_cast<float>(mant | (1u << m)), static_cast<int>(exp_field) - small_float_bias(f) - m);
  }
  return sign ? -value : value;
}

TESSERA_HD uint32_t small_float_encode(float x, SmallFloatFormat f) {
  const int m = f.mantissa_bits;
  const uint32_t sign = (float_bits(x) >> 31) << (f.exponent_bits + m);
  if (x != x) return sign | small_float_nan_code(f);
  const float a = fabsf(x);
  const uint32_t max_code = small_float_max_code(f);
  const float max_value = small_float_decode(max_code, f);
  const uint32_t inf_code = ((1u << f.exponent_bits) - 1u) << m;
  if (a == INFINITY) return sign | (f.saturate || !f.has_infinity ? max_code : inf_code);

  const int bias = small_float_bias(f);
  const int min_normal_exp = 1 - bias;
  int e;
  frexpf(a, &e);
  e -= 1;  // a = 1.xxx * 2^e
  uint32_t code;
  if (a == 0.0f || e < min_normal_exp) {
    // Subnormal range: a fixed quantum of 2^(min_normal_exp - m). Scaling by a power of two
    // is exact, rintf rounds to nearest even; q == 2^m lands exactly on the smallest normal.
    const float q = rintf(ldexpf(a, m - min_normal_exp));
    code = static_cast<uint32_t>(q);
  } else {
    float q = rintf(ldexpf(a, m - e));  // in [2^m, 2^(m+1)]
    if (q >= static_cast<float>(1u << (m + 1))) {
      q = static_cast<float>(1u << m);
      e += 1;
    }
    const int exp_field = e + bias;
    code = (static_cast<uint32_t>(exp_field) << m) | (static_cast<uint32_t>(q) - (1u << m));
  }
  // Anything past the largest finite value (including E4M3's NaN slot) saturates or overflows.
  if (code > max_code || small_float_decode(code, f) > max_value) {
    code = (f.saturate || !f.has_infinity) ? max_code : inf_code;
  }
  return sign | code;
}

// ---- Named formats -----------------------------------------------------------------------

TESSERA_HD uint8_t float_to_e4m3(float x) { return static_cast<uint8_t>(small_float_encode(x, kFormatE4M3)); }
TESSERA_HD float e4m3_to_float(uint8_t c) { return small_float_decode(c, kFormatE4M3); }
TESSERA_HD uint8_t float_to_e5m2(float x) { return static_cast<uint8_t>(small_float_encode(x, kFormatE5M2)); }
TESSERA_HD float e5m2_to_float(uint8_t c) { return small_float_decode(c, kFormatE5M2); }
TESSERA_HD uint16_t float_to_fp16_bits(float x) { return static_cast<uint16_t>(small_float_encode(x, kFormatFP16)); }
TESSERA_HD float fp16_bits_to_float(uint16_t c) { return small_float_decode(c, kFormatFP16); }

constexpr float kE4M3Max = 448.0f;
constexpr float kE5M2Max = 57344.0f;

// E8M0: an unsigned power of two 2^(code-127); code 255 is NaN. Used for MXFP8 block scales.
TESSERA_HD float e8m0_to_float(uint8_t code) {
  if (code == 0xff) return NAN;
  return ldexpf(1.0f, static_cast<int>(code) - 127);
}

// The E8M0 code of 2^exponent, clamped to the representable range [-127, 127].
TESSERA_HD uint8_t e8m0_from_exponent(int exponent) {
  if (exponent < -127) exponent = -127;
  if (exponent > 127) exponent = 127;
  return static_cast<uint8_t>(exponent + 127);
}

// Rounds a positive float down to a power of two (the exponent of its leading bit) and
// returns its E8M0 code, clamped to [2^-127, 2^127]. Zero gives 2^-127 (code 0); NaN,
// infinities and negative inputs give the NaN code 0xff (E8M0 has no infinity or sign).
TESSERA_HD uint8_t float_to_e8m0_floor(float x) {
  if (x != x || x < 0.0f || x == INFINITY) return 0xff;
  if (x == 0.0f) return 0;
  int e;
  frexpf(x, &e);
  return e8m0_from_exponent(e - 1);
}

// ---- FP8 scaling recipes: the scalar rules shared by the CPU reference and the kernels ----

// The scale that maps a tensor (or block) with max |x| = amax onto the FP8 range:
//   scale = fp8_max / amax / 2^margin            (Transformer Engine's formula)
// Zero, negative, NaN or infinite amax gives 1. A scale that overflows float (tiny amax)
// becomes FLT_MAX. power_of_two rounds the scale down to a power of two by dropping its
// mantissa bits, so that scaling and unscaling are exact. Bit-exact across backends when
// margin is an integer (exp2f of an integer is exact).
TESSERA_HD float fp8_scale_for_amax(float amax, float fp8_max, float margin, bool power_of_two) {
  if (!(amax > 0.0f) || amax == INFINITY) return 1.0f;
  float scale = fp8_max / amax;
  if (margin != 0.0f) scale = scale / exp2f(margin);
  if (scale == INFINITY) scale = FLT_MAX;
  if (power_of_two) scale = bits_float(float_bits(scale) & 0xff800000u);
  return scale;
}

// OCP Microscaling (MX) shared block exponent: floor(log2(amax)) - emax_elem, where
// emax_elem is the exponent of the element format's largest normal value (8 for E4M3,
// 15 for E5M2), clamped to E8M0's [-127, 127]. Returns the E8M0 code. An all-zero block
// gets code 0 (2^-127, the clamp of log2(0) = -inf); NaN or infinite amax gives the NaN
// code 0xff, which makes the whole block decode to NaN.
TESSERA_HD uint8_t mx_scale_code_for_amax(float amax, int emax_elem) {
  if (!(amax <= FLT_MAX)) return 0xff;
  if (amax <= 0.0f) return 0;
  int e;
  frexpf(amax, &e);
  return e8m0_from_exponent(e - 1 - emax_elem);
}

// ---- Little value types, so that containers and kernels can name the formats -------------

struct bf16 {
  uint16_t bits;
  TESSERA_HD static bf16 from_float(float x) { return bf16{float_to_bf16_bits(x)}; }
  TESSERA_HD float to_float() const { return bf16_bits_to_float(bits); }
};
struct fp16 {
  uint16_t bits;
  TESSERA_HD static fp16 from_float(float x) { return fp16{float_to_fp16_bits(x)}; }
  TESSERA_HD float to_float() const { return fp16_bits_to_float(bits); }
};
struct fp8_e4m3 {
  uint8_t bits;
  TESSERA_HD static fp8_e4m3 from_float(float x) { return fp8_e4m3{float_to_e4m3(x)}; }
  TESSERA_HD float to_float() const { return e4m3_to_float(bits); }
};
struct fp8_e5m2 {
  uint8_t bits;
  TESSERA_HD static fp8_e5m2 from_float(float x) { return fp8_e5m2{float_to_e5m2(x)}; }
  TESSERA_HD float to_float() const { return e5m2_to_float(bits); }
};
struct e8m0 {
  uint8_t bits;
  TESSERA_HD float to_float() const { return e8m0_to_float(bits); }
};

}  // namespace tessera
