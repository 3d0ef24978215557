// CPU reference: rotary position embedding (Hugging Face Llama "rotate_half" layout),
// forward and backward.
//
// Layout: row-major [B, T, H, D], D last and contiguous; the pairs rotated together are
// (i, i + D/2) of one head vector. A [T, D/2] table of cosines and sines is built in
// double and rounded once to the compute type (double for F64 inputs, float otherwise);
// the rotation itself runs in the compute type. Backward is the rotation by -angle.
#include "rope.h"

#include <cmath>
#include <vector>

#include "float_buffer.h"

namespace tessera::cpu {
namespace {

// Below this many elements a parallel region costs more than it saves (and stalls badly on
// a loaded machine), so small tensors stay on one thread.
constexpr int64_t kMinParallelElements = 1 << 15;

// Rotates every head vector of `in` by +angle (direction = 1) or -angle (direction = -1).
void rotate(const Tensor& in_tensor, Tensor& out_tensor, const RopeOptions& options, int direction) {
  dispatch_compute_type(in_tensor.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t seq = in_tensor.size(1), heads = in_tensor.size(2), dim = in_tensor.size(3);
    const int64_t half = dim / 2;
    const int64_t rows = in_tensor.numel() == 0 ? 0 : in_tensor.numel() / dim;

    std::vector<T> cos_table(static_cast<size_t>(seq * half)), sin_table(static_cast<size_t>(seq * half));
    std::vector<double> inv_freq(static_cast<size_t>(half));
    const double theta = options.theta;
    for (int64_t i = 0; i < half; ++i)
      inv_freq[i] = std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(dim));
#pragma omp parallel for schedule(static) if (seq * half >= kMinParallelElements)
    for (int64_t t = 0; t < seq; ++t) {
      const double position = static_cast<double>(t + options.position_offset);
      for (int64_t i = 0; i < half; ++i) {
        const double angle = position * inv_freq[i];
        cos_table[t * half + i] = static_cast<T>(std::cos(angle));
        sin_table[t * half + i] = static_cast<T>(direction * std::sin(angle));
      }
    }

    ReadBuffer<T> in(in_tensor);
    WriteBuffer<T> out(out_tensor);
#pragma omp parallel for schedule(static) if (in_tensor.numel() >= kMinParallelElements)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t t = (r / heads) % seq;
      const T* c = cos_table.data() + t * half;
      const T* s = sin_table.data() + t * half;
      const T* xr = in.data() + r * dim;
      T* yr = out.data() + r * dim;
      for (int64_t i = 0; i < half; ++i) {
        // Both halves are read before either is written, so out may be the same memory as in.
        const T first = xr[i], second = xr[i + half];
        yr[i] = first * c[i] - second * s[i];
        yr[i + half] = second * c[i] + first * s[i];
      }
    }
    out.commit();
  });
}

}  // namespace

void rope_forward(const Tensor& x, Tensor& y, const RopeOptions& options) { rotate(x, y, options, 1); }

void rope_backward(const Tensor& dy, Tensor& dx, const RopeOptions& options) { rotate(dy, dx, options, -1); }

}  // namespace tessera::cpu
