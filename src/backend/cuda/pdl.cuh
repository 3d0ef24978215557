// Programmatic dependent launch (sm_90, through cudaLaunchKernelEx): a kernel that may start
// before the one ahead of it in the stream ends. Shared by the cross-entropy kernels
// (loss*.cu) and the norm backward's finalize (norm_launch.cuh). CUDA-only.
#pragma once

#include <cuda_runtime.h>

#include "cuda_check.h"

namespace tessera::cuda {

// Programmatic dependent launch (sm_90): a kernel launched with pdl = true may start before
// the one ahead of it in the stream ends, once every block of that one has called
// pdl_launch_dependents (or exited); it must call pdl_wait before touching anything the
// earlier kernel writes, and every one of its blocks calls it (so it cannot end first).
// Without the launch attribute, or below sm_90, both are no-ops.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Launches kernel on stream s, as a programmatic dependent of the previous work there when
// `pdl` (see pdl_wait), as an ordinary launch otherwise (the kernels stay correct: pdl_wait
// is then a no-op and the stream orders them).
template <typename... Params, typename... Args>
void launch_pdl_if(bool pdl, void (*kernel)(Params...), dim3 blocks, dim3 threads, cudaStream_t s, Args... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = blocks;
  config.blockDim = threads;
  config.dynamicSmemBytes = 0;
  config.stream = s;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = pdl ? 1 : 0;
  TESSERA_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...));
}

// The cross-entropy kernels' launch (kUsePdl = false would make them ordinary launches).
constexpr bool kUsePdl = true;
template <typename... Params, typename... Args>
void launch_pdl(void (*kernel)(Params...), dim3 blocks, dim3 threads, cudaStream_t s, Args... args) {
  launch_pdl_if(kUsePdl, kernel, blocks, threads, s, args...);
}

}  // namespace tessera::cuda
