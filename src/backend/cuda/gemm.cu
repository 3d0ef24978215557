// GEMM on the GPU through cuBLASLt: c = alpha * op(a) op(b) * a_scale_inv * b_scale_inv
// + beta * c + bias, row-major, FP32 accumulation (CUBLAS_COMPUTE_32F).
//
// cuBLASLt is column-major; a row-major [M, N] matrix is the column-major [N, M] one, so
// the row-major product C = op(A) op(B) is computed as the column-major C^T = op(B)^T op(A)^T:
// the operands swap places and keep their transpose flags. The bias epilogue adds a vector
// over the rows of the column-major result, i.e. over the columns of ours, as GemmOptions
// says. F32 x F32 -> F32 and BF16 x BF16 -> BF16 or F32; the heuristic picks the
// algorithm (no algo cached yet). Speed against cuBLAS through PyTorch: the CUDA backend
// stage's benchmarks.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <mutex>

#include "cuda_backend.h"
#include "cuda_check.h"

#define TESSERA_CUBLAS_CHECK(call)                                                               \
  do {                                                                                           \
    cublasStatus_t tessera_cublas_status = (call);                                               \
    if (tessera_cublas_status != CUBLAS_STATUS_SUCCESS)                                          \
      TESSERA_FAIL("cuBLASLt error in ", #call, ": ", cublasGetStatusString(tessera_cublas_status)); \
  } while (0)

namespace tessera::cuda {

namespace {

constexpr size_t kWorkspaceBytes = size_t(32) << 20;

struct LtState {
  cublasLtHandle_t handle = nullptr;
  Tensor workspace;
};

// One handle and workspace per device, made on first use and kept for the process.
LtState& lt_state(int device) {
  static std::mutex mutex;
  static LtState* states[64] = {};
  std::lock_guard<std::mutex> lock(mutex);
  TESSERA_CHECK(device >= 0 && device < 64, "gemm: device index ", device, " out of range");
  if (!states[device]) {
    auto* s = new LtState();
    TESSERA_CUBLAS_CHECK(cublasLtCreate(&s->handle));
    s->workspace = Tensor::empty({static_cast<int64_t>(kWorkspaceBytes)}, DType::U8, Device::cuda(device));
    states[device] = s;
  }
  return *states[device];
}

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::F32: return CUDA_R_32F;
    case DType::BF16: return CUDA_R_16BF;
    default: TESSERA_FAIL("gemm on CUDA: dtype ", dtype_name(t), " has no cuBLASLt path in this build (F32, BF16)");
  }
}

struct Layout {
  cublasLtMatrixLayout_t desc = nullptr;
  Layout(cudaDataType_t type, uint64_t rows, uint64_t cols, int64_t ld) {
    TESSERA_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&desc, type, rows, cols, ld));
  }
  ~Layout() { cublasLtMatrixLayoutDestroy(desc); }
};

}  // namespace

bool gemm_supported(const Tensor& a, const Tensor& b, const Tensor& c, const Tensor& bias) {
  // The combinations cuBLASLt runs with FP32 compute: F32 x F32 -> F32, BF16 x BF16 -> BF16 or F32.
  const bool inputs = a.dtype() == b.dtype() && (a.dtype() == DType::F32 || a.dtype() == DType::BF16);
  const bool output = c.dtype() == DType::F32 || (c.dtype() == DType::BF16 && a.dtype() == DType::BF16);
  const bool bias_ok = !bias.defined() || bias.dtype() == c.dtype();
  return inputs && output && bias_ok;
}

void gemm(void* stream, const Tensor& a, const Tensor& b, Tensor& c, bool transpose_a, bool transpose_b, float alpha,
          float beta, const Tensor& bias) {
  const int64_t m = c.size(0), n = c.size(1);
  const int64_t k = transpose_a ? a.size(0) : a.size(1);
  if (m == 0 || n == 0) return;
  TESSERA_CHECK(k > 0, "gemm on CUDA: an inner dimension of 0 has no cuBLASLt path (a ", a.describe(), ", b ",
                b.describe(), ")");
  LtState& state = lt_state(c.device().index);

  cublasLtMatmulDesc_t desc = nullptr;
  TESSERA_CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  // Column-major call: first operand is our b, second our a.
  const cublasOperation_t op_first = transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_second = transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  TESSERA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_first, sizeof(op_first)));
  TESSERA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_second, sizeof(op_second)));
  if (bias.defined()) {
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    const void* bias_ptr = bias.raw_data();
    const cudaDataType_t bias_type = cuda_type(bias.dtype());
    TESSERA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
    TESSERA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias_ptr, sizeof(bias_ptr)));
    TESSERA_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type)));
  }
  // Stored shapes, column-major: our row-major [r, c] tensor is a [c, r] matrix with ld c.
  const Layout first(cuda_type(b.dtype()), b.size(1), b.size(0), b.size(1));
  const Layout second(cuda_type(a.dtype()), a.size(1), a.size(0), a.size(1));
  const Layout out(cuda_type(c.dtype()), n, m, n);
  const cublasStatus_t status =
      cublasLtMatmul(state.handle, desc, &alpha, b.raw_data(), first.desc, a.raw_data(), second.desc, &beta,
                     c.raw_data(), out.desc, c.raw_data(), out.desc, nullptr, state.workspace.raw_data(),
                     kWorkspaceBytes, static_cast<cudaStream_t>(stream));
  cublasLtMatmulDescDestroy(desc);
  TESSERA_CHECK(status == CUBLAS_STATUS_SUCCESS, "gemm on CUDA: cublasLtMatmul failed (", cublasGetStatusString(status),
                ") for a ", a.describe(), ", b ", b.describe(), ", c ", c.describe());
}

}  // namespace tessera::cuda
