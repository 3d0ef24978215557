// CUDA RoPE against the CPU reference: odd sequence lengths, one to many heads, head dims
// that take the 16-byte path and ones that do not (D/2 odd or not a multiple of the vector),
// position offsets up to long-context positions, F32 and BF16, forward and backward, in
// place, outputs poisoned first, NaN staying in its pair. Skipped (saying so) where no GPU
// is present.
#include <cmath>
#include <tuple>

#include "tessera/core/allocator.h"
#include "tessera/ops/rope.h"
#include "gpu_testing.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

Tensor poisoned(const Shape& shape, DType t, Device d) {
  Tensor host = Tensor::empty(shape, t);
  poison(host);
  return host.to(d);
}

Tensor host(const Tensor& t) { return t.to(Device::cpu()); }

// The tables are built in double and rounded once on both backends and the rotation runs
// the same float operations, so F32 agrees to a few 1e-8 and BF16 to the bit almost always;
// the DESIGN.md tolerances leave room for a last-bit difference of CUDA's pow/sincos.
double tolerance(DType t) { return t == DType::BF16 ? 1e-2 : 1e-5; }

}  // namespace

TEST(GpuRope, MatchesTheCpuReference) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  uint64_t seed = 300;
  // [B, T, H, D]: D = 2 (one pair), D/2 odd (6), D/2 = 4 (vectorised for F32 only), Llama's 64
  // and 128, odd T throughout.
  const std::vector<Shape> shapes = {{1, 1, 1, 2},    {2, 7, 3, 6},    {1, 5, 2, 8}, {2, 13, 4, 64},
                                     {1, 33, 8, 128}, {3, 17, 1, 128}, {1, 9, 5, 80}};
  for (DType t : {DType::F32, DType::BF16}) {
    for (const Shape& shape : shapes) {
      for (int64_t offset : {int64_t{0}, int64_t{1}, int64_t{4093}, int64_t{131071}}) {
        RopeOptions options;
        options.position_offset = offset;
        options.theta = offset % 2 ? 500000.0f : 10000.0f;
        const std::string what =
            std::string(dtype_name(t)) + shape_to_string(shape) + " offset " + std::to_string(offset);
        const Tensor x = random_tensor(shape, t, seed++, -2.0f, 2.0f);
        Tensor want = Tensor::empty(shape, t), got = poisoned(shape, t, kCuda);
        rope_forward(cpu, x, want, options);
        rope_forward(gpu, x.to(kCuda), got, options);
        EXPECT_LT(relative_error(host(got), want), tolerance(t)) << "forward " << what;

        Tensor dwant = Tensor::empty(shape, t), dgot = poisoned(shape, t, kCuda);
        rope_backward(cpu, x, dwant, options);
        rope_backward(gpu, x.to(kCuda), dgot, options);
        EXPECT_LT(relative_error(host(dgot), dwant), tolerance(t)) << "backward " << what;
      }
    }
  }
}

// Backward undoes forward (a rotation and its transpose), in place on the GPU.
TEST(GpuRope, InPlaceAndBackwardUndoesForward) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  RopeOptions options;
  options.position_offset = 17;
  for (DType t : {DType::F32, DType::BF16}) {
    for (Shape shape : {Shape{2, 11, 4, 128}, Shape{1, 3, 2, 6}}) {
      const Tensor x = random_tensor(shape, t, 77);
      Tensor want = Tensor::empty(shape, t);
      rope_forward(cpu, x, want, options);
      Tensor g = x.clone().to(kCuda);
      rope_forward(gpu, g, g, options);
      const std::string what = std::string(dtype_name(t)) + shape_to_string(shape);
      EXPECT_LT(relative_error(host(g), want), tolerance(t)) << "in-place forward " << what;
      rope_backward(gpu, g, g, options);
      EXPECT_LT(relative_error(host(g), x), t == DType::BF16 ? 2e-2 : 1e-6) << "backward after forward " << what;
    }
  }
}

// A NaN reaches only the two elements of its pair (and nothing else of the head vector).
TEST(GpuRope, NanStaysInItsPair) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  for (DType t : {DType::F32, DType::BF16}) {
    const Shape shape{1, 3, 2, 16};
    Tensor x = random_tensor(shape, t, 91);
    const int64_t nan_at = (1 * 2 + 1) * 16 + 2;  // token 1, head 1, element 2 (pairs with 10)
    x.set_item(nan_at, NAN);
    Tensor y = poisoned(shape, t, kCuda);
    rope_forward(gpu, x.to(kCuda), y, RopeOptions{});
    const std::vector<double> v = host(y).to_doubles();
    for (int64_t i = 0; i < static_cast<int64_t>(v.size()); ++i) {
      const bool in_pair = i == nan_at || i == nan_at + 8;
      EXPECT_EQ(std::isnan(v[i]), in_pair) << dtype_name(t) << " element " << i;
    }
  }
}

TEST(GpuRope, UnsupportedDtypesAreAClearError) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  Tensor x = Tensor::zeros({1, 2, 1, 4}, DType::F32, kCuda), y = Tensor::zeros({1, 2, 1, 4}, DType::BF16, kCuda);
  EXPECT_THROW(rope_forward(gpu, x, y), Error);  // x and y must share a dtype on CUDA
  Tensor h = Tensor::zeros({1, 2, 1, 4}, DType::F16, kCuda);
  EXPECT_THROW(rope_backward(gpu, h, h), Error);
}

// Split + rotate in one pass: Q and K head slices of a fused QKV projection (token stride
// (Hq + 2 Hkv) * D, aligned and unaligned for the vector path) against the CPU, forward
// into a packed tensor and backward into a slice of a fused gradient.
TEST(GpuRope, HeadSlicesOfAFusedProjection) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  const Device cuda = Device::cuda();
  uint64_t seed = 400;
  for (DType t : {DType::BF16, DType::F32}) {
    for (auto [heads_total, hq, hkv, d] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{6, 4, 1, 64}, {12, 8, 2, 128},
                                           {5, 3, 1, 16}, {7, 5, 1, 6}}) {
      const std::string what = std::string(dtype_name(t)) + " heads " + std::to_string(heads_total) + " d " +
                               std::to_string(d);
      const RopeOptions o{.theta = 10000.0f, .position_offset = 2};
      // Bit-identical except where CUDA's double pow/sincos round a table entry differently.
      const double tol = t == DType::BF16 ? 1e-2 : 1e-6;
      const Tensor fused = random_tensor({3, 17, heads_total, d}, t, seed++);
      const Tensor fused_gpu = fused.to(cuda);
      for (auto [h0, h1] : {std::pair<int64_t, int64_t>{0, hq}, {hq, hq + hkv}}) {
        Tensor want = Tensor::empty({3, 17, h1 - h0, d}, t);
        rope_forward(cpu, fused.slice(2, h0, h1), want, o);
        Tensor got = Tensor::empty({3, 17, h1 - h0, d}, t);
        poison(got);
        got = got.to(cuda);
        rope_forward(gpu, fused_gpu.slice(2, h0, h1), got, o);
        EXPECT_LT(relative_error(got.to(Device::cpu()), want), tol) << what << " forward heads " << h0;
        // Backward into the slice of a fused gradient; the other heads stay untouched.
        const Tensor dy = random_tensor({3, 17, h1 - h0, d}, t, seed++);
        Tensor d_want = Tensor::zeros({3, 17, heads_total, d}, t);
        Tensor d_want_part = d_want.slice(2, h0, h1);
        rope_backward(cpu, dy, d_want_part, o);
        Tensor d_got = Tensor::zeros({3, 17, heads_total, d}, t, cuda);
        Tensor d_got_part = d_got.slice(2, h0, h1);
        rope_backward(gpu, dy.to(cuda), d_got_part, o);
        EXPECT_LT(relative_error(d_got.to(Device::cpu()), d_want), tol) << what << " backward heads " << h0;
      }
    }
  }
}
