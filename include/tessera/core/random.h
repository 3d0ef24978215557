// Filling tensors with random numbers from the Philox stream (see philox.h).
//
// Element i of `out` (in its logical, row-major order) depends only on (seed, offset, i),
// so the CPU and CUDA backends fill identical values for the same arguments.
#pragma once

#include <cstdint>

#include "tessera/core/context.h"
#include "tessera/core/tensor.h"

namespace tessera {

// out[i] = low + (high - low) * U(seed, offset, i), U in [0, 1). Any floating dtype.
void fill_uniform(Context& ctx, Tensor& out, float low, float high, uint64_t seed, uint64_t offset = 0);
// out[i] = mean + std * N(seed, offset, i), using words 2i and 2i+1 of the stream.
void fill_normal(Context& ctx, Tensor& out, float mean, float std, uint64_t seed, uint64_t offset = 0);

}  // namespace tessera
