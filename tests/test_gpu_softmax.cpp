// CUDA softmax against the CPU reference: random rows of odd widths (wider and narrower
// than a block), masked entries, a fully masked row, a NaN row; F32 and BF16; outputs
// poisoned first. Skipped (saying so) where no GPU is present.
#include <cmath>

#include "tessera/core/allocator.h"
#include "tessera/ops/softmax.h"
#include "gpu_testing.h"

using namespace tessera;
using namespace tessera::testing;

TEST(GpuSoftmax, MatchesTheCpuReference) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  const Device cuda = Device::cuda();
  uint64_t seed = 50;
  for (DType t : {DType::F32, DType::BF16}) {
    // Rows in registers (vectors and single elements, narrow rows sharing a block, 4096 wide;
    // 32768: BF16 in registers, F32 looping) and rows only the looping kernel takes (70001).
    for (Shape shape : {Shape{1, 1}, Shape{5, 7}, Shape{3, 257}, Shape{64, 1000}, Shape{2, 3, 4099}, Shape{5, 4096},
                        Shape{2, 32768}, Shape{3, 70001}}) {
      Tensor x = random_tensor(shape, t, seed++, -8.0f, 8.0f), dy = random_tensor(shape, t, seed++);
      const int64_t cols = shape.back();
      if (x.numel() / cols >= 3 && cols >= 2) {
        x.set_item(1, -INFINITY);                                        // one masked entry in row 0
        for (int64_t c = 0; c < cols; ++c) x.set_item(cols + c, -INFINITY);  // row 1 fully masked
      }
      const double tol = t == DType::BF16 ? 1e-2 : 1e-5;
      const std::string what = std::string(dtype_name(t)) + shape_to_string(shape);
      Tensor want = Tensor::empty(shape, t), got = Tensor::empty(shape, t);
      poison(got);
      got = got.to(cuda);
      softmax_forward(cpu, x, want);
      softmax_forward(gpu, x.to(cuda), got);
      EXPECT_LT(relative_error(got.to(Device::cpu()), want), tol) << "forward " << what;
      Tensor dwant = Tensor::empty(shape, t), dgot = Tensor::empty(shape, t);
      poison(dgot);
      dgot = dgot.to(cuda);
      softmax_backward(cpu, want, dy, dwant);
      softmax_backward(gpu, want.to(cuda), dy.to(cuda), dgot);
      EXPECT_LT(relative_error(dgot.to(Device::cpu()), dwant), tol) << "backward " << what;
    }
  }
}

TEST(GpuSoftmax, NanRowStaysNan) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  Tensor x = Tensor::from_floats({1, NAN, 3, 0, 1, 2}, {2, 3});
  Tensor y = Tensor::zeros({2, 3}, DType::F32, Device::cuda());
  softmax_forward(gpu, x.to(Device::cuda()), y);
  const std::vector<float> v = y.to_floats();
  for (int c = 0; c < 3; ++c) EXPECT_TRUE(std::isnan(v[c]));
  EXPECT_NEAR(v[3] + v[4] + v[5], 1.0f, 1e-6);
}
