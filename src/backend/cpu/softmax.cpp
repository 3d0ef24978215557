// CPU reference: softmax over the last dimension, forward and backward.
//
// Layout: row-major [rows, C] with the softmax dimension last and contiguous (leading
// dimensions flattened). Exponentials run in the compute type (double for F64 inputs,
// float otherwise); row sums accumulate in double. OpenMP splits the rows.
#include "softmax.h"

#include <cmath>
#include <limits>

#include "float_buffer.h"

namespace tessera::cpu {
namespace {

// Below this many elements a parallel region costs more than it saves (and stalls badly on
// a loaded machine), so small tensors stay on one thread.
constexpr int64_t kMinParallelElements = 1 << 15;

}  // namespace

void softmax_forward(const Tensor& x, Tensor& y) {
  dispatch_compute_type(x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t cols = x.size(-1), rows = cols == 0 ? 0 : x.numel() / cols;
    ReadBuffer<T> in(x);
    WriteBuffer<T> out(y);
#pragma omp parallel for schedule(static) if (x.numel() >= kMinParallelElements)
    for (int64_t r = 0; r < rows; ++r) {
      const T* xr = in.data() + r * cols;
      T* yr = out.data() + r * cols;
      T row_max = -std::numeric_limits<T>::infinity();
      bool has_nan = false;
      for (int64_t c = 0; c < cols; ++c) {
        has_nan |= std::isnan(xr[c]);
        if (xr[c] > row_max) row_max = xr[c];
      }
      if (row_max == -std::numeric_limits<T>::infinity() && !has_nan) {
        // Fully masked row: no probability distribution exists; zeros keep it out of any sum.
        for (int64_t c = 0; c < cols; ++c) yr[c] = T(0);
        continue;
      }
      double sum = 0;
      for (int64_t c = 0; c < cols; ++c) {
        const T e = std::exp(xr[c] - row_max);  // -inf entries give exactly 0
        yr[c] = e;
        sum += e;
      }
      for (int64_t c = 0; c < cols; ++c) yr[c] = static_cast<T>(static_cast<double>(yr[c]) / sum);
    }
    out.commit();
  });
}

void softmax_backward(const Tensor& y, const Tensor& dy, Tensor& dx) {
  dispatch_compute_type(y.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t cols = y.size(-1), rows = cols == 0 ? 0 : y.numel() / cols;
    ReadBuffer<T> probs(y), grad_out(dy);
    WriteBuffer<T> grad_in(dx);
#pragma omp parallel for schedule(static) if (y.numel() >= kMinParallelElements)
    for (int64_t r = 0; r < rows; ++r) {
      const T* yr = probs.data() + r * cols;
      const T* dyr = grad_out.data() + r * cols;
      double dot = 0;
      for (int64_t c = 0; c < cols; ++c) dot += static_cast<double>(dyr[c]) * yr[c];
      const T dot_t = static_cast<T>(dot);
      T* dxr = grad_in.data() + r * cols;
      for (int64_t c = 0; c < cols; ++c) dxr[c] = yr[c] * (dyr[c] - dot_t);
    }
    grad_in.commit();
  });
}

}  // namespace tessera::cpu
