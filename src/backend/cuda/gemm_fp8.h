// FP8 GEMMs on the GPU through cuBLASLt (backend/cuda/gemm_fp8.cu): the kernels behind
// tessera/fp8/quantized_tensor.h and block_quantized_tensor.h, plus the two small kernels
// that keep the FP8 path free of host synchronisation (the scale reciprocal, and the
// rearrangement of block scales into cuBLASLt's layout).
//
// Only the "TN" layout exists on Hopper: in tessera's row-major terms
//     c[M, N] = alpha * a[M, K] * b[N, K]^T + beta * c (+ bias[N])
// with both operands contiguous along K. Callers pick the FP8 copy (data or data_t) that
// makes every product TN. This header stays C++17 (nvcc compiles it).
#pragma once

#include <cstdint>
#include <string>

#include "tessera/core/tensor.h"

namespace tessera::cuda {

// How an operand's scale_inv is read (cuBLASLt's CUBLASLT_MATMUL_MATRIX_SCALE_*):
//  - Tensor:     SCALAR_32F, one F32 [1] for the whole operand;
//  - Vec128:     VEC128_32F, one F32 per 1x128 block along K (activations, gradients);
//  - Block128:   BLK128x128_32F, one F32 per 128x128 tile (weights).
// Vec128 and Block128 read the GEMM-ready layout below, not tessera's block_scale_shape one.
// Block128 x Block128 does not exist in cuBLASLt; the other block pairs do (Hopper only).
enum class Fp8ScaleMode { Tensor, Vec128, Block128 };

// An FP8 operand [rows, K]: E4M3 or E5M2, rows contiguous, row stride = leading dimension.
// scale_inv is a device F32 tensor of the shape the mode asks for; the product uses
// data * scale_inv, so it is the dequantization factor (1 / the quantization scale).
struct Fp8Operand {
  Tensor data;
  Tensor scale_inv;
  Fp8ScaleMode mode = Fp8ScaleMode::Tensor;
};

struct Fp8GemmParams {
  float alpha = 1, beta = 0;
  // cuBLASLt's FAST_ACCUM: no periodic promotion of the tensor cores' partial sums to FP32.
  // Transformer Engine turns it on for the forward GEMM and off for the two backward ones.
  // Block-scaled GEMMs always promote (the flag is ignored there).
  bool fast_accumulate = false;
  Tensor bias;       // BF16 [N] or undefined (cuBLASLt's FP8 kernels take BF16 bias for every output)
  Tensor out_scale;  // F32 [1] or undefined (= 1); E4M3 output only: c = fp8(result * out_scale)
  Tensor amax_out;   // F32 [1] or undefined; E4M3 output only: max |result| before out_scale
};

// Empty when cuBLASLt's FP8 path takes these arguments, otherwise the reason, naming the
// offending tensor and the rule (for the error the front end raises). Rules:
//  - a, b: E4M3/E5M2 (not both E5M2), 2-D, on one CUDA device, contiguous rows, K > 0,
//    K % 16 == 0, row strides and base pointers 16-byte aligned;
//  - c: [M, N] of F32, BF16 or E4M3 on the same device, contiguous rows, row stride and base
//    pointer 16-byte aligned (N % 4 for F32, % 8 for BF16, % 16 for E4M3 when packed);
//  - E4M3 c: beta == 0 and per-tensor operands; out_scale / amax_out only with E4M3 c;
//  - block modes: M % 4 == 0 and N % 4 == 0, scale tensors of gemm_block_scale_shape;
//  - bias: BF16 [N], contiguous, on the device.
std::string fp8_gemm_check(const Fp8Operand& a, const Fp8Operand& b, const Tensor& c, const Fp8GemmParams& p);

// c = alpha * (a * b^T) + beta * c (+ bias), FP32 accumulation, on `stream` (a cudaStream_t).
// Throws tessera::Error (with fp8_gemm_check's reason, or cuBLASLt's status and the shapes).
// Nothing is read back to the host: every scale is a device pointer.
void fp8_gemm(void* stream, const Fp8Operand& a, const Fp8Operand& b, Tensor& c, const Fp8GemmParams& p);

// scale_inv[0] = 1.0f / scale[0], IEEE round to nearest (the bits the CPU's division gives),
// written on the device; a scale that is not finite and > 0 gives NaN, so that a bad scale
// poisons the GEMMs that use it instead of passing unnoticed. F32 [1] tensors on one device.
void fp8_reciprocal_scale(void* stream, const Tensor& scale, Tensor& scale_inv);

// ---- Block scales in cuBLASLt's layout ------------------------------------------------------
// tessera's quantize_blockwise writes scale_inv row-major in block order, [ceil(R/br), ceil(K/bc)]
// for an operand [R, K]. cuBLASLt (cuBLAS docs 3.1.4.5.1, "Scaling factors layouts") wants:
//  - Vec128 (1x128):   L = ceil(K/128) columns of R scales each, R contiguous: [L, R] row-major,
//                      i.e. the transpose of tessera's [R, L]; R must be a multiple of 4;
//  - Block128 (128x128): K-major, the stride between block rows a multiple of 4:
//                      [ceil(R/128), round_up(L, 4)] row-major, i.e. tessera's with each row
//                      padded by zeros to a multiple of 4.
inline Shape gemm_block_scale_shape(int64_t rows, int64_t k, Fp8ScaleMode mode) {
  const int64_t l = (k + 127) / 128;
  if (mode == Fp8ScaleMode::Vec128) return {l, rows};
  return {(rows + 127) / 128, (l + 3) / 4 * 4};
}

// out (F32, gemm_block_scale_shape(rows, k, mode)) = scale_inv (F32, tessera's layout for the
// mode's block shape) rearranged as above, padding zeroed. One small kernel on `stream`.
void to_gemm_block_scales(void* stream, const Tensor& scale_inv, int64_t rows, int64_t k, Fp8ScaleMode mode,
                          Tensor& out);

}  // namespace tessera::cuda
