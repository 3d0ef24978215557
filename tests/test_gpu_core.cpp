// The CUDA side of the core: caching allocator, copies, Philox fills and casts, checked
// against the CPU reference bit for bit. Skipped (saying so) where no GPU is present.
#include "tessera/core/allocator.h"
#include "tessera/core/random.h"
#include "tessera/ops/elementwise.h"
#include "gpu_testing.h"
#if TESSERA_WITH_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

using namespace tessera;
using namespace tessera::testing;

TEST(GpuCore, CopiesRoundTrip) {
  REQUIRE_GPU();
  Tensor x = random_tensor({37, 129}, DType::F32, 1);
  Tensor back = x.to(Device::cuda()).to(Device::cpu());
  EXPECT_EQ(bytes_of(back), bytes_of(x));
  Tensor strided = x.to(Device::cuda()).transpose(0, 1).contiguous();
  EXPECT_EQ(bytes_of(strided), bytes_of(x.transpose(0, 1).contiguous()));
}

TEST(GpuCore, RandomFillsMatchTheCpuBitForBit) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  for (DType t : {DType::F32, DType::BF16, DType::F16, DType::E4M3}) {
    Tensor host = Tensor::empty({1001}, t), dev = Tensor::empty({1001}, t, Device::cuda());
    fill_uniform(cpu, host, -3.0f, 5.0f, 1234, 17);
    fill_uniform(gpu, dev, -3.0f, 5.0f, 1234, 17);
    synchronize(gpu);
    EXPECT_EQ(bytes_of(dev), bytes_of(host)) << dtype_name(t);
  }
  // Normals go through logf/cosf, which may differ in the last bit between libm and CUDA.
  Tensor host = Tensor::empty({4096}, DType::F32), dev = Tensor::empty({4096}, DType::F32, Device::cuda());
  fill_normal(cpu, host, 0.0f, 1.0f, 99);
  fill_normal(gpu, dev, 0.0f, 1.0f, 99);
  EXPECT_LT(relative_error(dev.to(Device::cpu()), host), 1e-6);
}

TEST(GpuCore, CastsMatchTheCpuBitForBit) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  Tensor x = random_tensor({4099}, DType::F32, 5, -70000.0f, 70000.0f);
  x.set_item(0, NAN);
  x.set_item(1, INFINITY);
  x.set_item(2, 1e-8);
  Tensor xd = x.to(Device::cuda());
  for (DType t : {DType::F16, DType::BF16, DType::E4M3, DType::E5M2, DType::I32}) {
    Tensor host = Tensor::empty({4099}, t), dev = Tensor::empty({4099}, t, Device::cuda());
    if (t == DType::I32) {
      x.set_item(0, 0);
      x.set_item(1, 0);
      xd = x.to(Device::cuda());
    }
    cast(cpu, x, host);
    cast(gpu, xd, dev);
    EXPECT_EQ(bytes_of(dev), bytes_of(host)) << dtype_name(t);
  }
}

#if TESSERA_WITH_CUDA
TEST(GpuCore, CachingAllocatorReusesFreedBlocks) {
  REQUIRE_GPU();
  { Tensor warm = Tensor::empty({1 << 20}, DType::F32, Device::cuda()); }
  const auto before = cuda::allocator_stats(0);
  for (int i = 0; i < 10; ++i) Tensor t = Tensor::empty({1 << 20}, DType::F32, Device::cuda());
  EXPECT_EQ(cuda::allocator_stats(0).device_allocations, before.device_allocations);
}

TEST(GpuCore, OutOfMemoryIsAClearError) {
  REQUIRE_GPU();
  EXPECT_THROW(Tensor::empty({int64_t(1) << 40}, DType::F32, Device::cuda()), Error);  // 4 TiB
  Tensor still_works = Tensor::zeros({16}, DType::F32, Device::cuda());
  EXPECT_EQ(still_works.to_doubles()[0], 0.0);
}
#endif

TEST(GpuCore, StridedCopiesIntoAndOutOfTheDevice) {
  REQUIRE_GPU();
  Tensor x = random_tensor({6, 10}, DType::F32, 3);
  Tensor dev = Tensor::zeros({6, 10}, DType::F32, Device::cuda());
  dev.slice(1, 2, 7).copy_from(x.slice(1, 2, 7));  // strided destination on the device
  Tensor want = Tensor::zeros({6, 10}, DType::F32);
  want.slice(1, 2, 7).copy_from(x.slice(1, 2, 7));
  EXPECT_EQ(bytes_of(dev), bytes_of(want));
  EXPECT_EQ(bytes_of(dev.transpose(0, 1).to(Device::cpu())), bytes_of(want.transpose(0, 1).contiguous()));
}

// Device-to-device strided copies run as a kernel: the QKV split of attention (rows of a
// head at a stride, 16-byte path), transposes (scalar path) and odd sizes, every dtype width.
TEST(GpuCore, StridedCopiesWithinTheDeviceMatchTheHost) {
  REQUIRE_GPU();
  for (DType t : {DType::F32, DType::BF16, DType::F64, DType::E4M3}) {
    for (Shape shape : {Shape{2, 5, 7, 64}, Shape{3, 17, 3, 9}, Shape{1, 1, 1, 1}}) {
      const std::string what = std::string(dtype_name(t)) + shape_to_string(shape);
      Tensor host = random_tensor(shape, t == DType::E4M3 ? DType::F32 : t, 9);
      if (t == DType::E4M3) {
        Tensor q = Tensor::empty(shape, t);
        Context cpu = Context::cpu();
        cast(cpu, host, q);
        host = q;
      }
      const Tensor dev = host.to(Device::cuda());
      const int64_t h = shape[2];
      // A head slice (strided rows) made contiguous on the device.
      const Tensor part = dev.slice(2, h / 3, h).contiguous();
      EXPECT_EQ(bytes_of(part.to(Device::cpu())), bytes_of(host.slice(2, h / 3, h).contiguous())) << what;
      // Scattered back into a zeroed device tensor.
      Tensor back = Tensor::zeros(shape, t, Device::cuda());
      back.slice(2, h / 3, h).copy_from(part);
      Tensor want = Tensor::zeros(shape, t);
      want.slice(2, h / 3, h).copy_from(host.slice(2, h / 3, h));
      EXPECT_EQ(bytes_of(back.to(Device::cpu())), bytes_of(want)) << what;
      // A transpose (no contiguous dimension in common).
      const Tensor tr = dev.transpose(1, 3).contiguous();
      EXPECT_EQ(bytes_of(tr.to(Device::cpu())), bytes_of(host.transpose(1, 3).contiguous())) << what;
    }
  }
}

TEST(GpuCore, FillZeroOnTheDevice) {
  REQUIRE_GPU();
  Tensor dev = random_tensor({5, 9}, DType::F32, 4).to(Device::cuda());
  dev.slice(1, 2, 5).fill_zero();  // strided
  Tensor want = random_tensor({5, 9}, DType::F32, 4);
  want.slice(1, 2, 5).fill_zero();
  EXPECT_EQ(bytes_of(dev.to(Device::cpu())), bytes_of(want));
  dev.fill_zero();  // contiguous
  EXPECT_EQ(bytes_of(dev.to(Device::cpu())), bytes_of(Tensor::zeros({5, 9}, DType::F32)));
}
