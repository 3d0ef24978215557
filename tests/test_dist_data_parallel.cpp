// Data parallel training of a tiny GPT-2: N ranks, each on 1/N of the global batch, with
// gradients averaged by DataParallel, end up with the same weights (and losses) as one
// process that accumulates the same micro-batches with scale 1/N. Also: the replicas stay
// bitwise identical, the overlap-ready path (mark_ready / finish) equals the synchronous
// one, and bucketing is deterministic.
#include "dist_testing.h"
#include "tessera/dist/data_parallel.h"
#include "tessera/dist/distributed_optimizer.h"
#include "tessera/models/transformer_lm.h"
#include "tessera/train/optimizer.h"
#include "testing.h"

using namespace tessera;
using namespace tessera::testing;
using models::ModelConfig;
using models::TransformerLM;

namespace {

ModelConfig tiny_gpt2() {
  ModelConfig c;
  c.architecture = "gpt2";
  c.vocab_size = 37;
  c.hidden_size = 24;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 4;
  c.max_seq_len = 8;
  c.tie_embeddings = true;
  return c;
}

constexpr int64_t kGlobalBatch = 4, kSeq = 8;

// Tokens of the global batch at `step`: [kGlobalBatch, kSeq + 1], inputs are the first kSeq.
std::vector<int64_t> batch_tokens(int step) {
  std::vector<int64_t> t(static_cast<size_t>(kGlobalBatch * (kSeq + 1)));
  uint64_t s = 1234567ull + static_cast<uint64_t>(step) * 99991ull;
  for (auto& v : t) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    v = static_cast<int64_t>((s >> 33) % 37);
  }
  return t;
}

// Rows [begin, end) of the step's batch as (inputs, targets).
std::pair<Tensor, Tensor> rows(int step, int64_t begin, int64_t end) {
  const auto t = batch_tokens(step);
  std::vector<int64_t> in, tg;
  for (int64_t b = begin; b < end; ++b)
    for (int64_t i = 0; i < kSeq; ++i) {
      in.push_back(t[static_cast<size_t>(b * (kSeq + 1) + i)]);
      tg.push_back(t[static_cast<size_t>(b * (kSeq + 1) + i + 1)]);
    }
  return {Tensor::from_ints(in, {end - begin, kSeq}), Tensor::from_ints(tg, {end - begin, kSeq})};
}

train::OptimizerConfig optimizer_config() {
  train::OptimizerConfig o;
  o.lr = 1e-2;
  o.warmup_steps = 0;
  o.weight_decay = 0.1;
  o.grad_clip = 1.0;
  return o;
}

std::vector<double> all_weights(TransformerLM& model) {
  std::vector<double> w;
  for (nn::Parameter* p : model.parameters()) {
    const auto v = p->weights().to_doubles();
    w.insert(w.end(), v.begin(), v.end());
  }
  return w;
}

}  // namespace

TEST(DistDataParallel, TrainingMatchesOneProcessOnTheWholeBatch) {
  Context ctx = Context::cpu();
  auto world = test_world();
  const int n = world->size(), me = world->rank();
  ASSERT_EQ(kGlobalBatch % n, 0);
  const int64_t per_rank = kGlobalBatch / n;
  constexpr int kSteps = 3;

  // Reference 1, on every rank: one process on the whole batch, the N ranks' shares as N
  // micro-batches accumulated with scale 1/N (gradient accumulation rounds differently).
  TransformerLM ref(tiny_gpt2());
  ref.init(ctx, 7);
  train::Optimizer ref_opt(ref.parameters(), optimizer_config());
  std::vector<double> ref_losses;
  for (int step = 0; step < kSteps; ++step) {
    ref.zero_grad();
    double loss = 0;
    for (int r = 0; r < n; ++r) {
      auto [in, tg] = rows(step, r * per_rank, (r + 1) * per_rank);
      loss += ref.forward_backward(ctx, in, tg, 1.0f / static_cast<float>(n)) / n;
    }
    ref_losses.push_back(loss);
    ref_opt.step(ctx, 1e-2);
  }
  // Reference 2: one process computing each share's gradient alone and averaging them in
  // rank order in F32, the order the MPI backend reduces in: bitwise what DP must give.
  TransformerLM exact(tiny_gpt2());
  exact.init(ctx, 7);
  train::Optimizer exact_opt(exact.parameters(), optimizer_config());
  auto exact_params = exact.parameters();
  for (int step = 0; step < kSteps; ++step) {
    std::vector<std::vector<float>> sums;
    for (int r = 0; r < n; ++r) {
      exact.zero_grad();
      auto [in, tg] = rows(step, r * per_rank, (r + 1) * per_rank);
      exact.forward_backward(ctx, in, tg);
      for (size_t i = 0; i < exact_params.size(); ++i) {
        const Tensor& g = exact_params[i]->grad;
        if (r == 0) {
          sums.emplace_back(g.data<float>(), g.data<float>() + g.numel());
        } else {
          for (int64_t j = 0; j < g.numel(); ++j) sums[i][static_cast<size_t>(j)] += g.data<float>()[j];
        }
      }
    }
    for (size_t i = 0; i < exact_params.size(); ++i)
      for (int64_t j = 0; j < exact_params[i]->grad.numel(); ++j)
        exact_params[i]->grad.data<float>()[j] = sums[i][static_cast<size_t>(j)] / static_cast<float>(n);
    exact_opt.step(ctx, 1e-2);
  }

  // Data parallel: rank r trains on its share only. A different init seed on the other
  // ranks shows that broadcast_parameters makes the replicas equal.
  TransformerLM model(tiny_gpt2());
  model.init(ctx, me == 0 ? 7 : 1000 + me);
  dist::DataParallel dp(ctx, model.parameters(), world, {.bucket_bytes = 4096});
  dp.broadcast_parameters(ctx, 0);
  EXPECT_GT(dp.buckets().size(), 1u);
  train::Optimizer opt(model.parameters(), optimizer_config());
  for (int step = 0; step < kSteps; ++step) {
    model.zero_grad();
    auto [in, tg] = rows(step, me * per_rank, (me + 1) * per_rank);
    Tensor loss = Tensor::from_doubles({model.forward_backward(ctx, in, tg)}, {1});
    dp.all_reduce_gradients(ctx);
    world->all_reduce(ctx, loss, dist::ReduceOp::Avg);
    EXPECT_NEAR(loss.item(0), ref_losses[static_cast<size_t>(step)], 1e-6) << "step " << step;
    opt.step(ctx, 1e-2);
  }
  const auto got = all_weights(model), want = all_weights(ref);
  // AdamW divides by sqrt(v): gradient differences of 1e-7 become weight differences of a
  // few 1e-6 relative after 3 steps at lr 1e-2.
  EXPECT_LT(relative_error(got, want), 1e-5);
  double max_diff = 0;
  for (size_t i = 0; i < got.size(); ++i) max_diff = std::max(max_diff, std::abs(got[i] - want[i]));
  if (me == 0) std::printf("DP=%d vs one process: max |weight difference| after %d steps = %.3g\n", n, kSteps, max_diff);
  EXPECT_EQ(got, all_weights(exact)) << "DP is not bitwise equal to averaging the shares' gradients in rank order";
  // The replicas are bitwise identical.
  dist::check_consistent(ctx, *world, dist::hash_bytes(got.data(), got.size() * sizeof(double)), "the trained weights");
}

TEST(DistDataParallel, OverlapReadyPathEqualsTheSynchronousOne) {
  Context ctx = Context::cpu();
  auto world = test_world();
  const int me = world->rank();
  TransformerLM a(tiny_gpt2()), b(tiny_gpt2());
  a.init(ctx, 3);
  b.init(ctx, 3);
  auto [in, tg] = rows(0, 0, 1);
  // Different data per rank, so the reduction has something to do.
  if (me % 2) std::tie(in, tg) = rows(1, 2, 3);
  a.zero_grad();
  b.zero_grad();
  a.forward_backward(ctx, in, tg);
  b.forward_backward(ctx, in, tg);
  dist::DataParallel dpa(ctx, a.parameters(), world, {.bucket_bytes = 1 << 20});
  dist::DataParallel dpb(ctx, b.parameters(), world, {.bucket_bytes = 2048});
  dpa.all_reduce_gradients(ctx);
  // Marked in backward's order (last parameter first), as a backward hook would.
  auto params = b.parameters();
  for (auto it = params.rbegin(); it != params.rend(); ++it) dpb.mark_ready(ctx, **it);
  EXPECT_THROW(dpb.mark_ready(ctx, *params.back()), Error);
  dpb.finish(ctx);
  auto pa = a.parameters();
  for (size_t i = 0; i < pa.size(); ++i)
    ASSERT_EQ(pa[i]->grad.to_doubles(), params[i]->grad.to_doubles()) << pa[i]->name;
}

TEST(DistDataParallel, BucketsFollowBackwardOrderAndTheSizeLimit) {
  Context ctx = Context::cpu();
  TransformerLM model(tiny_gpt2());
  auto params = model.parameters();
  dist::DataParallel dp(ctx, params, dist::local_group(), {.bucket_bytes = 4096});
  size_t seen = 0;
  for (const auto& b : dp.buckets()) {
    int64_t elements = 0;
    for (size_t i = 0; i < b.parameters.size(); ++i) {
      EXPECT_EQ(b.parameters[i], params[params.size() - 1 - seen]);  // reverse order
      EXPECT_EQ(b.offsets[i], elements);
      elements += b.parameters[i]->numel();
      ++seen;
    }
    // A bucket over the limit holds one parameter that alone is larger.
    if (static_cast<size_t>(elements) * 4 > 4096) EXPECT_EQ(b.parameters.size(), 1u);
    EXPECT_EQ(b.flat.numel(), elements);
  }
  EXPECT_EQ(seen, params.size());
  // A world of one changes nothing.
  model.init(ctx, 1);
  model.zero_grad();
  auto [in, tg] = rows(0, 0, 2);
  model.forward_backward(ctx, in, tg);
  const auto before = params[0]->grad.to_doubles();
  dp.all_reduce_gradients(ctx);
  EXPECT_EQ(params[0]->grad.to_doubles(), before);
}

TEST(DistDataParallel, RanksWithDifferentModelsAreRefused) {
  Context ctx = Context::cpu();
  auto world = test_world();
  if (world->size() == 1) GTEST_SKIP() << "needs 2 ranks";
  ModelConfig c = tiny_gpt2();
  if (world->rank() == 1) c.num_layers = 1;
  TransformerLM model(c);
  EXPECT_THROW(dist::DataParallel(ctx, model.parameters(), world), Error);
}

TEST(DistDataParallel, DistributedOptimizerEqualsDataParallelWithThePlainOptimizer) {
  Context ctx = Context::cpu();
  auto world = test_world();
  const int n = world->size(), me = world->rank();
  const int64_t per_rank = kGlobalBatch / n;
  // One bucket for the whole model, small buckets, a bucket per parameter.
  for (size_t bucket_bytes : {size_t{25} << 20, size_t{2048}, size_t{0}})
    for (double clip : {0.0, 0.05}) {
      train::OptimizerConfig config = optimizer_config();
      config.grad_clip = clip;  // 0.05: below the gradient norm, so clipping acts
      TransformerLM plain(tiny_gpt2()), sharded(tiny_gpt2());
      plain.init(ctx, 11);
      sharded.init(ctx, 11);
      dist::DataParallel dp(ctx, plain.parameters(), world, {.bucket_bytes = bucket_bytes});
      train::Optimizer opt(plain.parameters(), config);
      dist::DistributedOptimizer zero(ctx, sharded.parameters(), world, config, {.bucket_bytes = bucket_bytes});
      // Its buckets are DataParallel's, and the ranks own every element once.
      ASSERT_EQ(zero.bucket_parameters().size(), dp.buckets().size());
      for (size_t b = 0; b < dp.buckets().size(); ++b)
        for (size_t j = 0; j < dp.buckets()[b].parameters.size(); ++j)
          EXPECT_EQ(sharded.parameters()[zero.bucket_parameters()[b][j]]->name, dp.buckets()[b].parameters[j]->name);
      Tensor owned = Tensor::from_doubles({static_cast<double>(zero.owned_elements())}, {1});
      world->all_reduce(ctx, owned, dist::ReduceOp::Sum);
      EXPECT_EQ(owned.item(0), static_cast<double>(zero.total_elements()));
      for (int step = 0; step < 3; ++step) {
        auto [in, tg] = rows(step, me * per_rank, (me + 1) * per_rank);
        plain.zero_grad();
        sharded.zero_grad();
        plain.forward_backward(ctx, in, tg);
        sharded.forward_backward(ctx, in, tg);
        dp.all_reduce_gradients(ctx);
        const double norm_plain = opt.step(ctx, 1e-2);
        const double norm_sharded = zero.step(ctx, 1e-2);
        EXPECT_NEAR(norm_sharded, norm_plain, 1e-6 * norm_plain) << "step " << step;
        if (clip > 0) EXPECT_GT(norm_plain, clip);
      }
      const auto got = all_weights(sharded), want = all_weights(plain);
      if (clip == 0) {
        EXPECT_EQ(got, want) << "without clipping the sharded step is the same arithmetic (bucket bytes "
                             << bucket_bytes << ")";
      } else {
        EXPECT_LT(relative_error(got, want), 1e-6);
      }
      dist::check_consistent(ctx, *world, dist::hash_bytes(got.data(), got.size() * sizeof(double)),
                             "the weights after sharded steps");
    }
}

// The reduce-scatters started by the backward hook, bucket by bucket, give the same bits as
// the ones step() starts after the backward: weights, norms and moments.
TEST(DistDataParallel, DistributedOptimizerOverlappedEqualsAfterBackwardBitwise) {
  Context ctx = Context::cpu();
  auto world = test_world();
  const int n = world->size(), me = world->rank();
  const int64_t per_rank = kGlobalBatch / n;
  train::OptimizerConfig config = optimizer_config();
  config.grad_clip = 0.05;  // clipping acts: the norm must be the same too
  TransformerLM a(tiny_gpt2()), b(tiny_gpt2());
  a.init(ctx, 5);
  b.init(ctx, 5);
  dist::DistributedOptimizer za(ctx, a.parameters(), world, config, {.bucket_bytes = 2048});
  dist::DistributedOptimizer zb(ctx, b.parameters(), world, config, {.bucket_bytes = 2048});
  ASSERT_GT(zb.bucket_parameters().size(), 2u);
  int marks = 0;
  for (int step = 0; step < 3; ++step) {
    auto [in, tg] = rows(step, me * per_rank, (me + 1) * per_rank);
    a.zero_grad();
    b.zero_grad();
    // Two micro-batches; only the last one's backward marks.
    a.forward_backward(ctx, in, tg, 0.5f);
    a.forward_backward(ctx, in, tg, 0.5f);
    zb.begin_backward();
    b.forward_backward(ctx, in, tg, 0.5f);
    b.set_grad_ready_hook([&](Context& c, nn::Parameter& p) {
      ++marks;
      zb.mark_ready(c, p);
    });
    b.forward_backward(ctx, in, tg, 0.5f);
    b.set_grad_ready_hook({});
    EXPECT_THROW(zb.mark_ready(ctx, *b.parameters().front()), Error) << "marked twice";
    const double na = za.step(ctx, 1e-2), nb = zb.step(ctx, 1e-2);
    EXPECT_EQ(na, nb) << "step " << step;
    EXPECT_EQ(all_weights(a), all_weights(b)) << "step " << step;
  }
  EXPECT_EQ(marks, 3 * static_cast<int>(b.parameters().size()));
  const auto sa = za.state(), sb = zb.state();
  for (size_t i = 0; i < sa.size(); ++i) EXPECT_EQ(sa[i].second.to_doubles(), sb[i].second.to_doubles()) << sa[i].first;
  // A step whose gradients were reduced but not taken (a NaN loss): the next backward
  // starts anew.
  b.zero_grad();
  auto [in, tg] = rows(7, me * per_rank, (me + 1) * per_rank);
  b.forward_backward(ctx, in, tg);
  zb.reduce_gradients(ctx);
  zb.begin_backward();
  a.zero_grad();
  b.zero_grad();
  a.forward_backward(ctx, in, tg);
  b.forward_backward(ctx, in, tg);
  EXPECT_EQ(za.step(ctx, 1e-2), zb.step(ctx, 1e-2));
  EXPECT_EQ(all_weights(a), all_weights(b));
}

// Rank r owns the r-th chunk of every bucket; the pieces of all ranks cover every element of
// every parameter once, and a rank's pieces follow its shard.
TEST(DistDataParallel, BucketedShardsCoverEveryElementOnce) {
  const std::vector<int64_t> numels = {5, 7, 1, 12, 3, 9, 2};
  for (size_t bucket_bytes : {size_t{0}, size_t{40}, size_t{64}, size_t{1} << 20}) {
    const auto buckets = dist::zero1_buckets(numels, 4, bucket_bytes);
    size_t listed = 0;
    for (const auto& b : buckets) listed += b.size();
    EXPECT_EQ(listed, numels.size());
    EXPECT_EQ(buckets.front().front(), numels.size() - 1) << "the last parameter first";
    for (int size = 1; size <= 5; ++size) {
      std::vector<std::vector<int>> seen(numels.size());
      for (size_t i = 0; i < numels.size(); ++i) seen[i].assign(static_cast<size_t>(numels[i]), 0);
      for (int rank = 0; rank < size; ++rank) {
        int64_t packed = 0, shard = -1;
        for (const dist::Zero1Piece& p : dist::zero1_pieces(numels, buckets, size, rank)) {
          EXPECT_EQ(p.packed_offset, packed);
          EXPECT_GT(p.shard_offset, shard);
          packed += p.length;
          shard = p.shard_offset + p.length - 1;
          for (int64_t e = 0; e < p.length; ++e) ++seen[p.parameter][static_cast<size_t>(p.param_offset + e)];
        }
      }
      for (size_t i = 0; i < numels.size(); ++i)
        for (int v : seen[i]) ASSERT_EQ(v, 1) << "parameter " << i << ", size " << size << ", bucket bytes " << bucket_bytes;
    }
  }
}
