// Helpers shared by the GPU tests (tests/test_gpu_*.cpp): the skip when no GPU is present,
// device copies (aligned or deliberately misaligned) and byte-exact comparisons.
#pragma once

#include <cstdint>
#include <vector>

#include "tessera/core/allocator.h"
#include "testing.h"

#define REQUIRE_GPU() \
  if (!::tessera::cuda_available()) GTEST_SKIP() << "no GPU present (or no CUDA backend in this build): skipping GPU test"

namespace tessera::testing {

inline const Device kCuda = Device::cuda();

// The bytes of a tensor (any device, any strides), for bit-exact comparisons.
inline std::vector<uint8_t> bytes_of(const Tensor& t) {
  Tensor host = t.to(Device::cpu()).contiguous();
  const auto* p = static_cast<const uint8_t*>(host.raw_data());
  return std::vector<uint8_t>(p, p + host.nbytes());
}

// A device copy of `host`, either a fresh (aligned) tensor or a view one element into a
// larger buffer, so that its rows are not 16-byte aligned.
// An undefined tensor stays undefined.
inline Tensor to_device(const Tensor& host, bool misaligned) {
  if (!host.defined()) return Tensor();
  if (!misaligned) return host.to(kCuda);
  Tensor buffer = Tensor::zeros({host.numel() + 1}, host.dtype(), kCuda);
  Tensor view = buffer.slice(0, 1, host.numel() + 1).reshape(host.shape());
  view.copy_from(host);
  return view;
}

// A device tensor of `shape` whose every byte is poison (NaN for floating dtypes): an
// output a kernel fails to write then fails the comparison.
inline Tensor poisoned_device(const Shape& shape, DType t, bool misaligned = false) {
  Tensor host = Tensor::empty(shape, t);
  poison(host);
  return to_device(host, misaligned);
}

}  // namespace tessera::testing
