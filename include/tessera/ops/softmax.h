// Softmax over the last dimension.
//
// x is a contiguous [..., C] tensor; every leading dimension is flattened into rows and
// each row is normalized on its own. Outputs are preallocated by the caller (any floating
// dtype, x's shape) and never resized. The reference computes in double when the main
// input is F64 and in float otherwise, with row sums in double.
//
// Gradient rule: the input gradient dx is OVERWRITTEN (softmax has no parameters).
#pragma once

#include "tessera/core/context.h"
#include "tessera/core/tensor.h"

namespace tessera {

// y[r, i] = exp(x[r, i] - m_r) / sum_j exp(x[r, j] - m_r), m_r = max_j x[r, j] (the
// subtraction keeps exp from overflowing). Entries may be -inf (masked): their
// probability is exactly 0. A row whose entries are all -inf has no defined softmax;
// it is given all zeros, and its gradient is then zero too. y may be the same tensor as x.
void softmax_forward(Context& ctx, const Tensor& x, Tensor& y);

// dx = y * (dy - sum_j(dy_j * y_j)) per row, from the forward output y. Computes in
// double when y is F64. dx may be the same tensor as dy.
void softmax_backward(Context& ctx, const Tensor& y, const Tensor& dy, Tensor& dx);

}  // namespace tessera
