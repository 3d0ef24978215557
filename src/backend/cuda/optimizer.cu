// AdamW on the GPU: one in-place step over F32 master weights and moments, from F32 or
// BF16 gradients, bit-identical to the CPU reference (backend/cpu/optimizer.cpp).
//
// Bit-identity: the step's scalars (bias corrections, step size, decay factor) are
// computed on the host by the very expressions the CPU uses, in double and rounded once
// to float; the kernel then performs the CPU's float operations in the CPU's order with
// the round-to-nearest intrinsics (__fmul_rn, __fadd_rn, __fdiv_rn, __fsqrt_rn), which
// nvcc never fuses into FMAs. The CPU build uses no FMAs either (-std=c++20 turns GCC's
// contraction off, and the x86-64 baseline has no FMA instructions); denormals are kept
// on both sides. Layout: flat contiguous arrays; 8 elements per thread step as 16-byte
// vectors when all four pointers are 16-byte aligned, scalar tail. Memory-bound: F32
// grads move 28 bytes per element (4 reads, 3 writes), BF16 grads 26; floor
// n * 28 B / 4.1 TB/s, e.g. 124M parameters -> 0.85 ms.
#include <cuda_runtime.h>

#include <cmath>

#include "cuda_check.h"
#include "optimizer.h"
#include "vec_io.cuh"

namespace tessera::cuda {

namespace {

using vec::kWidth;

constexpr int kThreads = 256;

struct Scalars {
  float step_size, bias_correction2_sqrt, decay, beta1, beta2, one_minus_beta1, one_minus_beta2, eps;
};

__device__ __forceinline__ void adamw_element(float& p, float& m, float& v, float g, const Scalars& c) {
  const float mi = __fadd_rn(__fmul_rn(c.beta1, m), __fmul_rn(c.one_minus_beta1, g));
  const float vi = __fadd_rn(__fmul_rn(c.beta2, v), __fmul_rn(__fmul_rn(c.one_minus_beta2, g), g));
  m = mi;
  v = vi;
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), c.bias_correction2_sqrt), c.eps);
  p = __fsub_rn(__fmul_rn(p, c.decay), __fmul_rn(c.step_size, __fdiv_rn(mi, denom)));
}

template <typename G, bool Vectorised>
__global__ void __launch_bounds__(kThreads)
    adamw_kernel(float* param, const G* grad, float* exp_avg, float* exp_avg_sq, int64_t n, Scalars c) {
  int64_t done = 0;
  if constexpr (Vectorised) {
    const int64_t vectors = n / kWidth;
    TESSERA_VEC_GRID_STRIDE(u, vectors) {
      const int64_t i = u * kWidth;
      float p[kWidth], m[kWidth], v[kWidth], g[kWidth];
      vec::load8(param + i, p);
      vec::load8(exp_avg + i, m);
      vec::load8(exp_avg_sq + i, v);
      vec::load8(grad + i, g);
#pragma unroll
      for (int k = 0; k < kWidth; ++k) adamw_element(p[k], m[k], v[k], g[k], c);
      vec::store8(param + i, p);
      vec::store8(exp_avg + i, m);
      vec::store8(exp_avg_sq + i, v);
    }
    done = vectors * kWidth;
  }
  TESSERA_VEC_GRID_STRIDE(j, n - done) {
    const int64_t i = done + j;
    float p = param[i], m = exp_avg[i], v = exp_avg_sq[i];
    adamw_element(p, m, v, vec::load(grad, i), c);
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
  }
}

// The CPU reference's scalar expressions (T = float), evaluated the same way.
Scalars scalars_for(const AdamWOptions& options) {
  const double step = static_cast<double>(options.step);
  const double bias_correction1 = 1.0 - std::pow(static_cast<double>(options.beta1), step);
  const double bias_correction2 = 1.0 - std::pow(static_cast<double>(options.beta2), step);
  Scalars c;
  c.step_size = static_cast<float>(static_cast<double>(options.lr) / bias_correction1);
  c.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  c.decay = static_cast<float>(1.0 - static_cast<double>(options.lr) * options.weight_decay);
  c.beta1 = options.beta1;
  c.beta2 = options.beta2;
  c.one_minus_beta1 = static_cast<float>(1.0 - static_cast<double>(options.beta1));
  c.one_minus_beta2 = static_cast<float>(1.0 - static_cast<double>(options.beta2));
  c.eps = options.eps;
  return c;
}

}  // namespace

bool adamw_step_supported(const Tensor& param, const Tensor& grad) {
  return param.dtype() == DType::F32 && vec::is_f32_or_bf16(grad.dtype());
}

void adamw_step(void* stream, Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                const AdamWOptions& options) {
  const int64_t n = param.numel();
  if (n == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  const Scalars c = scalars_for(options);
  const bool vectorised = vec::aligned16(param.raw_data()) && vec::aligned16(grad.raw_data()) &&
                          vec::aligned16(exp_avg.raw_data()) && vec::aligned16(exp_avg_sq.raw_data());
  const unsigned blocks = vec::blocks_for(vectorised ? (n + kWidth - 1) / kWidth : n, kThreads);
  vec::dispatch(grad.dtype(), "adamw_step", [&](auto* tag) {
    using G = std::remove_pointer_t<decltype(tag)>;
    if (vectorised)
      adamw_kernel<G, true><<<blocks, kThreads, 0, s>>>(param.data<float>(), grad.data<G>(), exp_avg.data<float>(),
                                                        exp_avg_sq.data<float>(), n, c);
    else
      adamw_kernel<G, false><<<blocks, kThreads, 0, s>>>(param.data<float>(), grad.data<G>(), exp_avg.data<float>(),
                                                         exp_avg_sq.data<float>(), n, c);
  });
  TESSERA_CUDA_CHECK_LAUNCH();
}

}  // namespace tessera::cuda
