#include "tessera/core/stream.h"

#include <utility>

#include "tessera/core/error.h"
#if TESSERA_WITH_CUDA
#include "../backend/cuda/cuda_backend.h"
#endif

namespace tessera {

namespace {

constexpr int kMaxDevices = 64;

// Plain pointers: a thread starts with every device on the default stream.
thread_local void* current_streams[kMaxDevices] = {};

void check_index(Device device) {
  TESSERA_CHECK(device.index >= 0 && device.index < kMaxDevices, "stream: cuda:", device.index,
                " is beyond the ", kMaxDevices, " devices tessera tracks");
}

}  // namespace

void* current_stream(Device device) {
  if (!device.is_cuda() || device.index < 0 || device.index >= kMaxDevices) return nullptr;
  return current_streams[device.index];
}

StreamGuard::StreamGuard(Device device, void* stream) : device_(device) {
  if (!device_.is_cuda()) return;
  check_index(device_);
  previous_ = current_streams[device_.index];
  current_streams[device_.index] = stream;
}

StreamGuard::~StreamGuard() {
  if (device_.is_cuda()) current_streams[device_.index] = previous_;
}

void stream_wait(Device device, void* waiter, void* producer) {
  if (!device.is_cuda() || waiter == producer) return;
#if TESSERA_WITH_CUDA
  cuda::stream_wait(waiter, producer);
#else
  TESSERA_FAIL("stream_wait: ", device.to_string(), " needs the CUDA backend, which this build does not have");
#endif
}

Stream Stream::create(Device device, int priority) {
  Stream s;
  s.device_ = device;
  if (!device.is_cuda()) return s;
  check_index(device);
#if TESSERA_WITH_CUDA
  s.stream_ = cuda::create_stream(device.index, priority);
#else
  (void)priority;
  TESSERA_FAIL("Stream::create: ", device.to_string(), " needs the CUDA backend, which this build does not have");
#endif
  return s;
}

void Stream::reset() {
#if TESSERA_WITH_CUDA
  if (stream_) cuda::destroy_stream(device_.index, stream_);
#endif
  stream_ = nullptr;
}

Stream::~Stream() { reset(); }

Stream::Stream(Stream&& other) noexcept
    : device_(other.device_), stream_(std::exchange(other.stream_, nullptr)) {}

Stream& Stream::operator=(Stream&& other) noexcept {
  if (this != &other) {
    reset();
    device_ = other.device_;
    stream_ = std::exchange(other.stream_, nullptr);
  }
  return *this;
}

}  // namespace tessera
