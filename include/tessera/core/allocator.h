// Memory for tensors. The CPU allocator hands out 64-byte aligned blocks; the CUDA
// allocator (backend/cuda/allocator.cu) caches freed blocks by size so the training step
// never calls cudaMalloc after its first iteration.
#pragma once

#include <cstddef>

#include "tessera/core/dtype.h"

namespace tessera {

class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual void* allocate(size_t bytes) = 0;
  virtual void deallocate(void* ptr, size_t bytes) = 0;
};

// The allocator for a device. Throws Error for CUDA when the build has no CUDA backend.
Allocator& allocator_for(Device device);

// Copies bytes between any two devices (host<->device, device<->device, host<->host).
void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes);

// Whether this build has the CUDA backend and a GPU is visible to it.
bool cuda_available();

}  // namespace tessera
