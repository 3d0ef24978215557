// The NCCL backend on CUDA tensors: collectives against a serial reference, sub-groups,
// data-parallel gradient averaging, the tensor-parallel MLP and a tensor-parallel model with
// communication overlap on and off. Skips without a GPU or
// without NCCL. Alone it runs a world of one; under mpirun each rank takes GPU
// (rank % device count), the MPI world bootstrapping the communicator:
//   mpirun -np 2 build/test_gpu_dist_nccl
#include "dist_testing.h"
#include "gpu_testing.h"
#include "tessera/dist/data_parallel.h"
#include "tessera/dist/distributed_optimizer.h"
#include "tessera/dist/nccl_group.h"
#include "tessera/dist/parallel_grid.h"
#include "tessera/models/transformer_lm.h"
#include "tessera/nn/parallel_linear.h"
#include "tessera/core/stream.h"
#include "tessera/ops/elementwise.h"

#include <cmath>

#if TESSERA_WITH_CUDA
#include <cuda_runtime.h>
#endif

using namespace tessera;
using namespace tessera::testing;
using dist::ReduceOp;

namespace {

#define REQUIRE_NCCL()                                                                 \
  REQUIRE_GPU();                                                                       \
  if (!dist::nccl_available()) GTEST_SKIP() << "no NCCL in this build: skipping NCCL test"

int my_device() {
  int count = 1;
#if TESSERA_WITH_CUDA
  cudaGetDeviceCount(&count);
#endif
  return test_world()->rank() % std::max(count, 1);
}

// Made once and never destroyed: destroying a communicator during static destruction, after
// MPI_Finalize and maybe after the CUDA runtime's own teardown, is not safe.
dist::GroupPtr nccl_world() {
  static auto* group = new dist::GroupPtr([] {
    Context cpu = Context::cpu();
    return dist::nccl_group(cpu, *test_world(), my_device());
  }());
  return *group;
}

Context gpu_ctx() { return Context::cuda(my_device()); }

Tensor rank_values(int rank, const Shape& shape, DType dtype, uint64_t seed) {
  return random_tensor(shape, dtype, seed * 131 + static_cast<uint64_t>(rank));
}

}  // namespace

TEST(GpuNccl, AllReduceSumAndAverageMatchTheSerialReference) {
  REQUIRE_NCCL();
  auto g = nccl_world();
  Context ctx = gpu_ctx();
  const int n = g->size();
  for (DType dtype : {DType::F32, DType::BF16}) {
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max}) {
      for (int64_t numel : {int64_t{1}, int64_t{1000}, int64_t{1 << 20}}) {
        Tensor t = rank_values(g->rank(), {numel}, dtype, 1).to(ctx.device);
        g->all_reduce(ctx, t, op);
        std::vector<double> want(static_cast<size_t>(numel), 0.0);
        for (int r = 0; r < n; ++r) {
          const auto v = rank_values(r, {numel}, dtype, 1).to_doubles();
          for (size_t i = 0; i < want.size(); ++i)
            want[i] = op == ReduceOp::Max ? (r == 0 ? v[i] : std::max(want[i], v[i])) : want[i] + v[i];
        }
        if (op == ReduceOp::Avg)
          for (auto& w : want) w /= n;
        const double tol = dtype == DType::BF16 ? 1e-2 : 1e-6;
        EXPECT_LT(relative_error(doubles_of(t), want), tol) << dtype_name(dtype) << " " << dist::reduce_op_name(op);
      }
    }
  }
}

TEST(GpuNccl, GatherScatterBroadcastAllToAllAndSplit) {
  REQUIRE_NCCL();
  auto g = nccl_world();
  Context ctx = gpu_ctx();
  const int n = g->size(), me = g->rank();
  // all_gather
  Tensor in = rank_values(me, {3, 4}, DType::F32, 2).to(ctx.device);
  Tensor out = Tensor::empty({3 * n, 4}, DType::F32, ctx.device);
  g->all_gather(ctx, in, out);
  for (int r = 0; r < n; ++r)
    EXPECT_EQ(doubles_of(out.slice(0, 3 * r, 3 * r + 3)), rank_values(r, {3, 4}, DType::F32, 2).to_doubles());
  // reduce_scatter
  Tensor big = rank_values(me, {2 * n, 5}, DType::F32, 3).to(ctx.device);
  Tensor part = Tensor::empty({2, 5}, DType::F32, ctx.device);
  g->reduce_scatter(ctx, big, part);
  std::vector<double> want(10, 0.0);
  for (int r = 0; r < n; ++r) {
    const auto v = rank_values(r, {2 * n, 5}, DType::F32, 3).to_doubles();
    for (size_t i = 0; i < 10; ++i) want[i] += v[static_cast<size_t>(me * 10) + i];
  }
  EXPECT_LT(relative_error(doubles_of(part), want), 1e-6);
  // broadcast from the last rank
  Tensor b = rank_values(me, {7}, DType::BF16, 4).to(ctx.device);
  g->broadcast(ctx, b, n - 1);
  EXPECT_EQ(doubles_of(b), rank_values(n - 1, {7}, DType::BF16, 4).to_doubles());
  // all_to_all, uneven: rank r sends r + p + 1 rows to p, each row filled with 100 r + p
  std::vector<int64_t> in_splits, out_splits;
  std::vector<float> values;
  for (int p = 0; p < n; ++p) {
    in_splits.push_back(me + p + 1);
    out_splits.push_back(p + me + 1);
    for (int j = 0; j < me + p + 1; ++j) values.push_back(static_cast<float>(100 * me + p));
  }
  int64_t in_rows = 0, out_rows = 0;
  for (int p = 0; p < n; ++p) {
    in_rows += in_splits[static_cast<size_t>(p)];
    out_rows += out_splits[static_cast<size_t>(p)];
  }
  Tensor a_in = Tensor::from_floats(values, {in_rows, 1}).to(ctx.device);
  Tensor a_out = Tensor::empty({out_rows, 1}, DType::F32, ctx.device);
  g->all_to_all(ctx, a_in, a_out, in_splits, out_splits);
  const auto got = doubles_of(a_out);
  size_t at = 0;
  for (int p = 0; p < n; ++p)
    for (int j = 0; j < p + me + 1; ++j) EXPECT_EQ(got[at++], 100.0 * p + me);
  // split into a group of one per rank
  auto single = g->split(me, 0);
  ASSERT_NE(single, nullptr);
  EXPECT_EQ(single->size(), 1);
  EXPECT_EQ(single->world_ranks(), std::vector<int>{g->world_ranks()[static_cast<size_t>(me)]});
  g->barrier();
}

TEST(GpuNccl, TensorParallelMlpMatchesTheSingleDeviceModule) {
  REQUIRE_NCCL();
  auto g = nccl_world();
  Context ctx = gpu_ctx();
  dist::ParallelGrid grid(ctx, g, {.data = 1, .tensor = g->size(), .pipeline = 1});
  for (bool sp : {false, true}) {
    const int64_t hidden = 64, ffn = 128, rows = 16;
    nn::MLP full("mlp", hidden, ffn, nn::Activation::GELU, true, DType::F32);
    for (nn::Parameter* p : {&full.fc.weight, &full.fc.bias, &full.proj.weight, &full.proj.bias})
      p->weights().copy_from(random_tensor(p->weights().shape(), DType::F32, p->numel(), -0.2f, 0.2f));
    nn::TensorParallelMLP mlp("mlp", hidden, ffn, nn::Activation::GELU, true, DType::F32,
                              [&] { auto c = grid.context(); c.sequence_parallel = sp && g->size() > 1; return c; }());
    Context cpu = Context::cpu();
    mlp.load_full(cpu, full);
    nn::ParameterList params;
    mlp.parameters(params);
    for (nn::Parameter* p : params) p->to(ctx.device);
    const Tensor x = random_tensor({rows, hidden}, DType::F32, 5), dy = random_tensor({rows, hidden}, DType::F32, 6);
    nn::MLP::Saved fs;
    const Tensor y_ref = full.forward(cpu, x, fs);
    const Tensor dx_ref = full.backward_input(cpu, dy, fs);
    const int tp = g->size();
    const int64_t local = sp && tp > 1 ? rows / tp : rows, first = sp && tp > 1 ? g->rank() * local : 0;
    nn::TensorParallelMLP::Saved s;
    const Tensor y = mlp.forward(ctx, x.slice(0, first, first + local).contiguous().to(ctx.device), s);
    const Tensor dx = mlp.backward_input(ctx, dy.slice(0, first, first + local).contiguous().to(ctx.device), s);
    EXPECT_LT(relative_error(doubles_of(y), doubles_of(y_ref.slice(0, first, first + local))), 1e-4) << "sp " << sp;
    EXPECT_LT(relative_error(doubles_of(dx), doubles_of(dx_ref.slice(0, first, first + local))), 1e-4) << "sp " << sp;
  }
}

TEST(GpuNccl, DataParallelAveragesGradientBuckets) {
  REQUIRE_NCCL();
  auto g = nccl_world();
  Context ctx = gpu_ctx();
  const int n = g->size();
  nn::Parameter a("a", {1000}, DType::F32, true, ctx.device), b("b", {37, 3}, DType::BF16, true, ctx.device);
  a.grad.copy_from(rank_values(g->rank(), {1000}, DType::F32, 7));
  b.grad.copy_from(rank_values(g->rank(), {37, 3}, DType::F32, 8));
  dist::DataParallel dp(ctx, {&a, &b}, g, {.bucket_bytes = 1024});
  dp.all_reduce_gradients(ctx);
  std::vector<double> wa(1000, 0.0), wb(111, 0.0);
  for (int r = 0; r < n; ++r) {
    const auto va = rank_values(r, {1000}, DType::F32, 7).to_doubles();
    const auto vb = rank_values(r, {37, 3}, DType::F32, 8).to_doubles();
    for (size_t i = 0; i < wa.size(); ++i) wa[i] += va[i] / n;
    for (size_t i = 0; i < wb.size(); ++i) wb[i] += vb[i] / n;
  }
  EXPECT_LT(relative_error(doubles_of(a.grad), wa), 1e-6);
  EXPECT_LT(relative_error(doubles_of(b.grad), wb), 1e-6);
}

// all_reduce_async runs on the group's communication stream: it must wait for what the
// caller's stream queued before it (the producer) and the caller's stream must wait for it
// after wait(), with no host synchronisation in between. A non-blocking stream of the
// test's own, as the trainer uses, so that the legacy stream cannot hide a missing
// dependency; a chain of reduce-then-double rounds makes any reordering change the result.
TEST(GpuNccl, AsyncAllReduceIsOrderedWithTheCallersStream) {
  REQUIRE_NCCL();
  auto g = nccl_world();
  const int n = g->size();
  Stream stream = Stream::create(Device::cuda(my_device()));
  Context ctx = stream.context();
  StreamGuard guard(ctx);
  const Shape shape{1 << 20};
  Tensor start = rank_values(g->rank(), shape, DType::F32, 21);
  Tensor t = Tensor::empty(shape, DType::F32, ctx.device);
  t.copy_from(start);
  constexpr int kRounds = 4;
  for (int round = 0; round < kRounds; ++round) {
    auto work = g->all_reduce_async(ctx, t, ReduceOp::Sum);
    if (round % 2 == 0) work->wait();  // odd rounds: the dropped handle must order the stream too
    work.reset();
    scale(ctx, t, 2.0f, t);
  }
  // Round 1 sums the ranks' values; each later round sums n equal copies; every round doubles.
  std::vector<double> want(static_cast<size_t>(shape[0]), 0.0);
  for (int r = 0; r < n; ++r) {
    const auto v = rank_values(r, shape, DType::F32, 21).to_doubles();
    for (size_t i = 0; i < want.size(); ++i) want[i] += v[i];
  }
  const double factor = std::pow(2.0, kRounds) * std::pow(double(n), kRounds - 1);
  for (double& w : want) w *= factor;
  EXPECT_LT(relative_error(doubles_of(t), want), 1e-6);
}

// The overlapped form the trainer uses: buckets start reducing as parameters are marked
// ready (here in reverse, as backward produces them), and finish() completes the rest.
TEST(GpuNccl, DataParallelOverlappedBucketsMatchTheSerialReference) {
  REQUIRE_NCCL();
  auto g = nccl_world();
  Stream stream = Stream::create(Device::cuda(my_device()));
  Context ctx = stream.context();
  StreamGuard guard(ctx);
  const int n = g->size();
  std::vector<std::unique_ptr<nn::Parameter>> params;
  nn::ParameterList list;
  for (int i = 0; i < 6; ++i) {
    params.push_back(std::make_unique<nn::Parameter>("p" + std::to_string(i), Shape{300 + 7 * i}, DType::F32, true,
                                                     ctx.device));
    params.back()->grad.copy_from(rank_values(g->rank(), {300 + 7 * i}, DType::F32, 40 + uint64_t(i)));
    list.push_back(params.back().get());
  }
  dist::DataParallel dp(ctx, list, g, {.bucket_bytes = 2048});
  for (int i = 5; i >= 1; --i) dp.mark_ready(ctx, *params[static_cast<size_t>(i)]);  // p0 left to finish()
  dp.finish(ctx);
  for (int i = 0; i < 6; ++i) {
    std::vector<double> want(static_cast<size_t>(300 + 7 * i), 0.0);
    for (int r = 0; r < n; ++r) {
      const auto v = rank_values(r, {300 + 7 * i}, DType::F32, 40 + uint64_t(i)).to_doubles();
      for (size_t k = 0; k < want.size(); ++k) want[k] += v[k] / n;
    }
    EXPECT_LT(relative_error(doubles_of(params[static_cast<size_t>(i)]->grad), want), 1e-6) << "p" << i;
  }
}

// reduce_scatter_async, like all_reduce_async, runs on the communication stream ordered by
// events with the caller's (non-blocking) stream: a producer queued before it, and a
// consumer queued after wait(), see the right data.
TEST(GpuNccl, AsyncReduceScatterIsOrderedWithTheCallersStream) {
  REQUIRE_NCCL();
  auto g = nccl_world();
  const int n = g->size();
  Stream stream = Stream::create(Device::cuda(my_device()));
  Context ctx = stream.context();
  StreamGuard guard(ctx);
  const int64_t chunk = 1 << 18;
  const Shape full{chunk * n};
  Tensor in = Tensor::empty(full, DType::F32, ctx.device), out = Tensor::empty({chunk}, DType::F32, ctx.device);
  in.copy_from(rank_values(g->rank(), full, DType::F32, 31));
  scale(ctx, in, 3.0f, in);  // the producer, queued just before
  auto work = g->reduce_scatter_async(ctx, in, out, ReduceOp::Avg);
  work->wait();
  scale(ctx, out, 0.5f, out);  // the consumer, queued just after
  std::vector<double> want(static_cast<size_t>(chunk), 0.0);
  for (int r = 0; r < n; ++r) {
    const auto v = rank_values(r, full, DType::F32, 31).to_doubles();
    for (int64_t i = 0; i < chunk; ++i) want[static_cast<size_t>(i)] += 1.5 * v[static_cast<size_t>(g->rank() * chunk + i)] / n;
  }
  EXPECT_LT(relative_error(doubles_of(out), want), 1e-6);
}

// all_gather_async (sequence parallelism's dy gather under tp_comm_overlap): the same
// ordering, BF16 rows gathered exactly in rank order.
TEST(GpuNccl, AsyncAllGatherIsOrderedWithTheCallersStream) {
  REQUIRE_NCCL();
  auto g = nccl_world();
  const int n = g->size();
  Stream stream = Stream::create(Device::cuda(my_device()));
  Context ctx = stream.context();
  StreamGuard guard(ctx);
  const int64_t rows = 513, cols = 64;
  Tensor in = Tensor::empty({rows, cols}, DType::BF16, ctx.device);
  Tensor out = Tensor::empty({rows * n, cols}, DType::BF16, ctx.device);
  in.copy_from(rank_values(g->rank(), {rows, cols}, DType::BF16, 37));
  scale(ctx, in, 2.0f, in);  // the producer, queued just before (exact in BF16)
  auto work = g->all_gather_async(ctx, in, out);
  work->wait();
  scale(ctx, out, 0.5f, out);  // the consumer, queued just after
  for (int r = 0; r < n; ++r)
    EXPECT_EQ(doubles_of(out.slice(0, r * rows, (r + 1) * rows)), doubles_of(rank_values(r, {rows, cols}, DType::BF16, 37)))
        << "rank " << r << "'s rows";
}

// ZeRO-1 on NCCL: buckets reduce-scattered as their parameters are marked ready (on the
// communication stream) give the same bits as the reduction inside step().
TEST(GpuNccl, DistributedOptimizerOverlappedEqualsAfterBackward) {
  REQUIRE_NCCL();
  auto g = nccl_world();
  Stream stream = Stream::create(Device::cuda(my_device()));
  Context ctx = stream.context();
  StreamGuard guard(ctx);
  auto make = [&](std::vector<std::unique_ptr<nn::Parameter>>& params) {
    nn::ParameterList list;
    for (int i = 0; i < 5; ++i) {
      params.push_back(std::make_unique<nn::Parameter>("p" + std::to_string(i), Shape{500 + 31 * i}, DType::F32, true,
                                                       ctx.device));
      params.back()->value.copy_from(rank_values(0, {500 + 31 * i}, DType::F32, 60 + uint64_t(i)));
      list.push_back(params.back().get());
    }
    return list;
  };
  std::vector<std::unique_ptr<nn::Parameter>> pa, pb;
  const nn::ParameterList a = make(pa), b = make(pb);
  train::OptimizerConfig config;
  config.grad_clip = 0.5;
  dist::DistributedOptimizer after(ctx, a, g, config, {.bucket_bytes = 4096});
  dist::DistributedOptimizer overlapped(ctx, b, g, config, {.bucket_bytes = 4096});
  for (int step = 0; step < 3; ++step) {
    for (int i = 0; i < 5; ++i) {
      const Tensor grad = rank_values(g->rank(), {500 + 31 * i}, DType::F32, 100 * uint64_t(step) + uint64_t(i));
      pa[size_t(i)]->grad.copy_from(grad);
      pb[size_t(i)]->grad.copy_from(grad);
    }
    overlapped.begin_backward();
    for (int i = 4; i >= 0; --i) overlapped.mark_ready(ctx, *pb[size_t(i)]);
    const double na = after.step(ctx, 1e-2), nb = overlapped.step(ctx, 1e-2);
    EXPECT_EQ(na, nb) << "step " << step;
  }
  for (int i = 0; i < 5; ++i) EXPECT_EQ(bytes_of(pa[size_t(i)]->value), bytes_of(pb[size_t(i)]->value)) << "p" << i;
}

// parallel.tp_comm_overlap on NCCL: the column-parallel layers' dx reductions (and the LM
// head's d_h one) run on the tensor group's communication stream beside the weight-gradient
// GEMMs, ordered with the compute stream by events only. The loss and every gradient must
// equal those with it off bit for bit (the same kernels and collectives on the same data).
// A tiny Llama (GQA: K/V split at TP 2, replicated at TP 4), TP = the world size, with and
// without sequence parallelism, F32 and BF16, two accumulating steps. A world of one runs
// the unsplit layers (nothing to overlap) and must still agree.
TEST(GpuNccl, TensorParallelCommOverlapIsBitIdentical) {
  REQUIRE_NCCL();
  auto g = nccl_world();
  Stream stream = Stream::create(Device::cuda(my_device()));  // non-blocking, as the trainer's
  Context ctx = stream.context();
  StreamGuard guard(ctx);
  models::ModelConfig c;
  c.architecture = "llama";
  c.vocab_size = 67;  // not a multiple of the tensor size: padded rows
  c.hidden_size = 256;  // head size 64: the fast attention kernels in BF16
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.intermediate_size = 384;
  c.max_seq_len = 32;
  c.tie_embeddings = false;
  const int64_t batch = 2, seq = 16;
  for (bool sp : {false, true})
  for (DType dtype : {DType::F32, DType::BF16}) {
    dist::ParallelGrid grid(ctx, g, {.data = 1, .tensor = g->size(), .pipeline = 1, .sequence_parallel = sp});
    nn::ParallelContext off = grid.context(), on = grid.context();
    on.tp_comm_overlap = g->size() > 1;
    const std::string what = std::string(dtype_name(dtype)) + (sp ? " sp" : "") + " tp " + std::to_string(g->size());
    models::TransformerLM a(c, dtype, off), b(c, dtype, on);
    for (models::TransformerLM* m : {&a, &b}) {
      m->to(ctx.device);
      m->init(ctx, 5);
    }
    for (int step = 0; step < 2; ++step) {
      std::vector<int64_t> in, tg;
      for (int64_t i = 0; i < batch * seq; ++i) {
        in.push_back((i * 7 + step * 3) % c.vocab_size);
        tg.push_back((i * 11 + step * 5 + 1) % c.vocab_size);
      }
      const Tensor inputs = Tensor::from_ints(in, {batch, seq}), targets = Tensor::from_ints(tg, {batch, seq});
      const double want = a.forward_backward(ctx, inputs, targets);
      const double got = b.forward_backward(ctx, inputs, targets);
      EXPECT_TRUE(std::isfinite(got)) << what;
      EXPECT_EQ(got, want) << what << " step " << step;
      const nn::ParameterList pa = a.parameters(), pb = b.parameters();
      ASSERT_EQ(pa.size(), pb.size());
      for (size_t i = 0; i < pa.size(); ++i)
        EXPECT_EQ(bytes_of(pb[i]->grad), bytes_of(pa[i]->grad)) << what << " step " << step << " " << pa[i]->name;
    }
  }
}
