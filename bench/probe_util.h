// What the kernel probes (attention_fwd_probe.cu, attention_bwd_probe.cu) share besides
// gpu_timing.h's CHECK_CUDA and median_ms: BF16-rounded random inputs on the host and their
// upload. Header-only, so the probes still build without libtessera.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <random>
#include <vector>

#include "gpu_timing.h"

// n uniform values in [lo, hi), each rounded to BF16 (kept as float for the host reference).
inline std::vector<float> random_bf16(size_t n, std::mt19937& gen, float lo, float hi) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> x(n);
  for (float& e : x) e = __bfloat162float(__float2bfloat16(u(gen)));
  return x;
}

// A device copy of x as BF16 (exact: x holds BF16 values).
inline __nv_bfloat16* to_device(const std::vector<float>& x) {
  std::vector<__nv_bfloat16> h(x.size());
  for (size_t i = 0; i < x.size(); ++i) h[i] = __float2bfloat16(x[i]);
  __nv_bfloat16* d = nullptr;
  CHECK_CUDA(cudaMalloc(&d, h.size() * 2));
  CHECK_CUDA(cudaMemcpy(d, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
  return d;
}
