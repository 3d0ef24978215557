// Device-side copies and fills for Tensor::copy_from and Tensor::fill_zero (core layer).
// They run on the stream passed in (the thread's current stream of the device, see
// tessera/core/stream.h; nullptr is the default stream), so they are ordered with the
// step's kernels and never wait for the host.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tessera::cuda {

// Sets `bytes` bytes at `ptr` (device memory) to zero.
void fill_zero_bytes(void* stream, void* ptr, size_t bytes);

// dst[i] = src[i] for every index i of `shape` (dims <= 8), with element strides
// `dst_strides` / `src_strides` (in elements of `element_size` bytes: 1, 2, 4 or 8).
// Both pointers are on the same device.
void copy_strided(void* stream, void* dst, const int64_t* dst_strides, const void* src, const int64_t* src_strides,
                  const int64_t* shape, int dims, size_t element_size);

}  // namespace tessera::cuda
