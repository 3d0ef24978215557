#include "tessera/ops/rope.h"

#include <cmath>

#include "testing.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

Tensor converted(const Tensor& t, DType dtype) { return Tensor::from_doubles(t.to_doubles(), t.shape(), dtype); }

Tensor run_rope(const Tensor& x, DType y_dtype, const RopeOptions& options) {
  Context ctx = Context::cpu();
  Tensor y = Tensor::empty(x.shape(), y_dtype);
  poison(y);
  rope_forward(ctx, x, y, options);
  return y;
}

Tensor run_rope_backward(const Tensor& dy, DType dx_dtype, const RopeOptions& options) {
  Context ctx = Context::cpu();
  Tensor dx = Tensor::empty(dy.shape(), dx_dtype);
  poison(dx);
  rope_backward(ctx, dy, dx, options);
  return dx;
}

// Straightforward double-precision RoPE of a [B, T, H, D] tensor, written independently of
// the kernel: x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1].
std::vector<double> reference_rope(const Tensor& x, const RopeOptions& options) {
  const int64_t batch = x.size(0), seq = x.size(1), heads = x.size(2), dim = x.size(3), half = dim / 2;
  const std::vector<double> in = x.to_doubles();
  std::vector<double> out(in.size());
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t t = 0; t < seq; ++t)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t j = 0; j < dim; ++j) {
          const int64_t base = ((b * seq + t) * heads + h) * dim;
          const int64_t i = j % half;
          const double angle =
              static_cast<double>(t + options.position_offset) / std::pow(double{options.theta}, 2.0 * i / dim);
          const double rotated = j < half ? -in[base + j + half] : in[base + j - half];
          out[base + j] = in[base + j] * std::cos(angle) + rotated * std::sin(angle);
        }
  return out;
}

}  // namespace

TEST(Rope, HeadDimTwoByHand) {
  // D = 2: one pair, inv_freq = 1, so the angle is the position itself.
  for (DType t : {DType::F64, DType::F32}) {
    const double tol = t == DType::F64 ? 1e-15 : 1e-7;
    Tensor x = Tensor::from_doubles({1, 0, 0.5, -2, 3, 1}, {1, 3, 1, 2}, t);
    for (int64_t offset : {0, 5}) {
      RopeOptions options;
      options.position_offset = offset;
      Tensor y = run_rope(x, t, options);
      std::vector<double> want;
      const std::vector<double> in = x.to_doubles();
      for (int64_t p = 0; p < 3; ++p) {
        const double a = static_cast<double>(p + offset), x0 = in[2 * p], x1 = in[2 * p + 1];
        want.push_back(x0 * std::cos(a) - x1 * std::sin(a));
        want.push_back(x1 * std::cos(a) + x0 * std::sin(a));
      }
      for (int i = 0; i < 6; ++i) EXPECT_NEAR(y.item(i), want[i], tol) << dtype_name(t) << " offset " << offset;
      if (offset == 0) EXPECT_EQ(y.item(0), 1.0);  // position 0 is the identity
    }
  }
}

TEST(Rope, HeadDimFourByHand) {
  // theta = 100, D = 4: inv_freq = [1, 100^(-1/2)] = [1, 0.1]; at position 3 the angles are [3, 0.3].
  Tensor x = Tensor::from_doubles({0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4}, {1, 4, 1, 4});
  RopeOptions options;
  options.theta = 100.0f;
  Tensor y = run_rope(x, DType::F64, options);
  const double c0 = std::cos(3.0), s0 = std::sin(3.0), c1 = std::cos(0.3), s1 = std::sin(0.3);
  const std::vector<double> want{1 * c0 - 3 * s0, 2 * c1 - 4 * s1, 3 * c0 + 1 * s0, 4 * c1 + 2 * s1};
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(y.item(12 + i), want[i], 1e-15);
  for (int i = 0; i < 12; ++i) EXPECT_EQ(y.item(i), 0.0);
}

TEST(Rope, MatchesReferenceAcrossBatchAndHeads) {
  RopeOptions options;
  options.theta = 500000.0f;
  options.position_offset = 3;
  Tensor x = random_tensor({2, 5, 3, 10}, DType::F64, 1);
  EXPECT_LT(relative_error(run_rope(x, DType::F64, options).to_doubles(), reference_rope(x, options)), 1e-14);
}

TEST(Rope, GradientMatchesFiniteDifferences) {
  uint64_t seed = 20;
  for (const Shape& shape : std::vector<Shape>{{1, 1, 1, 2}, {2, 3, 2, 6}, {1, 5, 3, 34}, {3, 1, 1, 4}}) {
    for (int64_t offset : {0, 7}) {
      SCOPED_TRACE(shape_to_string(shape) + " offset " + std::to_string(offset));
      RopeOptions options;
      options.position_offset = offset;
      Tensor x = random_tensor(shape, DType::F64, seed += 10), w = random_tensor(shape, DType::F64, seed + 1);
      Tensor dx = run_rope_backward(w, DType::F64, options);
      expect_gradient(dx, x, [&] { return weighted_sum(run_rope(x, DType::F64, options), w); }, "dx");
    }
  }
}

TEST(Rope, BackwardUndoesForward) {
  RopeOptions options;
  options.position_offset = 1000;
  Tensor x = random_tensor({2, 9, 4, 16}, DType::F32, 3);
  Tensor back = run_rope_backward(run_rope(x, DType::F32, options), DType::F32, options);
  EXPECT_LT(relative_error(back, x), 1e-6);
}

TEST(Rope, OffsetContinuesTheSequence) {
  // Rotating tokens 6..9 with position_offset 6 gives the same bits as rotating the full sequence.
  Tensor x = random_tensor({2, 10, 3, 8}, DType::F32, 4);
  Tensor full = run_rope(x, DType::F32, {});
  RopeOptions options;
  options.position_offset = 6;
  Tensor tail = run_rope(x.slice(1, 6, 10).contiguous(), DType::F32, options);
  EXPECT_EQ(tail.to_doubles(), full.slice(1, 6, 10).contiguous().to_doubles());
}

TEST(Rope, LowPrecisionMatchesDouble) {
  RopeOptions options;
  options.position_offset = 100000;  // large angles: computed in double, so F32 stays accurate
  const Shape shape{2, 7, 3, 64};
  for (DType t : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(dtype_name(t));
    const double tol = t == DType::F32 ? 1e-5 : 1e-2;
    Tensor x = random_tensor(shape, t, 5), x64 = converted(x, DType::F64);
    EXPECT_LT(relative_error(run_rope(x, t, options), run_rope(x64, DType::F64, options)), tol);
    EXPECT_LT(relative_error(run_rope_backward(x, t, options), run_rope_backward(x64, DType::F64, options)), tol);
  }
}

TEST(Rope, InPlace) {
  Context ctx = Context::cpu();
  RopeOptions options;
  options.position_offset = 2;
  for (DType t : {DType::F32, DType::BF16, DType::F64}) {
    Tensor x = random_tensor({2, 4, 3, 12}, t, 6);
    Tensor want = run_rope(x, t, options), want_back = run_rope_backward(x, t, options);
    Tensor y = x.clone();
    rope_forward(ctx, y, y, options);
    EXPECT_EQ(y.to_doubles(), want.to_doubles()) << dtype_name(t);
    Tensor d = x.clone();
    rope_backward(ctx, d, d, options);
    EXPECT_EQ(d.to_doubles(), want_back.to_doubles()) << dtype_name(t);
  }
}

TEST(Rope, RejectsBadArguments) {
  Context ctx = Context::cpu();
  Tensor x = Tensor::zeros({2, 3, 4, 8}, DType::F32), y = Tensor::zeros({2, 3, 4, 8}, DType::BF16);
  EXPECT_NO_THROW(rope_forward(ctx, x, y, {}));
  Tensor odd = Tensor::zeros({2, 3, 4, 7}, DType::F32);
  EXPECT_THROW(rope_forward(ctx, odd, odd, {}), Error);
  EXPECT_THROW(rope_backward(ctx, odd, odd, {}), Error);
  Tensor three_d = Tensor::zeros({6, 4, 8}, DType::F32);
  EXPECT_THROW(rope_forward(ctx, three_d, three_d, {}), Error);
  Tensor y_bad = Tensor::zeros({2, 3, 8, 4}, DType::F32);
  EXPECT_THROW(rope_forward(ctx, x, y_bad, {}), Error);
  EXPECT_THROW(rope_backward(ctx, x, y_bad, {}), Error);
  Tensor ints = Tensor::zeros({2, 3, 4, 8}, DType::I32), undefined;
  EXPECT_THROW(rope_forward(ctx, ints, y, {}), Error);
  EXPECT_THROW(rope_forward(ctx, x, undefined, {}), Error);
  EXPECT_THROW(rope_forward(ctx, Tensor::zeros({2, 4, 3, 8}, DType::F32).transpose(1, 2), y, {}), Error);
  RopeOptions bad_theta;
  bad_theta.theta = 0.0f;
  EXPECT_THROW(rope_forward(ctx, x, y, bad_theta), Error);
  RopeOptions bad_offset;
  bad_offset.position_offset = -1;
  EXPECT_THROW(rope_forward(ctx, x, y, bad_offset), Error);
  // Output overlapping the input without being the same memory would read rotated values.
  Tensor buffer = Tensor::zeros({3, 3, 4, 8}, DType::F32);
  Tensor first = buffer.slice(0, 0, 2), shifted = buffer.slice(0, 1, 3), disjoint = buffer.slice(0, 2, 3);
  EXPECT_THROW(rope_forward(ctx, first, shifted, {}), Error);
  Tensor single = buffer.slice(0, 0, 1);
  EXPECT_NO_THROW(rope_forward(ctx, single, disjoint, {}));
  Context gpu = Context::cuda(0);
  EXPECT_THROW(rope_forward(gpu, x, y, {}), Error);
}

TEST(Rope, ThreadedMatchesSmallSerialBlocks) {
  // [4, 32, 4, 64] runs threaded; each batch entry alone runs on one thread.
  const Shape shape{4, 32, 4, 64};
  RopeOptions options;
  options.position_offset = 11;
  Tensor x = random_tensor(shape, DType::F32, 61);
  Tensor y = run_rope(x, DType::F32, options), dx = run_rope_backward(x, DType::F32, options);
  for (int64_t b = 0; b < 4; ++b) {
    Tensor xb = x.slice(0, b, b + 1).contiguous();
    EXPECT_EQ(run_rope(xb, DType::F32, options).to_doubles(), y.slice(0, b, b + 1).contiguous().to_doubles());
    EXPECT_EQ(run_rope_backward(xb, DType::F32, options).to_doubles(),
              dx.slice(0, b, b + 1).contiguous().to_doubles());
  }
}

// Q and K sliced from a fused [B, T, Hq + 2 Hkv, D] projection (tokens at a stride) rotate
// like their packed copies, in both directions, and the backward may write into a slice.
TEST(Rope, HeadSlicesOfAFusedProjection) {
  Context ctx = Context::cpu();
  const Tensor fused = random_tensor({2, 5, 7, 8}, DType::F32, 91);
  const RopeOptions o{.theta = 500.0f, .position_offset = 3};
  const Tensor q = fused.slice(2, 0, 4);
  Tensor got = Tensor::empty({2, 5, 4, 8}, DType::F32), want = Tensor::empty({2, 5, 4, 8}, DType::F32);
  rope_forward(ctx, q, got, o);
  rope_forward(ctx, q.contiguous(), want, o);
  EXPECT_EQ(relative_error(got, want), 0.0);
  Tensor d_fused = Tensor::zeros({2, 5, 7, 8}, DType::F32);
  Tensor d_k = d_fused.slice(2, 4, 5);
  const Tensor dy = random_tensor({2, 5, 1, 8}, DType::F32, 92);
  rope_backward(ctx, dy, d_k, o);
  Tensor want_dk = Tensor::empty({2, 5, 1, 8}, DType::F32);
  rope_backward(ctx, dy, want_dk, o);
  EXPECT_EQ(relative_error(d_k.contiguous(), want_dk), 0.0);
  EXPECT_EQ(d_fused.slice(2, 5, 7).contiguous().to_floats(), std::vector<float>(2 * 5 * 2 * 8, 0.0f));
  // A transposed view is not a head slice.
  EXPECT_THROW(rope_forward(ctx, fused.transpose(1, 2), got, o), Error);
}
