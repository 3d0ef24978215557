// Shared by the quantization tests: raw FP8 codes, wide-range random data, and the
// reference recipes written from their definitions (double-precision log2 and powers of
// two rather than the library's bit manipulation).
#pragma once

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <string>
#include <vector>

#include "tessera/core/numeric.h"
#include "tessera/ops/quantize.h"
#include "testing.h"

namespace tessera::testing {

inline std::vector<uint8_t> codes_of(const Tensor& t) {
  const uint8_t* p = t.data<uint8_t>();
  return std::vector<uint8_t>(p, p + t.numel());
}

inline uint8_t encode(float v, DType fp8) { return fp8 == DType::E4M3 ? float_to_e4m3(v) : float_to_e5m2(v); }

inline Tensor scalar(float v) { return Tensor::from_floats({v}, {1}); }

// Values spanning many binades, so that blocks get very different scales: row r is
// uniform(-1, 1) times 2^((r * 7 + c / 37) % 25 - 12).
inline Tensor wide_range_tensor(int64_t rows, int64_t cols, uint64_t seed, DType dtype = DType::F32) {
  const std::vector<float> u = random_tensor({rows, cols}, DType::F32, seed).to_floats();
  std::vector<float> v(u.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      v[r * cols + c] = std::ldexp(u[r * cols + c], static_cast<int>((r * 7 + c / 37) % 25) - 12);
  return Tensor::from_floats(v, {rows, cols}, dtype);
}

// ---- Reference recipes, from the definitions ------------------------------------------

struct BlockReference {
  std::vector<uint8_t> codes;
  std::vector<float> scale_inv;
};

inline float reference_scale(double amax, DType fp8, bool power_of_two) {
  if (!(amax > 0) || std::isinf(amax) || std::isnan(amax)) return 1.0f;
  float scale = static_cast<float>(fp8 == DType::E4M3 ? 448.0 : 57344.0) / static_cast<float>(amax);
  if (std::isinf(scale)) scale = FLT_MAX;
  if (power_of_two) scale = static_cast<float>(std::exp2(std::floor(std::log2(static_cast<double>(scale)))));
  return scale;
}

inline BlockReference reference_blockwise(const std::vector<float>& x, int64_t rows, int64_t cols, DType fp8,
                                   const BlockScaling& b) {
  const int64_t grid_rows = (rows + b.block_rows - 1) / b.block_rows;
  const int64_t grid_cols = (cols + b.block_cols - 1) / b.block_cols;
  BlockReference ref{std::vector<uint8_t>(x.size()), std::vector<float>(grid_rows * grid_cols)};
  for (int64_t bi = 0; bi < grid_rows; ++bi) {
    for (int64_t bj = 0; bj < grid_cols; ++bj) {
      double amax = 0;
      bool nan = false;
      for (int64_t r = bi * b.block_rows; r < std::min(rows, (bi + 1) * b.block_rows); ++r)
        for (int64_t c = bj * b.block_cols; c < std::min(cols, (bj + 1) * b.block_cols); ++c) {
          nan |= std::isnan(x[r * cols + c]);
          amax = std::max(amax, std::fabs(static_cast<double>(x[r * cols + c])));
        }
      const float scale = reference_scale(nan ? NAN : amax, fp8, b.power_of_two_scales);
      ref.scale_inv[bi * grid_cols + bj] = 1.0f / scale;
      for (int64_t r = bi * b.block_rows; r < std::min(rows, (bi + 1) * b.block_rows); ++r)
        for (int64_t c = bj * b.block_cols; c < std::min(cols, (bj + 1) * b.block_cols); ++c)
          ref.codes[r * cols + c] = encode(x[r * cols + c] * scale, fp8);
    }
  }
  return ref;
}

struct MxReference {
  std::vector<uint8_t> codes;
  std::vector<uint8_t> scales;
};

inline MxReference reference_mxfp8(const std::vector<float>& x, int64_t rows, int64_t cols, DType fp8) {
  const int64_t per_row = (cols + 31) / 32;
  const int emax = fp8 == DType::E4M3 ? 8 : 15;
  MxReference ref{std::vector<uint8_t>(x.size()), std::vector<uint8_t>(rows * per_row)};
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < per_row; ++b) {
      double amax = 0;
      bool bad = false;
      for (int64_t c = b * 32; c < std::min(cols, b * 32 + 32); ++c) {
        bad |= !std::isfinite(x[r * cols + c]);
        amax = std::max(amax, std::fabs(static_cast<double>(x[r * cols + c])));
      }
      int exponent = (amax > 0 && !bad) ? static_cast<int>(std::floor(std::log2(amax))) - emax : -127;
      exponent = std::clamp(exponent, -127, 127);
      ref.scales[r * per_row + b] = bad ? 0xFF : static_cast<uint8_t>(exponent + 127);
      const float multiplier = bad ? 1.0f : static_cast<float>(std::ldexp(1.0, -exponent));
      for (int64_t c = b * 32; c < std::min(cols, b * 32 + 32); ++c)
        ref.codes[r * cols + c] = encode(x[r * cols + c] * multiplier, fp8);
    }
  }
  return ref;
}

// Half an FP8 ulp relative to the value, and half the subnormal quantum in absolute terms.
inline double fp8_half_ulp(DType fp8) { return fp8 == DType::E4M3 ? 0x1p-4 : 0x1p-3; }
inline double fp8_half_quantum(DType fp8) { return fp8 == DType::E4M3 ? 0x1p-10 : 0x1p-17; }

inline const std::vector<std::pair<int64_t, int64_t>> kOddShapes = {{1, 1}, {1, 300}, {3, 130}, {129, 257}, {130, 5}, {2, 128}};


}  // namespace tessera::testing
