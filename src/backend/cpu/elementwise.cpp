// CPU reference: residual add, casts and the 2-D transpose. Memory-bound loops;
// OpenMP splits them over the cores.
#include "elementwise.h"

#include <cstring>

#include "float_buffer.h"

namespace tessera::cpu {

void add(const Tensor& a, const Tensor& b, Tensor& out) {
  dispatch_compute_type(out.dtype(), [&](auto zero) {
    using T = decltype(zero);
    ReadBuffer<T> x(a), y(b);
    WriteBuffer<T> z(out);
    const int64_t n = out.numel();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) z[i] = x[i] + y[i];
    z.commit();
  });
}

void scale(const Tensor& in, float alpha, Tensor& out) {
  dispatch_compute_type(out.dtype(), [&](auto zero) {
    using T = decltype(zero);
    ReadBuffer<T> x(in);
    WriteBuffer<T> y(out);
    const int64_t n = out.numel();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) y[i] = static_cast<T>(alpha) * x[i];
    y.commit();
  });
}

void cast(const Tensor& in, Tensor& out) {
  const int64_t n = in.numel();
  const void* src = in.raw_data();
  void* dst = out.raw_data();
  if (in.dtype() == out.dtype()) {
    std::memcpy(dst, src, out.nbytes());
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) store_element(dst, out.dtype(), i, load_element(src, in.dtype(), i));
}

void transpose_2d(const Tensor& in, Tensor& out) {
  const int64_t rows = in.size(0), cols = in.size(1);
  const size_t es = dtype_size(in.dtype());
  const char* src = static_cast<const char*>(in.raw_data());
  char* dst = static_cast<char*>(out.raw_data());
  // 32x32 tiles keep both the reads and the writes within a few cache lines.
  constexpr int64_t kTile = 32;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t r0 = 0; r0 < rows; r0 += kTile)
    for (int64_t c0 = 0; c0 < cols; c0 += kTile)
      for (int64_t r = r0; r < std::min(rows, r0 + kTile); ++r)
        for (int64_t c = c0; c < std::min(cols, c0 + kTile); ++c)
          std::memcpy(dst + (c * rows + r) * es, src + (r * cols + c) * es, es);
}

}  // namespace tessera::cpu
