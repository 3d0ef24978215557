// LayerNorm and RMSNorm on the GPU, forward and backward, with the formulas, rounding
// points and gradient rule of the CPU reference (backend/cpu/norm.cpp). The kernels live in
// norm_kernels.cuh (how they work) and norm_launch.cuh (how they are launched), shared with
// the fused residual-add variants of add_norm.cu; this file launches the plain ones. A
// second family, norm_warp.cuh (a row in the registers of one to eight warps, FP32
// statistics), is the default forward; NormTuning::kernel (or TESSERA_NORM_KERNEL) = 1 or 2
// picks one family for both directions.
//
// Layout: x, y, dy, dx contiguous [rows, C] of one dtype (F32 or BF16); gamma, beta, dgamma,
// dbeta [C], each F32 or BF16 on its own; mean, rstd F32.
//
// Floor (H200, ~4.1 TB/s): forward reads x and writes y, 2 passes of the activation
// (16384x4096 BF16: 268 MB, ~65 us); backward reads x and dy and writes dx, 3 passes
// (~98 us), plus the partials (workers x C x 4 bytes per parameter, a few MB).
// Measured there against cudaMemcpy D2D (3.8 TB/s) in the same run (bench_bandwidth):
// layernorm forward 71% (warp-row; row-group 59%), backward 68%; rmsnorm forward 90%
// (row-group 82%), backward 81% (see norm_kernels.cuh and norm_warp.cuh for what limits them).
#include <cstdlib>

#include "norm.h"
#include "norm_launch.cuh"

namespace tessera::cuda {

namespace {
// TESSERA_NORM_KERNEL=1|2 picks the kernel family for a whole process (test suites, A/B runs).
NormTuning initial_tuning() {
  NormTuning t;
  if (const char* v = std::getenv("TESSERA_NORM_KERNEL")) t.kernel = std::atoi(v);
  return t;
}
NormTuning g_norm_tuning = initial_tuning();  // set only by benchmarks and tests, between launches
}  // namespace

void set_norm_tuning(const NormTuning& tuning) { g_norm_tuning = tuning; }
NormTuning norm_tuning() { return g_norm_tuning; }

bool norm_supported(std::initializer_list<const Tensor*> activations, std::initializer_list<const Tensor*> params,
                    std::initializer_list<const Tensor*> stats) {
  const DType first = (*activations.begin())->dtype();
  if (first != DType::F32 && first != DType::BF16) return false;
  for (const Tensor* t : activations)
    if (t->dtype() != first) return false;
  for (const Tensor* t : params)
    if (t->defined() && t->dtype() != DType::F32 && t->dtype() != DType::BF16) return false;
  for (const Tensor* t : stats)
    if (t->defined() && t->dtype() != DType::F32) return false;
  return true;
}

void layernorm_forward(void* stream, const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps, Tensor& y,
                       Tensor& mean, Tensor& rstd) {
  norm_forward<true, false>(stream, x, nullptr, nullptr, gamma, beta, eps, y, &mean, rstd);
}

void layernorm_backward(void* stream, const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                        const Tensor& rstd, Tensor& dx, Tensor& dgamma, Tensor& dbeta) {
  norm_backward<true, false>(stream, dy, x, gamma, &mean, rstd, nullptr, dx, dgamma, &dbeta);
}

void rmsnorm_forward(void* stream, const Tensor& x, const Tensor& gamma, float eps, Tensor& y, Tensor& rstd) {
  norm_forward<false, false>(stream, x, nullptr, nullptr, gamma, Tensor(), eps, y, nullptr, rstd);
}

void rmsnorm_backward(void* stream, const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& rstd,
                      Tensor& dx, Tensor& dgamma) {
  norm_backward<false, false>(stream, dy, x, gamma, nullptr, rstd, nullptr, dx, dgamma, nullptr);
}

}  // namespace tessera::cuda
