// CPU reference AdamW: one in-place step over flat, contiguous parameter, gradient and
// moment arrays (elementwise, so any shape), in PyTorch's order of operations; and its
// multi-tensor form with gradient clipping and the BF16 value copy, which runs the same
// element loop per tensor, so the two agree bit for bit.
#include "optimizer.h"

#include <algorithm>
#include <cmath>

#include "element.h"
#include "float_buffer.h"
#include "tessera/core/numeric.h"

namespace tessera::cpu {
namespace {

// The step's scalars in the compute type T: computed in double, as Python computes them
// for PyTorch, then rounded once to T. The CUDA kernels (optimizer.cu, multi_tensor.cu)
// evaluate the same expressions.
template <typename T>
struct Scalars {
  T step_size, bias_correction2_sqrt, beta1, beta2, one_minus_beta1, one_minus_beta2, eps;
};

template <typename T>
Scalars<T> scalars_for(const AdamWOptions& options) {
  const double step = static_cast<double>(options.step);
  const double bias_correction1 = 1.0 - std::pow(static_cast<double>(options.beta1), step);
  const double bias_correction2 = 1.0 - std::pow(static_cast<double>(options.beta2), step);
  Scalars<T> c;
  c.step_size = static_cast<T>(static_cast<double>(options.lr) / bias_correction1);
  c.bias_correction2_sqrt = static_cast<T>(std::sqrt(bias_correction2));
  c.beta1 = options.beta1;
  c.beta2 = options.beta2;
  c.one_minus_beta1 = static_cast<T>(1.0 - static_cast<double>(options.beta1));
  c.one_minus_beta2 = static_cast<T>(1.0 - static_cast<double>(options.beta2));
  c.eps = options.eps;
  return c;
}

template <typename T>
T decay_for(float lr, float weight_decay) {
  return static_cast<T>(1.0 - static_cast<double>(lr) * weight_decay);
}

// One tensor's update. With `scaled`, the gradient is multiplied by `clip` first, as
// scale(grad, clip) would have done in place; with `value_bits`, the updated weights are
// also written rounded to BF16, as cast(param -> value) would have done.
template <typename T>
void adamw_tensor(T* p, const T* g, T* m, T* v, int64_t n, const Scalars<T>& c, T decay, bool scaled, T clip,
                  uint16_t* value_bits) {
  // Small tensors (biases, norm gains) are cheaper on one thread than a team wake-up.
#pragma omp parallel for schedule(static) if (n > (1 << 14))
  for (int64_t i = 0; i < n; ++i) {
    const T gi = scaled ? clip * g[i] : g[i];
    const T mi = c.beta1 * m[i] + c.one_minus_beta1 * gi;
    const T vi = c.beta2 * v[i] + c.one_minus_beta2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    const T denom = std::sqrt(vi) / c.bias_correction2_sqrt + c.eps;
    const T pi = p[i] * decay - c.step_size * (mi / denom);
    p[i] = pi;
    if (value_bits) value_bits[i] = float_to_bf16_bits(static_cast<float>(pi));
  }
}

}  // namespace

void adamw_step(Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq, const AdamWOptions& options) {
  // param, exp_avg and exp_avg_sq are F32 or F64 (checked by the front end), so T is their
  // own type and the pointers below point straight at them.
  dispatch_compute_type(param.dtype(), [&](auto zero) {
    using T = decltype(zero);
    ReadBuffer<T> g(grad);
    adamw_tensor<T>(param.data<T>(), g.data(), exp_avg.data<T>(), exp_avg_sq.data<T>(), param.numel(),
                    scalars_for<T>(options), decay_for<T>(options.lr, options.weight_decay), false, T(1), nullptr);
  });
}

void global_grad_norm(const std::vector<Tensor>& grads, Tensor& norm_out) {
  // Every tensor cut into sum_of_squares' chunks, each summed exactly as sum_of_squares
  // sums it, all chunks of all tensors in one parallel loop (one team wake-up, not one per
  // tensor); then per tensor the chunks in order, rounded to float (kept in double for F64
  // gradients), which is what sum_of_squares writes into an F32 [1] slot; then the tensors
  // in list order. This is the training optimizer's earlier norm, bit for bit.
  constexpr int64_t kChunk = 1 << 14;  // sum_of_squares' chunk (backend/cpu/gemm.cpp)
  struct Chunk {
    size_t tensor;
    int64_t begin, end;
  };
  std::vector<Chunk> chunks;
  std::vector<size_t> first(grads.size() + 1);
  for (size_t t = 0; t < grads.size(); ++t) {
    first[t] = chunks.size();
    const int64_t n = grads[t].numel();
    for (int64_t b = 0; b < n; b += kChunk) chunks.push_back({t, b, std::min(n, b + kChunk)});
  }
  first[grads.size()] = chunks.size();
  std::vector<double> partial(chunks.size(), 0.0);
  const int64_t count = static_cast<int64_t>(chunks.size());
#pragma omp parallel for schedule(static) if (count > 1)
  for (int64_t c = 0; c < count; ++c) {
    const Chunk& k = chunks[static_cast<size_t>(c)];
    const void* base = grads[k.tensor].raw_data();
    const DType t = grads[k.tensor].dtype();
    double s = 0;
    if (t == DType::F32) {
      const float* p = static_cast<const float*>(base);
      for (int64_t i = k.begin; i < k.end; ++i) s += static_cast<double>(p[i]) * p[i];
    } else if (t == DType::F64) {
      const double* p = static_cast<const double*>(base);
      for (int64_t i = k.begin; i < k.end; ++i) s += p[i] * p[i];
    } else {
      for (int64_t i = k.begin; i < k.end; ++i) {
        const double v = load_element(base, t, i);
        s += v * v;
      }
    }
    partial[static_cast<size_t>(c)] = s;
  }
  double total = 0;
  for (size_t t = 0; t < grads.size(); ++t) {
    double sum = 0;
    for (size_t c = first[t]; c < first[t + 1]; ++c) sum += partial[c];
    total += grads[t].dtype() == DType::F64 ? sum : static_cast<double>(static_cast<float>(sum));
  }
  store_element(norm_out.raw_data(), norm_out.dtype(), 0, std::sqrt(total));
}

void adamw_step_multi(std::vector<Tensor>& params, const std::vector<Tensor>& grads, std::vector<Tensor>& exp_avgs,
                      std::vector<Tensor>& exp_avg_sqs, std::vector<Tensor>& bf16_values, const AdamWOptions& options,
                      const std::vector<float>& weight_decays, const Tensor& grad_norm, double max_norm) {
  double clip = 1.0;
  if (max_norm > 0) {
    const double norm = load_element(grad_norm.raw_data(), grad_norm.dtype(), 0);
    if (norm > max_norm) clip = max_norm / (norm + 1e-6);  // NaN norm: no clipping
  }
  const bool scaled = clip != 1.0;
  const float clip_f = static_cast<float>(clip);  // what scale(grad, float alpha) received
  for (size_t t = 0; t < params.size(); ++t) {
    Tensor& param = params[t];
    if (param.numel() == 0) continue;
    uint16_t* value_bits =
        !bf16_values.empty() && bf16_values[t].defined() ? static_cast<uint16_t*>(bf16_values[t].raw_data()) : nullptr;
    dispatch_compute_type(param.dtype(), [&](auto zero) {
      using T = decltype(zero);
      ReadBuffer<T> g(grads[t]);
      adamw_tensor<T>(param.data<T>(), g.data(), exp_avgs[t].data<T>(), exp_avg_sqs[t].data<T>(), param.numel(),
                      scalars_for<T>(options), decay_for<T>(options.lr, weight_decays[t]), scaled,
                      static_cast<T>(clip_f), value_bits);
    });
  }
}

}  // namespace tessera::cpu
