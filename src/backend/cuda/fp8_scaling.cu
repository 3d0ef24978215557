// Delayed-scaling bookkeeping for every FP8 tensor of a model in one launch: fold the
// micro-batch's amaxes into the current history slot, and once per step compute each
// tensor's new scale from its amax window and advance the ring. One thread per tensor (a
// model has hundreds; the window is at most a few thousand floats per tensor), so the
// launch is latency, not bandwidth: about 5 us, against a host round trip per tensor that
// reading the amaxes back would cost. The rules and the bits are DelayedScalingState's
// (src/fp8/recipe.cpp): NaN folds sticky, the window max ignores NaN (fmaxf), a scale
// changes only for a finite amax > 0.
//
// The ring position is an I64 [1] on the device, read by the kernels (so a captured CUDA
// graph replays with the current one, not the one seen at capture). The update kernel is
// one block that loops over the tensors: every thread reads the position before a
// __syncthreads, and only after it does thread 0 advance it, so no thread can see the
// advanced value. (Several blocks would need a second launch for the advance.)
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda_check.h"
#include "fp8_scaling.h"
#include "tessera/core/numeric.h"

namespace tessera::cuda {

namespace {

constexpr int kThreads = 128;
constexpr int kUpdateThreads = 1024;  // the update's one block

__device__ __forceinline__ float fold_amax(float slot, float amax) {
  if (isnan(amax) || isnan(slot)) return __int_as_float(0x7fc00000);
  return amax > slot ? amax : slot;
}

__global__ void record_kernel(float* history, float* pending, const int64_t* position_ptr, int n, int len) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t position = *position_ptr;
  float& slot = history[static_cast<int64_t>(i) * len + position];
  slot = fold_amax(slot, pending[i]);
  pending[i] = 0.0f;
}

__global__ void update_kernel(float* history, float* pending, float* scale, float* scale_inv, const float* fp8_max,
                              int64_t* position_ptr, int n, int len, bool window_max, float margin) {
  const int position = static_cast<int>(*position_ptr);
  const int next = (position + 1) % len;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
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
    row[next] = 0.0f;
  }
  __syncthreads();  // every thread has read the position above
  if (threadIdx.x == 0) *position_ptr = next;
}

__global__ void scale_from_amax_kernel(const float* amax, float fp8_max, float margin, bool power_of_two, float* scale) {
  scale[0] = fp8_scale_for_amax(amax[0], fp8_max, margin, power_of_two);
}

int blocks_for(int64_t n) { return static_cast<int>((n + kThreads - 1) / kThreads); }

__global__ void fold_amax_kernel(const float* amax, float* target) { *target = fold_amax(*target, *amax); }

}  // namespace

void fold_amax(void* stream, const Tensor& amax, Tensor& target) {
  fold_amax_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(amax.data<float>(), target.data<float>());
  TESSERA_CUDA_CHECK(cudaGetLastError());
}

void delayed_scaling_record(void* stream, Tensor& history, Tensor& pending, const Tensor& position) {
  const int64_t n = history.size(0), len = history.size(1);
  record_kernel<<<blocks_for(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      history.data<float>(), pending.data<float>(), position.data<int64_t>(), static_cast<int>(n),
      static_cast<int>(len));
  TESSERA_CUDA_CHECK(cudaGetLastError());
}

void delayed_scaling_update(void* stream, Tensor& history, Tensor& pending, Tensor& scale, Tensor& scale_inv,
                            const Tensor& fp8_max, Tensor& position, bool window_max, float margin) {
  const int64_t n = history.size(0), len = history.size(1);
  // Whole warps, at most one block's worth; more tensors loop.
  const int threads = static_cast<int>(std::min<int64_t>(kUpdateThreads, std::max<int64_t>(32, (n + 31) / 32 * 32)));
  update_kernel<<<1, threads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<float*>(history.raw_data()), static_cast<float*>(pending.raw_data()),
      static_cast<float*>(scale.raw_data()), static_cast<float*>(scale_inv.raw_data()),
      static_cast<const float*>(fp8_max.raw_data()), position.data<int64_t>(), static_cast<int>(n),
      static_cast<int>(len), window_max, margin);
  TESSERA_CUDA_CHECK(cudaGetLastError());
}

void scale_from_amax(void* stream, const Tensor& amax, float fp8_max, float margin, bool power_of_two, Tensor& scale) {
  scale_from_amax_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(amax.data<float>(), fp8_max, margin,
                                                                         power_of_two, scale.data<float>());
  TESSERA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace tessera::cuda
