// LayerNorm and RMSNorm kernels on the GPU (backend/cuda/norm.cu), and the same with the
// residual add fused in (backend/cuda/add_norm.cu). The op front end (src/ops/norm.cpp) has
// already checked shapes, contiguity and devices; these functions only launch. Same
// formulas, gradient rule and statistics dtype as the CPU reference.
#pragma once

#include <initializer_list>

#include "tessera/core/tensor.h"

namespace tessera::cuda {

// Whether a kernel exists for these dtypes: every activation-shaped tensor (x, y, dy, dx)
// F32, or every one BF16; each defined parameter-shaped tensor (gamma, beta, dgamma,
// dbeta) F32 or BF16 on its own; every defined row statistic (mean, rstd) F32.
bool norm_supported(std::initializer_list<const Tensor*> activations, std::initializer_list<const Tensor*> params,
                    std::initializer_list<const Tensor*> stats);

// The launch shape of the register kernels, for tuning sweeps (`bench_bandwidth 30 norm
// --sweep-norm`); 0 or -1 keeps the measured default. forward_vectors / backward_vectors: the
// 16-byte vectors each thread of a row group aims to hold (1, 2, 4 or 8: fewer means wider
// groups); forward_persistent: 1 = one wave of row groups looping over the rows with the next
// row prefetched, 0 = one block per row group, each normalizing one row.
// kernel: 0 = the measured defaults (warp-row forward, row-group backward), 1 = the row-group
// kernels (norm_kernels.cuh) both ways, 2 = the warp-row kernels (norm_warp.cuh: one to eight
// warps per row, the row in registers) both ways; the warp-row kernels run where the row is
// vectorizable and fits, the row-group ones otherwise; forward_persistent applies to both
// (the warp-row default is 0).
// warp_words: the 32-bit words of one operand a lane of the warp-row kernels may hold (4 to
// 64, a power of two; 0 = 16 in forward, 8 in backward, which takes 16 at most): rows wider
// than 32 lanes x warp_words take more warps per row, then more words when 8 warps do not
// suffice. The environment variable TESSERA_NORM_KERNEL (1 or 2)
// sets `kernel` at start-up, so whole test suites can run on either family.
struct NormTuning {
  int forward_vectors = 0, forward_persistent = -1, backward_vectors = 0;
  int kernel = 0, warp_words = 0;
  // The backward's dgamma/dbeta finalize launched as a programmatic dependent of the kernel
  // that writes its partials (-1: the default, on; 0: an ordinary launch, for A/B runs).
  int finalize_pdl = -1;
};
void set_norm_tuning(const NormTuning& tuning);
NormTuning norm_tuning();

void layernorm_forward(void* stream, const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps, Tensor& y,
                       Tensor& mean, Tensor& rstd);
void layernorm_backward(void* stream, const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                        const Tensor& rstd, Tensor& dx, Tensor& dgamma, Tensor& dbeta);
void rmsnorm_forward(void* stream, const Tensor& x, const Tensor& gamma, float eps, Tensor& y, Tensor& rstd);
void rmsnorm_backward(void* stream, const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& rstd,
                      Tensor& dx, Tensor& dgamma);

// Fused residual add (add_norm.cu); norm_supported applies with x, residual, sum, y (or x, dy,
// d_residual, dx) as the activations.
void add_layernorm_forward(void* stream, const Tensor& x, const Tensor& residual, const Tensor& gamma,
                           const Tensor& beta, float eps, Tensor& sum, Tensor& y, Tensor& mean, Tensor& rstd);
void add_rmsnorm_forward(void* stream, const Tensor& x, const Tensor& residual, const Tensor& gamma, float eps,
                         Tensor& sum, Tensor& y, Tensor& rstd);
void layernorm_backward_add(void* stream, const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                            const Tensor& rstd, const Tensor& d_residual, Tensor& dx, Tensor& dgamma, Tensor& dbeta);
void rmsnorm_backward_add(void* stream, const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& rstd,
                          const Tensor& d_residual, Tensor& dx, Tensor& dgamma);

}  // namespace tessera::cuda
