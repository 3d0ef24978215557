// CPU reference: GELU (tanh approximation) and SwiGLU, forward and backward.
//
// GELU is elementwise over contiguous tensors. SwiGLU works on row-major [rows, 2F]
// inputs (leading dimensions flattened, last dimension contiguous) whose first F columns
// are the gate and last F the up projection, producing [rows, F]. Everything runs in the
// compute type: double for F64 inputs, float otherwise.
#include "activation.h"

#include <cmath>

#include "float_buffer.h"

namespace tessera::cpu {
namespace {

// Below this many elements a parallel region costs more than it saves (and stalls badly on
// a loaded machine), so small tensors stay on one thread.
constexpr int64_t kMinParallelElements = 1 << 15;

template <typename T>
struct GeluConstants {
  static constexpr T kSqrt2OverPi = static_cast<T>(0.79788456080286535587989211986876);  // sqrt(2 / pi)
  static constexpr T kCubic = static_cast<T>(0.044715);
};

template <typename T>
T gelu(T x) {
  using K = GeluConstants<T>;
  const T inner = K::kSqrt2OverPi * (x + K::kCubic * x * x * x);
  return T(0.5) * x * (T(1) + std::tanh(inner));
}

template <typename T>
T gelu_derivative(T x) {
  using K = GeluConstants<T>;
  const T inner = K::kSqrt2OverPi * (x + K::kCubic * x * x * x);
  const T t = std::tanh(inner);
  const T sech2 = T(1) - t * t;
  // Far in the tails sech^2 is exactly 0 while x * d_inner may overflow; 0 * inf would be NaN.
  if (sech2 == T(0)) return T(0.5) * (T(1) + t);
  const T d_inner = K::kSqrt2OverPi * (T(1) + T(3) * K::kCubic * x * x);
  return T(0.5) * (T(1) + t) + T(0.5) * x * sech2 * d_inner;
}

// 1 / (1 + exp(-g)) saturates cleanly at both ends: exp(-g) = inf gives 0, never NaN.
template <typename T>
T sigmoid(T g) {
  return T(1) / (T(1) + std::exp(-g));
}

}  // namespace

void gelu_forward(const Tensor& x, Tensor& y) {
  dispatch_compute_type(x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    ReadBuffer<T> in(x);
    WriteBuffer<T> out(y);
    const int64_t n = x.numel();
#pragma omp parallel for schedule(static) if (n >= kMinParallelElements)
    for (int64_t i = 0; i < n; ++i) out[i] = gelu(in[i]);
    out.commit();
  });
}

void gelu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) {
  dispatch_compute_type(x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    ReadBuffer<T> in(x), grad_out(dy);
    WriteBuffer<T> grad_in(dx);
    const int64_t n = x.numel();
#pragma omp parallel for schedule(static) if (n >= kMinParallelElements)
    for (int64_t i = 0; i < n; ++i) grad_in[i] = grad_out[i] * gelu_derivative(in[i]);
    grad_in.commit();
  });
}

void swiglu_forward(const Tensor& x, Tensor& y) {
  dispatch_compute_type(x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t width = x.size(-1), half = width / 2, rows = width == 0 ? 0 : x.numel() / width;
    ReadBuffer<T> in(x);
    WriteBuffer<T> out(y);
#pragma omp parallel for schedule(static) if (x.numel() >= kMinParallelElements)
    for (int64_t r = 0; r < rows; ++r) {
      const T* gate = in.data() + r * width;
      const T* up = gate + half;
      T* yr = out.data() + r * half;
      for (int64_t c = 0; c < half; ++c) yr[c] = gate[c] * sigmoid(gate[c]) * up[c];
    }
    out.commit();
  });
}

void swiglu_backward(const Tensor& x, const Tensor& dy, Tensor& dx, Tensor* y) {
  dispatch_compute_type(x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t width = x.size(-1), half = width / 2, rows = width == 0 ? 0 : x.numel() / width;
    ReadBuffer<T> in(x), grad_out(dy);
    WriteBuffer<T> grad_in(dx);
    // An undefined tensor when y is not wanted: nothing is written to it.
    Tensor none;
    WriteBuffer<T> forward_out(y ? *y : none);
    T* yd = y ? forward_out.data() : nullptr;
#pragma omp parallel for schedule(static) if (x.numel() >= kMinParallelElements)
    for (int64_t r = 0; r < rows; ++r) {
      const T* gate = in.data() + r * width;
      const T* up = gate + half;
      const T* dyr = grad_out.data() + r * half;
      T* dgate = grad_in.data() + r * width;
      T* dup = dgate + half;
      T* yr = yd ? yd + r * half : nullptr;
      for (int64_t c = 0; c < half; ++c) {
        const T g = gate[c], s = sigmoid(g), u = up[c], d = dyr[c];
        // Both values are read before either gradient is stored.
        dgate[c] = d * u * s * (T(1) + g * (T(1) - s));
        dup[c] = d * g * s;
        if (yr) yr[c] = g * s * u;  // swiglu_forward's expression: gate * sigmoid(gate) * up
      }
    }
    grad_in.commit();
    if (y) forward_out.commit();
  });
}

}  // namespace tessera::cpu
