// A copy between two contiguous tensors of one device and dtype, queued on ctx's stream on
// CUDA (Tensor::copy_from uses the thread's current stream, which need not be ctx's), a
// plain copy on the CPU.
#pragma once

#include "tessera/core/context.h"
#include "tessera/core/tensor.h"
#include "tessera/ops/elementwise.h"

namespace tessera::dist::detail {

inline void stream_copy(Context& ctx, const Tensor& src, Tensor& dst) {
  if (ctx.device.is_cuda() && src.is_contiguous() && dst.is_contiguous()) {
    cast(ctx, src, dst);
  } else {
    dst.copy_from(src);
  }
}

}  // namespace tessera::dist::detail
