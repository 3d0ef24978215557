// CUDA graph capture of the work one thread queues on a stream, with the private allocation
// pool that keeps the graph's memory its own (runtime.cu). No kernels here: a replay costs
// one cudaGraphLaunch instead of one launch per kernel, which is what a small model's step
// is bound by (host launch overhead, not the GPU).
#include "graph.h"

#include <cuda_runtime.h>

#include <utility>

#include "cuda_backend.h"
#include "cuda_check.h"

namespace tessera::cuda {

bool stream_capturing(void* stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  TESSERA_CUDA_CHECK(cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status));
  return status != cudaStreamCaptureStatusNone;
}

CapturedGraph::~CapturedGraph() { reset(); }

CapturedGraph::CapturedGraph(CapturedGraph&& other) noexcept
    : device_(other.device_),
      stream_(other.stream_),
      exec_(std::exchange(other.exec_, nullptr)),
      pool_(std::exchange(other.pool_, 0)),
      capturing_(std::exchange(other.capturing_, false)) {}

CapturedGraph& CapturedGraph::operator=(CapturedGraph&& other) noexcept {
  if (this != &other) {
    reset();
    device_ = other.device_;
    stream_ = other.stream_;
    exec_ = std::exchange(other.exec_, nullptr);
    pool_ = std::exchange(other.pool_, 0);
    capturing_ = std::exchange(other.capturing_, false);
  }
  return *this;
}

void CapturedGraph::begin(int device, void* stream) {
  reset();
  TESSERA_CHECK(stream != nullptr,
                "CUDA graph capture needs a stream of its own (the default stream cannot be captured)");
  device_ = device;
  stream_ = stream;
  TESSERA_CUDA_CHECK(cudaSetDevice(device));
  // Everything queued so far, on any stream, is done: the general free blocks the pool may
  // take over are idle (runtime.cu).
  TESSERA_CUDA_CHECK(cudaDeviceSynchronize());
  pool_ = create_allocation_pool(device);
  select_allocation_pool(device, pool_);
  const cudaError_t err = cudaStreamBeginCapture(static_cast<cudaStream_t>(stream), cudaStreamCaptureModeThreadLocal);
  if (err != cudaSuccess) {
    cudaGetLastError();
    reset();
    TESSERA_FAIL("CUDA graph capture could not begin: ", cudaGetErrorString(err));
  }
  capturing_ = true;
}

void CapturedGraph::end() {
  TESSERA_CHECK(capturing_, "CapturedGraph::end without begin");
  cudaGraph_t graph = nullptr;
  cudaError_t err = cudaStreamEndCapture(static_cast<cudaStream_t>(stream_), &graph);
  capturing_ = false;
  select_allocation_pool(device_, 0);
  cudaGraphExec_t exec = nullptr;
  if (err == cudaSuccess) err = cudaGraphInstantiate(&exec, graph, 0);
  if (graph) cudaGraphDestroy(graph);  // the executable graph keeps what it needs
  if (err != cudaSuccess) {
    cudaGetLastError();
    reset();
    TESSERA_FAIL("CUDA graph capture failed: ", cudaGetErrorString(err));
  }
  exec_ = exec;
}

void CapturedGraph::abandon() noexcept { reset(); }

void CapturedGraph::replay() const {
  TESSERA_CHECK(exec_ != nullptr, "CapturedGraph::replay: nothing was captured");
  TESSERA_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec_), static_cast<cudaStream_t>(stream_)));
}

void CapturedGraph::reset() noexcept {
  if (capturing_) {
    cudaGraph_t graph = nullptr;
    if (cudaStreamEndCapture(static_cast<cudaStream_t>(stream_), &graph) == cudaSuccess && graph)
      cudaGraphDestroy(graph);
    cudaGetLastError();  // an invalidated capture reports an error here; it is expected
    capturing_ = false;
  }
  if (exec_) {
    // The last replay may still run and use the pool's blocks.
    cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));
    cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));
    cudaGetLastError();
    exec_ = nullptr;
  }
  if (pool_ != 0) {
    try {
      if (selected_allocation_pool(device_) == pool_) select_allocation_pool(device_, 0);
      release_allocation_pool(device_, pool_);
    } catch (...) {
      // Only a vanished device gets here; the pool's blocks then stay unused.
    }
    pool_ = 0;
  }
}

}  // namespace tessera::cuda
