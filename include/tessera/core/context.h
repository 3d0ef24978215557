// Context: where an op runs. Every op takes one first.
//
// It names the device and, on CUDA, the stream the op is queued on (nullptr is the
// default stream). Library handles (cuBLASLt, cuDNN) and workspaces hang off it as the
// backends grow; ops never create them on their own.
#pragma once

#include "tessera/core/dtype.h"

namespace tessera {

struct Context {
  Device device;
  void* stream = nullptr;  // cudaStream_t on CUDA

  static Context cpu() { return Context{Device::cpu(), nullptr}; }
  static Context cuda(int index = 0, void* stream = nullptr) { return Context{Device::cuda(index), stream}; }
};

// Blocks until the work queued on ctx's stream has finished (no-op on the CPU).
void synchronize(const Context& ctx);

}  // namespace tessera
