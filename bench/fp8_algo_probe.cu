// Does cuBLASLt's first heuristic choice leave FP8 GEMM speed on the table at the Mixtral
// expert shapes? For each GEMM of one expert (2048 rows; hidden 4096, ffn 14336) this asks
// the heuristic for up to 16 algorithms and times every one (CUDA events, median of 10 after
// 2 warm-ups, random codes), with tessera's mapping (backend/cuda/gemm_fp8.cu: our row-major
// c[M, N] = a[M, K] b[N, K]^T is cuBLASLt's column-major c^T = op_T(b) a, TN). The
// weight-gradient GEMMs read C (beta 1, F32) and write a scratch D, so timing them changes
// no input; they read expert slices of [*, 16384] transposed codes, as GroupedLinear does.
// Prints TFLOP/s per algorithm, the heuristic's first marked. Measured: bench/RESULTS.md,
// sixteenth session (the FP32 gradient read-back of beta 1 is what the wgrads lose).
//
// Build and run (standalone, on the GPU machine):
//   nvcc -O2 -std=c++17 -arch=sm_90 bench/fp8_algo_probe.cu -lcublasLt -lcublas -o fp8_algo_probe && ./fp8_algo_probe
#include <cublasLt.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK_CUDA(x)                                                                 \
  do {                                                                                \
    cudaError_t e_ = (x);                                                             \
    if (e_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));                   \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)
#define CHECK_LT(x)                                                                   \
  do {                                                                                \
    cublasStatus_t s_ = (x);                                                          \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                \
      std::fprintf(stderr, "%s: %s\n", #x, cublasGetStatusString(s_));               \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

namespace {

__global__ void fill_codes(uint8_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    p[i] = uint8_t((h >> 8) & 0x3f) | uint8_t(h & 0x80);  // small finite magnitudes, both signs
  }
}

struct Case {
  const char* name;
  int64_t m, n, k;
  cudaDataType_t a, b, c;
  float beta;
  bool fast;
  int64_t ld = 0;  // row stride of a and b (0: k); the wgrads read expert slices of [*, 16384] codes
};

void run(cublasLtHandle_t handle, const Case& cs, void* workspace, size_t workspace_bytes) {
  const int64_t ld = cs.ld > 0 ? cs.ld : cs.k;
  const size_t a_bytes = size_t(cs.m) * ld, b_bytes = size_t(cs.n) * ld;
  const size_t c_elem = cs.c == CUDA_R_32F ? 4 : 2, c_bytes = size_t(cs.m) * cs.n * c_elem;
  uint8_t *a, *b;
  void *c, *d;
  float* scale;
  CHECK_CUDA(cudaMalloc(&a, a_bytes));
  CHECK_CUDA(cudaMalloc(&b, b_bytes));
  CHECK_CUDA(cudaMalloc(&c, c_bytes));
  CHECK_CUDA(cudaMalloc(&d, c_bytes));
  CHECK_CUDA(cudaMalloc(&scale, sizeof(float)));
  fill_codes<<<1024, 256>>>(a, a_bytes, 1);
  fill_codes<<<1024, 256>>>(b, b_bytes, 2);
  CHECK_CUDA(cudaMemset(c, 0, c_bytes));
  const float one = 1.0f;
  CHECK_CUDA(cudaMemcpy(scale, &one, sizeof(float), cudaMemcpyHostToDevice));

  cublasLtMatmulDesc_t desc;
  CHECK_LT(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
  CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof(op_t)));
  CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof(op_n)));
  const int8_t fast = cs.fast ? 1 : 0;
  CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)));
  CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale, sizeof(scale)));
  CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale, sizeof(scale)));
  cublasLtMatrixLayout_t la, lb, lc;
  CHECK_LT(cublasLtMatrixLayoutCreate(&la, cs.b, cs.k, cs.n, ld));  // cuBLASLt's A is our b [N, K]
  CHECK_LT(cublasLtMatrixLayoutCreate(&lb, cs.a, cs.k, cs.m, ld));  // its B our a [M, K]
  CHECK_LT(cublasLtMatrixLayoutCreate(&lc, cs.c, cs.n, cs.m, cs.n));
  cublasLtMatmulPreference_t pref;
  CHECK_LT(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws = workspace_bytes;
  CHECK_LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  cublasLtMatmulHeuristicResult_t results[16];
  int found = 0;
  CHECK_LT(cublasLtMatmulAlgoGetHeuristic(handle, desc, la, lb, lc, lc, pref, 16, results, &found));
  const double flops = 2.0 * cs.m * cs.n * cs.k;
  std::printf("\n%s: M %lld N %lld K %lld, beta %.0f, %d algorithms\n", cs.name, (long long)cs.m, (long long)cs.n,
              (long long)cs.k, cs.beta, found);
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  for (int i = 0; i < found; ++i) {
    std::vector<float> ms;
    bool ok = true;
    for (int rep = 0; rep < 12 && ok; ++rep) {
      CHECK_CUDA(cudaEventRecord(start));
      ok = cublasLtMatmul(handle, desc, &one, b, la, a, lb, &cs.beta, c, lc, d, lc, &results[i].algo, workspace,
                          workspace_bytes, nullptr) == CUBLAS_STATUS_SUCCESS;
      CHECK_CUDA(cudaEventRecord(stop));
      CHECK_CUDA(cudaEventSynchronize(stop));
      float t = 0;
      CHECK_CUDA(cudaEventElapsedTime(&t, start, stop));
      if (rep >= 2) ms.push_back(t);
    }
    if (!ok) {
      std::printf("  algo %2d: failed\n", i);
      continue;
    }
    std::sort(ms.begin(), ms.end());
    const double med = ms[ms.size() / 2];
    int tile = 0, stages = 0;
    size_t written = 0;
    cublasLtMatmulAlgoConfigGetAttribute(&results[i].algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile), &written);
    cublasLtMatmulAlgoConfigGetAttribute(&results[i].algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof(stages),
                                         &written);
    std::printf("  algo %2d: %8.3f ms %7.1f TFLOP/s  tile %d stages %d workspace %zu%s\n", i, med,
                flops / med * 1e-9, tile, stages, results[i].workspaceSize, i == 0 ? "  <- heuristic's choice" : "");
  }
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(lc);
  cublasLtMatmulDescDestroy(desc);
  CHECK_CUDA(cudaFree(a));
  CHECK_CUDA(cudaFree(b));
  CHECK_CUDA(cudaFree(c));
  CHECK_CUDA(cudaFree(d));
  CHECK_CUDA(cudaFree(scale));
}

}  // namespace

int main() {
  cublasLtHandle_t handle;
  CHECK_LT(cublasLtCreate(&handle));
  const size_t workspace_bytes = 32u << 20;
  void* workspace;
  CHECK_CUDA(cudaMalloc(&workspace, workspace_bytes));
  const int64_t rows = 2048, hidden = 4096, ffn = 14336;
  const Case cases[] = {
      {"fc forward (y = x W^T, BF16 out)", rows, 2 * ffn, hidden, CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, CUDA_R_16BF, 0, true},
      {"fc dgrad (dx = dy W, BF16 out)", rows, hidden, 2 * ffn, CUDA_R_8F_E5M2, CUDA_R_8F_E4M3, CUDA_R_16BF, 0, false},
      {"fc wgrad (dW += dy^T x, F32)", 2 * ffn, hidden, rows, CUDA_R_8F_E5M2, CUDA_R_8F_E4M3, CUDA_R_32F, 1, false, 16384},
      {"fc wgrad, first micro-batch (beta 0)", 2 * ffn, hidden, rows, CUDA_R_8F_E5M2, CUDA_R_8F_E4M3, CUDA_R_32F, 0,
       false, 16384},
      {"proj wgrad (dW += dy^T h, F32)", hidden, ffn, rows, CUDA_R_8F_E5M2, CUDA_R_8F_E4M3, CUDA_R_32F, 1, false, 16384},
      {"proj wgrad, first micro-batch (beta 0)", hidden, ffn, rows, CUDA_R_8F_E5M2, CUDA_R_8F_E4M3, CUDA_R_32F, 0,
       false, 16384},
      // Four micro-batches' rows in one GEMM (K = 4 x 2048): what deferring the wgrad to the
      // step's end with the codes side by side would run instead of one beta-0 and three
      // beta-1 GEMMs.
      {"fc wgrad over 4 micro-batches (K 8192, beta 0)", 2 * ffn, hidden, 4 * rows, CUDA_R_8F_E5M2, CUDA_R_8F_E4M3,
       CUDA_R_32F, 0, false, 4 * 16384},
  };
  for (const Case& c : cases) run(handle, c, workspace, workspace_bytes);
  CHECK_CUDA(cudaFree(workspace));
  cublasLtDestroy(handle);
  return 0;
}
