#pragma once
#include "tessera/core/tensor.h"
#include "tessera/ops/gemm.h"
namespace tessera::cpu {
// The GEMM of gemm.h: OpenBLAS when the build has it, otherwise gemm_portable.
void gemm(const Tensor& a, const Tensor& b, Tensor& c, const GemmOptions& options, const Tensor& bias);
// The same computation, always with the cache-blocked OpenMP loop (no BLAS).
void gemm_portable(const Tensor& a, const Tensor& b, Tensor& c, const GemmOptions& options, const Tensor& bias);
void bias_grad(const Tensor& dy, Tensor& dbias);
void sum_of_squares(const Tensor& x, Tensor& out);
}  // namespace tessera::cpu
