// Tensor: a small value type over shared storage.
//
// A tensor is (storage, offset, shape, strides, dtype, device). Copies of a Tensor share
// the storage; views (slice, reshape, transpose, view) make new Tensors over the same
// bytes without copying. Strides and offsets count elements, not bytes. Ops require
// contiguous inputs unless they say otherwise; `contiguous()` makes a packed copy when
// needed.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "tessera/core/dtype.h"
#include "tessera/core/error.h"

namespace tessera {

using Shape = std::vector<int64_t>;

std::string shape_to_string(const Shape& shape);
int64_t shape_numel(const Shape& shape);

struct Storage {
  void* data = nullptr;
  size_t bytes = 0;
  Device device;
  bool owned = true;  // false: wraps memory somebody else frees
  ~Storage();
};

class Tensor {
 public:
  Tensor() = default;

  // ---- Allocation ----
  static Tensor empty(const Shape& shape, DType dtype, Device device = Device::cpu());
  static Tensor zeros(const Shape& shape, DType dtype, Device device = Device::cpu());
  // Wraps memory owned by the caller (no copy, never freed by tessera).
  static Tensor wrap(void* data, const Shape& shape, DType dtype, Device device = Device::cpu());
  // A CPU tensor holding `values` converted to `dtype` (rounded to nearest even).
  static Tensor from_floats(const std::vector<float>& values, const Shape& shape, DType dtype = DType::F32);
  static Tensor from_doubles(const std::vector<double>& values, const Shape& shape, DType dtype = DType::F64);
  static Tensor from_ints(const std::vector<int64_t>& values, const Shape& shape, DType dtype = DType::I32);

  // ---- Description ----
  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  int64_t stride(int d) const { return strides_[static_cast<size_t>(d < 0 ? d + dim() : d)]; }  // in elements
  int dim() const { return static_cast<int>(shape_.size()); }
  int64_t size(int d) const;  // negative d counts from the end
  int64_t numel() const { return shape_numel(shape_); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  int64_t offset() const { return offset_; }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  bool is_contiguous() const;
  std::string shape_string() const { return shape_to_string(shape_); }
  std::string describe() const;  // "bf16[4, 8] on cuda:0"
  bool shares_storage(const Tensor& other) const { return storage_ == other.storage_; }

  // ---- Data ----
  void* raw_data() const;  // pointer to element 0 of this view
  template <typename T>
  T* data() const { return static_cast<T*>(raw_data()); }

  // ---- Views (no copies) ----
  Tensor slice(int d, int64_t start, int64_t end) const;   // [start, end) along d
  Tensor select(int d, int64_t index) const;                 // drops dimension d
  Tensor reshape(const Shape& shape) const;                  // contiguous only; one -1 allowed
  Tensor transpose(int d0, int d1) const;
  Tensor view_as(DType dtype) const;                         // same bytes, same element size
  // Part of this contiguous view's bytes, from byte_offset on, as a packed `shape` of `dtype`
  // (it must fit, and start on a multiple of dtype's size): memory reused for other data.
  Tensor bytes_as(DType dtype, const Shape& shape, size_t byte_offset = 0) const;

  // ---- Copies ----
  Tensor contiguous() const;              // itself when already contiguous
  Tensor clone() const;                   // always a new packed copy
  Tensor to(Device device) const;         // itself when already there
  void copy_from(const Tensor& src);      // same shape and dtype; any strides, any devices
  void fill_zero();

  // ---- Reading and writing values on the CPU, for tests and tools (not hot paths) ----
  std::vector<float> to_floats() const;   // converts any floating dtype
  std::vector<double> to_doubles() const;
  std::vector<int64_t> to_ints() const;
  double item(int64_t flat_index) const;  // element flat_index of the logical view, as double
  void set_item(int64_t flat_index, double value);
  // Elements from the first to the last of this view, strides included (non-empty views):
  // the memory a kernel may touch, for overlap checks.
  int64_t span_elements() const;

 private:
  Tensor host_span_view() const;   // a CPU copy of that span, viewed with this shape and strides

  std::shared_ptr<Storage> storage_;
  int64_t offset_ = 0;
  Shape shape_;
  Shape strides_;
  DType dtype_ = DType::F32;
  Device device_;
};

Shape contiguous_strides(const Shape& shape);

// Error helpers shared by every op's argument checks.
void check_defined(const Tensor& t, const char* op, const char* name);
void check_contiguous(const Tensor& t, const char* op, const char* name);
void check_dtype(const Tensor& t, DType want, const char* op, const char* name);
void check_shape(const Tensor& t, const Shape& want, const char* op, const char* name);
void check_same_device(const Tensor& a, const Tensor& b, const char* op);
void check_floating(const Tensor& t, const char* op, const char* name);

}  // namespace tessera
