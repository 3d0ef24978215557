// Shared by every op's front end (src/ops/<family>.cpp): device checks and the error for
// a backend that lacks a kernel.
#pragma once

#include <initializer_list>

#include "tessera/core/context.h"
#include "tessera/core/tensor.h"

namespace tessera {

// Every defined tensor must live on the context's device.
inline void check_on_device(const Context& ctx, const char* op, std::initializer_list<const Tensor*> tensors) {
  for (const Tensor* t : tensors) {
    if (!t->defined()) continue;
    TESSERA_CHECK(t->device() == ctx.device, op, ": ", t->describe(), " is not on the context's device ",
                  ctx.device.to_string());
  }
}

// A defined F32 tensor of shape [1]: an FP8 scale or amax.
inline void check_f32_scalar(const Tensor& t, const char* op, const char* name) {
  check_defined(t, op, name);
  check_dtype(t, DType::F32, op, name);
  check_shape(t, {1}, op, name);
}

// Bytes from a view's first element to just past its last, strides included.
inline int64_t span_bytes(const Tensor& t) { return t.span_elements() * static_cast<int64_t>(dtype_size(t.dtype())); }

// A matrix whose rows are contiguous, at any row stride >= its width: a column slice of a
// wider buffer (the LM head pads the logits' row stride so its GEMMs stay aligned).
inline void check_row_strided(const Tensor& t, const char* op, const char* name) {
  TESSERA_CHECK(t.dim() == 2 && (t.is_contiguous() || (t.stride(1) == 1 && t.stride(0) >= t.size(1))), op, ": ", name,
                " must be a 2-D matrix with contiguous rows, got ", t.describe());
}

[[noreturn]] inline void fail_no_kernel(const char* op, const Context& ctx) {
  TESSERA_FAIL(op, ": no kernel for device ", ctx.device.to_string(),
               " in this build; the CPU reference runs it with a CPU context");
}

}  // namespace tessera
