// Turning CUDA errors into tessera::Error with the failing call named.
#pragma once

#include <cuda_runtime.h>

#include "tessera/core/error.h"

#define TESSERA_CUDA_CHECK(call)                                                                     \
  do {                                                                                               \
    cudaError_t tessera_cuda_status = (call);                                                        \
    if (tessera_cuda_status != cudaSuccess)                                                          \
      TESSERA_FAIL("CUDA error in ", #call, ": ", cudaGetErrorString(tessera_cuda_status));          \
  } while (0)

// After a kernel launch: reports bad launch configurations at once (no device sync).
#define TESSERA_CUDA_CHECK_LAUNCH() TESSERA_CUDA_CHECK(cudaGetLastError())
