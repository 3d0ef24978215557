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

[[noreturn]] inline void fail_no_kernel(const char* op, const Context& ctx) {
  TESSERA_FAIL(op, ": no kernel for device ", ctx.device.to_string(),
               " in this build; the CPU reference runs it with a CPU context");
}

}  // namespace tessera
