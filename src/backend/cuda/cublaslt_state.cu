// See cublaslt_state.h.
#include "cublaslt_state.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
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

// Each candidate: one untimed run, then timed rounds; see lt_tune.
int pick_fastest(void* stream, int count, const std::function<bool(int)>& launch, const std::string& what) {
  const auto s = static_cast<cudaStream_t>(stream);
  // Each candidate: one untimed run (its first launch loads the kernel), then three rounds
  // of two runs between events, interleaved with the others so that clock drift spreads
  // evenly; a candidate's figure is its best round.
  constexpr int kRounds = 3, kRunsPerRound = 2;
  std::vector<float> best(count, std::numeric_limits<float>::infinity());
  std::vector<bool> runs(count, false);
  for (int i = 0; i < count; ++i) runs[i] = launch(i);
  cudaEvent_t start = nullptr, stop = nullptr;
  TESSERA_CUDA_CHECK(cudaEventCreate(&start));
  TESSERA_CUDA_CHECK(cudaEventCreate(&stop));
  for (int round = 0; round < kRounds; ++round) {
    for (int i = 0; i < count; ++i) {
      if (!runs[i]) continue;
      TESSERA_CUDA_CHECK(cudaEventRecord(start, s));
      for (int r = 0; r < kRunsPerRound && runs[i]; ++r) runs[i] = launch(i);
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
    if (runs[i] && best[i] < best[fastest]) fastest = i;
  if (!runs[0]) {
    // The heuristic's own first choice failed to launch here: keep whichever ran.
  } else if (best[fastest] > 0.99f * best[0]) {
    fastest = 0;
  }
  char line[160];
  if (fastest == 0) {
    std::snprintf(line, sizeof(line), ": heuristic's choice kept (%.3f ms; %d candidates)", best[0], count);
  } else {
    std::snprintf(line, sizeof(line), ": candidate %d, %.3f ms against the heuristic's %.3f ms (%.3fx)", fastest,
                  best[fastest], best[0], best[0] / best[fastest]);
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
  void* d = beta_zero ? out : scratch.get();
  return pick_fastest(stream, count, [&](int i) { return launch(i, d); }, what);
}

}  // namespace tessera::cuda
