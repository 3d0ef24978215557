#include "tessera/core/tensor.h"

#include <algorithm>
#include <cstring>
#include <sstream>

#include "../backend/cpu/element.h"
#include "tessera/core/allocator.h"
#include "tessera/core/stream.h"
#if TESSERA_WITH_CUDA
#include "../backend/cuda/copy.h"
#endif

namespace tessera {

std::string shape_to_string(const Shape& shape) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << "]";
  return out.str();
}

int64_t shape_numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

Shape contiguous_strides(const Shape& shape) {
  Shape strides(shape.size());
  int64_t s = 1;
  for (int i = static_cast<int>(shape.size()) - 1; i >= 0; --i) {
    strides[i] = s;
    s *= shape[i];
  }
  return strides;
}

Storage::~Storage() {
  if (owned && data) allocator_for(device).deallocate(data, bytes);
}

// ---- Allocation ------------------------------------------------------------------------

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  for (int64_t s : shape) {
    TESSERA_CHECK(s >= 0, "Tensor::empty: negative dimension in shape ", shape_to_string(shape));
  }
  Tensor t;
  t.storage_ = std::make_shared<Storage>();
  t.storage_->device = device;
  t.storage_->bytes = static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype);
  t.storage_->data = t.storage_->bytes ? allocator_for(device).allocate(t.storage_->bytes) : nullptr;
  t.shape_ = shape;
  t.strides_ = contiguous_strides(shape);
  t.dtype_ = dtype;
  t.device_ = device;
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  t.fill_zero();
  return t;
}

Tensor Tensor::wrap(void* data, const Shape& shape, DType dtype, Device device) {
  TESSERA_CHECK(data != nullptr || shape_numel(shape) == 0, "Tensor::wrap: null pointer for shape ",
                shape_to_string(shape));
  Tensor t;
  t.storage_ = std::make_shared<Storage>();
  t.storage_->data = data;
  t.storage_->bytes = static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype);
  t.storage_->device = device;
  t.storage_->owned = false;
  t.shape_ = shape;
  t.strides_ = contiguous_strides(shape);
  t.dtype_ = dtype;
  t.device_ = device;
  return t;
}

namespace {
template <typename V>
Tensor from_values(const std::vector<V>& values, const Shape& shape, DType dtype, const char* who) {
  TESSERA_CHECK(static_cast<int64_t>(values.size()) == shape_numel(shape), who, ": ", values.size(),
                " values do not fill shape ", shape_to_string(shape));
  Tensor t = Tensor::empty(shape, dtype);
  for (size_t i = 0; i < values.size(); ++i) cpu::store_element(t.raw_data(), dtype, static_cast<int64_t>(i),
                                                                static_cast<double>(values[i]));
  return t;
}
}  // namespace

Tensor Tensor::from_floats(const std::vector<float>& v, const Shape& s, DType d) { return from_values(v, s, d, "Tensor::from_floats"); }
Tensor Tensor::from_doubles(const std::vector<double>& v, const Shape& s, DType d) { return from_values(v, s, d, "Tensor::from_doubles"); }
Tensor Tensor::from_ints(const std::vector<int64_t>& v, const Shape& s, DType d) { return from_values(v, s, d, "Tensor::from_ints"); }

// ---- Description -----------------------------------------------------------------------

int64_t Tensor::size(int d) const {
  const int n = dim();
  if (d < 0) d += n;
  TESSERA_CHECK(d >= 0 && d < n, "Tensor::size: dimension ", d, " out of range for shape ", shape_string());
  return shape_[d];
}

bool Tensor::is_contiguous() const {
  int64_t expected = 1;
  for (int i = dim() - 1; i >= 0; --i) {
    if (shape_[i] != 1 && strides_[i] != expected) return false;
    expected *= shape_[i];
  }
  return true;
}

std::string Tensor::describe() const {
  if (!defined()) return "undefined tensor";
  return std::string(dtype_name(dtype_)) + shape_string() + " on " + device_.to_string();
}

void* Tensor::raw_data() const {
  if (!storage_ || !storage_->data) return nullptr;
  return static_cast<char*>(storage_->data) + offset_ * static_cast<int64_t>(dtype_size(dtype_));
}

// ---- Views -----------------------------------------------------------------------------

static int normalize_dim(int d, int n, const char* who, const Tensor& t) {
  if (d < 0) d += n;
  TESSERA_CHECK(d >= 0 && d < n, who, ": dimension out of range for ", t.describe());
  return d;
}

Tensor Tensor::slice(int d, int64_t start, int64_t end) const {
  d = normalize_dim(d, dim(), "Tensor::slice", *this);
  TESSERA_CHECK(0 <= start && start <= end && end <= shape_[d], "Tensor::slice: range [", start, ", ", end,
                ") out of bounds for dimension ", d, " of ", describe());
  Tensor t = *this;
  t.offset_ += start * strides_[d];
  t.shape_[d] = end - start;
  return t;
}

Tensor Tensor::select(int d, int64_t index) const {
  d = normalize_dim(d, dim(), "Tensor::select", *this);
  TESSERA_CHECK(0 <= index && index < shape_[d], "Tensor::select: index ", index, " out of bounds for dimension ",
                d, " of ", describe());
  Tensor t = *this;
  t.offset_ += index * strides_[d];
  t.shape_.erase(t.shape_.begin() + d);
  t.strides_.erase(t.strides_.begin() + d);
  return t;
}

Tensor Tensor::reshape(const Shape& shape) const {
  TESSERA_CHECK(is_contiguous(), "Tensor::reshape: needs a contiguous tensor, got strides ",
                shape_to_string(strides_), " for ", describe(), " (call contiguous() first)");
  Shape s = shape;
  int infer = -1;
  int64_t known = 1;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == -1) {
      TESSERA_CHECK(infer < 0, "Tensor::reshape: more than one -1 in ", shape_to_string(shape));
      infer = static_cast<int>(i);
    } else {
      TESSERA_CHECK(s[i] >= 0, "Tensor::reshape: negative dimension in ", shape_to_string(shape));
      known *= s[i];
    }
  }
  if (infer >= 0) {
    TESSERA_CHECK(known > 0 && numel() % known == 0, "Tensor::reshape: cannot infer -1 in ", shape_to_string(shape),
                  " for ", describe());
    s[infer] = numel() / known;
  }
  TESSERA_CHECK(shape_numel(s) == numel(), "Tensor::reshape: ", shape_to_string(s), " has ", shape_numel(s),
                " elements but ", describe(), " has ", numel());
  Tensor t = *this;
  t.shape_ = s;
  t.strides_ = contiguous_strides(s);
  return t;
}

Tensor Tensor::transpose(int d0, int d1) const {
  d0 = normalize_dim(d0, dim(), "Tensor::transpose", *this);
  d1 = normalize_dim(d1, dim(), "Tensor::transpose", *this);
  Tensor t = *this;
  std::swap(t.shape_[d0], t.shape_[d1]);
  std::swap(t.strides_[d0], t.strides_[d1]);
  return t;
}

Tensor Tensor::view_as(DType dtype) const {
  TESSERA_CHECK(dtype_size(dtype) == dtype_size(dtype_), "Tensor::view_as: ", dtype_name(dtype),
                " has another element size than ", describe());
  Tensor t = *this;
  t.dtype_ = dtype;
  return t;
}

Tensor Tensor::bytes_as(DType dtype, const Shape& shape, size_t byte_offset) const {
  TESSERA_CHECK(defined() && is_contiguous(), "Tensor::bytes_as: needs a defined contiguous tensor, got ", describe());
  for (int64_t d : shape) TESSERA_CHECK(d >= 0, "Tensor::bytes_as: negative dimension in ", shape_to_string(shape));
  const size_t size = dtype_size(dtype);
  const size_t start = static_cast<size_t>(offset_) * dtype_size(dtype_) + byte_offset;
  TESSERA_CHECK(start % size == 0, "Tensor::bytes_as: byte ", byte_offset, " of ", describe(), " is not aligned for ",
                dtype_name(dtype));
  TESSERA_CHECK(byte_offset <= nbytes() && static_cast<size_t>(shape_numel(shape)) * size <= nbytes() - byte_offset,
                "Tensor::bytes_as: ", dtype_name(dtype), shape_to_string(shape), " from byte ", byte_offset,
                " does not fit in ", describe());
  Tensor t = *this;
  t.dtype_ = dtype;
  t.shape_ = shape;
  t.strides_ = contiguous_strides(shape);
  t.offset_ = static_cast<int64_t>(start / size);
  return t;
}

// ---- Copies ----------------------------------------------------------------------------

// Calls fn(dst_offset, src_offset) for every element, walking both views in row-major order.
template <typename Fn>
static void for_each_element(const Shape& shape, const Shape& dst_strides, const Shape& src_strides, Fn fn) {
  const int n = static_cast<int>(shape.size());
  const int64_t total = shape_numel(shape);
  std::vector<int64_t> index(n, 0);
  int64_t d_off = 0, s_off = 0;
  for (int64_t k = 0; k < total; ++k) {
    fn(d_off, s_off);
    for (int i = n - 1; i >= 0; --i) {
      if (++index[i] < shape[i]) {
        d_off += dst_strides[i];
        s_off += src_strides[i];
        break;
      }
      d_off -= dst_strides[i] * (shape[i] - 1);
      s_off -= src_strides[i] * (shape[i] - 1);
      index[i] = 0;
    }
  }
}

void Tensor::copy_from(const Tensor& src) {
  check_defined(*this, "Tensor::copy_from", "destination");
  check_defined(src, "Tensor::copy_from", "source");
  TESSERA_CHECK(src.shape_ == shape_ && src.dtype_ == dtype_, "Tensor::copy_from: source ", src.describe(),
                " does not match destination ", describe());
  if (numel() == 0) return;
  if (is_contiguous() && src.is_contiguous()) {
    copy_bytes(raw_data(), device_, src.raw_data(), src.device_, nbytes());
    return;
  }
#if TESSERA_WITH_CUDA
  // Within one GPU a strided copy is a kernel (the QKV split in every attention layer).
  if (device_.is_cuda() && src.device_ == device_) {
    cuda::copy_strided(current_stream(device_), raw_data(), strides_.data(), src.raw_data(), src.strides_.data(),
                       shape_.data(), dim(), dtype_size(dtype_));
    return;
  }
#endif
  // Strided copies between host and device go through the host: fine for tools and tests,
  // never used in a step. A strided device view travels as the byte range it spans, viewed with its strides on
  // the host; a device destination is read, written on the host and sent back the same way.
  const Tensor s = src.device_.is_cpu() ? src : src.host_span_view();
  Tensor d = device_.is_cpu() ? *this : host_span_view();
  const size_t es = dtype_size(dtype_);
  char* dp = static_cast<char*>(d.raw_data());
  const char* sp = static_cast<const char*>(s.raw_data());
  if (dim() >= 2 && d.strides_.back() == 1 && s.strides_.back() == 1) {
    // Rows are contiguous on both sides (e.g. splitting a fused QKV projection): copy row
    // by row instead of element by element.
    const int64_t row = shape_.back();
    const Shape outer(shape_.begin(), shape_.end() - 1);
    const Shape d_outer(d.strides_.begin(), d.strides_.end() - 1), s_outer(s.strides_.begin(), s.strides_.end() - 1);
    for_each_element(outer, d_outer, s_outer,
                     [&](int64_t dof, int64_t sof) { std::memcpy(dp + dof * es, sp + sof * es, row * es); });
  } else {
    for_each_element(shape_, d.strides_, s.strides_,
                     [&](int64_t dof, int64_t sof) { std::memcpy(dp + dof * es, sp + sof * es, es); });
  }
  if (!device_.is_cpu()) copy_bytes(raw_data(), device_, d.raw_data(), Device::cpu(), span_elements() * es);
}

int64_t Tensor::span_elements() const {
  int64_t span = 1;
  for (int i = 0; i < dim(); ++i) span += (shape_[i] - 1) * strides_[i];
  return span;
}

Tensor Tensor::host_span_view() const {
  Tensor host = Tensor::empty({span_elements()}, dtype_);
  copy_bytes(host.raw_data(), Device::cpu(), raw_data(), device_, static_cast<size_t>(span_elements()) * dtype_size(dtype_));
  host.shape_ = shape_;
  host.strides_ = strides_;
  return host;
}

Tensor Tensor::clone() const {
  check_defined(*this, "Tensor::clone", "tensor");
  Tensor t = empty(shape_, dtype_, device_);
  t.copy_from(*this);
  return t;
}

Tensor Tensor::contiguous() const { return is_contiguous() ? *this : clone(); }

Tensor Tensor::to(Device device) const {
  check_defined(*this, "Tensor::to", "tensor");
  if (device == device_) return *this;
  Tensor t = empty(shape_, dtype_, device);
  t.copy_from(*this);
  return t;
}

void Tensor::fill_zero() {
  if (numel() == 0) return;
  if (is_contiguous()) {
    if (device_.is_cpu()) {
      std::memset(raw_data(), 0, nbytes());
    } else {
#if TESSERA_WITH_CUDA
      cuda::fill_zero_bytes(current_stream(device_), raw_data(), nbytes());
#endif
    }
    return;
  }
  Tensor z = zeros(shape_, dtype_, device_);
  copy_from(z);
}

// ---- Value access for tests and tools ---------------------------------------------------

std::vector<double> Tensor::to_doubles() const {
  check_defined(*this, "Tensor::to_doubles", "tensor");
  const Tensor c = to(Device::cpu()).contiguous();
  std::vector<double> out(static_cast<size_t>(numel()));
  for (int64_t i = 0; i < numel(); ++i) out[i] = cpu::load_element(c.raw_data(), dtype_, i);
  return out;
}

std::vector<float> Tensor::to_floats() const {
  const std::vector<double> d = to_doubles();
  return std::vector<float>(d.begin(), d.end());
}

std::vector<int64_t> Tensor::to_ints() const {
  TESSERA_CHECK(is_integer(dtype_), "Tensor::to_ints: ", describe(), " is not an integer tensor");
  const std::vector<double> d = to_doubles();
  std::vector<int64_t> out(d.size());
  for (size_t i = 0; i < d.size(); ++i) out[i] = static_cast<int64_t>(d[i]);
  return out;
}

static int64_t element_offset(const Tensor& t, int64_t flat_index) {
  TESSERA_CHECK(flat_index >= 0 && flat_index < t.numel(), "Tensor: flat index ", flat_index, " out of range for ",
                t.describe());
  int64_t off = 0;
  for (int i = t.dim() - 1; i >= 0; --i) {
    off += (flat_index % t.shape()[i]) * t.strides()[i];
    flat_index /= t.shape()[i];
  }
  return off;
}

double Tensor::item(int64_t flat_index) const {
  TESSERA_CHECK(device_.is_cpu(), "Tensor::item: ", describe(), " is not on the CPU");
  return cpu::load_element(raw_data(), dtype_, element_offset(*this, flat_index));
}

void Tensor::set_item(int64_t flat_index, double value) {
  TESSERA_CHECK(device_.is_cpu(), "Tensor::set_item: ", describe(), " is not on the CPU");
  cpu::store_element(raw_data(), dtype_, element_offset(*this, flat_index), value);
}

// ---- Argument checks -------------------------------------------------------------------

void check_defined(const Tensor& t, const char* op, const char* name) {
  TESSERA_CHECK(t.defined(), op, ": ", name, " is an undefined (empty) tensor");
}

void check_contiguous(const Tensor& t, const char* op, const char* name) {
  check_defined(t, op, name);
  TESSERA_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous, got ", t.describe(), " with strides ",
                shape_to_string(t.strides()));
}

void check_dtype(const Tensor& t, DType want, const char* op, const char* name) {
  check_defined(t, op, name);
  TESSERA_CHECK(t.dtype() == want, op, ": ", name, " must be ", dtype_name(want), ", got ", t.describe());
}

void check_shape(const Tensor& t, const Shape& want, const char* op, const char* name) {
  check_defined(t, op, name);
  TESSERA_CHECK(t.shape() == want, op, ": ", name, " must have shape ", shape_to_string(want), ", got ", t.describe());
}

void check_same_device(const Tensor& a, const Tensor& b, const char* op) {
  TESSERA_CHECK(a.device() == b.device(), op, ": tensors on different devices: ", a.describe(), " and ",
                b.describe());
}

void check_floating(const Tensor& t, const char* op, const char* name) {
  check_defined(t, op, name);
  TESSERA_CHECK(is_floating(t.dtype()), op, ": ", name, " must be a floating dtype, got ", t.describe());
}

}  // namespace tessera
