// FP8 GEMM on the GPU through cuBLASLt: c[M, N] = alpha * a[M, K] b[N, K]^T + beta * c + bias,
// E4M3/E5M2 operands, FP32 accumulation (CUBLAS_COMPUTE_32F), F32, BF16 or E4M3 output, with
// per-tensor scales (SCALAR_32F) or Hopper's block scales (VEC128_32F for 1x128 blocks,
// BLK128x128_32F for 128x128 tiles). Every scale is a device pointer, so nothing here waits
// for the GPU.
//
// Layout: Hopper's FP8 tensor cores take only TN. cuBLASLt is column-major, so our row-major
// product is computed as the column-major c^T[N, M] = op(B) op(A) with cuBLASLt's A = our b
// (stored [N, K] = column-major K x N, transposed) and cuBLASLt's B = our a (K x M, not
// transposed): CUBLAS_OP_T / CUBLAS_OP_N, exactly gemm.cu's mapping with transpose_b set.
// Our b's scales are therefore cuBLASLt's A scales and our a's its B scales.
//
// Plans (descriptors + the heuristic's algorithm) are cached per (shape, leading dims, dtypes,
// scale modes, epilogue, output scaling, fast accumulation, pointer alignment), as gemm.cu
// does. It shares the device's cuBLASLt handle and workspaces (cublaslt_state.h), and is
// autotuned like gemm.cu when tessera::gemm_autotune() is on.
//
// Floor: 2MNK FLOPs at H200's dense FP8 peak (~1979 TFLOP/s), e.g. 8192 x 4096 x 4096 in
// ~0.14 ms; the two helper kernels move a few KiB to a few MiB of scales (negligible).
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <sstream>
#include <tuple>
#include <vector>

#include "cublaslt_state.h"
#include "cuda_check.h"
#include "gemm_fp8.h"

// cuBLASLt failures name the FP8 GEMM (the shared TESSERA_CUBLAS_CHECK names only the call).
#define TESSERA_CUBLASLT_CHECK(call)                                                                 \
  do {                                                                                               \
    cublasStatus_t tessera_cublas_status = (call);                                                   \
    if (tessera_cublas_status != CUBLAS_STATUS_SUCCESS)                                              \
      TESSERA_FAIL("fp8_gemm: cuBLASLt error in ", #call, ": ", cublasGetStatusString(tessera_cublas_status)); \
  } while (0)

namespace tessera::cuda {

namespace {

constexpr size_t kWorkspaceBytes = kLtWorkspaceBytes;

cudaDataType_t lt_type(DType t) {
  switch (t) {
    case DType::E4M3: return CUDA_R_8F_E4M3;
    case DType::E5M2: return CUDA_R_8F_E5M2;
    case DType::BF16: return CUDA_R_16BF;
    case DType::F32: return CUDA_R_32F;
    default: TESSERA_FAIL("fp8_gemm: dtype ", dtype_name(t), " has no cuBLASLt FP8 path");
  }
}

int32_t lt_scale_mode(Fp8ScaleMode m) {
  switch (m) {
    case Fp8ScaleMode::Vec128: return CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    case Fp8ScaleMode::Block128: return CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    case Fp8ScaleMode::Tensor: break;
  }
  return CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
}

const char* mode_name(Fp8ScaleMode m) {
  switch (m) {
    case Fp8ScaleMode::Vec128: return "1x128 blocks";
    case Fp8ScaleMode::Block128: return "128x128 blocks";
    case Fp8ScaleMode::Tensor: break;
  }
  return "per-tensor";
}

uint32_t alignment_of(const void* p) {
  const auto v = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && v % a != 0) a /= 2;
  return a;
}

// Row stride in elements: the leading dimension cuBLASLt sees (a single row has none of its own).
int64_t leading_dim(const Tensor& t) { return t.size(0) > 1 ? t.stride(0) : t.size(1); }

bool rows_contiguous(const Tensor& t) { return t.dim() == 2 && (t.size(1) <= 1 || t.stride(1) == 1); }

template <typename... Parts>
std::string str(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}

// Block scales must start on a 16-byte boundary (cuBLAS docs); a scalar needs only a float's.
std::string check_scale(const Tensor& s, const Shape& want, const Device& device, const char* name,
                        uint32_t alignment = 4) {
  if (!s.defined()) return str(name, " is undefined");
  if (s.dtype() != DType::F32) return str(name, " must be F32, got ", s.describe());
  if (s.shape() != want) return str(name, " must have shape ", shape_to_string(want), ", got ", s.describe());
  if (!s.is_contiguous()) return str(name, " must be contiguous, got ", s.describe());
  if (s.device() != device) return str(name, " ", s.describe(), " is not on ", device.to_string());
  if (alignment_of(s.raw_data()) < alignment) return str(name, " must start on a ", alignment, "-byte boundary");
  return {};
}

std::string check_operand(const Fp8Operand& x, const char* name, const Device& device) {
  const Tensor& d = x.data;
  if (!d.defined()) return str(name, " is undefined");
  if (d.dtype() != DType::E4M3 && d.dtype() != DType::E5M2) return str(name, " must be E4M3 or E5M2, got ", d.describe());
  if (!rows_contiguous(d)) return str(name, " must be a 2-D matrix with contiguous rows, got ", d.describe());
  if (d.device() != device) return str(name, " ", d.describe(), " is not on ", device.to_string());
  const int64_t k = d.size(1);
  if (k % 16 != 0) return str(name, " ", d.describe(), ": K = ", k, " must be a multiple of 16 (cuBLASLt FP8)");
  if (leading_dim(d) % 16 != 0)
    return str(name, " ", d.describe(), ": row stride ", leading_dim(d), " must be a multiple of 16 (cuBLASLt FP8)");
  if (alignment_of(d.raw_data()) < 16) return str(name, " ", d.describe(), " must start on a 16-byte boundary");
  const Shape want = x.mode == Fp8ScaleMode::Tensor ? Shape{1} : gemm_block_scale_shape(d.size(0), k, x.mode);
  const bool scalar = x.mode == Fp8ScaleMode::Tensor;
  std::string why =
      check_scale(x.scale_inv, want, device, scalar ? "scale_inv" : "GEMM-ready block scale_inv", scalar ? 4 : 16);
  return why.empty() ? why : str(name, ": ", why);
}

}  // namespace

std::string fp8_gemm_check(const Fp8Operand& a, const Fp8Operand& b, const Tensor& c, const Fp8GemmParams& p) {
  if (!c.defined()) return "c is undefined";
  const Device device = c.device();
  if (!device.is_cuda()) return str("c ", c.describe(), " is not on a CUDA device");
  if (std::string why = check_operand(a, "a", device); !why.empty()) return why;
  if (std::string why = check_operand(b, "b", device); !why.empty()) return why;
  if (a.data.dtype() == DType::E5M2 && b.data.dtype() == DType::E5M2)
    return "E5M2 x E5M2 has no FP8 GEMM on Hopper (one operand must be E4M3)";
  const int64_t m = a.data.size(0), n = b.data.size(0), k = a.data.size(1);
  if (b.data.size(1) != k)
    return str("inner dimensions differ: a ", a.data.describe(), " and b ", b.data.describe(), " (both [rows, K])");
  if (k == 0) return "K = 0 has no cuBLASLt path";
  if (c.dim() != 2 || c.size(0) != m || c.size(1) != n) return str("c must have shape [", m, ", ", n, "], got ", c.describe());
  if (c.dtype() != DType::F32 && c.dtype() != DType::BF16 && c.dtype() != DType::E4M3)
    return str("c must be F32, BF16 or E4M3, got ", c.describe());
  if (!rows_contiguous(c)) return str("c must have contiguous rows, got ", c.describe());
  if (leading_dim(c) * static_cast<int64_t>(dtype_size(c.dtype())) % 16 != 0)
    return str("c ", c.describe(), ": its row stride (", leading_dim(c), " elements) must be a multiple of 16 bytes");
  if (alignment_of(c.raw_data()) < 16) return str("c ", c.describe(), " must start on a 16-byte boundary");
  const bool fp8_out = c.dtype() == DType::E4M3;
  const bool blocks = a.mode != Fp8ScaleMode::Tensor || b.mode != Fp8ScaleMode::Tensor;
  if (blocks) {
    if (a.mode == Fp8ScaleMode::Tensor || b.mode == Fp8ScaleMode::Tensor)
      return "a per-tensor operand cannot be mixed with a block-scaled one";
    if (a.mode == Fp8ScaleMode::Block128 && b.mode == Fp8ScaleMode::Block128)
      return "128x128 x 128x128 block scaling has no cuBLASLt GEMM (one operand must use 1x128 blocks)";
    if (m % 4 != 0 || n % 4 != 0) return str("block-scaled GEMMs need M and N multiples of 4, got M = ", m, ", N = ", n);
    if (fp8_out) return "block-scaled GEMMs cannot write FP8 (c must be F32 or BF16)";
  }
  if (fp8_out && p.beta != 0) return "an E4M3 output cannot accumulate (beta must be 0)";
  if (!fp8_out && (p.out_scale.defined() || p.amax_out.defined()))
    return str("out_scale and amax_out need an E4M3 output, c is ", c.describe());
  if (p.out_scale.defined())
    if (std::string why = check_scale(p.out_scale, {1}, device, "out_scale"); !why.empty()) return why;
  if (p.amax_out.defined())
    if (std::string why = check_scale(p.amax_out, {1}, device, "amax_out"); !why.empty()) return why;
  if (p.bias.defined()) {
    if (p.bias.dtype() != DType::BF16)
      return str("bias must be BF16 (cuBLASLt's FP8 kernels take a BF16 bias), got ", p.bias.describe());
    if (p.bias.shape() != Shape{n} || !p.bias.is_contiguous())
      return str("bias must be a contiguous [", n, "], got ", p.bias.describe());
    if (p.bias.device() != device) return str("bias ", p.bias.describe(), " is not on ", device.to_string());
  }
  return {};
}

namespace {

struct PlanKey {
  int device;
  int64_t m, n, k, lda, ldb, ldc;
  DType a, b, c;
  Fp8ScaleMode a_mode, b_mode;
  bool has_bias, beta_zero, fast_accumulate, has_out_scale, has_amax;
  uint32_t align_a, align_b, align_c;
  auto tie() const {
    return std::tie(device, m, n, k, lda, ldb, ldc, a, b, c, a_mode, b_mode, has_bias, beta_zero, fast_accumulate,
                    has_out_scale, has_amax, align_a, align_b, align_c);
  }
  bool operator<(const PlanKey& o) const { return tie() < o.tie(); }
};

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t first = nullptr, second = nullptr, c_layout = nullptr, d_layout = nullptr;
  cublasLtMatmulAlgo_t algo{};
  std::vector<cublasLtMatmulAlgo_t> candidates;  // the heuristic's, best first (autotuning)
  int uses = 0;
  bool tuned = false;
};

void destroy(Plan& plan) {
  if (plan.desc) cublasLtMatmulDescDestroy(plan.desc);
  if (plan.first) cublasLtMatrixLayoutDestroy(plan.first);
  if (plan.second) cublasLtMatrixLayoutDestroy(plan.second);
  if (plan.c_layout) cublasLtMatrixLayoutDestroy(plan.c_layout);
  if (plan.d_layout) cublasLtMatrixLayoutDestroy(plan.d_layout);
}

void set_attr(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const void* value, size_t size) {
  TESSERA_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(desc, attr, value, size));
}

// The per-call device pointers: scales, bias, output scale and amax.
void set_pointers(const Plan& plan, const Fp8Operand& a, const Fp8Operand& b, const Fp8GemmParams& p) {
  const void* first_scale = b.scale_inv.raw_data();  // cuBLASLt's A is our b
  const void* second_scale = a.scale_inv.raw_data();
  set_attr(plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &first_scale, sizeof(first_scale));
  set_attr(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &second_scale, sizeof(second_scale));
  if (p.bias.defined()) {
    const void* bias = p.bias.raw_data();
    set_attr(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias));
  }
  if (p.out_scale.defined()) {
    const void* d_scale = p.out_scale.raw_data();
    set_attr(plan.desc, CUBLASLT_MATMUL_DESC_D_SCALE_POINTER, &d_scale, sizeof(d_scale));
  }
  if (p.amax_out.defined()) {
    void* amax = p.amax_out.raw_data();
    set_attr(plan.desc, CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, &amax, sizeof(amax));
  }
}

std::string describe_call(const PlanKey& key) {
  return str("M = ", key.m, ", N = ", key.n, ", K = ", key.k, ", a ", dtype_name(key.a), " (", mode_name(key.a_mode),
             ", row stride ", key.lda, "), b ", dtype_name(key.b), " (", mode_name(key.b_mode), ", row stride ", key.ldb,
             "), c ", dtype_name(key.c), " (row stride ", key.ldc, ")", key.has_bias ? ", bias" : "",
             key.beta_zero ? "" : ", beta != 0");
}

Plan make_plan(cublasLtHandle_t handle, const PlanKey& key, const Fp8Operand& a, const Fp8Operand& b,
               const Fp8GemmParams& p) {
  Plan plan;
  try {
    TESSERA_CUBLASLT_CHECK(cublasLtMatmulDescCreate(&plan.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
    set_attr(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof(op_t));
    set_attr(plan.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof(op_n));
    const bool blocks = key.a_mode != Fp8ScaleMode::Tensor;
    const int8_t fast = key.fast_accumulate && !blocks ? 1 : 0;
    set_attr(plan.desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast));
    if (blocks) {
      const int32_t first_mode = lt_scale_mode(key.b_mode), second_mode = lt_scale_mode(key.a_mode);
      set_attr(plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &first_mode, sizeof(first_mode));
      set_attr(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &second_mode, sizeof(second_mode));
    }
    const cublasLtEpilogue_t epilogue = key.has_bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
    set_attr(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue));
    if (key.has_bias) {
      const cudaDataType_t bias_type = CUDA_R_16BF;
      set_attr(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type));
    }
    set_pointers(plan, a, b, p);
    TESSERA_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&plan.first, lt_type(key.b), key.k, key.n, key.ldb));
    TESSERA_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&plan.second, lt_type(key.a), key.k, key.m, key.lda));
    // An FP8 D takes a 16-bit C layout (BF16, the bias type); beta is 0 and no C is passed.
    const cudaDataType_t c_type = key.c == DType::E4M3 ? CUDA_R_16BF : lt_type(key.c);
    TESSERA_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&plan.c_layout, c_type, key.n, key.m, key.ldc));
    TESSERA_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&plan.d_layout, lt_type(key.c), key.n, key.m, key.ldc));

    cublasLtMatmulPreference_t pref = nullptr;
    TESSERA_CUBLASLT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t workspace = kWorkspaceBytes;
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace, sizeof(workspace));
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &key.align_b, sizeof(key.align_b));
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &key.align_a, sizeof(key.align_a));
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &key.align_c, sizeof(key.align_c));
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &key.align_c, sizeof(key.align_c));
    cublasLtMatmulHeuristicResult_t results[kLtCandidates] = {};
    int found = 0;
    const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
        handle, plan.desc, plan.first, plan.second, plan.c_layout, plan.d_layout, pref, kLtCandidates, results, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    TESSERA_CHECK(status == CUBLAS_STATUS_SUCCESS && found > 0, "fp8_gemm on CUDA: cuBLASLt has no algorithm (",
                  status == CUBLAS_STATUS_SUCCESS ? "no result" : cublasGetStatusString(status), ") for ",
                  describe_call(key));
    plan.algo = results[0].algo;
    for (int i = 0; i < found; ++i) plan.candidates.push_back(results[i].algo);
  } catch (...) {
    destroy(plan);
    throw;
  }
  return plan;
}

__global__ void reciprocal_kernel(const float* scale, float* scale_inv) {
  const float s = scale[0];
  scale_inv[0] = (s > 0.0f && s <= 3.402823466e38f) ? __fdiv_rn(1.0f, s) : __int_as_float(0x7fc00000);
}

// out[r, c] = in[c, r] (transpose) or in[r, c], zero outside in's bounds. Scales are small
// (one float per 128 or 16384 elements), so a plain grid-stride loop is enough.
__global__ void rearrange_kernel(const float* in, float* out, int64_t in_rows, int64_t in_cols, int64_t out_rows,
                                 int64_t out_cols, bool transpose) {
  const int64_t total = out_rows * out_cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / out_cols, c = i % out_cols;
    const int64_t ir = transpose ? c : r, ic = transpose ? r : c;
    out[i] = ir < in_rows && ic < in_cols ? in[ir * in_cols + ic] : 0.0f;
  }
}

}  // namespace

void fp8_gemm(void* stream, const Fp8Operand& a, const Fp8Operand& b, Tensor& c, const Fp8GemmParams& p) {
  const std::string why = fp8_gemm_check(a, b, c, p);
  TESSERA_CHECK(why.empty(), "fp8_gemm on CUDA: ", why);
  const int64_t m = c.size(0), n = c.size(1);
  if (m == 0 || n == 0) return;
  const int device = c.device().index;
  LtState& state = lt_state(device);
  const PlanKey key{device,
                    m,
                    n,
                    a.data.size(1),
                    leading_dim(a.data),
                    leading_dim(b.data),
                    leading_dim(c),
                    a.data.dtype(),
                    b.data.dtype(),
                    c.dtype(),
                    a.mode,
                    b.mode,
                    p.bias.defined(),
                    p.beta == 0.0f,
                    p.fast_accumulate,
                    p.out_scale.defined(),
                    p.amax_out.defined(),
                    alignment_of(a.data.raw_data()),
                    alignment_of(b.data.raw_data()),
                    alignment_of(c.raw_data())};
  static std::mutex mutex;
  static std::map<PlanKey, Plan> plans;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = plans.find(key);
  if (it == plans.end()) {
    it = plans.emplace(key, make_plan(state.handle, key, a, b, p)).first;
  } else {
    set_pointers(it->second, a, b, p);  // descriptors are only touched under the lock
  }
  Plan& plan = it->second;
  // An FP8 D has no C (beta is 0): Transformer Engine passes none either.
  const void* c_in = c.dtype() == DType::E4M3 ? nullptr : c.raw_data();
  if (!plan.tuned && !plan.candidates.empty() && lt_should_tune(device, stream, ++plan.uses)) {
    plan.tuned = true;
    const size_t c_bytes = static_cast<size_t>((m - 1) * key.ldc + n) * dtype_size(c.dtype());
    void* workspace = lt_workspace(state, device, stream);
    // The widened list lives for the tuning only: the plan keeps the choice.
    const std::vector<cublasLtMatmulAlgo_t> candidates = lt_widen(
        state.handle, plan.desc, plan.first, plan.second, plan.c_layout, plan.d_layout, plan.candidates, kWorkspaceBytes);
    const int pick = lt_tune(
        stream, static_cast<int>(candidates.size()), key.beta_zero, c.raw_data(), c_bytes,
        [&](int i, void* d) {
          // beta != 0: in place on lt_tune's copy, as the real call runs.
          return cublasLtMatmul(state.handle, plan.desc, &p.alpha, b.data.raw_data(), plan.first, a.data.raw_data(),
                                plan.second, &p.beta, key.beta_zero ? c_in : d, plan.c_layout, d, plan.d_layout,
                                &candidates[i], workspace, kWorkspaceBytes,
                                static_cast<cudaStream_t>(stream)) == CUBLAS_STATUS_SUCCESS;
        },
        "fp8 " + describe_call(key));
    plan.algo = candidates[pick];
  }
  const cublasStatus_t status =
      cublasLtMatmul(state.handle, plan.desc, &p.alpha, b.data.raw_data(), plan.first, a.data.raw_data(), plan.second,
                     &p.beta, c_in, plan.c_layout, c.raw_data(), plan.d_layout, &plan.algo,
                     lt_workspace(state, device, stream), kWorkspaceBytes, static_cast<cudaStream_t>(stream));
  TESSERA_CHECK(status == CUBLAS_STATUS_SUCCESS, "fp8_gemm on CUDA: cublasLtMatmul failed (",
                cublasGetStatusString(status), ") for ", describe_call(key));
}

void fp8_reciprocal_scale(void* stream, const Tensor& scale, Tensor& scale_inv) {
  TESSERA_CHECK(scale.dtype() == DType::F32 && scale.numel() == 1 && scale_inv.dtype() == DType::F32 &&
                    scale_inv.numel() == 1 && scale.device().is_cuda() && scale_inv.device() == scale.device(),
                "fp8_reciprocal_scale: scale ", scale.describe(), " and scale_inv ", scale_inv.describe(),
                " must be F32 [1] on one CUDA device");
  reciprocal_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(scale.data<float>(), scale_inv.data<float>());
  TESSERA_CUDA_CHECK_LAUNCH();
}

void to_gemm_block_scales(void* stream, const Tensor& scale_inv, int64_t rows, int64_t k, Fp8ScaleMode mode,
                          Tensor& out) {
  TESSERA_CHECK(mode != Fp8ScaleMode::Tensor, "to_gemm_block_scales: a per-tensor scale needs no rearranging");
  const int64_t l = (k + 127) / 128;
  const Shape in_shape = mode == Fp8ScaleMode::Vec128 ? Shape{rows, l} : Shape{(rows + 127) / 128, l};
  const Shape out_shape = gemm_block_scale_shape(rows, k, mode);
  TESSERA_CHECK(scale_inv.dtype() == DType::F32 && scale_inv.shape() == in_shape && scale_inv.is_contiguous() &&
                    scale_inv.device().is_cuda(),
                "to_gemm_block_scales: scale_inv must be a contiguous F32 ", shape_to_string(in_shape),
                " on a CUDA device (", mode_name(mode), " of a [", rows, ", ", k, "] operand), got ", scale_inv.describe());
  TESSERA_CHECK(out.dtype() == DType::F32 && out.shape() == out_shape && out.is_contiguous() &&
                    out.device() == scale_inv.device(),
                "to_gemm_block_scales: out must be a contiguous F32 ", shape_to_string(out_shape), " on ",
                scale_inv.device().to_string(), ", got ", out.describe());
  const int64_t total = out_shape[0] * out_shape[1];
  if (total == 0) return;
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((total + threads - 1) / threads, 4096);
  rearrange_kernel<<<static_cast<unsigned>(blocks), threads, 0, static_cast<cudaStream_t>(stream)>>>(
      scale_inv.data<float>(), out.data<float>(), in_shape[0], in_shape[1], out_shape[0], out_shape[1],
      mode == Fp8ScaleMode::Vec128);
  TESSERA_CUDA_CHECK_LAUNCH();
}

}  // namespace tessera::cuda
