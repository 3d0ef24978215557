// Residual add fused into LayerNorm/RMSNorm on the GPU (the pre-norm Transformer's
// "h = x + branch; y = norm(h)"), forward and backward, equal to the plain ops composed:
//   forward:  sum = x + residual (rounded to the activation dtype, as add() rounds), then the
//             norm of that ROUNDED sum, statistics and y exactly as layernorm/rmsnorm_forward;
//   backward: dx = (the norm's dx rounded to the activation dtype) + d_residual, rounded.
// Same kernels as norm.cu (norm_kernels.cuh, norm_launch.cuh) with the add compiled in; see
// there for the threading, the double row sums and the deterministic parameter gradients.
//
// Layout: x, residual, sum, y, dy, d_residual, dx contiguous [rows, C], all F32 or all BF16;
// gamma, beta, dgamma, dbeta [C], F32 or BF16 each; mean, rstd F32. sum may be x or residual
// (in place), dx may be d_residual or dy.
//
// Floor (H200, ~4.1 TB/s): forward reads x and residual and writes sum and y, 4 passes of the
// activation (16384x4096 BF16: 537 MB, ~130 us) against 5 for add() then the norm; backward
// reads x, dy, d_residual and writes dx, 4 passes (~130 us) against 6 unfused, plus the
// parameter-gradient partials. Measured there against cudaMemcpy D2D in the same run
// (bench_bandwidth): backward with the add 65% (LayerNorm) and 72% (RMSNorm). Forward: 77%
// (LayerNorm) and 94% (RMSNorm) with one row group per block and per-element FP64 sums;
// 74% / 85% with the plain norms' persistent, prefetching launch; this version (one row
// group per block, per-vector sums) is not measured yet.
#include "norm.h"
#include "norm_launch.cuh"

namespace tessera::cuda {

void add_layernorm_forward(void* stream, const Tensor& x, const Tensor& residual, const Tensor& gamma,
                           const Tensor& beta, float eps, Tensor& sum, Tensor& y, Tensor& mean, Tensor& rstd) {
  norm_forward<true, true>(stream, x, &residual, &sum, gamma, beta, eps, y, &mean, rstd);
}

void add_rmsnorm_forward(void* stream, const Tensor& x, const Tensor& residual, const Tensor& gamma, float eps,
                         Tensor& sum, Tensor& y, Tensor& rstd) {
  norm_forward<false, true>(stream, x, &residual, &sum, gamma, Tensor(), eps, y, nullptr, rstd);
}

void layernorm_backward_add(void* stream, const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                            const Tensor& rstd, const Tensor& d_residual, Tensor& dx, Tensor& dgamma, Tensor& dbeta) {
  norm_backward<true, true>(stream, dy, x, gamma, &mean, rstd, &d_residual, dx, dgamma, &dbeta);
}

void rmsnorm_backward_add(void* stream, const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& rstd,
                          const Tensor& d_residual, Tensor& dx, Tensor& dgamma) {
  norm_backward<false, true>(stream, dy, x, gamma, nullptr, rstd, &d_residual, dx, dgamma, nullptr);
}

}  // namespace tessera::cuda
