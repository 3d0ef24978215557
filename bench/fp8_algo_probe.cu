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
// `fp8_algo_probe search` goes past the heuristic for the weight-gradient GEMMs: every algorithm
// id cuBLASLt has for the types, and for each every tile, stage count, cluster shape, CTA
// swizzle and custom option that cublasLtMatmulAlgoCheck accepts, each timed (median of 5
// after 1 warm-up), the ten fastest printed against the heuristic's choice. The wgrads write
// FP32 dW and their K (an expert's rows) is short, so a tile's epilogue (128 KiB of FP32 for
// 128 x 256) is as long as a third of its main loop: whether some configuration hides it.
//
// Build and run (standalone, on the GPU machine):
//   nvcc -O2 -std=c++17 -arch=sm_90 bench/fp8_algo_probe.cu -lcublasLt -lcublas -o fp8_algo_probe && ./fp8_algo_probe [search]
#include <cublasLt.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
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
  // The BF16 weight gradient as nn::GroupedLinear runs it through gemm.cu: dW[m, n] = dy^T x
  // with dy [k, m] and x [k, n] row-major (no transposed copies): cuBLASLt's N / T with x first.
  bool bf16_wgrad = false;
  bool in_place = false;  // D = C, as tessera's accumulating weight gradients write
};

// One case's buffers, descriptors and layouts, made once and timed with any algorithm.
struct Problem {
  Case cs;
  uint8_t *a = nullptr, *b = nullptr;
  void *c = nullptr, *d = nullptr;
  float* scale = nullptr;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cudaDataType_t c_type = CUDA_R_32F;

  explicit Problem(const Case& c_) : cs(c_) {
    const int64_t ld = cs.ld > 0 ? cs.ld : cs.k;
    const size_t elem = cs.bf16_wgrad ? 2 : 1;
    const size_t a_bytes = size_t(cs.m) * (cs.bf16_wgrad ? cs.k : ld) * elem,
                 b_bytes = size_t(cs.n) * (cs.bf16_wgrad ? cs.k : ld) * elem;
    const size_t c_elem = cs.c == CUDA_R_32F ? 4 : 2, c_bytes = size_t(cs.m) * cs.n * c_elem;
    CHECK_CUDA(cudaMalloc(&a, a_bytes));
    CHECK_CUDA(cudaMalloc(&b, b_bytes));
    CHECK_CUDA(cudaMalloc(&c, c_bytes));
    if (cs.in_place) d = c;
    else CHECK_CUDA(cudaMalloc(&d, c_bytes));
    CHECK_CUDA(cudaMalloc(&scale, sizeof(float)));
    fill_codes<<<1024, 256>>>(a, a_bytes, 1);  // as BF16: small finite values too
    fill_codes<<<1024, 256>>>(b, b_bytes, 2);
    CHECK_CUDA(cudaMemset(c, 0, c_bytes));
    const float one = 1.0f;
    CHECK_CUDA(cudaMemcpy(scale, &one, sizeof(float), cudaMemcpyHostToDevice));
    CHECK_LT(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
    CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, cs.bf16_wgrad ? &op_n : &op_t,
                                            sizeof(op_t)));
    CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, cs.bf16_wgrad ? &op_t : &op_n,
                                            sizeof(op_n)));
    if (cs.bf16_wgrad) {
      CHECK_LT(cublasLtMatrixLayoutCreate(&la, cs.b, cs.n, cs.k, cs.n));  // x [k, n] row-major
      CHECK_LT(cublasLtMatrixLayoutCreate(&lb, cs.a, cs.m, cs.k, cs.m));  // dy [k, m] row-major, transposed
    } else {
      const int8_t fast = cs.fast ? 1 : 0;
      CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)));
      CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale, sizeof(scale)));
      CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale, sizeof(scale)));
      CHECK_LT(cublasLtMatrixLayoutCreate(&la, cs.b, cs.k, cs.n, ld));  // cuBLASLt's A is our b [N, K]
      CHECK_LT(cublasLtMatrixLayoutCreate(&lb, cs.a, cs.k, cs.m, ld));  // its B our a [M, K]
    }
    CHECK_LT(cublasLtMatrixLayoutCreate(&lc, cs.c, cs.n, cs.m, cs.n));
  }
  ~Problem() {
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(lc);
    cublasLtMatmulDescDestroy(desc);
    cudaFree(a);
    cudaFree(b);
    cudaFree(c);
    if (d != c) cudaFree(d);
    cudaFree(scale);
  }
  double flops() const { return 2.0 * cs.m * cs.n * cs.k; }

  // Median ms of `reps` timed calls after `warm` untimed ones; < 0 when the call fails.
  double time(cublasLtHandle_t handle, const cublasLtMatmulAlgo_t& algo, void* workspace, size_t workspace_bytes,
              int warm, int reps) const {
    cudaEvent_t start, stop;
    CHECK_CUDA(cudaEventCreate(&start));
    CHECK_CUDA(cudaEventCreate(&stop));
    const float one = 1.0f;
    std::vector<float> ms;
    bool ok = true;
    for (int rep = 0; rep < warm + reps && ok; ++rep) {
      CHECK_CUDA(cudaEventRecord(start));
      ok = cublasLtMatmul(handle, desc, &one, b, la, a, lb, &cs.beta, c, lc, d, lc, &algo, workspace, workspace_bytes,
                          nullptr) == CUBLAS_STATUS_SUCCESS;
      CHECK_CUDA(cudaEventRecord(stop));
      CHECK_CUDA(cudaEventSynchronize(stop));
      float t = 0;
      CHECK_CUDA(cudaEventElapsedTime(&t, start, stop));
      if (rep >= warm) ms.push_back(t);
    }
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    if (!ok) {
      cudaGetLastError();
      return -1;
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  }
};

std::string describe(const cublasLtMatmulAlgo_t& algo) {
  int id = 0, tile = 0, stages = 0, splitk = 0, swizzle = 0, custom = 0;
  uint16_t cluster = 0;
  size_t w = 0;
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof(id), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof(stages), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof(splitk), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &swizzle, sizeof(swizzle), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, &custom, sizeof(custom), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster, sizeof(cluster), &w);
  char buf[160];
  std::snprintf(buf, sizeof(buf), "id %d tile %d stages %d splitk %d swizzle %d custom %d cluster %d", id, tile, stages,
                splitk, swizzle, custom, int(cluster));
  return buf;
}

// The heuristic's first `max` algorithms for the problem; returns how many it gave.
int heuristic(cublasLtHandle_t handle, const Problem& p, size_t workspace_bytes, cublasLtMatmulHeuristicResult_t* results,
              int max) {
  cublasLtMatmulPreference_t pref;
  CHECK_LT(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws = workspace_bytes;
  CHECK_LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  int found = 0;
  CHECK_LT(cublasLtMatmulAlgoGetHeuristic(handle, p.desc, p.la, p.lb, p.lc, p.lc, pref, max, results, &found));
  cublasLtMatmulPreferenceDestroy(pref);
  return found;
}

void run(cublasLtHandle_t handle, const Case& cs, void* workspace, size_t workspace_bytes) {
  const Problem p(cs);
  cublasLtMatmulHeuristicResult_t results[16];
  const int found = heuristic(handle, p, workspace_bytes, results, 16);
  std::printf("\n%s: M %lld N %lld K %lld, beta %.0f, %d algorithms\n", cs.name, (long long)cs.m, (long long)cs.n,
              (long long)cs.k, cs.beta, found);
  for (int i = 0; i < found; ++i) {
    const double med = p.time(handle, results[i].algo, workspace, workspace_bytes, 2, 10);
    if (med < 0) {
      std::printf("  algo %2d: failed\n", i);
      continue;
    }
    std::printf("  algo %2d: %8.3f ms %7.1f TFLOP/s  %s workspace %zu%s\n", i, med, p.flops() / med * 1e-9,
                describe(results[i].algo).c_str(), results[i].workspaceSize, i == 0 ? "  <- heuristic's choice" : "");
  }
}

// Every configuration cublasLtMatmulAlgoCheck accepts, timed; the ten fastest printed.
void search(cublasLtHandle_t handle, const Case& cs, void* workspace, size_t workspace_bytes) {
  const Problem p(cs);
  cublasLtMatmulHeuristicResult_t first{};
  const int found = heuristic(handle, p, workspace_bytes, &first, 1);
  const double heuristic_ms = found ? p.time(handle, first.algo, workspace, workspace_bytes, 2, 10) : -1;
  std::printf("\n%s: M %lld N %lld K %lld, beta %.0f; heuristic: %.3f ms %.1f TFLOP/s (%s)\n", cs.name,
              (long long)cs.m, (long long)cs.n, (long long)cs.k, cs.beta, heuristic_ms,
              p.flops() / heuristic_ms * 1e-9, found ? describe(first.algo).c_str() : "none");
  int ids[256], id_count = 0;
  CHECK_LT(cublasLtMatmulAlgoGetIds(handle, CUBLAS_COMPUTE_32F, CUDA_R_32F, cs.b, cs.a, cs.c, cs.c, 256, ids, &id_count));
  const uint16_t clusters[] = {CUBLASLT_CLUSTER_SHAPE_AUTO, CUBLASLT_CLUSTER_SHAPE_1x1x1, CUBLASLT_CLUSTER_SHAPE_2x1x1,
                               CUBLASLT_CLUSTER_SHAPE_1x2x1, CUBLASLT_CLUSTER_SHAPE_2x2x1, CUBLASLT_CLUSTER_SHAPE_4x1x1,
                               CUBLASLT_CLUSTER_SHAPE_1x4x1};
  std::vector<std::pair<double, cublasLtMatmulAlgo_t>> timed;
  int checked = 0;
  for (int i = 0; i < id_count; ++i) {
    cublasLtMatmulAlgo_t algo;
    if (cublasLtMatmulAlgoInit(handle, CUBLAS_COMPUTE_32F, CUDA_R_32F, cs.b, cs.a, cs.c, cs.c, ids[i], &algo) !=
        CUBLAS_STATUS_SUCCESS)
      continue;
    size_t w = 0;
    std::vector<int> tiles(1, 0), stages(1, 0);
    if (cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_TILE_IDS, nullptr, 0, &w) == CUBLAS_STATUS_SUCCESS &&
        w > 0) {
      tiles.resize(w / sizeof(int));
      cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_TILE_IDS, tiles.data(), w, &w);
    }
    if (cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_STAGES_IDS, nullptr, 0, &w) ==
            CUBLAS_STATUS_SUCCESS &&
        w > 0) {
      stages.resize(w / sizeof(int));
      cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_STAGES_IDS, stages.data(), w, &w);
    }
    int custom_max = 0, swizzle_ok = 0;
    cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_CUSTOM_OPTION_MAX, &custom_max, sizeof(custom_max), &w);
    cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_CTA_SWIZZLING_SUPPORT, &swizzle_ok, sizeof(swizzle_ok),
                                      &w);
    for (int tile : tiles)
      for (int stage : stages)
        for (uint16_t cluster : clusters)
          for (int swizzle = 0; swizzle <= (swizzle_ok ? 1 : 0); ++swizzle)
            for (int custom = 0; custom <= std::min(custom_max, 7); ++custom) {
              cublasLtMatmulAlgo_t a = algo;
              cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile));
              cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stage, sizeof(stage));
              cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster,
                                                   sizeof(cluster));
              cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &swizzle, sizeof(swizzle));
              cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, &custom, sizeof(custom));
              cublasLtMatmulHeuristicResult_t r{};
              if (cublasLtMatmulAlgoCheck(handle, p.desc, p.la, p.lb, p.lc, p.lc, &a, &r) != CUBLAS_STATUS_SUCCESS ||
                  r.workspaceSize > workspace_bytes)
                continue;
              ++checked;
              // One call first: configurations far slower than the heuristic's are not worth 5 more.
              const double once = p.time(handle, a, workspace, workspace_bytes, 1, 1);
              if (once < 0 || (heuristic_ms > 0 && once > 1.5 * heuristic_ms)) continue;
              const double med = p.time(handle, a, workspace, workspace_bytes, 1, 5);
              if (med > 0) timed.emplace_back(med, a);
            }
  }
  std::sort(timed.begin(), timed.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
  std::printf("  %d algorithm ids, %d configurations accepted, %zu within 1.5x of the heuristic; fastest (re-timed, median of 20):\n", id_count,
              checked, timed.size());
  for (size_t i = 0; i < timed.size() && i < 10; ++i) {
    const double med = p.time(handle, timed[i].second, workspace, workspace_bytes, 2, 20);
    std::printf("  %8.3f ms %7.1f TFLOP/s %5.3fx heuristic  %s\n", med, p.flops() / med * 1e-9, heuristic_ms / med,
                describe(timed[i].second).c_str());
  }
}

}  // namespace

int main(int argc, char** argv) {
  const bool exhaustive = argc > 1 && std::string(argv[1]) == "search";
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
  if (!exhaustive) {
    for (const Case& c : cases) run(handle, c, workspace, workspace_bytes);
  } else {
    // The single-pass weight gradients, and for scale the same fc wgrad writing BF16 (what
    // the FP32 epilogue costs) and the forward GEMM (what the tensor cores reach here).
    const Case searched[] = {
        // FP8, accumulating in place (D = C), as tessera's later micro-batches do.
        {"fc wgrad, in place (dW += dy^T x, F32)", 2 * ffn, hidden, rows, CUDA_R_8F_E5M2, CUDA_R_8F_E4M3, CUDA_R_32F, 1,
         false, 16384, false, true},
        // BF16, as GroupedLinear's BF16 path: beta 0, then beta 1 in place.
        {"BF16 fc wgrad (beta 0)", 2 * ffn, hidden, rows, CUDA_R_16BF, CUDA_R_16BF, CUDA_R_32F, 0, false, 0, true},
        {"BF16 proj wgrad (beta 0)", hidden, ffn, rows, CUDA_R_16BF, CUDA_R_16BF, CUDA_R_32F, 0, false, 0, true},
        {"BF16 fc wgrad, in place (beta 1)", 2 * ffn, hidden, rows, CUDA_R_16BF, CUDA_R_16BF, CUDA_R_32F, 1, false, 0,
         true, true},
        cases[3], cases[5], cases[2],
        {"fc wgrad, BF16 dW (for scale only)", 2 * ffn, hidden, rows, CUDA_R_8F_E5M2, CUDA_R_8F_E4M3, CUDA_R_16BF, 0,
         false, 16384},
        cases[0],
    };
    // `search new`: the in-place and BF16 rows only.
    const size_t count = argc > 2 && std::string(argv[2]) == "new" ? 4 : sizeof(searched) / sizeof(searched[0]);
    for (size_t i = 0; i < count; ++i) search(handle, searched[i], workspace, workspace_bytes);
  }
  CHECK_CUDA(cudaFree(workspace));
  cublasLtDestroy(handle);
  return 0;
}
