// Host side of the lazily reported index errors (see index_error.h): one claim word in
// device memory and one record in mapped, pinned host memory per device, made on first
// use (the only synchronising CUDA calls, once per process) and kept for the process.
#include "index_error.h"

#include <cuda_runtime.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <string>

#include "cuda_check.h"

namespace tessera::cuda {

namespace {

constexpr int kMaxDevices = 64;

struct Slot {
  unsigned int* claim = nullptr;
  IndexErrorRecord* host = nullptr;    // what the host reads
  IndexErrorRecord* device = nullptr;  // the same memory as the device addresses it
};

std::atomic<Slot*> slots[kMaxDevices];

Slot& slot_for(int device) {
  TESSERA_CHECK(device >= 0 && device < kMaxDevices, "cuda:", device, " is beyond the ", kMaxDevices,
                " devices tessera tracks");
  if (Slot* s = slots[device].load(std::memory_order_acquire)) return *s;
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  if (Slot* s = slots[device].load(std::memory_order_acquire)) return *s;
  int previous = 0;
  TESSERA_CUDA_CHECK(cudaGetDevice(&previous));
  TESSERA_CUDA_CHECK(cudaSetDevice(device));
  auto* s = new Slot();  // leaked on purpose, like the allocators: kernels may still hold it
  TESSERA_CUDA_CHECK(cudaMalloc(&s->claim, sizeof(unsigned int)));
  TESSERA_CUDA_CHECK(cudaMemset(s->claim, 0, sizeof(unsigned int)));
  TESSERA_CUDA_CHECK(cudaHostAlloc(&s->host, sizeof(IndexErrorRecord), cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(static_cast<void*>(s->host), 0, sizeof(IndexErrorRecord));
  TESSERA_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&s->device), s->host, 0));
  TESSERA_CUDA_CHECK(cudaSetDevice(previous));
  slots[device].store(s, std::memory_order_release);
  return *s;
}

const char* op_name(int32_t op) {
  switch (static_cast<IndexOp>(op)) {
    case IndexOp::EmbeddingForward: return "embedding_forward";
    case IndexOp::EmbeddingBackward: return "embedding_backward";
    case IndexOp::CrossEntropyForward: return "cross_entropy_forward";
    case IndexOp::CrossEntropyBackward: return "cross_entropy_backward";
  }
  return "an indexing kernel";
}

}  // namespace

IndexErrorSink index_error_sink(int device, IndexOp op, int64_t limit, int64_t ignore_index) {
  Slot& s = slot_for(device);
  return IndexErrorSink{s.claim, s.device, limit, ignore_index, static_cast<int32_t>(op)};
}

void raise_pending_index_error(int device, void* stream, const char* caller) {
  if (device < 0 || device >= kMaxDevices) return;
  Slot* s = slots[device].load(std::memory_order_acquire);
  if (!s || s->host->ready == 0) return;  // the normal path: one read of host memory
  std::atomic_thread_fence(std::memory_order_acquire);
  const IndexErrorRecord r{s->host->index, s->host->position, s->host->limit, s->host->ignore_index, s->host->op, 1};
  s->host->ready = 0;
  // Re-arm for the next report, in stream order after the kernels queued so far.
  TESSERA_CUDA_CHECK(cudaMemsetAsync(s->claim, 0, sizeof(unsigned int), static_cast<cudaStream_t>(stream)));
  const bool embedding = r.op == static_cast<int32_t>(IndexOp::EmbeddingForward) ||
                         r.op == static_cast<int32_t>(IndexOp::EmbeddingBackward);
  const std::string consequence =
      r.op == static_cast<int32_t>(IndexOp::EmbeddingForward)    ? "its output row for that position is NaN"
      : r.op == static_cast<int32_t>(IndexOp::EmbeddingBackward) ? "that position added nothing to d_table"
      : r.op == static_cast<int32_t>(IndexOp::CrossEntropyForward)
          ? "its loss is NaN"
          : "its d_logits row for that target is NaN";
  if (embedding) {
    TESSERA_FAIL(caller, ": an earlier ", op_name(r.op), " on cuda:", device, " met id ", r.index,
                 " at flat position ", r.position, " of ids, outside the vocabulary [0, ", r.limit, "); ",
                 consequence, " (CUDA kernels check ids on the device and report them at the next call)");
  }
  TESSERA_FAIL(caller, ": an earlier ", op_name(r.op), " on cuda:", device, " met target ", r.index, " at row ",
               r.position, ", outside the vocabulary [0, ", r.limit, ") and not ignore_index ", r.ignore_index, "; ",
               consequence, " (CUDA kernels check targets on the device and report them at the next call)");
}

}  // namespace tessera::cuda
