// See stream_fan.h.
#include "stream_fan.h"

#include <cuda_runtime.h>

#include <mutex>

#include "cuda_check.h"
#include "tessera/core/error.h"

namespace tessera::cuda {

namespace {

cudaStream_t* side_streams(int device) {
  static std::mutex mutex;
  static cudaStream_t pools[64][kSideStreams] = {};  // kept until exit, like the allocators
  TESSERA_CHECK(device >= 0 && device < 64, "StreamFan: device index ", device, " out of range");
  std::lock_guard<std::mutex> lock(mutex);
  if (pools[device][0] == nullptr) {
    int previous = 0;
    TESSERA_CUDA_CHECK(cudaGetDevice(&previous));
    TESSERA_CUDA_CHECK(cudaSetDevice(device));
    for (cudaStream_t& s : pools[device]) TESSERA_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    TESSERA_CUDA_CHECK(cudaSetDevice(previous));
  }
  return pools[device];
}

// An event recorded on `from` that `to` waits for; released at once (the wait is queued).
void order(cudaStream_t from, cudaStream_t to) {
  cudaEvent_t event = nullptr;
  TESSERA_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  TESSERA_CUDA_CHECK(cudaEventRecord(event, from));
  TESSERA_CUDA_CHECK(cudaStreamWaitEvent(to, event, 0));
  TESSERA_CUDA_CHECK(cudaEventDestroy(event));
}

}  // namespace

int side_stream_index(int device, const void* stream) {
  if (stream == nullptr) return -1;
  cudaStream_t* sides = side_streams(device);
  for (int i = 0; i < kSideStreams; ++i)
    if (sides[i] == stream) return i;
  return -1;
}

StreamFan::StreamFan(void* stream, int device) : stream_(stream), device_(device) {
  cudaStream_t* sides = side_streams(device);
  for (int i = 0; i < kSideStreams; ++i) order(static_cast<cudaStream_t>(stream_), sides[i]);
}

StreamFan::~StreamFan() {
  if (joined_) return;
  // Never leave the caller's stream ahead of work still reading its tensors; errors here
  // cannot be thrown from a destructor, and the next CUDA call reports them.
  cudaStream_t* sides = side_streams(device_);
  for (int i = 0; i < kSideStreams; ++i) {
    cudaEvent_t event = nullptr;
    if (cudaEventCreateWithFlags(&event, cudaEventDisableTiming) != cudaSuccess) continue;
    cudaEventRecord(event, sides[i]);
    cudaStreamWaitEvent(static_cast<cudaStream_t>(stream_), event, 0);
    cudaEventDestroy(event);
  }
}

void* StreamFan::side(int i) const { return side_streams(device_)[i % kSideStreams]; }

void StreamFan::join() {
  if (joined_) return;
  cudaStream_t* sides = side_streams(device_);
  for (int i = 0; i < kSideStreams; ++i) order(sides[i], static_cast<cudaStream_t>(stream_));
  joined_ = true;
}

}  // namespace tessera::cuda
