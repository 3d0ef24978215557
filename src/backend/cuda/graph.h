// CUDA graph capture with a private memory pool (backend/cuda/graph.cu). Declarations only;
// usable from C++ (the CUDA handles are plain pointers).
//
// Capture mode: cudaStreamCaptureModeThreadLocal. The capturing thread may not make
// "potentially unsafe" calls: a synchronisation, a synchronous copy or cudaFree makes the
// capture fail, which is reported, never silently mis-recorded. Other threads (the
// asynchronous checkpoint writer pinning host memory, say) are not restricted, as
// cudaStreamCaptureModeGlobal would restrict them. The one unsafe call a capture needs,
// cudaMalloc when the graph's pool must grow, the caching allocator makes in relaxed mode
// for just that call (runtime.cu): new memory is harmless to a graph, which never
// allocates when replayed. Relaxed mode for the whole capture would also let this thread
// synchronise, which inside a capture is always a bug.
#pragma once

#include <cstdint>

namespace tessera::cuda {

// Whether work queued on `stream` is being captured right now.
bool stream_capturing(void* stream);

class CapturedGraph {
 public:
  CapturedGraph() = default;
  // Waits for `stream` of the last replay, destroys the graph, then releases its pool.
  ~CapturedGraph();
  CapturedGraph(CapturedGraph&& other) noexcept;
  CapturedGraph& operator=(CapturedGraph&& other) noexcept;
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;

  // Synchronises cuda:device, makes a private allocation pool and selects it for this
  // thread, and begins capturing `stream` (a non-default stream of that device).
  void begin(int device, void* stream);
  // Ends the capture and instantiates the graph; deselects the pool (which the graph keeps).
  // Throws Error with CUDA's reason when the capture failed (everything is then released).
  void end();
  // Ends a capture that an exception interrupted, discards it and releases the pool. Never
  // throws; a no-op when no capture is under way.
  void abandon() noexcept;
  // Queues the whole graph on the stream it was captured on.
  void replay() const;
  bool ready() const { return exec_ != nullptr; }

 private:
  void reset() noexcept;
  int device_ = 0;
  void* stream_ = nullptr;
  void* exec_ = nullptr;  // cudaGraphExec_t
  uint64_t pool_ = 0;
  bool capturing_ = false;
};

}  // namespace tessera::cuda
