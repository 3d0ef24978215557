// Delayed-scaling bookkeeping on the GPU (backend/cuda/fp8_scaling.cu), for
// tessera/fp8/device_scaling.h: one launch folds every tensor's pending amax into the
// history, one updates every scale. Arguments are checked by the caller.
#pragma once

#include <cstdint>

#include "tessera/core/tensor.h"

namespace tessera::cuda {

// history [N, H] F32, pending [N] F32, position I64 [1] (read on the device, not changed):
// history[i, position] = fold(., pending[i]); pending = 0.
void delayed_scaling_record(void* stream, Tensor& history, Tensor& pending, const Tensor& position);

// record, then for every i the window amax (max ignoring NaN when window_max, else the
// current slot), scale/scale_inv from it when finite and > 0, and history[i, next] = 0;
// then position = (position + 1) % H on the device. N may be 0 (only the position moves).
void delayed_scaling_update(void* stream, Tensor& history, Tensor& pending, Tensor& scale, Tensor& scale_inv,
                            const Tensor& fp8_max, Tensor& position, bool window_max, float margin);

// scale[0] = fp8_scale_for_amax(amax[0], fp8_max, margin, power_of_two) (one thread).
void scale_from_amax(void* stream, const Tensor& amax, float fp8_max, float margin, bool power_of_two, Tensor& scale);

// target[0] = fold(target[0], amax[0]) (NaN sticky, else the max; both F32 [1], >= 0 or NaN):
// a pending amax that several casts of one tensor add to (one thread).
void fold_amax(void* stream, const Tensor& amax, Tensor& target);

}  // namespace tessera::cuda
