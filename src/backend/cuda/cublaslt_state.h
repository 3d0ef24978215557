// The cuBLASLt handle and workspace of each device, shared by the BF16/F32 GEMMs (gemm.cu)
// and the FP8 ones (gemm_fp8.cu), and the check that turns a cuBLASLt status into an Error.
// Both GEMM families queue on the caller's stream, so one workspace per device serves both,
// except on the side streams that fan GEMMs out (stream_fan.h), which have their own.
#pragma once

#include <cublasLt.h>

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

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

// GEMM autotuning (tessera::gemm_autotune(), ops/gemm.h), shared by gemm.cu and gemm_fp8.cu.
// Each plan asks the heuristic for up to kLtCandidates algorithms; lt_should_tune says
// whether a plan used `uses` times should be timed now (autotuning on, second use, the
// stream not capturing, the device's budget of kLtTunedShapesMax not spent: it takes one).
constexpr int kLtCandidates = 8;
constexpr int kLtTunedShapesMax = 512;
bool lt_should_tune(int device, void* stream, int uses);

// The heuristic's candidates widened for tuning: besides each of them, its variants with
// every tile its algorithm supports, every custom option up to 7 and the cluster shapes 1x1,
// 2x1 and 1x2 (its stage count, split-K and swizzle kept), those cublasLtMatmulAlgoCheck
// accepts within the workspace, at most kLtWideMax in all. The heuristic's list comes first,
// in its order (index 0 stays its choice). Why: for the short-K weight gradients of MoE
// experts the heuristic's choices ran 1.18-1.37x slower than configurations it never offers
// (bench/RESULTS.md, twenty-second session).
constexpr int kLtWideMax = 384;
std::vector<cublasLtMatmulAlgo_t> lt_widen(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                           cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                           cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
                                           const std::vector<cublasLtMatmulAlgo_t>& heuristic, size_t workspace_bytes);

// Times `count` candidate algorithms of one GEMM on the stream and returns the index to
// keep: 0 (the heuristic's first) unless another is more than 1% faster, also 0 when there
// is nothing to time (one candidate, or no memory for a scratch output). More than
// kLtCandidates are screened first (one timed run each) and the heuristic's first plus the
// kLtCandidates - 1 fastest timed in full. launch(i, d) runs candidate i with d as its output
// (and, when beta != 0, as its C input too: the GEMM runs in place, as the caller's does)
// and returns false where it fails. With beta_zero the candidates write `out` itself (the
// caller's own call, after, overwrites it); otherwise out is also an input, so they run on a
// scratch copy of out's out_bytes, cudaMalloc'ed outside the caching allocator and freed
// before returning. Logs a line naming `what`.
int lt_tune(void* stream, int count, bool beta_zero, void* out, size_t out_bytes,
            const std::function<bool(int, void*)>& launch, const std::string& what);
std::vector<std::string> lt_autotune_log();

}  // namespace tessera::cuda
