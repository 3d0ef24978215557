// CUDA elementwise kernels (add, scale, GELU, SwiGLU, forward and backward) against the
// CPU reference on random data, F32 and BF16, odd sizes, outputs poisoned with NaN first.
// Skipped (saying so) where no GPU is present.
#include "tessera/core/allocator.h"
#include "tessera/ops/activation.h"
#include "tessera/ops/elementwise.h"
#include "gpu_testing.h"

using namespace tessera;
using namespace tessera::testing;

namespace {
Tensor poisoned_like(const Shape& shape, DType t, Device d) {
  Tensor host = Tensor::empty(shape, t);
  poison(host);
  return host.to(d);
}
// CPU and GPU may round a float differently in the last bit (fused multiply-adds, tanhf
// and expf of CUDA's math library); BF16 outputs can then differ by one BF16 step.
double tolerance(DType t) { return t == DType::BF16 ? 1e-2 : 1e-6; }
}  // namespace

TEST(GpuElementwise, MatchesTheCpuReference) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  const Device cuda = Device::cuda();
  uint64_t seed = 10;
  for (DType t : {DType::F32, DType::BF16}) {
    // The last two take the 16-byte vector paths (SwiGLU too: F % 8 == 0).
    for (Shape shape : {Shape{1, 2}, Shape{7, 34}, Shape{33, 1026}, Shape{9, 2064}, Shape{3, 4096}}) {
      const Tensor x = random_tensor(shape, t, seed++, -4.0f, 4.0f), z = random_tensor(shape, t, seed++);
      const std::string what = std::string(dtype_name(t)) + shape_to_string(shape);
      {
        Tensor want = Tensor::empty(shape, t), got = poisoned_like(shape, t, cuda);
        add(cpu, x, z, want);
        add(gpu, x.to(cuda), z.to(cuda), got);
        EXPECT_LT(relative_error(got.to(Device::cpu()), want), tolerance(t)) << "add " << what;
        scale(cpu, x, -1.5f, want);
        scale(gpu, x.to(cuda), -1.5f, got);
        EXPECT_LT(relative_error(got.to(Device::cpu()), want), tolerance(t)) << "scale " << what;
        gelu_forward(cpu, x, want);
        gelu_forward(gpu, x.to(cuda), got);
        EXPECT_LT(relative_error(got.to(Device::cpu()), want), tolerance(t)) << "gelu_forward " << what;
        gelu_backward(cpu, x, z, want);
        gelu_backward(gpu, x.to(cuda), z.to(cuda), got);
        EXPECT_LT(relative_error(got.to(Device::cpu()), want), tolerance(t)) << "gelu_backward " << what;
      }
      {
        const Shape half{shape[0], shape[1] / 2};
        const Tensor dy = random_tensor(half, t, seed++);
        Tensor want = Tensor::empty(half, t), got = poisoned_like(half, t, cuda);
        swiglu_forward(cpu, x, want);
        swiglu_forward(gpu, x.to(cuda), got);
        EXPECT_LT(relative_error(got.to(Device::cpu()), want), tolerance(t)) << "swiglu_forward " << what;
        Tensor dwant = Tensor::empty(shape, t), dgot = poisoned_like(shape, t, cuda);
        swiglu_backward(cpu, x, dy, dwant);
        swiglu_backward(gpu, x.to(cuda), dy.to(cuda), dgot);
        EXPECT_LT(relative_error(dgot.to(Device::cpu()), dwant), tolerance(t)) << "swiglu_backward " << what;
        // The recomputed forward output: the CUDA forward's bits, dx unchanged.
        Tensor dgot2 = poisoned_like(shape, t, cuda), ygot = poisoned_like(half, t, cuda);
        swiglu_backward(gpu, x.to(cuda), dy.to(cuda), dgot2, &ygot);
        EXPECT_EQ(ygot.to(Device::cpu()).to_doubles(), got.to(Device::cpu()).to_doubles()) << "swiglu_backward y " << what;
        EXPECT_EQ(dgot2.to(Device::cpu()).to_doubles(), dgot.to(Device::cpu()).to_doubles()) << "swiglu_backward y " << what;
      }
    }
  }
}

TEST(GpuElementwise, MixedDtypesAreAClearError) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  Tensor a = Tensor::zeros({4}, DType::F32, Device::cuda()), b = Tensor::zeros({4}, DType::BF16, Device::cuda());
  Tensor out = Tensor::zeros({4}, DType::F32, Device::cuda());
  EXPECT_THROW(add(gpu, a, b, out), Error);
}
