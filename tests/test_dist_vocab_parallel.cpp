// Vocab-parallel embedding and LM head + cross-entropy against the single-device ops: the
// vocabulary split over the world (1 alone, 2 and 4 under mpirun), vocabularies that do
// not divide (padding rows, and at 4 ranks one rank holding no real row), several chunks
// with ignored targets, with and without sequence parallelism; the input gradient against
// F64 finite differences.
#include "dist_testing.h"
#include "tessera/dist/parallel_grid.h"
#include "tessera/nn/vocab_parallel.h"
#include "tessera/ops/embedding.h"
#include "tessera/ops/gemm.h"
#include "tessera/ops/loss.h"
#include "testing.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

constexpr int64_t kIgnore = -100;

struct Reference {
  double loss = 0;
  Tensor d_h, d_w, logits;  // F64
};

// The single-device head: logits = h W^T, mean cross-entropy, and its gradients times `scale`.
Reference reference_head(const Tensor& h, const Tensor& w, const Tensor& targets, float scale) {
  Context ctx = Context::cpu();
  const int64_t n = h.size(0), v = w.size(0);
  Reference r;
  r.logits = Tensor::empty({n, v}, DType::F64);
  gemm(ctx, h, w, r.logits, {.transpose_b = true});
  Tensor loss = Tensor::empty({1}, DType::F64), lse = Tensor::empty({n}, DType::F64);
  cross_entropy_forward(ctx, r.logits, targets, loss, lse, {.ignore_index = kIgnore});
  r.loss = loss.item(0);
  Tensor d_logits = Tensor::empty({n, v}, DType::F64);
  cross_entropy_backward(ctx, r.logits, targets, lse, scale, d_logits, {.ignore_index = kIgnore});
  r.d_h = Tensor::empty(h.shape(), DType::F64);
  gemm(ctx, d_logits, w, r.d_h);
  r.d_w = Tensor::zeros(w.shape(), DType::F64);
  gemm(ctx, d_logits, h, r.d_w, {.transpose_a = true, .beta = 1});
  return r;
}

// This rank's rows of a full [V, C] tensor, zero past V.
std::vector<double> shard_rows(const nn::VocabShard& s, const Tensor& full) {
  std::vector<double> out(static_cast<size_t>(s.rows * full.size(1)), 0.0);
  if (s.owned > 0) {
    const auto rows = doubles_of(full.slice(0, s.begin, s.begin + s.owned));
    std::copy(rows.begin(), rows.end(), out.begin());
  }
  return out;
}

Tensor targets_with_ignores(int64_t n, int64_t vocab, uint64_t seed) {
  std::vector<int64_t> t(static_cast<size_t>(n));
  uint64_t s = seed;
  for (int64_t i = 0; i < n; ++i) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    t[static_cast<size_t>(i)] = static_cast<int64_t>((s >> 33) % static_cast<uint64_t>(vocab));
  }
  t[1] = kIgnore;
  // Rows 6..8 form a chunk of 3 with no valid target.
  if (n > 8) t[6] = t[7] = t[8] = kIgnore;
  t[static_cast<size_t>(n - 1)] = vocab - 1;  // the last id: on the last rank that holds any
  return Tensor::from_ints(t, {n}, DType::I64);
}

void check_head(const nn::ParallelContext& base, int64_t vocab, bool sp, bool tied_to_embedding) {
  Context ctx = Context::cpu();
  const int64_t hidden = 6, n = 12;
  const int tp = base.tensor_size, tr = base.tensor_rank;
  nn::ParallelContext pc = base;
  pc.sequence_parallel = sp && tp > 1;
  const Tensor w_full = random_tensor({vocab, hidden}, DType::F64, 51, -0.8f, 0.8f);
  const Tensor h = random_tensor({n, hidden}, DType::F64, 52, -1.5f, 1.5f);
  const Tensor targets = targets_with_ignores(n, vocab, 53 + static_cast<uint64_t>(vocab));
  const float scale = 0.5f;
  const Reference ref = reference_head(h, w_full, targets, scale);

  nn::VocabParallelEmbedding table(tied_to_embedding ? "embed.weight" : "lm_head.weight", vocab, hidden, DType::F64, pc);
  table.load_full(ctx, w_full);
  nn::VocabParallelLMHead head(table, /*chunk_rows=*/3);
  const nn::VocabShard& shard = table.shard();
  const std::string what = "vocab=" + std::to_string(vocab) + (sp ? " sp" : "") + " tp=" + std::to_string(tp) +
                           " rank=" + std::to_string(tr);
  EXPECT_EQ(shard.rows, (vocab + tp - 1) / tp) << what;

  const int64_t local = pc.sequence_parallel ? n / tp : n, first = pc.sequence_parallel ? tr * local : 0;
  const Tensor h_local = h.slice(0, first, first + local).contiguous();
  Tensor d_h = Tensor::empty(h_local.shape(), DType::F64);
  poison(d_h);
  const double loss = head.loss(ctx, h_local, targets, &d_h, scale, kIgnore).read();
  EXPECT_NEAR(loss, ref.loss, 1e-12 * std::abs(ref.loss)) << what;
  EXPECT_LT(relative_error(doubles_of(d_h), doubles_of(ref.d_h.slice(0, first, first + local))), 1e-12) << what;
  EXPECT_LT(relative_error(doubles_of(table.weight.grad), shard_rows(shard, ref.d_w)), 1e-12) << what;
  // The rows past the parameter collected the "elsewhere" terms; the model clears them.
  table.clear_padding_grad();
  EXPECT_EQ(relative_error(doubles_of(table.padded_grad().slice(0, shard.rows, table.padded_rows())),
                           std::vector<double>(static_cast<size_t>((table.padded_rows() - shard.rows) * hidden), 0.0)),
            0.0)
      << what;
  // Weight gradients accumulate; the loss alone leaves them alone.
  head.loss(ctx, h_local, targets, &d_h, scale, kIgnore);
  EXPECT_NEAR(head.loss(ctx, h_local, targets, nullptr, 1.0f, kIgnore).read(), ref.loss, 1e-12 * std::abs(ref.loss));
  std::vector<double> twice = shard_rows(shard, ref.d_w);
  for (double& x : twice) x *= 2;
  EXPECT_LT(relative_error(doubles_of(table.weight.grad), twice), 1e-12) << what;
  // The full logits on every rank.
  EXPECT_LT(relative_error(doubles_of(head.logits(ctx, h_local)), doubles_of(ref.logits)), 1e-6) << what;  // F32 out

  // Embedding: the lookup reduced over the ranks, and its table gradient.
  nn::VocabParallelEmbedding::Saved saved;
  const Tensor ids = Tensor::from_ints({0, vocab - 1, 3 % vocab, 1, vocab - 1, 2 % vocab, 0, 4 % vocab, 1, 2 % vocab,
                                        (vocab - 2) % vocab, 1},
                                       {n}, DType::I64);
  const Tensor out = table.forward(ctx, ids, saved);
  Tensor want = Tensor::empty({n, hidden}, DType::F64);
  embedding_forward(ctx, ids, w_full, want);
  EXPECT_LT(relative_error(doubles_of(out), doubles_of(want.slice(0, first, first + local))), 1e-15) << what;
  const Tensor dy = random_tensor({n, hidden}, DType::F64, 54);
  table.weight.grad.fill_zero();
  table.backward_weight(ctx, table.gather_grad(ctx, dy.slice(0, first, first + local).contiguous()), saved);
  Tensor d_table = Tensor::zeros({vocab, hidden}, DType::F64);
  embedding_backward(ctx, ids, dy, d_table);
  EXPECT_LT(relative_error(doubles_of(table.weight.grad), shard_rows(shard, d_table)), 1e-15) << what;
  Tensor bad = Tensor::from_ints({0, vocab}, {2}, DType::I64);
  EXPECT_THROW(table.forward_partial(ctx, bad, saved), Error);
}

}  // namespace

TEST(DistVocabParallel, HeadAndEmbeddingMatchTheSingleDeviceOps) {
  Context ctx = Context::cpu();
  auto world = test_world();
  dist::ParallelGrid grid(ctx, world, {.data = 1, .tensor = world->size(), .pipeline = 1, .sequence_parallel = true});
  // 13: padding on the last rank at 2 and 4 ranks; 5 at 4 ranks: rows 2, the last rank
  // holds no real row (all its logits masked); 16: divides.
  for (int64_t vocab : {13, 5, 16})
    for (bool sp : {false, true})
      for (bool tied : {true, false}) check_head(grid.context(), vocab, sp, tied);
  // parallel.tp_comm_overlap: each chunk's weight-gradient GEMM deferred, the last beside d_h's
  // reduction (4 chunks of 3 rows, one without a valid target).
  nn::ParallelContext overlap = grid.context();
  overlap.tp_comm_overlap = world->size() > 1;
  for (bool sp : {false, true}) check_head(overlap, 13, sp, false);
}

// The head with communication overlap against without: loss, d_h and the weight gradient
// (accumulated over two calls) bit for bit, F32 and BF16, with and without sequence
// parallelism, chunks of 3 (one with no valid target) and one chunk.
TEST(DistVocabParallel, HeadWithCommOverlapIsBitIdentical) {
  Context ctx = Context::cpu();
  auto world = test_world();
  dist::ParallelGrid grid(ctx, world, {.data = 1, .tensor = world->size(), .pipeline = 1});
  const int64_t vocab = 13, hidden = 8, n = 12;
  const int tp = world->size();
  for (DType dtype : {DType::F32, DType::BF16})
  for (int64_t chunk : {3, 1024})
  for (bool sp : {false, true}) {
    nn::ParallelContext off = grid.context();
    off.sequence_parallel = sp && tp > 1;
    nn::ParallelContext on = off;
    on.tp_comm_overlap = tp > 1;
    const std::string what = std::string(dtype_name(dtype)) + " chunk " + std::to_string(chunk) + (sp ? " sp" : "");
    const Tensor w_full = random_tensor({vocab, hidden}, dtype, 61, -0.8f, 0.8f);
    const Tensor targets = targets_with_ignores(n, vocab, 62);
    const int64_t local = off.sequence_parallel ? n / tp : n, first = off.sequence_parallel ? world->rank() * local : 0;
    const Tensor h = random_tensor({n, hidden}, dtype, 63, -1.5f, 1.5f).slice(0, first, first + local).contiguous();
    nn::VocabParallelEmbedding ta("lm_head.weight", vocab, hidden, dtype, off), tb("lm_head.weight", vocab, hidden, dtype, on);
    ta.load_full(ctx, w_full);
    tb.load_full(ctx, w_full);
    EXPECT_EQ(tb.comm_overlap(), tp > 1);
    nn::VocabParallelLMHead ha(ta, chunk), hb(tb, chunk);
    for (int call = 0; call < 2; ++call) {
      Tensor da = Tensor::empty(h.shape(), dtype), db = Tensor::empty(h.shape(), dtype);
      poison(da);
      poison(db);
      const double la = ha.loss(ctx, h, targets, &da, 0.5f, kIgnore).read();
      const double lb = hb.loss(ctx, h, targets, &db, 0.5f, kIgnore).read();
      EXPECT_EQ(lb, la) << what;
      EXPECT_EQ(doubles_of(db), doubles_of(da)) << what << " d_h";
      EXPECT_EQ(doubles_of(tb.padded_grad()), doubles_of(ta.padded_grad())) << what << " weight gradient";
    }
  }
}

TEST(DistVocabParallel, CrossEntropyInputGradientMatchesFiniteDifferences) {
  Context ctx = Context::cpu();
  auto world = test_world();
  dist::ParallelGrid grid(ctx, world, {.data = 1, .tensor = world->size(), .pipeline = 1});
  const int64_t vocab = 11, hidden = 4, n = 7;
  nn::VocabParallelEmbedding table("embed.weight", vocab, hidden, DType::F64, grid.context());
  table.load_full(ctx, random_tensor({vocab, hidden}, DType::F64, 61, -1.0f, 1.0f));
  nn::VocabParallelLMHead head(table, /*chunk_rows=*/2);
  Tensor h = random_tensor({n, hidden}, DType::F64, 62, -1.0f, 1.0f);
  const Tensor targets = Tensor::from_ints({3, 10, kIgnore, 0, 7, 5, 9}, {n}, DType::I64);
  Tensor d_h = Tensor::empty({n, hidden}, DType::F64);
  head.loss(ctx, h, targets, &d_h, 1.0f, kIgnore);
  // Every rank perturbs the same element of h in step (the loss is collective).
  expect_gradient(d_h, h, [&] { return head.loss(ctx, h, targets, nullptr, 1.0f, kIgnore).read(); },
                  "vocab-parallel cross-entropy d_h, tp=" + std::to_string(world->size()), 1e-7);
}

TEST(DistVocabParallel, NoValidTargetGivesZeroLossAndGradient) {
  Context ctx = Context::cpu();
  auto world = test_world();
  dist::ParallelGrid grid(ctx, world, {.data = 1, .tensor = world->size(), .pipeline = 1});
  nn::VocabParallelEmbedding table("embed.weight", 9, 4, DType::F32, grid.context());
  nn::VocabParallelLMHead head(table);
  const Tensor h = random_tensor({4, 4}, DType::F32, 71);
  Tensor d_h = Tensor::empty({4, 4}, DType::F32);
  poison(d_h);
  EXPECT_EQ(head.loss(ctx, h, Tensor::from_ints({kIgnore, kIgnore, kIgnore, kIgnore}, {4}), &d_h).read(), 0.0);
  EXPECT_EQ(relative_error(doubles_of(d_h), std::vector<double>(16, 0.0)), 0.0);
  EXPECT_THROW(head.loss(ctx, h, Tensor::from_ints({0, 9, 1, 1}, {4}), &d_h), Error);  // target outside [0, 9)
}
