#include "tessera/core/allocator.h"

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

#include "tessera/core/context.h"
#include "tessera/core/error.h"
#if TESSERA_WITH_CUDA
#include "../backend/cuda/cuda_backend.h"
#endif

namespace tessera {

namespace {

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kCacheHostBlocks = false;  // let AddressSanitizer see every free
#else
constexpr bool kCacheHostBlocks = true;
#endif

// 64-byte alignment: a cache line, and enough for every SIMD load the compiler emits.
//
// Blocks of 1 MiB and more are kept on per-size free lists when released: a training step
// allocates the same activation sizes every iteration, and memory fresh from the OS costs
// a page fault per 4 KiB page on first touch (for a GPT-2-sized vocabulary the logits
// chunk alone is hundreds of MiB). At most kMaxCachedBytes stay cached.
class CpuAllocator final : public Allocator {
 public:
  void* allocate(size_t bytes) override {
    const size_t rounded = (bytes + 63) / 64 * 64;
    if (kCacheHostBlocks && rounded >= kMinCachedBlock) {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = free_.find(rounded);
      if (it != free_.end() && !it->second.empty()) {
        void* p = it->second.back();
        it->second.pop_back();
        cached_bytes_ -= rounded;
        return p;
      }
    }
    void* p = std::aligned_alloc(64, rounded);
    TESSERA_CHECK(p != nullptr, "out of host memory: could not allocate ", bytes, " bytes");
    return p;
  }

  void deallocate(void* ptr, size_t bytes) override {
    const size_t rounded = (bytes + 63) / 64 * 64;
    if (kCacheHostBlocks && rounded >= kMinCachedBlock) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (cached_bytes_ + rounded <= kMaxCachedBytes) {
        free_[rounded].push_back(ptr);
        cached_bytes_ += rounded;
        return;
      }
    }
    std::free(ptr);
  }

 private:
  static constexpr size_t kMinCachedBlock = size_t(1) << 20;
  static constexpr size_t kMaxCachedBytes = size_t(8) << 30;
  std::mutex mutex_;
  std::unordered_map<size_t, std::vector<void*>> free_;
  size_t cached_bytes_ = 0;
};
}  // namespace

Allocator& allocator_for(Device device) {
  if (device.is_cpu()) {
    // Leaked on purpose: tensors held by static objects may be freed after it would be destroyed.
    static CpuAllocator* cpu = new CpuAllocator();
    return *cpu;
  }
#if TESSERA_WITH_CUDA
  return cuda::caching_allocator(device.index);
#else
  TESSERA_FAIL("device ", device.to_string(), " requested but this build of tessera has no CUDA backend ",
               "(configure with -DTESSERA_CUDA=ON)");
#endif
}

void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes) {
  if (bytes == 0) return;
  if (dst_device.is_cpu() && src_device.is_cpu()) {
    std::memcpy(dst, src, bytes);
    return;
  }
#if TESSERA_WITH_CUDA
  cuda::memcpy_any(dst, dst_device, src, src_device, bytes);
#else
  TESSERA_FAIL("copy between ", src_device.to_string(), " and ", dst_device.to_string(),
               " needs the CUDA backend, which this build does not have");
#endif
}

bool cuda_available() {
#if TESSERA_WITH_CUDA
  return cuda::device_present();
#else
  return false;
#endif
}

void synchronize(const Context& ctx) {
#if TESSERA_WITH_CUDA
  if (ctx.device.is_cuda()) cuda::synchronize(ctx.stream);
#else
  (void)ctx;
#endif
}

}  // namespace tessera
