// The fused FP8 cast with transpose on the GPU (backend/cuda/cast_transpose.cu): one read
// of x [M, K] writes both FP8 copies a per-tensor-scaled QuantizedTensor keeps (the [M, K]
// codes and their [K, M] transpose, the operand layout Hopper's TN-only FP8 GEMMs need for
// the backward) and, optionally, max |x|. The bytes are those of quantize_per_tensor then
// transpose_2d (tessera/fp8/quantized_tensor.h uses this on CUDA in their place).
#pragma once

#include "tessera/core/tensor.h"

namespace tessera::cuda {

// x F32 or BF16 (other dtypes take the two-op path).
bool cast_transpose_supported(DType x);

// x [M, K] contiguous; scale F32 [1]; q [M, K] and q_t [K, M] contiguous, both E4M3 or both
// E5M2 (q may be undefined: then only q_t is written); amax_out F32 [1] or undefined. All on the device of `stream`; arguments checked by
// the caller. amax_out is overwritten (it may be the scale tensor itself: then the amax is
// taken in a pass of its own after the cast, which read the old scale).
// dbias, when non-null and defined: F32 [K] contiguous on the same device; the same pass adds
// the column sums of x into it (dbias[c] += sum_r x[r, c], a bias gradient: accumulates),
// deterministically (per-tile partials added in a fixed order; nothing for M == 0).
void cast_transpose(void* stream, const Tensor& x, const Tensor& scale, Tensor& q, Tensor& q_t, Tensor& amax_out,
                    Tensor* dbias = nullptr);

// The bias gradient's second step, shared with gelu_fp8.cu's fused backward: dbias[c] +=
// sum over k < chunks of partial[k * cols + c] (F64 per-tile column partials, added in a fixed
// order, rounded once to F32). partial and dbias on the device of `stream`.
void add_column_partials(void* stream, const double* partial, int64_t chunks, int64_t cols, float* dbias,
                         const char* op);

}  // namespace tessera::cuda
