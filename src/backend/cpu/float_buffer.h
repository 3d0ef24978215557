// Contiguous arrays of a compute type over tensors of any floating dtype, for the CPU
// reference kernels.
//
// The reference computes in double for F64 tensors and in float for everything else
// (F32, BF16, F16, FP8 are read by exact upcast). When a tensor already holds the compute
// type these buffers point straight at its memory and copy nothing, so an all-F32 or
// all-F64 step does not allocate; otherwise they convert into a temporary.
#pragma once

#include <type_traits>
#include <vector>

#include "element.h"
#include "tessera/core/tensor.h"

namespace tessera::cpu {

template <typename T>
constexpr DType dtype_of() {
  return std::is_same_v<T, double> ? DType::F64 : DType::F32;
}

// Calls fn(double{}) when `t` is F64 and fn(float{}) for any other dtype.
template <typename Fn>
void dispatch_compute_type(DType t, Fn&& fn) {
  if (t == DType::F64) fn(double{});
  else fn(float{});
}

template <typename T>
class ReadBuffer {
 public:
  explicit ReadBuffer(const Tensor& t) {
    if (!t.defined()) return;
    if (t.dtype() == dtype_of<T>() && t.is_contiguous()) {
      ptr_ = t.data<T>();
      return;
    }
    const Tensor c = t.contiguous();
    copy_.resize(static_cast<size_t>(c.numel()));
    for (int64_t i = 0; i < c.numel(); ++i) copy_[i] = static_cast<T>(load_element(c.raw_data(), c.dtype(), i));
    ptr_ = copy_.data();
  }
  const T* data() const { return ptr_; }
  const T& operator[](int64_t i) const { return ptr_[i]; }

 private:
  const T* ptr_ = nullptr;
  std::vector<T> copy_;
};

// Write access to a contiguous output. `load_existing` is for outputs that accumulate
// (gradients with beta = 1). Call commit() once the kernel has written everything.
template <typename T>
class WriteBuffer {
 public:
  explicit WriteBuffer(Tensor& t, bool load_existing = false) : target_(t) {
    if (!t.defined()) return;
    if (t.dtype() == dtype_of<T>()) {
      ptr_ = t.data<T>();
      return;
    }
    copy_.assign(static_cast<size_t>(t.numel()), T(0));
    if (load_existing)
      for (int64_t i = 0; i < t.numel(); ++i) copy_[i] = static_cast<T>(load_element(t.raw_data(), t.dtype(), i));
    ptr_ = copy_.data();
  }
  T* data() { return ptr_; }
  T& operator[](int64_t i) { return ptr_[i]; }
  void commit() {
    if (copy_.empty()) return;
    for (int64_t i = 0; i < target_.numel(); ++i) store_element(target_.raw_data(), target_.dtype(), i, copy_[i]);
  }

 private:
  Tensor& target_;
  T* ptr_ = nullptr;
  std::vector<T> copy_;
};

}  // namespace tessera::cpu
