// Launch helpers for sm_90 features that need cudaLaunchKernelEx: programmatic dependent
// launch (a kernel that may start before the one ahead of it in the stream ends) and thread
// block clusters sized at run time. Shared by the cross-entropy kernels (loss*.cu) and the
// norm backward (norm_launch.cuh). CUDA-only.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

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

struct LaunchOptions {
  dim3 grid, block;
  size_t smem = 0;       // dynamic shared memory per block
  unsigned cluster = 1;  // blocks per cluster along x (1: no cluster)
  bool pdl = false;      // a programmatic dependent of the previous work on the stream
};

template <typename... Params, typename... Args>
void launch_ex(void (*kernel)(Params...), const LaunchOptions& o, cudaStream_t s, Args... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = o.grid;
  config.blockDim = o.block;
  config.dynamicSmemBytes = o.smem;
  config.stream = s;
  cudaLaunchAttribute attribute[2];
  unsigned n = 0;
  if (o.pdl) {
    attribute[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  if (o.cluster > 1) {
    attribute[n].id = cudaLaunchAttributeClusterDimension;
    attribute[n].val.clusterDim.x = o.cluster;
    attribute[n].val.clusterDim.y = 1;
    attribute[n].val.clusterDim.z = 1;
    ++n;
  }
  config.attrs = attribute;
  config.numAttrs = n;
  TESSERA_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...));
}

// Launches kernel as a programmatic dependent of the previous work on stream s (see pdl_wait).
// kUsePdl = false makes it an ordinary launch (the kernels stay correct: pdl_wait is then a
// no-op and the stream orders them).
constexpr bool kUsePdl = true;
template <typename... Params, typename... Args>
void launch_pdl(void (*kernel)(Params...), dim3 blocks, dim3 threads, cudaStream_t s, Args... args) {
  LaunchOptions o;
  o.grid = blocks;
  o.block = threads;
  o.pdl = kUsePdl;
  launch_ex(kernel, o, s, args...);
}

}  // namespace tessera::cuda
