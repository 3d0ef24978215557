// Token embedding lookup: out[..., :] = table[ids[...], :].
//
// ids are I32 or I64 of any shape; table is [V, C]; out has shape ids.shape + [C].
// All tensors contiguous (row-major), outputs preallocated by the caller.
#pragma once

#include "tessera/core/context.h"
#include "tessera/core/tensor.h"

namespace tessera {

// out[t, :] = table[ids[t], :] for every position t of ids (flattened).
// table and out may be any floating dtypes; values are converted by rounding to nearest
// even (an exact copy when the dtypes match). An id outside [0, V) throws Error naming
// the id and its position.
void embedding_forward(Context& ctx, const Tensor& ids, const Tensor& table, Tensor& out);

// d_table[ids[t], :] += d_out[t, :] for every position t, in position order.
// The table is a parameter, so its gradient ACCUMULATES into d_table (zero it before the
// first micro-batch); repeated ids add up. d_out has shape ids.shape + [C], d_table is
// [V, C]; any floating dtypes, summed in float (double when d_table is F64).
// Deterministic: each thread owns a strip of columns, so no two threads add to the same
// element and every element sums its contributions in position order.
void embedding_backward(Context& ctx, const Tensor& ids, const Tensor& d_out, Tensor& d_table);

}  // namespace tessera
