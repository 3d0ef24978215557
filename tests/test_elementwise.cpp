#include "tessera/ops/elementwise.h"

#include "testing.h"

using namespace tessera;
using namespace tessera::testing;

TEST(Add, MatchesDoubleSumInEveryDtype) {
  Context ctx = Context::cpu();
  for (DType t : {DType::F64, DType::F32, DType::BF16, DType::F16}) {
    Tensor a = random_tensor({7, 13}, t, 1), b = random_tensor({7, 13}, t, 2), out = Tensor::empty({7, 13}, t);
    poison(out);
    add(ctx, a, b, out);
    Tensor want = Tensor::empty({7, 13}, t);
    for (int64_t i = 0; i < want.numel(); ++i) want.set_item(i, a.item(i) + b.item(i));
    EXPECT_EQ(relative_error(out, want), 0.0) << dtype_name(t);
  }
}

TEST(Add, RejectsMismatchedShapes) {
  Context ctx = Context::cpu();
  Tensor a = Tensor::zeros({2, 3}, DType::F32), b = Tensor::zeros({3, 2}, DType::F32), out = Tensor::zeros({2, 3}, DType::F32);
  EXPECT_THROW(add(ctx, a, b, out), Error);
  Tensor undefined;
  EXPECT_THROW(add(ctx, a, undefined, out), Error);
  Tensor ints = Tensor::zeros({2, 3}, DType::I32);
  EXPECT_THROW(add(ctx, a, ints, out), Error);
}

TEST(Cast, RoundTripsThroughEveryFloatDtype) {
  Context ctx = Context::cpu();
  Tensor x = random_tensor({5, 9}, DType::F32, 3, -300.0f, 300.0f);
  for (DType t : {DType::F16, DType::BF16, DType::E4M3, DType::E5M2}) {
    Tensor low = Tensor::empty({5, 9}, t), back = Tensor::empty({5, 9}, DType::F32);
    cast(ctx, x, low);
    cast(ctx, low, back);
    // Each element must come back as the nearest representable value: casting again is exact.
    Tensor again = Tensor::empty({5, 9}, t);
    cast(ctx, back, again);
    EXPECT_EQ(relative_error(low, again), 0.0) << dtype_name(t);
    EXPECT_LT(relative_error(back, x), t == DType::E5M2 ? 0.15 : 0.07) << dtype_name(t);
  }
}

TEST(Cast, IntegersTruncate) {
  Context ctx = Context::cpu();
  Tensor x = Tensor::from_floats({1.7f, -2.5f, 3.0f}, {3}), out = Tensor::empty({3}, DType::I32);
  cast(ctx, x, out);
  EXPECT_EQ(out.to_ints(), (std::vector<int64_t>{1, -2, 3}));
}

TEST(Transpose2d, MovesEveryElement) {
  Context ctx = Context::cpu();
  for (auto [r, c] : {std::pair{1, 1}, {1, 37}, {33, 65}, {70, 3}}) {
    Tensor x = random_tensor({r, c}, DType::BF16, 4), out = Tensor::empty({c, r}, DType::BF16);
    poison(out);
    transpose_2d(ctx, x, out);
    EXPECT_EQ(relative_error(out, x.transpose(0, 1).contiguous()), 0.0);
  }
  Tensor x = Tensor::zeros({2, 3}, DType::F32), bad = Tensor::zeros({2, 3}, DType::F32);
  EXPECT_THROW(transpose_2d(ctx, x, bad), Error);
}

TEST(Scale, MultipliesInPlace) {
  Context ctx = Context::cpu();
  Tensor x = Tensor::from_floats({1, -2, 3.5f}, {3});
  scale(ctx, x, -2.0f, x);
  EXPECT_EQ(x.to_floats(), (std::vector<float>{-2, 4, -7}));
  Tensor wrong = Tensor::zeros({2}, DType::F32);
  EXPECT_THROW(scale(ctx, x, 1.0f, wrong), Error);
}
