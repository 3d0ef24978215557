// FP8 quantization: amax, scale computation and the three scaling recipes
// (per-tensor delayed/current scaling, 2-D block scaling, OCP MXFP8).
//
// These are the CPU reference definitions the CUDA kernels must reproduce bit for bit, so
// the arithmetic is pinned down exactly:
//  - inputs of any floating dtype are first converted to float (exact for F32, BF16, F16
//    and FP8; F64 rounds to nearest even);
//  - products are single float multiplications, rounded to nearest even;
//  - float -> FP8 conversion rounds to nearest even and saturates to the largest finite
//    value (E4M3 448, E5M2 57344), infinities included; NaN stays NaN.
// The ops have no gradient: the FP8 training recipes treat quantization as the identity
// in backward (straight-through) and quantize the gradients with these same ops.
//
// Outputs are preallocated by the caller and must be contiguous; so must the inputs.
// Scale tensors are F32 (E8M0 for MXFP8) and always hold one value per tensor or block.
#pragma once

#include <cstdint>

#include "tessera/core/context.h"
#include "tessera/core/tensor.h"

namespace tessera {

// Largest finite value of an FP8 dtype: 448 (E4M3) or 57344 (E5M2). Throws for other dtypes.
float fp8_max(DType fp8);

// The exponent of the largest normal FP8 value, emax_elem in the OCP MX spec: 8 (E4M3), 15 (E5M2).
int fp8_max_exponent(DType fp8);

// The quantization scale for a tensor whose max |x| is amax, Transformer Engine's formula:
//   scale = fp8_max(fp8) / amax / 2^margin
// amax == 0, NaN or infinite gives 1 (nothing to scale, or no usable statistic); a scale
// that overflows float becomes FLT_MAX. power_of_two rounds the scale down to a power of
// two, which makes x * scale and q * (1 / scale) exact apart from the FP8 rounding.
// Quantized values are fp8(x * scale); dequantize with scale_inv = 1 / scale.
float fp8_scale_from_amax(float amax, DType fp8, float margin = 0, bool power_of_two = false);

// amax_out[0] = max |x| over every element of x (any floating dtype). amax_out is F32 [1].
// NaN propagates: if any element is NaN, amax is NaN. An empty x gives 0.
void amax(Context& ctx, const Tensor& x, Tensor& amax_out);

// ---- Per-tensor scaling -----------------------------------------------------------------

// out = fp8(float(x) * scale[0]), saturating. x: any floating dtype; scale: F32 [1];
// out: E4M3 or E5M2, same shape as x. When amax_out (F32 [1]) is defined it receives
// max |x| of the unscaled input (the statistic delayed scaling keeps a history of);
// pass an undefined Tensor to skip it.
void quantize_per_tensor(Context& ctx, const Tensor& x, const Tensor& scale, Tensor& out, Tensor& amax_out);
void quantize_per_tensor(Context& ctx, const Tensor& x, const Tensor& scale, Tensor& out);

// out = float(q) * scale_inv[0], stored in out's dtype (F64, F32, F16 or BF16).
// q: E4M3 or E5M2; scale_inv: F32 [1]; out: same shape as q.
void dequantize_per_tensor(Context& ctx, const Tensor& q, const Tensor& scale_inv, Tensor& out);

// ---- Block scaling (DeepSeek-V3, Transformer Engine Float8BlockScaling) --------------------

// Tiles of block_rows x block_cols elements of a 2-D [rows, cols] tensor share one scale.
// The recipes are 1x128 (activations and gradients) and 128x128 (weights); any positive
// block size works. Blocks at the bottom and right edges may be partial.
struct BlockScaling {
  int64_t block_rows = 1;
  int64_t block_cols = 128;
  bool power_of_two_scales = true;  // DeepSeek-V3 and TE use power-of-two block scales

  static BlockScaling tile_1x128(bool power_of_two = true) { return {1, 128, power_of_two}; }
  static BlockScaling tile_128x128(bool power_of_two = true) { return {128, 128, power_of_two}; }
};

// Shape of the scale tensor for x of shape [rows, cols]: [ceil(rows / block_rows), ceil(cols / block_cols)].
Shape block_scale_shape(int64_t rows, int64_t cols, const BlockScaling& blocks);

// For every block b: scale_b = fp8_scale_from_amax(amax_b, out dtype, 0, power_of_two_scales),
// out = fp8(float(x) * scale_b), scale_inv[b] = 1 / scale_b (float division). An all-zero
// block, or one holding NaN or Inf, gets scale 1 (its NaN elements stay NaN, Inf saturates).
// x: [rows, cols], any floating dtype; out: E4M3 or E5M2 [rows, cols];
// scale_inv: F32, block_scale_shape(rows, cols, blocks).
void quantize_blockwise(Context& ctx, const Tensor& x, Tensor& out, Tensor& scale_inv, const BlockScaling& blocks);

// out[i, j] = float(q[i, j]) * scale_inv[block of (i, j)], stored in out's dtype
// (F64, F32, F16 or BF16).
void dequantize_blockwise(Context& ctx, const Tensor& q, const Tensor& scale_inv, Tensor& out,
                          const BlockScaling& blocks);

// ---- MXFP8 (OCP Microscaling, 1x32 blocks along the last dimension) ---------------------

constexpr int64_t kMxBlockSize = 32;

// For every 1x32 block of a row: the shared exponent X = floor(log2(amax)) - emax_elem
// (emax_elem = fp8_max_exponent(out dtype)), clamped to [-127, 127] and stored as the E8M0
// code X + 127; elements out = fp8(float(x) * 2^-X), saturating (values in
// (fp8_max * 2^X, 2^(emax_elem + 1) * 2^X) clamp, as the spec allows).
// An all-zero block gets X = -127 (code 0); a block with NaN or Inf gets the NaN scale
// code 0xFF and its elements are fp8(float(x)) unscaled (the block decodes to NaN anyway).
// x: [rows, cols], any floating dtype; out: E4M3 or E5M2 [rows, cols];
// scales: E8M0 [rows, ceil(cols / 32)].
void quantize_mxfp8(Context& ctx, const Tensor& x, Tensor& out, Tensor& scales);

// out[i, j] = float(q[i, j]) * 2^X of its block (NaN when the scale code is 0xFF), stored
// in out's dtype (F64, F32, F16 or BF16).
void dequantize_mxfp8(Context& ctx, const Tensor& q, const Tensor& scales, Tensor& out);

}  // namespace tessera
