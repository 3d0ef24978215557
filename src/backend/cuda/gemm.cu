// GEMM on the GPU through cuBLASLt: c = alpha * op(a) op(b) + beta * c + bias, row-major,
// FP32 accumulation (CUBLAS_COMPUTE_32F), optionally with GELU fused into the epilogue
// (forward: c = gelu(product + bias) and the pre-activation saved as the epilogue's aux
// output; backward: c = product * gelu'(pre)), or with the bias gradient taken from the
// weight-gradient GEMM's operand (BGRADB: for dW = dy^T x it writes the column sums of dy,
// which saves linear layers a second pass over dy).
//
// cuBLASLt is column-major; a row-major [M, N] matrix is the column-major [N, M] one, so
// the row-major product C = op(A) op(B) is computed as the column-major C^T = op(B)^T op(A)^T:
// the operands swap places and keep their transpose flags. The bias epilogue adds a vector
// over the rows of the column-major result, i.e. over the columns of ours, as GemmOptions
// says. F32 x F32 -> F32 and BF16 x BF16 -> BF16 or F32.
//
// Plans are cached per shape: the descriptors and the algorithm the heuristic picked for
// (shape, transposes, dtypes, epilogue, pointer alignment) are made once, so a training
// step spends no host time in the heuristic. With autotuning on (tessera::gemm_autotune)
// the plan's second use times the heuristic's candidates and keeps the fastest. Speed
// against cuBLAS through PyTorch: the GEMM shapes of GPT-2 and Llama in bench/RESULTS.md.
// Floor: 2 M N K FLOPs at the H200's 989 TFLOP/s dense BF16 peak. Measured inside training
// steps (H200): Llama-3.2-1B's GEMMs about 755 TFLOP/s (76% of peak), GPT-2's 478-567
// (hidden 768: small K), the Mixtral experts' 780-800; these are cuBLASLt's own kernels, so
// the gain left here is in choosing among them (autotuning) and in the epilogues.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "cuda_backend.h"
#include "cuda_check.h"
#include "cublaslt_state.h"

namespace tessera::cuda {

namespace {

constexpr size_t kWorkspaceBytes = kLtWorkspaceBytes;

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::F32: return CUDA_R_32F;
    case DType::BF16: return CUDA_R_16BF;
    default: TESSERA_FAIL("gemm on CUDA: dtype ", dtype_name(t), " has no cuBLASLt path in this build (F32, BF16)");
  }
}



}  // namespace

bool gemm_supported(const Tensor& a, const Tensor& b, const Tensor& c, const Tensor& bias) {
  // The combinations cuBLASLt runs with FP32 compute: F32 x F32 -> F32, BF16 x BF16 -> BF16 or F32.
  const bool inputs = a.dtype() == b.dtype() && (a.dtype() == DType::F32 || a.dtype() == DType::BF16);
  const bool output = c.dtype() == DType::F32 || (c.dtype() == DType::BF16 && a.dtype() == DType::BF16);
  const bool bias_ok = !bias.defined() || bias.dtype() == c.dtype();
  return inputs && output && bias_ok;
}

namespace {

// Largest power of two (up to 256) dividing the address: what the heuristic may assume.
uint32_t alignment_of(const void* p) {
  const auto v = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && v % a != 0) a /= 2;
  return a;
}

struct PlanKey {
  int device;
  int64_t m, n, k, lda, ldb, ldc;
  bool transpose_a, transpose_b, has_bias, beta_zero;
  DType a, b, c;
  GemmEpilogue epilogue;
  uint32_t align_a, align_b, align_c, align_aux;
  bool operator<(const PlanKey& o) const {
    return std::tie(device, m, n, k, lda, ldb, ldc, transpose_a, transpose_b, has_bias, beta_zero, a, b, c, epilogue,
                    align_a, align_b, align_c, align_aux) <
           std::tie(o.device, o.m, o.n, o.k, o.lda, o.ldb, o.ldc, o.transpose_a, o.transpose_b, o.has_bias, o.beta_zero,
                    o.a, o.b, o.c, o.epilogue, o.align_a, o.align_b, o.align_c, o.align_aux);
  }
};

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t first = nullptr, second = nullptr, out = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool has_algo = false;
  std::vector<cublasLtMatmulAlgo_t> candidates;  // the heuristic's, best first (algo: one of them or, tuned, a variant)
  int uses = 0;
  bool tuned = false;
};

cublasLtEpilogue_t epilogue_of(GemmEpilogue e, bool has_bias) {
  switch (e) {
    case GemmEpilogue::Gelu: return has_bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
    case GemmEpilogue::GeluBackward: return CUBLASLT_EPILOGUE_DGELU;
    case GemmEpilogue::BiasGrad: return CUBLASLT_EPILOGUE_BGRADB;
    case GemmEpilogue::None: break;
  }
  return has_bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
}

Plan make_plan(cublasLtHandle_t handle, const PlanKey& key, const Tensor& a, const Tensor& b, const Tensor& c,
               const Tensor& bias) {
  Plan plan;
  TESSERA_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  // Column-major call: first operand is our b, second our a.
  const cublasOperation_t op_first = key.transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_second = key.transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  TESSERA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_first, sizeof(op_first)));
  TESSERA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_second, sizeof(op_second)));
  const cublasLtEpilogue_t epilogue = epilogue_of(key.epilogue, key.has_bias);
  TESSERA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
  if (key.has_bias) {
    const cudaDataType_t bias_type = cuda_type(bias.dtype());
    TESSERA_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type)));
  }
  if (key.epilogue == GemmEpilogue::Gelu || key.epilogue == GemmEpilogue::GeluBackward) {
    const int64_t aux_ld = key.n;  // the aux matrix is packed [m, n]
    TESSERA_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof(aux_ld)));
  }
  // Stored shapes, column-major: our row-major [r, c] tensor is a [c, r] matrix whose
  // leading dimension is our row stride (c when packed).
  TESSERA_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.first, cuda_type(b.dtype()), b.size(1), b.size(0), key.ldb));
  TESSERA_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.second, cuda_type(a.dtype()), a.size(1), a.size(0), key.lda));
  TESSERA_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.out, cuda_type(c.dtype()), key.n, key.m, key.ldc));

  cublasLtMatmulPreference_t pref = nullptr;
  TESSERA_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t workspace = kWorkspaceBytes;
  TESSERA_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                                            sizeof(workspace)));
  // Our a is cuBLASLt's B and our b its A.
  TESSERA_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &key.align_b,
                                                            sizeof(key.align_b)));
  TESSERA_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &key.align_a,
                                                            sizeof(key.align_a)));
  TESSERA_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &key.align_c,
                                                            sizeof(key.align_c)));
  TESSERA_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &key.align_c,
                                                            sizeof(key.align_c)));
  cublasLtMatmulHeuristicResult_t results[kLtCandidates] = {};
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(handle, plan.desc, plan.first, plan.second, plan.out,
                                                               plan.out, pref, kLtCandidates, results, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (status == CUBLAS_STATUS_SUCCESS && found > 0) {
    plan.algo = results[0].algo;
    plan.has_algo = true;
    for (int i = 0; i < found; ++i) plan.candidates.push_back(results[i].algo);
  }
  return plan;
}

}  // namespace

bool gemm_epilogue_supported(const Tensor& a, const Tensor& b, const Tensor& c, const Tensor& bias, const Tensor& aux) {
  // The GELU epilogues: BF16 throughout, and the aux matrix aligned as cuBLASLt requires.
  return a.dtype() == DType::BF16 && b.dtype() == DType::BF16 && c.dtype() == DType::BF16 && c.is_contiguous() &&
         aux.dtype() == DType::BF16 && aux.is_contiguous() && (!bias.defined() || bias.dtype() == DType::BF16) && c.size(1) % 8 == 0 &&
         alignment_of(aux.raw_data()) >= 16;
}

namespace {

PlanKey plan_key(const Tensor& a, const Tensor& b, const Tensor& c, bool transpose_a, bool transpose_b, float beta,
                 const Tensor& bias, GemmEpilogue epilogue, const Tensor& aux) {
  return PlanKey{c.device().index,
                 c.size(0),
                 c.size(1),
                 transpose_a ? a.size(0) : a.size(1),
                 a.size(0) > 1 ? a.stride(0) : a.size(1),
                 b.size(0) > 1 ? b.stride(0) : b.size(1),
                 c.size(0) > 1 ? c.stride(0) : c.size(1),
                 transpose_a,
                 transpose_b,
                 bias.defined(),
                 beta == 0.0f,
                 a.dtype(),
                 b.dtype(),
                 c.dtype(),
                 epilogue,
                 alignment_of(a.raw_data()),
                 alignment_of(b.raw_data()),
                 alignment_of(c.raw_data()),
                 aux.defined() ? alignment_of(aux.raw_data()) : 256u};
}

std::mutex plans_mutex;

const char* epilogue_name(GemmEpilogue e) {
  switch (e) {
    case GemmEpilogue::Gelu: return ", GELU epilogue";
    case GemmEpilogue::GeluBackward: return ", GELU-backward epilogue";
    case GemmEpilogue::BiasGrad: return ", bias-gradient epilogue";
    case GemmEpilogue::None: break;
  }
  return "";
}

// Times the plan's candidates on this call's operands (lt_tune) and keeps the fastest.
void tune(Plan& plan, LtState& state, void* stream, const PlanKey& key, const Tensor& a, const Tensor& b,
          const Tensor& c, float alpha, float beta) {
  const std::string what = detail::concat("M ", key.m, " N ", key.n, " K ", key.k, ", a ", dtype_name(key.a),
                               key.transpose_a ? " (T)" : "", ", b ", dtype_name(key.b), key.transpose_b ? " (T)" : "",
                               ", c ", dtype_name(key.c), key.beta_zero ? "" : ", beta != 0",
                               key.has_bias ? ", bias" : "", epilogue_name(key.epilogue));
  const size_t c_bytes = static_cast<size_t>((key.m - 1) * key.ldc + key.n) * dtype_size(key.c);
  void* workspace = lt_workspace(state, c.device().index, stream);
  // The widened list lives for the tuning only: the plan keeps the choice.
  const std::vector<cublasLtMatmulAlgo_t> candidates =
      lt_widen(state.handle, plan.desc, plan.first, plan.second, plan.out, plan.out, plan.candidates, kWorkspaceBytes);
  const int pick = lt_tune(
      stream, static_cast<int>(candidates.size()), key.beta_zero, c.raw_data(), c_bytes,
      [&](int i, void* d) {
        // beta != 0: in place on lt_tune's copy, as the real call runs.
        return cublasLtMatmul(state.handle, plan.desc, &alpha, b.raw_data(), plan.first, a.raw_data(), plan.second,
                              &beta, key.beta_zero ? c.raw_data() : d, plan.out, d, plan.out, &candidates[i],
                              workspace, kWorkspaceBytes, static_cast<cudaStream_t>(stream)) == CUBLAS_STATUS_SUCCESS;
      },
      what);
  plan.algo = candidates[pick];
}

// The cached plan for a key, made on first use. Call with plans_mutex held; plans are never
// erased, so the reference stays valid.
Plan& plan_for(const PlanKey& key, const Tensor& a, const Tensor& b, const Tensor& c, const Tensor& bias) {
  static std::map<PlanKey, Plan> plans;
  auto it = plans.find(key);
  if (it == plans.end()) it = plans.emplace(key, make_plan(lt_state(key.device).handle, key, a, b, c, bias)).first;
  return it->second;
}

}  // namespace

bool gemm_bias_grad_available(const Tensor& a, const Tensor& b, const Tensor& c, bool transpose_a, bool transpose_b,
                              float beta, const Tensor& bias) {
  if (!bias.defined() || bias.dtype() != DType::F32 || alignment_of(bias.raw_data()) < 16) return false;
  if (!(c.size(0) > 0 && c.size(1) > 0 && (transpose_a ? a.size(0) : a.size(1)) > 0)) return false;
  const PlanKey key = plan_key(a, b, c, transpose_a, transpose_b, beta, bias, GemmEpilogue::BiasGrad, Tensor());
  std::lock_guard<std::mutex> lock(plans_mutex);
  return plan_for(key, a, b, c, bias).has_algo;
}

void gemm(void* stream, const Tensor& a, const Tensor& b, Tensor& c, bool transpose_a, bool transpose_b, float alpha,
          float beta, const Tensor& bias, GemmEpilogue epilogue, const Tensor& aux) {
  const int64_t m = c.size(0), n = c.size(1);
  const int64_t k = transpose_a ? a.size(0) : a.size(1);
  if (m == 0 || n == 0) return;
  TESSERA_CHECK(k > 0, "gemm on CUDA: an inner dimension of 0 has no cuBLASLt path (a ", a.describe(), ", b ",
                b.describe(), ")");
  LtState& state = lt_state(c.device().index);
  const PlanKey key = plan_key(a, b, c, transpose_a, transpose_b, beta, bias, epilogue, aux);
  std::lock_guard<std::mutex> lock(plans_mutex);
  Plan& plan = plan_for(key, a, b, c, bias);
  // Pointers change from call to call; the descriptor is only used under the lock.
  if (bias.defined()) {
    const void* bias_ptr = bias.raw_data();
    TESSERA_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias_ptr, sizeof(bias_ptr)));
  }
  if (epilogue == GemmEpilogue::Gelu || epilogue == GemmEpilogue::GeluBackward) {
    const void* aux_ptr = aux.raw_data();
    TESSERA_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux_ptr, sizeof(aux_ptr)));
  }
  if (!plan.tuned && !plan.candidates.empty() && lt_should_tune(key.device, stream, ++plan.uses)) {
    plan.tuned = true;
    tune(plan, state, stream, key, a, b, c, alpha, beta);
  }
  const cublasStatus_t status =
      cublasLtMatmul(state.handle, plan.desc, &alpha, b.raw_data(), plan.first, a.raw_data(), plan.second, &beta,
                     c.raw_data(), plan.out, c.raw_data(), plan.out, plan.has_algo ? &plan.algo : nullptr,
                     lt_workspace(state, c.device().index, stream), kWorkspaceBytes, static_cast<cudaStream_t>(stream));
  TESSERA_CHECK(status == CUBLAS_STATUS_SUCCESS, "gemm on CUDA: cublasLtMatmul failed (", cublasGetStatusString(status),
                ") for a ", a.describe(), ", b ", b.describe(), ", c ", c.describe());
}

}  // namespace tessera::cuda
