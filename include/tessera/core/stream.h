// Streams for the Tensor-level operations that take no Context.
//
// Ops queue on ctx.stream. Tensor::copy_from, fill_zero, zeros, clone and to() have no
// Context, so they queue on this thread's "current stream" of the CUDA device involved:
// nullptr (the legacy default stream, what every op used before streams existed) unless a
// StreamGuard says otherwise. Code that runs ops on a Context with its own stream sets a
// StreamGuard for the same stream for as long as it does (the trainer and
// train::CudaGraphStep do), so that the copies and fills between its ops stay in order with
// them. A copy whose destination is host memory waits for that stream only (not for the
// whole device) before it returns; a host-to-device copy also returns only when the host
// memory may be reused. With no guard set everything behaves as before: synchronous
// cudaMemcpy, and memsets and copy kernels on the default stream.
#pragma once

#include "tessera/core/context.h"
#include "tessera/core/dtype.h"

namespace tessera {

// This thread's stream for Tensor-level work on `device` (nullptr for the CPU, and for a
// CUDA device no StreamGuard is active for).
void* current_stream(Device device);

// Makes `stream` the current stream of `device` in this thread until destroyed, then
// restores the previous one. Nests. A no-op for a CPU device.
class StreamGuard {
 public:
  StreamGuard(Device device, void* stream);
  explicit StreamGuard(const Context& ctx) : StreamGuard(ctx.device, ctx.stream) {}
  ~StreamGuard();
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  Device device_;
  void* previous_ = nullptr;
};

// A stream tessera creates and destroys: on CUDA a non-blocking stream (it does not wait
// for, nor hold up, work on the legacy default stream), on the CPU nothing (get() is null).
// Destroying it waits for the work queued on it. Move-only.
class Stream {
 public:
  Stream() = default;
  // priority: CUDA's stream priority, lower runs first (0: the default and lowest; -1 and
  // below: higher, clamped to what the device offers). Ignored on the CPU.
  static Stream create(Device device, int priority = 0);
  ~Stream();
  Stream(Stream&& other) noexcept;
  Stream& operator=(Stream&& other) noexcept;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  void* get() const { return stream_; }
  Device device() const { return device_; }
  // A Context on this stream's device that queues on it.
  Context context() const { return Context{device_, stream_}; }

 private:
  void reset();
  Device device_;
  void* stream_ = nullptr;
};

// Work queued on the stream `waiter` of `device` from now on waits for everything queued on
// its stream `producer` so far: no host wait, and a no-op on the CPU (whose ops run as they
// are called) or when both are the same stream.
void stream_wait(Device device, void* waiter, void* producer);

// A Context on `device` that uses this thread's current stream there.
inline Context context_on(Device device) { return Context{device, current_stream(device)}; }

}  // namespace tessera
