// The FP8 quantization family on the GPU (backend/cuda/quantize.cu): the kernels behind
// tessera/ops/quantize.h, bit-identical to the CPU reference (backend/cpu/quantize.cpp).
//
// Also the scalar bit-level helpers the kernels use in place of numeric.h's general
// small-float code (which is exact but slow on a GPU: frexpf, ldexpf, several branches).
// They are plain inline functions here so that the tests can check them against numeric.h
// on the host, where no GPU is needed. This header stays C++17 (nvcc compiles it).
#pragma once

#include <cstdint>

#include "tessera/core/numeric.h"
#include "tessera/core/tensor.h"
#include "tessera/ops/quantize.h"

namespace tessera::cuda {

// ---- What has a kernel ----------------------------------------------------------------------
// Every dtype the CPU reference accepts has a kernel: inputs F64, F32, F16, BF16, E4M3, E5M2;
// dequantized outputs F64, F32, F16, BF16. The *_supported functions say no only for what the
// kernels cannot index: a block (tile) of 2^31 elements or more.
bool quantize_input_supported(DType x);
bool dequantize_output_supported(DType out);
bool blockwise_supported(int64_t rows, int64_t cols, const BlockScaling& blocks);

// ---- Kernels (arguments already checked by src/ops/quantize.cpp; stream is a cudaStream_t) ---
// amax_out is written on the device; nothing synchronises with the host.
void amax(void* stream, const Tensor& x, Tensor& amax_out);
// amax_out may be undefined (no statistic wanted).
void quantize_per_tensor(void* stream, const Tensor& x, const Tensor& scale, Tensor& out, Tensor& amax_out);
void dequantize_per_tensor(void* stream, const Tensor& q, const Tensor& scale_inv, Tensor& out);
void quantize_blockwise(void* stream, const Tensor& x, Tensor& out, Tensor& scale_inv, const BlockScaling& blocks);
void dequantize_blockwise(void* stream, const Tensor& q, const Tensor& scale_inv, Tensor& out,
                          const BlockScaling& blocks);
void quantize_mxfp8(void* stream, const Tensor& x, Tensor& out, Tensor& scales);
void dequantize_mxfp8(void* stream, const Tensor& q, const Tensor& scales, Tensor& out);

// ---- Bit-level scalar helpers (host and device) ---------------------------------------------

// float -> FP8, round to nearest even, saturating, NaN keeps its sign: the same bytes as
// numeric.h's float_to_e4m3 / float_to_e5m2 for every float (the tests check this).
// Normal results round on the float's own bits (add half an FP8 ulp minus one, plus the
// ties-to-even bit, then drop the low mantissa bits); a carry out of the mantissa moves to
// the next exponent by itself, and anything past the largest code saturates. Below the
// smallest FP8 normal the quantum is fixed, so the value is scaled by a power of two
// (exact) and rounded with rintf.
template <int kMantissaBits, int kBias, uint32_t kMaxCode, uint32_t kNanCode>
TESSERA_HD uint8_t encode_fp8_bits(float x) {
  const uint32_t u = float_bits(x);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint8_t>(sign | kNanCode);
  uint32_t code;
  if (a >= (static_cast<uint32_t>(128 - kBias) << 23)) {
    constexpr int kShift = 23 - kMantissaBits;
    const uint32_t rounded = a + ((1u << (kShift - 1)) - 1u) + ((a >> kShift) & 1u);
    code = (rounded >> kShift) - (static_cast<uint32_t>(127 - kBias) << kMantissaBits);
    code = code < kMaxCode ? code : kMaxCode;
  } else {
    constexpr float kToQuanta = static_cast<float>(1u << (kMantissaBits - 1 + kBias));
    code = static_cast<uint32_t>(rintf(bits_float(a) * kToQuanta));
  }
  return static_cast<uint8_t>(sign | code);
}

TESSERA_HD uint8_t encode_e4m3_bits(float x) { return encode_fp8_bits<3, 7, 0x7eu, 0x7fu>(x); }
TESSERA_HD uint8_t encode_e5m2_bits(float x) { return encode_fp8_bits<2, 15, 0x7bu, 0x7eu>(x); }

// FP8 -> float, the same bits as numeric.h's e4m3_to_float / e5m2_to_float (NaN included:
// the quiet NaN 0x7fc00000 with the code's sign).
TESSERA_HD float decode_e4m3_bits(uint8_t c) {
  const uint32_t sign = static_cast<uint32_t>(c & 0x80u) << 24;
  const uint32_t mag = c & 0x7fu;
  if (mag == 0x7fu) return bits_float(sign | 0x7fc00000u);
  if (mag < 8u) return bits_float(sign | float_bits(static_cast<float>(mag) * 0x1p-9f));
  return bits_float(sign | ((mag << 20) + (120u << 23)));
}

TESSERA_HD float decode_e5m2_bits(uint8_t c) {
  const uint32_t sign = static_cast<uint32_t>(c & 0x80u) << 24;
  const uint32_t mag = c & 0x7fu;
  if (mag >= 0x7cu) return bits_float(sign | (mag == 0x7cu ? 0x7f800000u : 0x7fc00000u));
  if (mag < 4u) return bits_float(sign | float_bits(static_cast<float>(mag) * 0x1p-16f));
  return bits_float(sign | ((mag << 21) + (112u << 23)));
}

// a * b with the NaN that x86 SSE/AVX produce, which is what the CPU reference computes:
// a NaN operand comes through (quieted, sign and payload kept), and an invalid product
// (0 * Inf) gives the "default NaN" 0xffc00000. A GPU returns the canonical NaN 0x7fffffff
// instead, which would change the sign bit that FP8, BF16 and F16 keep. When both are NaN,
// x86 returns its first source operand, and which one that is depends on the compiler's
// register choice: the GCC 12 build of the reference's `x * scale` loops returns the
// scale's NaN, so the kernels pass the scale as b and b wins. Only NaN products take the
// slow path.
TESSERA_HD float mul_x86_nan(float a, float b) {
  const float p = a * b;
  if (p == p) return p;
  if (b != b) return bits_float(float_bits(b) | 0x00400000u);
  if (a != a) return bits_float(float_bits(a) | 0x00400000u);
  return bits_float(0xffc00000u);
}

}  // namespace tessera::cuda
