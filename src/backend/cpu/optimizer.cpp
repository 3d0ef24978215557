// CPU reference AdamW: one in-place step over flat, contiguous parameter, gradient and
// moment arrays (elementwise, so any shape), in PyTorch's order of operations.
#include "optimizer.h"

#include <cmath>

#include "float_buffer.h"

namespace tessera::cpu {

void adamw_step(Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq, const AdamWOptions& options) {
  // param, exp_avg and exp_avg_sq are F32 or F64 (checked by the front end), so T is their
  // own type and the buffers below point straight at them.
  dispatch_compute_type(param.dtype(), [&](auto zero) {
    using T = decltype(zero);
    T* p = param.data<T>();
    T* m = exp_avg.data<T>();
    T* v = exp_avg_sq.data<T>();
    ReadBuffer<T> g(grad);
    const double step = static_cast<double>(options.step);
    // Scalars in double, as Python computes them for PyTorch, then rounded once to T.
    const double bias_correction1 = 1.0 - std::pow(static_cast<double>(options.beta1), step);
    const double bias_correction2 = 1.0 - std::pow(static_cast<double>(options.beta2), step);
    const T step_size = static_cast<T>(static_cast<double>(options.lr) / bias_correction1);
    const T bias_correction2_sqrt = static_cast<T>(std::sqrt(bias_correction2));
    const T decay = static_cast<T>(1.0 - static_cast<double>(options.lr) * options.weight_decay);
    const T beta1 = options.beta1, beta2 = options.beta2;
    const T one_minus_beta1 = static_cast<T>(1.0 - static_cast<double>(options.beta1));
    const T one_minus_beta2 = static_cast<T>(1.0 - static_cast<double>(options.beta2));
    const T eps = options.eps;
    const int64_t n = param.numel();
    // Small tensors (biases, norm gains) are cheaper on one thread than a team wake-up.
#pragma omp parallel for schedule(static) if (n > (1 << 14))
    for (int64_t i = 0; i < n; ++i) {
      const T gi = g[i];
      const T mi = beta1 * m[i] + one_minus_beta1 * gi;
      const T vi = beta2 * v[i] + one_minus_beta2 * gi * gi;
      m[i] = mi;
      v[i] = vi;
      const T denom = std::sqrt(vi) / bias_correction2_sqrt + eps;
      p[i] = p[i] * decay - step_size * (mi / denom);
    }
  });
}

}  // namespace tessera::cpu
