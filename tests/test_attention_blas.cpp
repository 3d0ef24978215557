// The F32 attention path (BLAS, blocks of 64 query rows) against the F64 reference on
// shapes that span several blocks, causal and not, GQA, more keys than queries.
#include "tessera/ops/attention.h"

#include "testing.h"

using namespace tessera;
using namespace tessera::testing;

namespace {
struct Result {
  Tensor out, lse, dq, dk, dv;
};

Result run(DType t, const Shape& qs, const Shape& ks, bool causal) {
  Context ctx = Context::cpu();
  const DType stats = t == DType::F64 ? DType::F64 : DType::F32;
  Tensor q = random_tensor(qs, t, 1), k = random_tensor(ks, t, 2), v = random_tensor(ks, t, 3);
  Tensor d_out = random_tensor(qs, t, 4);
  Result r{Tensor::empty(qs, t), Tensor::empty({qs[0], qs[2], qs[1]}, stats), Tensor::empty(qs, t), Tensor::empty(ks, t),
           Tensor::empty(ks, t)};
  poison(r.out);
  poison(r.dq);
  poison(r.dk);
  poison(r.dv);
  attention_forward(ctx, q, k, v, r.out, r.lse, {.causal = causal});
  attention_backward(ctx, d_out, q, k, v, r.out, r.lse, r.dq, r.dk, r.dv, {.causal = causal});
  return r;
}
}  // namespace

TEST(AttentionBlas, F32MatchesF64AcrossBlocks) {
  for (bool causal : {false, true}) {
    for (auto [qs, ks] : {std::pair<Shape, Shape>{{2, 130, 4, 16}, {2, 150, 2, 16}}, {{1, 64, 3, 8}, {1, 64, 3, 8}},
                          {{3, 1, 2, 5}, {3, 70, 1, 5}}, {{1, 129, 2, 32}, {1, 129, 1, 32}}}) {
      const Result want = run(DType::F64, qs, ks, causal), got = run(DType::F32, qs, ks, causal);
      const std::string what = (causal ? "causal " : "") + shape_to_string(qs) + " x " + shape_to_string(ks);
      EXPECT_LT(relative_error(got.out, want.out), 1e-5) << what;
      EXPECT_LT(relative_error(got.lse, want.lse), 1e-5) << what;
      EXPECT_LT(relative_error(got.dq, want.dq), 1e-5) << what;
      EXPECT_LT(relative_error(got.dk, want.dk), 1e-5) << what;
      EXPECT_LT(relative_error(got.dv, want.dv), 1e-5) << what;
    }
  }
}
