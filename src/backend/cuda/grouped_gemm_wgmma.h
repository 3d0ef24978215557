// tessera's own grouped GEMM for Hopper (backend/cuda/grouped_gemm_wgmma.cu): every expert's
//     y[rows of e, N] = x[rows of e, K] * w[e]^T        (w: [E, N, K], both operands K-major)
// in ONE persistent launch, the experts' row ranges read from a device offsets array (no host
// synchronisation, no per-expert launch), TMA loads + wgmma, BF16 in and out, FP32
// accumulation. grouped_linear_forward (ops/moe.cpp) uses it when the backend switch below
// says Own and the shapes qualify; otherwise the cuBLASLt loop runs. Declarations only;
// C++17 (nvcc includes it).
#pragma once

#include <cstdint>
#include <vector>

#include "tessera/core/tensor.h"

namespace tessera::cuda {

// Which grouped GEMM GroupedLinear's forward runs on CUDA (process-wide).
enum class GroupedGemmBackend : int { Cublas = 0, Own = 1 };
// Cublas until the kernel has been measured faster on an H200 (docs/ops/moe.md).
void set_grouped_gemm_backend(GroupedGemmBackend backend);
GroupedGemmBackend grouped_gemm_backend();

// Whether the kernel handles these operands: x [rows, K], w [E, N, K] contiguous, y [rows, N],
// all BF16 on a CUDA device of compute capability 9.x, rows of x and y contiguous with
// 16-byte aligned rows, K and N multiples of 64, 1 <= E <= 256.
bool grouped_gemm_wgmma_supported(const Tensor& x, const Tensor& w, const Tensor& y);

// y rows [offsets[e], offsets[e+1]) = x rows of e * w[e]^T for every expert. offsets: device
// I64 [E + 1], non-decreasing, offsets[0] = 0, offsets[E] <= rows; the kernel reads it (the
// host never does). Rows of y at or past offsets[E] are NOT written. block_n: 256 (default)
// or 128, the CTA tile's N extent (the tile is 128 x block_n).
void grouped_gemm_wgmma_forward(void* stream, const Tensor& x, const Tensor& w, const Tensor& offsets, Tensor& y,
                                int block_n = 256);

// The same from host splits: builds the device offsets with one small host-to-device copy on
// `stream` (what grouped_linear_forward does for now).
void grouped_gemm_wgmma_forward(void* stream, const Tensor& x, const Tensor& w, const std::vector<int64_t>& splits,
                                Tensor& y, int block_n = 256);

// The input gradient the same way: dx rows of e = dy rows of e * w[e], dy [rows, N],
// w [E, N, K], dx [rows, K] (w is read N-major: wgmma's transpose bit). Same conditions
// (N and K multiples of 64, ...); rows of dx at or past offsets[E] are not written.
// Not yet wired into grouped_linear_backward_input: run by its test and bench_grouped_gemm.
bool grouped_gemm_wgmma_backward_input_supported(const Tensor& dy, const Tensor& w, const Tensor& dx);
void grouped_gemm_wgmma_backward_input(void* stream, const Tensor& dy, const Tensor& w, const Tensor& offsets,
                                       Tensor& dx, int block_n = 256);

}  // namespace tessera::cuda
