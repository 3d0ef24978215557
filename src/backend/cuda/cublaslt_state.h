// The cuBLASLt handle and workspace of each device, shared by the BF16/F32 GEMMs (gemm.cu)
// and the FP8 ones (gemm_fp8.cu), and the check that turns a cuBLASLt status into an Error.
// Both GEMM families queue on the caller's stream, so one workspace per device serves both,
// except on the side streams that fan GEMMs out (stream_fan.h), which have their own.
#pragma once

#include <cublasLt.h>

#include <cstddef>

#include "tessera/core/error.h"
#include "tessera/core/tensor.h"

#define TESSERA_CUBLAS_CHECK(call)                                                               \
  do {                                                                                           \
    cublasStatus_t tessera_cublas_status = (call);                                               \
    if (tessera_cublas_status != CUBLAS_STATUS_SUCCESS)                                          \
      TESSERA_FAIL("cuBLASLt error in ", #call, ": ", cublasGetStatusString(tessera_cublas_status)); \
  } while (0)

namespace tessera::cuda {

constexpr size_t kLtWorkspaceBytes = size_t(32) << 20;

struct LtState {
  cublasLtHandle_t handle = nullptr;
  Tensor workspace;  // kLtWorkspaceBytes on the device
  Tensor side_workspaces[4];  // one per StreamFan side stream (stream_fan.h), made on first use
};

// The workspace a GEMM queued on `stream` uses: the device's shared one, or the side
// stream's own (GEMMs that may run at once must not share a workspace).
void* lt_workspace(LtState& state, int device, void* stream);

// One handle and workspace per device, made on first use and kept for the process.
LtState& lt_state(int device);

}  // namespace tessera::cuda
