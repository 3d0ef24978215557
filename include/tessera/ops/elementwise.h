// Elementwise ops: residual add, dtype casts, and the 2-D transpose copy.
//
// Outputs are preallocated by the caller and must be contiguous; inputs are contiguous
// and of the same shape unless said otherwise.
#pragma once

#include "tessera/core/context.h"
#include "tessera/core/tensor.h"

namespace tessera {

// out = a + b (residual add). Any floating dtypes, computed in float (double for F64).
// Backward is the identity for both inputs: d_a = d_b = d_out.
void add(Context& ctx, const Tensor& a, const Tensor& b, Tensor& out);

// out = alpha * in (out may be in itself). Any floating dtypes, same shape.
void scale(Context& ctx, const Tensor& in, float alpha, Tensor& out);

// out = in converted to out's dtype, rounding to nearest even (FP8: saturating).
// Integer <-> floating casts are allowed; integers truncate toward zero.
void cast(Context& ctx, const Tensor& in, Tensor& out);

// out[j, i] = in[i, j] for a 2-D `in` of shape [rows, cols]; out is [cols, rows], same dtype.
void transpose_2d(Context& ctx, const Tensor& in, Tensor& out);

}  // namespace tessera
