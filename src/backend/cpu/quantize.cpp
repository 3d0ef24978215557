// CPU reference of the FP8 quantization recipes: amax, per-tensor scaling, 2-D block
// scaling and MXFP8. Tensors are row-major with the last dimension contiguous; block ops
// take 2-D [rows, cols] tensors and their scale tensors are row-major over the block grid.
//
// Everything is computed in float, whatever the input dtype, because these loops define
// bit for bit what the CUDA kernels produce: an input is upcast (F64 rounded) to float,
// multiplied by a float scale, and rounded to FP8 by numeric.h's saturating conversion.
#include "quantize.h"

#include <algorithm>
#include <cmath>

#include "float_buffer.h"
#include "tessera/core/numeric.h"

namespace tessera::cpu {
namespace {

using Fp8Encoder = uint8_t (*)(float);

Fp8Encoder fp8_encoder(DType t) { return t == DType::E4M3 ? float_to_e4m3 : float_to_e5m2; }

int64_t ceil_div(int64_t a, int64_t b) { return a == 0 ? 0 : 1 + (a - 1) / b; }

// max |x| over one row segment; NaN wins over any number.
struct AmaxAccumulator {
  float max = 0.0f;
  bool nan = false;
  void add(float v) {
    const float a = std::fabs(v);
    if (a != a) nan = true;
    else if (a > max) max = a;
  }
  float value() const { return nan ? NAN : max; }
};

float amax_of(const float* x, int64_t n) {
  float max = 0.0f;
  bool nan = false;
#pragma omp parallel for reduction(max : max) reduction(|| : nan) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    if (a != a) nan = true;
    else max = std::max(max, a);
  }
  return nan ? NAN : max;
}

}  // namespace

void amax(const Tensor& x, Tensor& amax_out) {
  ReadBuffer<float> in(x);
  amax_out.data<float>()[0] = amax_of(in.data(), x.numel());
}

void quantize_per_tensor(const Tensor& x, const Tensor& scale, Tensor& out, Tensor& amax_out) {
  ReadBuffer<float> in(x);
  const float s = scale.data<float>()[0];
  const Fp8Encoder encode = fp8_encoder(out.dtype());
  uint8_t* q = out.data<uint8_t>();
  const int64_t n = x.numel();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) q[i] = encode(in[i] * s);
  if (amax_out.defined()) amax_out.data<float>()[0] = amax_of(in.data(), n);
}

void dequantize_per_tensor(const Tensor& q, const Tensor& scale_inv, Tensor& out) {
  ReadBuffer<float> in(q);
  const float s = scale_inv.data<float>()[0];
  WriteBuffer<float> result(out);
  const int64_t n = q.numel();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) result[i] = in[i] * s;
  result.commit();
}

void quantize_blockwise(const Tensor& x, Tensor& out, Tensor& scale_inv, const BlockScaling& blocks) {
  ReadBuffer<float> in(x);
  const int64_t rows = x.size(0), cols = x.size(1);
  const int64_t block_grid_rows = ceil_div(rows, blocks.block_rows);
  const int64_t block_grid_cols = ceil_div(cols, blocks.block_cols);
  const float max_value = fp8_max(out.dtype());
  const Fp8Encoder encode = fp8_encoder(out.dtype());
  uint8_t* q = out.data<uint8_t>();
  float* inv = scale_inv.data<float>();
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t bi = 0; bi < block_grid_rows; ++bi) {
    for (int64_t bj = 0; bj < block_grid_cols; ++bj) {
      const int64_t r0 = bi * blocks.block_rows, r1 = std::min(rows, r0 + blocks.block_rows);
      const int64_t c0 = bj * blocks.block_cols, c1 = std::min(cols, c0 + blocks.block_cols);
      AmaxAccumulator block_amax;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) block_amax.add(in[r * cols + c]);
      const float scale = fp8_scale_for_amax(block_amax.value(), max_value, 0.0f, blocks.power_of_two_scales);
      inv[bi * block_grid_cols + bj] = 1.0f / scale;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) q[r * cols + c] = encode(in[r * cols + c] * scale);
    }
  }
}

void dequantize_blockwise(const Tensor& q, const Tensor& scale_inv, Tensor& out, const BlockScaling& blocks) {
  ReadBuffer<float> in(q);
  const int64_t rows = q.size(0), cols = q.size(1);
  const int64_t block_grid_cols = ceil_div(cols, blocks.block_cols);
  const float* inv = scale_inv.data<float>();
  WriteBuffer<float> result(out);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float* row_inv = inv + (r / blocks.block_rows) * block_grid_cols;
    for (int64_t c = 0; c < cols; ++c) result[r * cols + c] = in[r * cols + c] * row_inv[c / blocks.block_cols];
  }
  result.commit();
}

void quantize_mxfp8(const Tensor& x, Tensor& out, Tensor& scales) {
  ReadBuffer<float> in(x);
  const int64_t rows = x.size(0), cols = x.size(1);
  const int64_t blocks_per_row = ceil_div(cols, kMxBlockSize);
  const int emax_elem = fp8_max_exponent(out.dtype());
  const Fp8Encoder encode = fp8_encoder(out.dtype());
  uint8_t* q = out.data<uint8_t>();
  uint8_t* codes = scales.data<uint8_t>();
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < blocks_per_row; ++b) {
      const float* xs = in.data() + r * cols;
      const int64_t c0 = b * kMxBlockSize, c1 = std::min(cols, c0 + kMxBlockSize);
      AmaxAccumulator block_amax;
      for (int64_t c = c0; c < c1; ++c) block_amax.add(xs[c]);
      const uint8_t code = mx_scale_code_for_amax(block_amax.value(), emax_elem);
      codes[r * blocks_per_row + b] = code;
      // 2^-X = 2^(127 - code) lies in [2^-127, 2^127]: always a float, multiplying is exact
      // unless the product lands among float subnormals.
      const float multiplier = code == 0xff ? 1.0f : ldexpf(1.0f, 127 - static_cast<int>(code));
      for (int64_t c = c0; c < c1; ++c) q[r * cols + c] = encode(xs[c] * multiplier);
    }
  }
}

void dequantize_mxfp8(const Tensor& q, const Tensor& scales, Tensor& out) {
  ReadBuffer<float> in(q);
  const int64_t rows = q.size(0), cols = q.size(1);
  const int64_t blocks_per_row = ceil_div(cols, kMxBlockSize);
  const uint8_t* codes = scales.data<uint8_t>();
  WriteBuffer<float> result(out);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const float scale = e8m0_to_float(codes[r * blocks_per_row + c / kMxBlockSize]);
      result[r * cols + c] = in[r * cols + c] * scale;
    }
  }
  result.commit();
}

}  // namespace tessera::cpu
