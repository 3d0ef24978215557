// Out-of-range indices met inside CUDA kernels (embedding ids, cross-entropy targets),
// reported without a host synchronisation.
//
// The CPU reference checks every index before it writes anything and throws at once. A
// GPU kernel cannot throw, and checking on the host would mean copying the indices back
// and waiting for them on every call. So a kernel that meets a bad index (1) never reads
// or writes out of bounds with it: it poisons the affected output with NaN (embedding
// forward, cross-entropy) or skips it (embedding backward), and (2) records the first
// such index of the device in a small record in mapped, pinned host memory. The record is
// checked lazily: the next embedding or cross-entropy call on that device (whose front
// end calls raise_pending_index_error first), or an explicit call of it after a
// synchronisation, throws tessera::Error naming the op, the index, where it was and the
// valid range. The normal path costs one uncontended host read per call.
//
// Usable from C++ translation units; the device-side half is compiled only under nvcc.
#pragma once

#include <cstdint>

namespace tessera::cuda {

enum class IndexOp : int32_t { EmbeddingForward = 1, EmbeddingBackward, CrossEntropyForward, CrossEntropyBackward };

// What a kernel recorded. Lives in mapped host memory, written by the device.
struct IndexErrorRecord {
  int64_t index;     // the offending id / target
  int64_t position;  // flat position in ids, or row of targets
  int64_t limit;     // valid range [0, limit)
  int64_t ignore_index;
  int32_t op;        // IndexOp
  volatile int32_t ready;  // set last, after a system-wide fence
};

// What a kernel needs to record an error: passed by value as a kernel argument.
struct IndexErrorSink {
  unsigned int* claim;       // device memory; the first thread to flip it 0 -> 1 writes the record
  IndexErrorRecord* record;  // mapped host memory (device-visible pointer)
  int64_t limit;
  int64_t ignore_index;
  int32_t op;
};

// The sink for kernels of `op` on cuda:device (allocated on first use, then reused).
IndexErrorSink index_error_sink(int device, IndexOp op, int64_t limit, int64_t ignore_index = 0);

// Throws tessera::Error if a kernel on cuda:device has recorded a bad index since the last
// check, then re-arms the record (the re-arm is queued on `stream`, no synchronisation).
// `caller` names the op that found the report, for the message.
void raise_pending_index_error(int device, void* stream, const char* caller);

#if defined(__CUDACC__)
// Called by a kernel thread that met a bad index; only the first caller per device writes.
__device__ inline void record_bad_index(const IndexErrorSink& sink, int64_t index, int64_t position) {
  if (atomicCAS(sink.claim, 0u, 1u) != 0u) return;
  IndexErrorRecord* r = sink.record;
  r->index = index;
  r->position = position;
  r->limit = sink.limit;
  r->ignore_index = sink.ignore_index;
  r->op = sink.op;
  __threadfence_system();  // the fields reach the host before `ready` does
  r->ready = 1;
}
#endif

}  // namespace tessera::cuda
