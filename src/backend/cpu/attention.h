#pragma once
#include "tessera/core/tensor.h"
namespace tessera::cpu {
// Shapes and dtypes are checked by the front end (src/ops/attention.cpp); `scale` is the
// resolved softmax scale (never 0).
void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse, bool causal,
                       double scale);
void attention_backward(const Tensor& d_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                        const Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv, bool causal, double scale);

// F32 paths through BLAS (attention_blas.cpp), used by the two above when every tensor is
// F32 and the build has BLAS.
void attention_forward_blas(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse, bool causal,
                            float scale);
void attention_backward_blas(const Tensor& d_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                             const Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv, bool causal, float scale);
}  // namespace tessera::cpu
