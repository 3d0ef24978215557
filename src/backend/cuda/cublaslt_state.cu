// See cublaslt_state.h.
#include "cublaslt_state.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>
#include <utility>
#include <limits>
#include <mutex>

#include "cuda_check.h"
#include "stream_fan.h"
#include "tessera/ops/gemm.h"

namespace tessera::cuda {

LtState& lt_state(int device) {
  static std::mutex mutex;
  static LtState* states[64] = {};  // leaked on purpose, like the allocators: used until exit
  std::lock_guard<std::mutex> lock(mutex);
  TESSERA_CHECK(device >= 0 && device < 64, "cuBLASLt: device index ", device, " out of range");
  if (!states[device]) {
    auto* s = new LtState();
    TESSERA_CUBLAS_CHECK(cublasLtCreate(&s->handle));
    s->workspace = Tensor::empty({static_cast<int64_t>(kLtWorkspaceBytes)}, DType::U8, Device::cuda(device));
    states[device] = s;
  }
  return *states[device];
}

void* lt_workspace(LtState& state, int device, void* stream) {
  static_assert(sizeof(LtState::side_workspaces) / sizeof(Tensor) == kSideStreams);
  const int side = side_stream_index(device, stream);
  if (side < 0) return state.workspace.raw_data();
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  Tensor& w = state.side_workspaces[side];
  if (!w.defined()) w = Tensor::empty({static_cast<int64_t>(kLtWorkspaceBytes)}, DType::U8, Device::cuda(device));
  return w.raw_data();
}

namespace {

std::mutex autotune_mutex;
std::vector<std::string> autotune_lines;  // guarded by autotune_mutex
int tuned_shapes[64] = {};                // per device, guarded by autotune_mutex

void autotune_note(const std::string& line) {
  std::lock_guard<std::mutex> lock(autotune_mutex);
  autotune_lines.push_back(line);
}

// Device memory outside the caching allocator for the candidates' scratch output: freed when
// the tuning ends, so it never stays cached. Null if cudaMalloc fails.
class Scratch {
 public:
  explicit Scratch(size_t bytes) {
    if (bytes == 0) return;
    if (cudaMalloc(&ptr_, bytes) != cudaSuccess) {
      ptr_ = nullptr;
      cudaGetLastError();  // clear the failed allocation's error
    }
  }
  ~Scratch() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  void* get() const { return ptr_; }

 private:
  void* ptr_ = nullptr;
};

// Each candidate: one untimed run, then timed rounds; see lt_tune. `indices` are the
// candidates to time (launch's numbering); returns the position in it of the fastest, and
// the figures through best.
int time_rounds(void* stream, const std::vector<int>& indices, const std::function<bool(int)>& launch,
                std::vector<float>& best) {
  const auto s = static_cast<cudaStream_t>(stream);
  // Each candidate: one untimed run (its first launch loads the kernel), then three rounds
  // of two runs between events, interleaved with the others so that clock drift spreads
  // evenly; a candidate's figure is its best round.
  constexpr int kRounds = 3, kRunsPerRound = 2;
  const int count = static_cast<int>(indices.size());
  best.assign(count, std::numeric_limits<float>::infinity());
  std::vector<bool> runs(count, false);
  for (int i = 0; i < count; ++i) runs[i] = launch(indices[i]);
  cudaEvent_t start = nullptr, stop = nullptr;
  TESSERA_CUDA_CHECK(cudaEventCreate(&start));
  TESSERA_CUDA_CHECK(cudaEventCreate(&stop));
  for (int round = 0; round < kRounds; ++round) {
    for (int i = 0; i < count; ++i) {
      if (!runs[i]) continue;
      TESSERA_CUDA_CHECK(cudaEventRecord(start, s));
      for (int r = 0; r < kRunsPerRound && runs[i]; ++r) runs[i] = launch(indices[i]);
      TESSERA_CUDA_CHECK(cudaEventRecord(stop, s));
      TESSERA_CUDA_CHECK(cudaEventSynchronize(stop));
      float ms = 0;
      TESSERA_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
      if (runs[i]) best[i] = std::min(best[i], ms / kRunsPerRound);
    }
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  int fastest = 0;
  for (int i = 1; i < count; ++i)
    if (best[i] < best[fastest]) fastest = i;
  return fastest;
}

// A wide list is screened: every candidate run once untimed (kernel load) and once timed;
// the heuristic's first and the kLtCandidates - 1 fastest of the others go on to the rounds.
std::vector<int> screen(void* stream, int count, const std::function<bool(int)>& launch) {
  std::vector<int> all(count);
  for (int i = 0; i < count; ++i) all[i] = i;
  if (count <= kLtCandidates) return all;
  const auto s = static_cast<cudaStream_t>(stream);
  cudaEvent_t start = nullptr, stop = nullptr;
  TESSERA_CUDA_CHECK(cudaEventCreate(&start));
  TESSERA_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<std::pair<float, int>> timed;
  for (int i = 1; i < count; ++i) {
    if (!launch(i)) continue;
    TESSERA_CUDA_CHECK(cudaEventRecord(start, s));
    const bool ok = launch(i);
    TESSERA_CUDA_CHECK(cudaEventRecord(stop, s));
    TESSERA_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    TESSERA_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    if (ok) timed.emplace_back(ms, i);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(timed.begin(), timed.end());
  std::vector<int> kept = {0};
  for (size_t j = 0; j < timed.size() && kept.size() < static_cast<size_t>(kLtCandidates); ++j)
    kept.push_back(timed[j].second);
  return kept;
}

int pick_fastest(void* stream, int count, const std::function<bool(int)>& launch, const std::string& what) {
  const std::vector<int> kept = screen(stream, count, launch);
  std::vector<float> best;
  const int pos = time_rounds(stream, kept, launch, best);
  // The heuristic's choice (position 0) unless another is more than 1% faster; if it failed
  // to launch here (infinite figure), whichever ran.
  const int fastest_pos = std::isinf(best[0]) || best[pos] <= 0.99f * best[0] ? pos : 0;
  const int fastest = kept[fastest_pos];
  char line[200];
  if (fastest == 0) {
    std::snprintf(line, sizeof(line), ": heuristic's choice kept (%.3f ms; %d candidates, %d timed in full)", best[0],
                  count, static_cast<int>(kept.size()));
  } else {
    std::snprintf(line, sizeof(line), ": candidate %d of %d, %.3f ms against the heuristic's %.3f ms (%.3fx)", fastest,
                  count, best[fastest_pos], best[0], best[0] / best[fastest_pos]);
    std::fprintf(stderr, "tessera: gemm autotune: %s%s\n", what.c_str(), line);
  }
  autotune_note(what + line);
  return fastest;
}

}  // namespace

bool lt_should_tune(int device, void* stream, int uses) {
  if (uses < 2 || !gemm_autotune()) return false;  // one-off shapes (a last partial batch) keep the heuristic
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  TESSERA_CUDA_CHECK(cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &capture));
  if (capture != cudaStreamCaptureStatusNone) return false;  // timing would break the capture: tune later
  std::lock_guard<std::mutex> lock(autotune_mutex);
  if (device < 0 || device >= 64 || tuned_shapes[device] >= kLtTunedShapesMax) return false;
  if (++tuned_shapes[device] == kLtTunedShapesMax) {
    std::fprintf(stderr, "tessera: gemm autotune: %d shapes tuned on device %d; new shapes keep the heuristic's choice\n",
                 kLtTunedShapesMax, device);
  }
  return true;
}

std::vector<std::string> lt_autotune_log() {
  std::lock_guard<std::mutex> lock(autotune_mutex);
  return autotune_lines;
}

int lt_tune(void* stream, int count, bool beta_zero, void* out, size_t out_bytes,
            const std::function<bool(int, void*)>& launch, const std::string& what) {
  if (count <= 1) {
    autotune_note(what + ": the heuristic offers one algorithm; nothing to time");
    return 0;
  }
  Scratch scratch(beta_zero ? 0 : out_bytes);
  if (!beta_zero && scratch.get() == nullptr) {
    autotune_note(what + ": no device memory for a scratch output; heuristic's choice kept");
    return 0;
  }
  // beta != 0: the candidates run in place on a copy of out (the caller's GEMM runs in
  // place, which some kernels do much faster than writing a separate D).
  if (!beta_zero)
    TESSERA_CUDA_CHECK(
        cudaMemcpyAsync(scratch.get(), out, out_bytes, cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream)));
  void* d = beta_zero ? out : scratch.get();
  return pick_fastest(stream, count, [&](int i) { return launch(i, d); }, what);
}

std::vector<cublasLtMatmulAlgo_t> lt_widen(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                           cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                           cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
                                           const std::vector<cublasLtMatmulAlgo_t>& heuristic, size_t workspace_bytes) {
  std::vector<cublasLtMatmulAlgo_t> out = heuristic;
  // A configuration's identity: algorithm id, tile, stages, split-K, swizzle, custom option,
  // cluster shape.
  auto identity = [](const cublasLtMatmulAlgo_t& algo) {
    int v[6] = {};
    uint16_t cluster = 0;
    size_t w = 0;
    const cublasLtMatmulAlgoConfigAttributes_t attrs[6] = {
        CUBLASLT_ALGO_CONFIG_ID,         CUBLASLT_ALGO_CONFIG_TILE_ID,        CUBLASLT_ALGO_CONFIG_STAGES_ID,
        CUBLASLT_ALGO_CONFIG_SPLITK_NUM, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION};
    for (int i = 0; i < 6; ++i) cublasLtMatmulAlgoConfigGetAttribute(&algo, attrs[i], &v[i], sizeof(int), &w);
    cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster, sizeof(cluster), &w);
    return std::vector<int>{v[0], v[1], v[2], v[3], v[4], v[5], static_cast<int>(cluster)};
  };
  std::set<std::vector<int>> seen;
  for (const auto& h : heuristic) seen.insert(identity(h));
  const uint16_t clusters[] = {CUBLASLT_CLUSTER_SHAPE_1x1x1, CUBLASLT_CLUSTER_SHAPE_2x1x1,
                               CUBLASLT_CLUSTER_SHAPE_1x2x1};
  for (const auto& base : heuristic) {
    size_t w = 0;
    std::vector<int> tiles;
    if (cublasLtMatmulAlgoCapGetAttribute(&base, CUBLASLT_ALGO_CAP_TILE_IDS, nullptr, 0, &w) == CUBLAS_STATUS_SUCCESS &&
        w >= sizeof(int)) {
      tiles.resize(w / sizeof(int));
      cublasLtMatmulAlgoCapGetAttribute(&base, CUBLASLT_ALGO_CAP_TILE_IDS, tiles.data(), w, &w);
    }
    int custom_max = 0;
    cublasLtMatmulAlgoCapGetAttribute(&base, CUBLASLT_ALGO_CAP_CUSTOM_OPTION_MAX, &custom_max, sizeof(custom_max), &w);
    for (int tile : tiles)
      for (int custom = 0; custom <= std::min(custom_max, 7); ++custom)
        for (uint16_t cluster : clusters) {
          if (static_cast<int>(out.size()) >= kLtWideMax) return out;
          cublasLtMatmulAlgo_t v = base;
          cublasLtMatmulAlgoConfigSetAttribute(&v, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile));
          cublasLtMatmulAlgoConfigSetAttribute(&v, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, &custom, sizeof(custom));
          cublasLtMatmulAlgoConfigSetAttribute(&v, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster, sizeof(cluster));
          if (!seen.insert(identity(v)).second) continue;
          cublasLtMatmulHeuristicResult_t r{};
          if (cublasLtMatmulAlgoCheck(handle, desc, a, b, c, d, &v, &r) != CUBLAS_STATUS_SUCCESS ||
              r.state != CUBLAS_STATUS_SUCCESS || r.workspaceSize > workspace_bytes)
            continue;
          out.push_back(v);
        }
  }
  return out;
}

}  // namespace tessera::cuda
