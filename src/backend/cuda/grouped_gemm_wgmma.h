// tessera's own grouped GEMM for Hopper (backend/cuda/grouped_gemm_wgmma.cu): every expert's
//     y[rows of e, N] = x[rows of e, K] * w[e]^T        (w: [E, N, K], both operands K-major)
// in ONE persistent launch, the experts' row ranges read from a device offsets array (no host
// synchronisation, no per-expert launch), TMA loads + wgmma, BF16 in and out, FP32
// accumulation. grouped_linear_forward (ops/moe.cpp) uses it when the backend switch below
// says Own and the shapes qualify (grouped_linear_backward_input likewise with the dgrad
// kernel); otherwise the cuBLASLt loop runs. Declarations only;
// C++17 (nvcc includes it).
#pragma once

#include <cstdint>
#include <vector>

#include "tessera/core/tensor.h"

namespace tessera::cuda {

// Which grouped GEMM GroupedLinear's forward and input gradient run on CUDA (process-wide).
enum class GroupedGemmBackend : int { Cublas = 0, Own = 1 };
// Cublas until the kernel has been measured faster on an H200 (docs/ops/moe.md).
void set_grouped_gemm_backend(GroupedGemmBackend backend);
GroupedGemmBackend grouped_gemm_backend();

// The kernel's variants (all compute the same result; they differ in speed only):
//   Coop256Wait0 / Coop128Wait0  the round-1 kernel (128 x 256 / 128 x 128 tiles, two
//                 consumer warpgroups x 64 rows, each k-block's MMAs waited for before its
//                 stage is freed; dgrad with m64n64 MMAs), kept as the baseline;
//   Coop256 / Coop128  the same tiles with the MMAs kept in flight across k-blocks
//                 (wait_group 1), dgrad with one m64n256 / m64n128 MMA per k16 step, and
//                 the epilogue through shared memory (stmatrix) with 16-byte stores;
//   Coop256Scalar Coop256 with round 1's 4-byte epilogue stores (to measure the two apart);
//   PingPong128   each consumer warpgroup owns a whole 128 x 128 tile and the two take
//                 turns, so one's epilogue overlaps the other's MMAs (pipelined, 16-byte
//                 epilogue as Coop256);
//   Coop256Mc2    Coop256 on clusters of two CTAs (M tiles 2m, 2m + 1 of one w tile), each
//                 loading half of the w tile and multicasting it to both (TMA multicast):
//                 a third less L2 traffic. Not in kGroupedGemmVariants (see below).
// Default = the process-wide choice below (Coop256 until measured otherwise).
enum class GroupedGemmVariant : int {
  Default = -1,
  Coop256Wait0 = 0,
  Coop128Wait0,
  Coop256Scalar,
  Coop256,
  Coop128,
  PingPong128,
  Coop256Mc2
};
inline constexpr GroupedGemmVariant kGroupedGemmVariants[] = {
    GroupedGemmVariant::Coop256Wait0, GroupedGemmVariant::Coop128Wait0, GroupedGemmVariant::Coop256Scalar,
    GroupedGemmVariant::Coop256,      GroupedGemmVariant::Coop128,      GroupedGemmVariant::PingPong128};
// Cluster variants, tested and benchmarked after all the others: a launch that hangs or
// faults would end the process and lose the other rows.
inline constexpr GroupedGemmVariant kGroupedGemmClusterVariants[] = {GroupedGemmVariant::Coop256Mc2};
void set_grouped_gemm_variant(GroupedGemmVariant variant);
GroupedGemmVariant grouped_gemm_variant();
const char* grouped_gemm_variant_name(GroupedGemmVariant variant);

// Whether the kernel handles these operands: x [rows, K], w [E, N, K] contiguous, y [rows, N],
// all BF16 on a CUDA device of compute capability 9.x, rows of x and y contiguous with
// 16-byte aligned rows (row strides multiples of 8 elements, 16-byte aligned bases), K and
// N multiples of 64, 1 <= E <= 256.
bool grouped_gemm_wgmma_supported(const Tensor& x, const Tensor& w, const Tensor& y);

// y rows [offsets[e], offsets[e+1]) = x rows of e * w[e]^T for every expert. offsets: device
// I64 [E + 1], non-decreasing, offsets[0] = 0, offsets[E] <= rows; the kernel reads it (the
// host never does). Rows of y at or past offsets[E] are NOT written.
void grouped_gemm_wgmma_forward(void* stream, const Tensor& x, const Tensor& w, const Tensor& offsets, Tensor& y,
                                GroupedGemmVariant variant = GroupedGemmVariant::Default);

// The same from host splits: builds the device offsets with one small host-to-device copy on
// `stream` (what grouped_linear_forward does for now).
void grouped_gemm_wgmma_forward(void* stream, const Tensor& x, const Tensor& w, const std::vector<int64_t>& splits,
                                Tensor& y, GroupedGemmVariant variant = GroupedGemmVariant::Default);

// The input gradient the same way: dx rows of e = dy rows of e * w[e], dy [rows, N],
// w [E, N, K], dx [rows, K] (w is read N-major: wgmma's transpose bit). Same conditions
// (N and K multiples of 64, ...); rows of dx at or past offsets[E] are not written.
// grouped_linear_backward_input uses it under the same backend switch (Own).
bool grouped_gemm_wgmma_backward_input_supported(const Tensor& dy, const Tensor& w, const Tensor& dx);
void grouped_gemm_wgmma_backward_input(void* stream, const Tensor& dy, const Tensor& w, const Tensor& offsets,
                                       Tensor& dx, GroupedGemmVariant variant = GroupedGemmVariant::Default);
void grouped_gemm_wgmma_backward_input(void* stream, const Tensor& dy, const Tensor& w,
                                       const std::vector<int64_t>& splits, Tensor& dx,
                                       GroupedGemmVariant variant = GroupedGemmVariant::Default);

}  // namespace tessera::cuda
