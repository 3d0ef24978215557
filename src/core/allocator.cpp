#include "tessera/core/allocator.h"

#include <cstdlib>
#include <cstring>
#include <new>

#include "tessera/core/context.h"
#include "tessera/core/error.h"
#if TESSERA_WITH_CUDA
#include "../backend/cuda/cuda_backend.h"
#endif

namespace tessera {

namespace {
// 64-byte alignment: a cache line, and enough for every SIMD load the compiler emits.
class CpuAllocator final : public Allocator {
 public:
  void* allocate(size_t bytes) override {
    const size_t rounded = (bytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded);
    TESSERA_CHECK(p != nullptr, "out of host memory: could not allocate ", bytes, " bytes");
    return p;
  }
  void deallocate(void* ptr, size_t) override { std::free(ptr); }
};
}  // namespace

Allocator& allocator_for(Device device) {
  if (device.is_cpu()) {
    static CpuAllocator cpu;
    return cpu;
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
