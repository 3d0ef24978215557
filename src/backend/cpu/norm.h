#pragma once
#include "tessera/core/tensor.h"
namespace tessera::cpu {
void layernorm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps, Tensor& y, Tensor& mean,
                       Tensor& rstd);
void layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                        const Tensor& rstd, Tensor& dx, Tensor& dgamma, Tensor& dbeta);
void rmsnorm_forward(const Tensor& x, const Tensor& gamma, double eps, Tensor& y, Tensor& rstd);
void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& rstd, Tensor& dx,
                      Tensor& dgamma);
// The residual-add variants: the plain ops composed with add() (backend/cpu/elementwise.h).
void add_layernorm_forward(const Tensor& x, const Tensor& residual, const Tensor& gamma, const Tensor& beta, double eps,
                           Tensor& sum_out, Tensor& y, Tensor& mean, Tensor& rstd);
void add_rmsnorm_forward(const Tensor& x, const Tensor& residual, const Tensor& gamma, double eps, Tensor& sum_out,
                         Tensor& y, Tensor& rstd);
void layernorm_backward_add(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                            const Tensor& rstd, const Tensor& d_residual_in, Tensor& dx, Tensor& dgamma,
                            Tensor& dbeta);
void rmsnorm_backward_add(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& rstd,
                          const Tensor& d_residual_in, Tensor& dx, Tensor& dgamma);
// y from x and the statistics a forward wrote, with that forward's exact operations
// (LayerNorm when mean is defined, RMSNorm otherwise); the FP8 apply ops' reference.
void norm_apply(const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& mean, const Tensor& rstd,
                Tensor& y);
}  // namespace tessera::cpu
