// The CUDA runtime pieces the core layer needs: device discovery, a caching allocator,
// streams, copies and stream synchronisation.
//
// The caching allocator keeps freed blocks in per-size free lists (sizes rounded up to
// 512 bytes below 1 MiB and to 2 MiB above), so that after the first training step every
// allocation is served from the cache and cudaMalloc, which synchronises the device, is
// never called in the step. Blocks are not split; a failed cudaMalloc first releases the
// cache and retries, then raises a clear out-of-memory error.
//
// Private pools for CUDA graphs. A captured graph keeps the addresses of every temporary
// its kernels used; those blocks must never be handed to anybody else while the graph can
// be replayed. While a thread has a pool selected on a device (select_allocation_pool,
// which cuda::CapturedGraph does around its capture), that thread's allocations there come
// from the pool, and frees of pool blocks return to the pool, whoever frees them and
// whenever (a tensor made during the capture and dropped long after still goes back to the
// pool). Blocks the pool lacks are taken first from the general free lists: a capture
// starts after the device has been synchronised, so a block that was free then is idle
// (this is what keeps the warm-up step's temporaries from doubling the memory); then from
// cudaMalloc, called in relaxed capture mode (thread-local mode counts it among the calls a
// capturing thread may not make; new memory is harmless to a graph, whose replays never
// allocate). A general block freed by the capturing thread joins the pool too, because the
// work captured so far may have used it. cudaFree is never called while a pool is selected
// anywhere on the device (it would synchronise, which a capture forbids), so an allocation
// that fails then fails at once. Releasing a pool (after its graph was destroyed and its
// stream synchronised) moves its free blocks to the general lists, and its blocks still in
// use go there when freed.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "cuda_backend.h"
#include "cuda_check.h"
#include "tessera/core/stream.h"

namespace tessera::cuda {

bool device_present() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return false;
  }
  return count > 0;
}

int multiprocessor_count(int device) {
  static std::atomic<int> cache[64];
  if (device >= 0 && device < 64 && cache[device].load(std::memory_order_relaxed) > 0) return cache[device].load();
  int sms = 0;
  TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  sms = std::max(sms, 1);
  if (device >= 0 && device < 64) cache[device].store(sms);
  return sms;
}

namespace {

constexpr int kMaxDevices = 64;

// The pool this thread allocates from on each device (0: the general free lists).
thread_local uint64_t selected_pool[kMaxDevices] = {};

size_t round_block_size(size_t bytes) {
  constexpr size_t kSmall = 512, kLarge = 2u << 20;
  if (bytes < (1u << 20)) return (bytes + kSmall - 1) / kSmall * kSmall;
  return (bytes + kLarge - 1) / kLarge * kLarge;
}

using FreeLists = std::map<size_t, std::vector<void*>>;

// Switches this thread to cudaStreamCaptureModeRelaxed for a scope (when `on`).
class RelaxedCaptureMode {
 public:
  explicit RelaxedCaptureMode(bool on) : on_(on) {
    if (on_) TESSERA_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode_));
  }
  ~RelaxedCaptureMode() {
    if (on_) cudaThreadExchangeStreamCaptureMode(&mode_);
  }
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  bool on_;
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

void* pop_block(FreeLists& lists, size_t size) {
  auto it = lists.find(size);
  if (it == lists.end() || it->second.empty()) return nullptr;
  void* p = it->second.back();
  it->second.pop_back();
  return p;
}

class CachingAllocator final : public Allocator {
 public:
  explicit CachingAllocator(int device) : device_(device) {}

  void* allocate(size_t bytes) override {
    const size_t size = round_block_size(bytes);
    std::lock_guard<std::mutex> lock(mutex_);
    const uint64_t pool = selected_pool[device_];
    void* p = nullptr;
    if (pool != 0) {
      p = pop_block(pools_.at(pool), size);
      if (!p) {
        p = pop_block(free_, size);  // idle since the capture's synchronisation
        if (p) owner_[p] = pool;
      }
      if (p) {
        stats_.bytes_cached -= size;
        note_in_use(size);
        return p;
      }
      p = device_malloc(size);
      owner_[p] = pool;
      return p;
    }
    if ((p = pop_block(free_, size))) {
      stats_.bytes_cached -= size;
      note_in_use(size);
      return p;
    }
    return device_malloc(size);
  }

  void deallocate(void* ptr, size_t bytes) override {
    const size_t size = round_block_size(bytes);
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.bytes_in_use -= size;
    stats_.bytes_cached += size;
    if (!owner_.empty()) {
      auto it = owner_.find(ptr);
      if (it != owner_.end()) {
        pools_.at(it->second)[size].push_back(ptr);
        return;
      }
    }
    if (const uint64_t pool = selected_pool[device_]; pool != 0) {
      owner_[ptr] = pool;  // captured work may have used it: it stays with the graph
      pools_.at(pool)[size].push_back(ptr);
      return;
    }
    free_[size].push_back(ptr);
  }

  AllocatorStats stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_;
  }

  uint64_t create_pool() {
    std::lock_guard<std::mutex> lock(mutex_);
    const uint64_t id = next_pool_++;
    pools_[id];
    return id;
  }

  void select_pool(uint64_t pool) {
    std::lock_guard<std::mutex> lock(mutex_);
    TESSERA_CHECK(pool == 0 || pools_.count(pool), "allocation pool ", pool, " does not exist on cuda:", device_);
    const uint64_t previous = selected_pool[device_];
    if (previous == pool) return;
    if (previous != 0) selecting_threads_ -= 1;
    if (pool != 0) selecting_threads_ += 1;
    selected_pool[device_] = pool;
  }

  void release_pool(uint64_t pool) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = pools_.find(pool);
    if (it == pools_.end()) return;
    for (auto& [size, blocks] : it->second) {
      std::vector<void*>& general = free_[size];
      general.insert(general.end(), blocks.begin(), blocks.end());
    }
    pools_.erase(it);
    for (auto o = owner_.begin(); o != owner_.end();) o = o->second == pool ? owner_.erase(o) : std::next(o);
    if (selected_pool[device_] == pool) {
      selected_pool[device_] = 0;
      selecting_threads_ -= 1;
    }
  }

 private:
  void note_in_use(size_t size) {
    stats_.bytes_in_use += size;
    stats_.peak_bytes_in_use = std::max(stats_.peak_bytes_in_use, stats_.bytes_in_use);
  }

  // Call with mutex_ held.
  void* device_malloc(size_t size) {
    // A capture in thread-local mode forbids this thread "potentially unsafe" calls, and
    // cudaMalloc is one (it may synchronise); its new memory is fine for the graph, whose
    // replays never allocate, so the call is made in relaxed mode, as PyTorch does.
    RelaxedCaptureMode relaxed(selected_pool[device_] != 0);
    TESSERA_CUDA_CHECK(cudaSetDevice(device_));
    void* p = nullptr;
    cudaError_t err = cudaMalloc(&p, size);
    if (err == cudaErrorMemoryAllocation && selecting_threads_ == 0) {
      cudaGetLastError();
      release_cache_locked();
      err = cudaMalloc(&p, size);
    }
    if (err != cudaSuccess) {
      cudaGetLastError();
      size_t free_bytes = 0, total_bytes = 0;
      cudaMemGetInfo(&free_bytes, &total_bytes);
      TESSERA_FAIL("out of GPU memory on cuda:", device_, ": could not allocate ", size, " bytes (",
                   free_bytes >> 20, " MiB free of ", total_bytes >> 20, " MiB; tessera holds ",
                   stats_.bytes_in_use >> 20, " MiB in use",
                   selecting_threads_ ? ", and the cache cannot be released during a CUDA graph capture" : "", "): ",
                   cudaGetErrorString(err));
    }
    stats_.device_allocations += 1;
    note_in_use(size);
    stats_.peak_bytes_reserved = std::max(stats_.peak_bytes_reserved, stats_.bytes_in_use + stats_.bytes_cached);
    return p;
  }

  void release_cache_locked() {
    for (auto& [size, blocks] : free_) {
      for (void* p : blocks) cudaFree(p);
      stats_.bytes_cached -= size * blocks.size();
      blocks.clear();
    }
  }

  int device_;
  std::mutex mutex_;
  FreeLists free_;                                // the general free lists
  std::map<uint64_t, FreeLists> pools_;           // private pools: their free lists
  std::unordered_map<void*, uint64_t> owner_;     // every block a live pool owns, in use or free
  uint64_t next_pool_ = 1;
  int selecting_threads_ = 0;                     // threads with a pool selected here
  AllocatorStats stats_;
};

CachingAllocator& allocator_of(int device_index) {
  // Leaked on purpose: tensors may be freed during static destruction, after the CUDA
  // runtime has shut down, and must not call into it then.
  static std::vector<CachingAllocator*>* allocators = new std::vector<CachingAllocator*>();
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  // The device count is asked once: every allocation and free comes through here, also
  // during graph captures.
  if (allocators->empty()) {
    int count = 0;
    TESSERA_CUDA_CHECK(cudaGetDeviceCount(&count));
    allocators->resize(static_cast<size_t>(std::min(count, kMaxDevices)), nullptr);
  }
  const int count = static_cast<int>(allocators->size());
  TESSERA_CHECK(device_index >= 0 && device_index < count, "cuda:", device_index, " does not exist (", count,
                " GPUs visible)");
  if (!(*allocators)[device_index]) (*allocators)[device_index] = new CachingAllocator(device_index);
  return *(*allocators)[device_index];
}

}  // namespace

Allocator& caching_allocator(int device_index) { return allocator_of(device_index); }

AllocatorStats allocator_stats(int device_index) { return allocator_of(device_index).stats(); }

uint64_t create_allocation_pool(int device) { return allocator_of(device).create_pool(); }
void select_allocation_pool(int device, uint64_t pool) { allocator_of(device).select_pool(pool); }
uint64_t selected_allocation_pool(int device) {
  return device >= 0 && device < kMaxDevices ? selected_pool[device] : 0;
}
void release_allocation_pool(int device, uint64_t pool) { allocator_of(device).release_pool(pool); }

void memcpy_any(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes) {
  // Unified addressing tells the directions apart (cudaMemcpyDefault).
  void* stream = current_stream(dst_device.is_cuda() ? dst_device : src_device);
  if (!stream) {
    TESSERA_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault));
    return;
  }
  // On a stream of its own: in order with that stream's kernels. Involving the host, it
  // returns once the copy is done (the host may read the result, or reuse its buffer: a
  // pinned source is not staged), which waits for this stream only.
  auto s = static_cast<cudaStream_t>(stream);
  TESSERA_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s));
  if (dst_device.is_cpu() || src_device.is_cpu()) TESSERA_CUDA_CHECK(cudaStreamSynchronize(s));
}

void memcpy_async(void* dst, const void* src, size_t bytes, void* stream) {
  if (bytes == 0) return;
  TESSERA_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream)));
}

void synchronize(void* stream) { TESSERA_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream))); }

void* create_stream(int device, int priority) {
  int previous = 0;
  TESSERA_CUDA_CHECK(cudaGetDevice(&previous));
  TESSERA_CUDA_CHECK(cudaSetDevice(device));
  cudaStream_t s = nullptr;
  int least = 0, greatest = 0;
  cudaError_t err = cudaDeviceGetStreamPriorityRange(&least, &greatest);
  if (err == cudaSuccess)
    err = cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, std::min(least, std::max(greatest, priority)));
  cudaSetDevice(previous);
  TESSERA_CUDA_CHECK(err);
  return s;
}

void stream_wait(void* waiter, void* producer) {
  if (waiter == producer) return;
  cudaEvent_t event = nullptr;
  TESSERA_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  const cudaError_t recorded = cudaEventRecord(event, static_cast<cudaStream_t>(producer));
  const cudaError_t waited =
      recorded == cudaSuccess ? cudaStreamWaitEvent(static_cast<cudaStream_t>(waiter), event, 0) : recorded;
  cudaEventDestroy(event);  // the wait is queued; the event may go
  TESSERA_CUDA_CHECK(waited);
}

void destroy_stream(int device, void* stream) {
  (void)device;
  // Errors are dropped: this runs in destructors, and a failed sync was reported by
  // whatever read the stream last.
  auto s = static_cast<cudaStream_t>(stream);
  if (cudaStreamSynchronize(s) != cudaSuccess) cudaGetLastError();
  if (cudaStreamDestroy(s) != cudaSuccess) cudaGetLastError();
}

void* pinned_host_alloc(size_t bytes) {
  void* p = nullptr;
  TESSERA_CUDA_CHECK(cudaHostAlloc(&p, bytes == 0 ? 1 : bytes, cudaHostAllocPortable));
  return p;
}

void pinned_host_free(void* ptr) {
  if (ptr && cudaFreeHost(ptr) != cudaSuccess) cudaGetLastError();
}

}  // namespace tessera::cuda
