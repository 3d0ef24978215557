#include "tessera/core/random.h"

#include <cmath>

#include "tessera/core/philox.h"
#include "testing.h"

using namespace tessera;

// Known-answer vectors of Philox4x32-10 published with the Random123 library
// (kat_vectors): counter, key -> output.
TEST(Philox, MatchesPublishedKnownAnswers) {
  Philox4 zero = philox4x32(0, 0, 0);
  EXPECT_EQ(zero.x[0], 0x6627e8d5u);
  EXPECT_EQ(zero.x[1], 0xe169c58du);
  EXPECT_EQ(zero.x[2], 0xbc57ac4cu);
  EXPECT_EQ(zero.x[3], 0x9b00dbd8u);
  Philox4 ones = philox4x32(~0ull, ~0ull, ~0ull);
  EXPECT_EQ(ones.x[0], 0x408f276du);
  EXPECT_EQ(ones.x[1], 0x41c83b0eu);
  EXPECT_EQ(ones.x[2], 0xa20bc7c6u);
  EXPECT_EQ(ones.x[3], 0x6d5451fdu);
  Philox4 pi = philox4x32(0x299f31d0a4093822ull, 0x85a308d3243f6a88ull, 0x0370734413198a2eull);
  EXPECT_EQ(pi.x[0], 0xd16cfe09u);
  EXPECT_EQ(pi.x[1], 0x94fdccebu);
  EXPECT_EQ(pi.x[2], 0x5001e420u);
  EXPECT_EQ(pi.x[3], 0x24126ea1u);
}

TEST(Random, UniformDependsOnlyOnSeedOffsetAndIndex) {
  Context ctx = Context::cpu();
  Tensor a = Tensor::empty({1000}, DType::F32), b = Tensor::empty({10}, DType::F32);
  fill_uniform(ctx, a, -2.0f, 3.0f, 42);
  fill_uniform(ctx, b, -2.0f, 3.0f, 42, /*offset=*/25);  // words 100..109 of the stream
  for (int i = 0; i < 10; ++i) EXPECT_EQ(b.item(i), a.item(100 + i));
  double mean = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    EXPECT_GE(a.item(i), -2.0);
    EXPECT_LT(a.item(i), 3.0);
    mean += a.item(i) / a.numel();
  }
  EXPECT_NEAR(mean, 0.5, 0.15);
  Tensor c = Tensor::empty({1000}, DType::F32);
  fill_uniform(ctx, c, -2.0f, 3.0f, 43);
  EXPECT_GT(tessera::testing::relative_error(a, c), 0.1);  // another seed, another stream
}

TEST(Random, NormalHasTheRequestedMoments) {
  Context ctx = Context::cpu();
  Tensor t = Tensor::empty({200000}, DType::F64);
  fill_normal(ctx, t, 1.5f, 0.5f, 7);
  double mean = 0, var = 0;
  const auto v = t.to_doubles();
  for (double x : v) mean += x / v.size();
  for (double x : v) var += (x - mean) * (x - mean) / v.size();
  EXPECT_NEAR(mean, 1.5, 0.01);
  EXPECT_NEAR(std::sqrt(var), 0.5, 0.01);
}

TEST(Random, RejectsBadArguments) {
  Context ctx = Context::cpu();
  Tensor ints = Tensor::empty({4}, DType::I32), f = Tensor::empty({4}, DType::F32);
  EXPECT_THROW(fill_uniform(ctx, ints, 0, 1, 1), Error);
  EXPECT_THROW(fill_uniform(ctx, f, 1, 0, 1), Error);
  EXPECT_THROW(fill_normal(ctx, f, 0, -1, 1), Error);
}
