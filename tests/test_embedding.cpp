#include "tessera/ops/embedding.h"

#include <string>

#include "testing.h"

using namespace tessera;
using namespace tessera::testing;

TEST(EmbeddingForward, HandComputedLookup) {
  Context ctx = Context::cpu();
  Tensor table = Tensor::from_doubles({0, 1, 10, 11, 20, 21, 30, 31}, {4, 2}, DType::F32);
  Tensor ids = Tensor::from_ints({2, 0, 3, 2, 1, 2}, {2, 3}, DType::I64);
  Tensor out = Tensor::empty({2, 3, 2}, DType::F32);
  poison(out);
  embedding_forward(ctx, ids, table, out);
  EXPECT_EQ(out.to_doubles(), (std::vector<double>{20, 21, 0, 1, 30, 31, 20, 21, 10, 11, 20, 21}));
}

TEST(EmbeddingForward, ConvertsBetweenDtypes) {
  Context ctx = Context::cpu();
  const int64_t vocab = 11, channels = 37;
  Tensor ids = Tensor::from_ints({10, 0, 5, 5, 3}, {5}, DType::I32);
  const std::vector<int64_t> idv = ids.to_ints();
  for (auto [tt, ot] : {std::pair{DType::F32, DType::F32}, {DType::BF16, DType::F32}, {DType::F32, DType::BF16},
                        {DType::F64, DType::F16}, {DType::E4M3, DType::F64}}) {
    Tensor table = random_tensor({vocab, channels}, tt, 1, -3, 3);
    Tensor out = Tensor::empty({5, channels}, ot);
    poison(out);
    embedding_forward(ctx, ids, table, out);
    std::vector<double> want;
    for (int64_t t = 0; t < 5; ++t)
      for (int64_t c = 0; c < channels; ++c) want.push_back(table.item(idv[t] * channels + c));
    // Rounding the exact table values into out's dtype is what the op must produce.
    const Tensor want_rounded = Tensor::from_doubles(want, {5, channels}, ot);
    EXPECT_EQ(relative_error(out, want_rounded), 0.0) << dtype_name(tt) << " -> " << dtype_name(ot);
  }
}

TEST(EmbeddingForward, OneTokenAndScalarIds) {
  Context ctx = Context::cpu();
  Tensor table = random_tensor({3, 4}, DType::F32, 2);
  Tensor ids = Tensor::from_ints({1}, {1}, DType::I32), out = Tensor::empty({1, 4}, DType::F32);
  poison(out);
  embedding_forward(ctx, ids, table, out);
  for (int64_t c = 0; c < 4; ++c) EXPECT_EQ(out.item(c), table.item(4 + c));
  Tensor scalar_ids = Tensor::from_ints({2}, {}, DType::I64), out_vec = Tensor::empty({4}, DType::F32);
  poison(out_vec);
  embedding_forward(ctx, scalar_ids, table, out_vec);
  for (int64_t c = 0; c < 4; ++c) EXPECT_EQ(out_vec.item(c), table.item(8 + c));
}

TEST(EmbeddingBackward, GradientMatchesFiniteDifferences) {
  Context ctx = Context::cpu();
  struct Case {
    Shape ids_shape;
    std::vector<int64_t> ids;
    int64_t vocab, channels;
  };
  for (const Case& k : {Case{{2, 3}, {4, 1, 4, 0, 1, 4}, 5, 7}, Case{{1}, {0}, 1, 1}, Case{{5}, {2, 2, 2, 2, 2}, 3, 33}}) {
    Tensor ids = Tensor::from_ints(k.ids, k.ids_shape, DType::I32);
    Tensor table = random_tensor({k.vocab, k.channels}, DType::F64, 3);
    Shape out_shape = k.ids_shape;
    out_shape.push_back(k.channels);
    Tensor weights = random_tensor(out_shape, DType::F64, 4);
    auto loss = [&] {
      Tensor out = Tensor::empty(out_shape, DType::F64);
      embedding_forward(ctx, ids, table, out);
      return weighted_sum(out, weights);
    };
    Tensor start = random_tensor({k.vocab, k.channels}, DType::F64, 5);
    Tensor d_table = start.clone();
    embedding_backward(ctx, ids, weights, d_table);
    Tensor added = Tensor::empty({k.vocab, k.channels}, DType::F64);
    for (int64_t i = 0; i < added.numel(); ++i) added.set_item(i, d_table.item(i) - start.item(i));
    expect_gradient(added, table, loss, "embedding d_table");
  }
}

TEST(EmbeddingBackward, RepeatedIdsAddUpAndOtherRowsStayUntouched) {
  Context ctx = Context::cpu();
  const int64_t channels = 40;
  Tensor ids = Tensor::from_ints({1, 1, 1, 3}, {4}, DType::I64);
  Tensor d_out = random_tensor({4, channels}, DType::F64, 6);
  Tensor d_table = random_tensor({5, channels}, DType::F64, 7);
  const Tensor before = d_table.clone();
  embedding_backward(ctx, ids, d_out, d_table);
  for (int64_t v = 0; v < 5; ++v)
    for (int64_t c = 0; c < channels; ++c) {
      double want = before.item(v * channels + c);
      if (v == 1) want += d_out.item(c) + d_out.item(channels + c) + d_out.item(2 * channels + c);
      if (v == 3) want += d_out.item(3 * channels + c);
      EXPECT_NEAR(d_table.item(v * channels + c), want, 1e-14) << "v=" << v << " c=" << c;
    }
}

TEST(EmbeddingBackward, DeterministicPositionOrderSums) {
  Context ctx = Context::cpu();
  const int64_t vocab = 7, channels = 100, tokens = 300;
  std::vector<int64_t> idv(tokens);
  for (int64_t t = 0; t < tokens; ++t) idv[t] = (t * 5) % vocab;
  Tensor ids = Tensor::from_ints(idv, {tokens}, DType::I32);
  Tensor d_out = random_tensor({tokens, channels}, DType::F32, 8);
  Tensor d_table = Tensor::zeros({vocab, channels}, DType::F32);
  embedding_backward(ctx, ids, d_out, d_table);
  // Sequential float sums in position order, bit for bit.
  std::vector<float> want(vocab * channels, 0.0f);
  const std::vector<float> g = d_out.to_floats();
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t c = 0; c < channels; ++c) want[idv[t] * channels + c] += g[t * channels + c];
  EXPECT_EQ(d_table.to_floats(), want);
}

TEST(EmbeddingBackward, LowPrecisionAgreesWithF64) {
  Context ctx = Context::cpu();
  const int64_t vocab = 9, channels = 19;
  Tensor ids = Tensor::from_ints({3, 8, 3, 0, 5, 3, 8}, {7}, DType::I64);
  Tensor d_out64 = random_tensor({7, channels}, DType::F64, 9);
  Tensor want = Tensor::zeros({vocab, channels}, DType::F64);
  embedding_backward(ctx, ids, d_out64, want);
  for (DType t : {DType::F32, DType::BF16}) {
    Tensor d_out = Tensor::from_doubles(d_out64.to_doubles(), {7, channels}, t);
    Tensor d_table = Tensor::zeros({vocab, channels}, t);
    embedding_backward(ctx, ids, d_out, d_table);
    EXPECT_LT(relative_error(d_table, want), t == DType::F32 ? 1e-5 : 1e-2) << dtype_name(t);
  }
}

TEST(EmbeddingErrors, OutOfRangeIdNamesIdAndPosition) {
  Context ctx = Context::cpu();
  Tensor table = Tensor::zeros({5, 3}, DType::F32), out = Tensor::zeros({2, 2, 3}, DType::F32);
  Tensor d_table = Tensor::zeros({5, 3}, DType::F32);
  for (int64_t bad : {int64_t{5}, int64_t{-1}}) {
    Tensor ids = Tensor::from_ints({0, 1, bad, 2}, {2, 2}, DType::I64);
    poison(out);
    try {
      embedding_forward(ctx, ids, table, out);
      ADD_FAILURE() << "id " << bad << " was accepted";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("id " + std::to_string(bad)), std::string::npos) << msg;
      EXPECT_NE(msg.find("[1, 0]"), std::string::npos) << msg;
    }
    EXPECT_THROW(embedding_backward(ctx, ids, out, d_table), Error);
  }
  // Nothing was added before the bad id was found.
  for (double v : d_table.to_doubles()) EXPECT_EQ(v, 0.0);
}

TEST(EmbeddingErrors, BadArgumentsThrow) {
  Context ctx = Context::cpu();
  Tensor table = Tensor::zeros({5, 3}, DType::F32), ids = Tensor::from_ints({0, 1}, {2}, DType::I32);
  Tensor out = Tensor::zeros({2, 3}, DType::F32);
  EXPECT_NO_THROW(embedding_forward(ctx, ids, table, out));
  Tensor float_ids = Tensor::zeros({2}, DType::F32);
  EXPECT_THROW(embedding_forward(ctx, float_ids, table, out), Error);
  Tensor out_bad = Tensor::zeros({2, 4}, DType::F32);
  EXPECT_THROW(embedding_forward(ctx, ids, table, out_bad), Error);
  Tensor table_1d = Tensor::zeros({15}, DType::F32);
  EXPECT_THROW(embedding_forward(ctx, ids, table_1d, out), Error);
  Tensor int_table = Tensor::zeros({5, 3}, DType::I32);
  EXPECT_THROW(embedding_forward(ctx, ids, int_table, out), Error);
  Tensor undefined;
  EXPECT_THROW(embedding_forward(ctx, undefined, table, out), Error);
  Tensor d_out_bad = Tensor::zeros({3, 3}, DType::F32), d_table = Tensor::zeros({5, 3}, DType::F32);
  EXPECT_THROW(embedding_backward(ctx, ids, d_out_bad, d_table), Error);
  Tensor d_table_bad = Tensor::zeros({5, 4}, DType::F32);
  EXPECT_THROW(embedding_backward(ctx, ids, out, d_table_bad), Error);
}
