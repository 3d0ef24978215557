// Fanning independent work out of one stream onto a few side streams and joining it back:
// the grouped expert GEMMs (ops/moe.cpp) queue one cuBLASLt call per expert, and on one
// stream those run one after another even when each is too small to fill the GPU.
//
// Each device has a fixed pool of side streams (non-blocking, made on first use, kept for
// the process), each with its own cuBLASLt workspace (cublaslt_state.h: GEMMs that may run
// at once must not share one). A StreamFan made on stream S makes every side stream wait
// for the work S has queued so far; join() (or the destructor) makes S wait for everything
// queued on the side streams since. No host synchronisation; capturable into a CUDA graph.
//
// Work queued on a side stream must not allocate memory it frees before join(): the caching
// allocator hands freed blocks to whatever stream asks next.
#pragma once

namespace tessera::cuda {

constexpr int kSideStreams = 4;

// Which side stream of `device` `stream` is (0 .. kSideStreams-1), or -1 for any other.
int side_stream_index(int device, const void* stream);

class StreamFan {
 public:
  StreamFan(void* stream, int device);
  ~StreamFan();
  StreamFan(const StreamFan&) = delete;
  StreamFan& operator=(const StreamFan&) = delete;
  // Side stream i % kSideStreams of the device.
  void* side(int i) const;
  void join();

 private:
  void* stream_;
  int device_;
  bool joined_ = false;
};

}  // namespace tessera::cuda
