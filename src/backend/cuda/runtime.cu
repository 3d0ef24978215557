// The CUDA runtime pieces the core layer needs: device discovery, a caching allocator,
// copies and stream synchronisation.
//
// The caching allocator keeps freed blocks in per-size free lists (sizes rounded up to
// 512 bytes below 1 MiB and to 2 MiB above), so that after the first training step every
// allocation is served from the cache and cudaMalloc, which synchronises the device, is
// never called in the step. Blocks are not split; a failed cudaMalloc first releases the
// cache and retries, then raises a clear out-of-memory error.
#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <vector>

#include "cuda_backend.h"
#include "cuda_check.h"

namespace tessera::cuda {

bool device_present() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return false;
  }
  return count > 0;
}

namespace {

size_t round_block_size(size_t bytes) {
  constexpr size_t kSmall = 512, kLarge = 2u << 20;
  if (bytes < (1u << 20)) return (bytes + kSmall - 1) / kSmall * kSmall;
  return (bytes + kLarge - 1) / kLarge * kLarge;
}

class CachingAllocator final : public Allocator {
 public:
  explicit CachingAllocator(int device) : device_(device) {}

  void* allocate(size_t bytes) override {
    const size_t size = round_block_size(bytes);
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = free_.find(size);
    if (it != free_.end() && !it->second.empty()) {
      void* p = it->second.back();
      it->second.pop_back();
      stats_.bytes_cached -= size;
      stats_.bytes_in_use += size;
      stats_.peak_bytes_in_use = std::max(stats_.peak_bytes_in_use, stats_.bytes_in_use);
      return p;
    }
    TESSERA_CUDA_CHECK(cudaSetDevice(device_));
    void* p = nullptr;
    cudaError_t err = cudaMalloc(&p, size);
    if (err == cudaErrorMemoryAllocation) {
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
                   stats_.bytes_in_use >> 20, " MiB in use): ", cudaGetErrorString(err));
    }
    stats_.device_allocations += 1;
    stats_.bytes_in_use += size;
    stats_.peak_bytes_in_use = std::max(stats_.peak_bytes_in_use, stats_.bytes_in_use);
    stats_.peak_bytes_reserved = std::max(stats_.peak_bytes_reserved, stats_.bytes_in_use + stats_.bytes_cached);
    return p;
  }

  void deallocate(void* ptr, size_t bytes) override {
    const size_t size = round_block_size(bytes);
    std::lock_guard<std::mutex> lock(mutex_);
    free_[size].push_back(ptr);
    stats_.bytes_in_use -= size;
    stats_.bytes_cached += size;
  }

  AllocatorStats stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_;
  }

 private:
  void release_cache_locked() {
    for (auto& [size, blocks] : free_) {
      for (void* p : blocks) cudaFree(p);
      stats_.bytes_cached -= size * blocks.size();
      blocks.clear();
    }
  }

  int device_;
  std::mutex mutex_;
  std::map<size_t, std::vector<void*>> free_;
  AllocatorStats stats_;
};

CachingAllocator& allocator_of(int device_index) {
  // Leaked on purpose: tensors may be freed during static destruction, after the CUDA
  // runtime has shut down, and must not call into it then.
  static std::vector<CachingAllocator*>* allocators = new std::vector<CachingAllocator*>();
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  int count = 0;
  TESSERA_CUDA_CHECK(cudaGetDeviceCount(&count));
  TESSERA_CHECK(device_index >= 0 && device_index < count, "cuda:", device_index, " does not exist (",
                count, " GPUs visible)");
  if (allocators->empty()) allocators->resize(count, nullptr);
  if (!(*allocators)[device_index]) (*allocators)[device_index] = new CachingAllocator(device_index);
  return *(*allocators)[device_index];
}

}  // namespace

Allocator& caching_allocator(int device_index) { return allocator_of(device_index); }

AllocatorStats allocator_stats(int device_index) { return allocator_of(device_index).stats(); }

void memcpy_any(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes) {
  cudaMemcpyKind kind = cudaMemcpyDefault;  // unified addressing tells the directions apart
  (void)dst_device;
  (void)src_device;
  TESSERA_CUDA_CHECK(cudaMemcpy(dst, src, bytes, kind));
}

void synchronize(void* stream) { TESSERA_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream))); }

}  // namespace tessera::cuda
