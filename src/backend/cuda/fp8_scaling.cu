// Delayed-scaling bookkeeping for every FP8 tensor of a model in one launch: fold the
// micro-batch's amaxes into the current history slot, and once per step compute each
// tensor's new scale from its amax window and advance the ring. One thread per tensor (a
// model has hundreds; the window is at most a few thousand floats per tensor), so the
// launch is latency, not bandwidth: about 5 us, against a host round trip per tensor that
// reading the amaxes back would cost. The rules and the bits are DelayedScalingState's
// (src/fp8/recipe.cpp): NaN folds sticky, the window max ignores NaN (fmaxf), a scale
// changes only for a finite amax > 0.
#include <cuda_runtime.h>

#include "cuda_check.h"
#include "fp8_scaling.h"
#include "tessera/core/numeric.h"

namespace tessera::cuda {

namespace {

constexpr int kThreads = 128;

__device__ __forceinline__ float fold_amax(float slot, float amax) {
  if (isnan(amax) || isnan(slot)) return __int_as_float(0x7fc00000);
  return amax > slot ? amax : slot;
}

__global__ void record_kernel(float* history, float* pending, int n, int len, int position) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float& slot = history[static_cast<int64_t>(i) * len + position];
  slot = fold_amax(slot, pending[i]);
  pending[i] = 0.0f;
}

__global__ void update_kernel(float* history, float* pending, float* scale, float* scale_inv, const float* fp8_max,
                              int n, int len, int position, bool window_max, float margin) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float* row = history + static_cast<int64_t>(i) * len;
  row[position] = fold_amax(row[position], pending[i]);
  pending[i] = 0.0f;
  float amax = row[position];
  if (window_max) {
    amax = 0.0f;
    for (int s = 0; s < len; ++s) amax = fmaxf(amax, row[s]);
  }
  if (amax > 0.0f && isfinite(amax)) {
    const float s = fp8_scale_for_amax(amax, fp8_max[i], margin, false);
    scale[i] = s;
    scale_inv[i] = 1.0f / s;
  }
  row[(position + 1) % len] = 0.0f;
}

__global__ void scale_from_amax_kernel(const float* amax, float fp8_max, float margin, bool power_of_two, float* scale) {
  scale[0] = fp8_scale_for_amax(amax[0], fp8_max, margin, power_of_two);
}

int blocks_for(int64_t n) { return static_cast<int>((n + kThreads - 1) / kThreads); }

}  // namespace

void delayed_scaling_record(void* stream, Tensor& history, Tensor& pending, int64_t position) {
  const int64_t n = history.size(0), len = history.size(1);
  record_kernel<<<blocks_for(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      history.data<float>(), pending.data<float>(), static_cast<int>(n), static_cast<int>(len),
      static_cast<int>(position));
  TESSERA_CUDA_CHECK(cudaGetLastError());
}

void delayed_scaling_update(void* stream, Tensor& history, Tensor& pending, Tensor& scale, Tensor& scale_inv,
                            const Tensor& fp8_max, int64_t position, bool window_max, float margin) {
  const int64_t n = history.size(0), len = history.size(1);
  update_kernel<<<blocks_for(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      history.data<float>(), pending.data<float>(), scale.data<float>(), scale_inv.data<float>(),
      fp8_max.data<float>(), static_cast<int>(n), static_cast<int>(len), static_cast<int>(position), window_max,
      margin);
  TESSERA_CUDA_CHECK(cudaGetLastError());
}

void scale_from_amax(void* stream, const Tensor& amax, float fp8_max, float margin, bool power_of_two, Tensor& scale) {
  scale_from_amax_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(amax.data<float>(), fp8_max, margin,
                                                                         power_of_two, scale.data<float>());
  TESSERA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace tessera::cuda
