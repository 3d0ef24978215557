// The process-group collectives against a serial reference computed on every rank, for
// every reduce op and dtype, uneven all-to-all splits, point to point, sub-groups, the
// parallel grid, and the cross-rank consistency check. Runs alone and under mpirun.
#include <cstdlib>

#include "dist_testing.h"
#include "tessera/dist/nccl_group.h"
#include "tessera/dist/parallel_grid.h"
#include "testing.h"

#include <nlohmann/json.hpp>

using namespace tessera;
using namespace tessera::testing;
using dist::ReduceOp;

namespace {

// Rank r's input for a test: values that depend on the rank, exactly representable in the
// dtype (multiples of 1/8 in [-4, 4)), so that the reference can round once where the
// backend does.
std::vector<double> input_of(int rank, int64_t n, uint64_t seed, DType dtype) {
  std::vector<double> v(static_cast<size_t>(n));
  uint64_t s = seed * 1000003ull + static_cast<uint64_t>(rank) * 7919ull + 1;
  for (auto& x : v) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    const int64_t k = static_cast<int64_t>((s >> 33) % 64) - 32;
    x = is_integer(dtype) ? static_cast<double>(k * 3 + rank) : static_cast<double>(k) / 8.0 + rank * 0.375;
  }
  return v;
}

Tensor tensor_of(const std::vector<double>& v, const Shape& shape, DType dtype) {
  if (is_integer(dtype)) {
    std::vector<int64_t> ints(v.begin(), v.end());
    return Tensor::from_ints(ints, shape, dtype);
  }
  return Tensor::from_doubles(v, shape, dtype);
}

// The reference: in rank order, accumulating in the backend's precision.
std::vector<double> reduce_reference(int size, int64_t n, uint64_t seed, DType dtype, ReduceOp op) {
  std::vector<double> out(static_cast<size_t>(n));
  std::vector<std::vector<double>> inputs;
  for (int r = 0; r < size; ++r) inputs.push_back(input_of(r, n, seed, dtype));
  for (int64_t i = 0; i < n; ++i) {
    double acc_d = 0;
    float acc_f = 0;
    for (int r = 0; r < size; ++r) {
      const double x = inputs[static_cast<size_t>(r)][static_cast<size_t>(i)];
      if (r == 0) {
        acc_d = x;
        acc_f = static_cast<float>(x);
        continue;
      }
      switch (op) {
        case ReduceOp::Sum:
        case ReduceOp::Avg: acc_d += x; acc_f += static_cast<float>(x); break;
        case ReduceOp::Max: acc_d = std::max(acc_d, x); acc_f = std::max(acc_f, static_cast<float>(x)); break;
        case ReduceOp::Min: acc_d = std::min(acc_d, x); acc_f = std::min(acc_f, static_cast<float>(x)); break;
      }
    }
    if (op == ReduceOp::Avg) {
      acc_d /= size;
      acc_f /= static_cast<float>(size);
    }
    if (dtype == DType::F64 || is_integer(dtype)) {
      out[static_cast<size_t>(i)] = is_integer(dtype) ? std::trunc(acc_d) : acc_d;
    } else {
      // F32 accumulation, then one rounding to the dtype.
      out[static_cast<size_t>(i)] = Tensor::from_floats({acc_f}, {1}, dtype).to_doubles()[0];
    }
  }
  return out;
}

}  // namespace

TEST(DistCollectives, WorldComesFromTheLauncher) {
  auto world = test_world();
  ASSERT_NE(world, nullptr);
  EXPECT_GE(world->size(), 1);
  EXPECT_LT(world->rank(), world->size());
  EXPECT_EQ(world->world_ranks().size(), static_cast<size_t>(world->size()));
  EXPECT_EQ(world->world_ranks()[static_cast<size_t>(world->rank())], world->rank());
  // mpirun: MPI; RANK / WORLD_SIZE (tessera launch, tests/run_ranks.sh): TCP; alone: local.
  const char* size = std::getenv("WORLD_SIZE");
  const char* expected = dist::launched_by_mpi() ? "mpi" : size != nullptr && std::atoi(size) > 1 ? "tcp" : "local";
  EXPECT_STREQ(world->backend(), expected);
  world->barrier();
}

TEST(DistCollectives, AllReduceEveryOpAndDtypeMatchesTheSerialReference) {
  auto world = test_world();
  Context ctx = Context::cpu();
  uint64_t seed = 1;
  for (DType dtype : {DType::F32, DType::F64, DType::BF16, DType::F16, DType::I32, DType::I64}) {
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min}) {
      if (is_integer(dtype) && op == ReduceOp::Avg) continue;
      for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1000}, int64_t{4099}}) {
        ++seed;
        Tensor t = tensor_of(input_of(world->rank(), n, seed, dtype), {n}, dtype);
        world->all_reduce(ctx, t, op);
        const auto want = reduce_reference(world->size(), n, seed, dtype, op);
        const auto got = t.to_doubles();
        ASSERT_EQ(got, want) << dtype_name(dtype) << " " << dist::reduce_op_name(op) << " n=" << n;
      }
    }
  }
}

TEST(DistCollectives, AllReduceOfAMultiDimensionalTensorAndOfNothing) {
  auto world = test_world();
  Context ctx = Context::cpu();
  Tensor t = tensor_of(input_of(world->rank(), 24, 99, DType::F32), {2, 3, 4}, DType::F32);
  world->all_reduce(ctx, t, ReduceOp::Sum);
  EXPECT_EQ(t.to_doubles(), reduce_reference(world->size(), 24, 99, DType::F32, ReduceOp::Sum));
  Tensor empty = Tensor::empty({0}, DType::F32);
  world->all_reduce(ctx, empty, ReduceOp::Sum);
  EXPECT_EQ(empty.numel(), 0);
}

TEST(DistCollectives, ReduceScatterGivesEachRankItsRowsOfTheSum) {
  auto world = test_world();
  Context ctx = Context::cpu();
  const int n = world->size();
  for (DType dtype : {DType::F32, DType::BF16, DType::F64}) {
    for (int64_t rows : {int64_t{1}, int64_t{5}}) {
      const int64_t cols = 3, total = n * rows * cols;
      Tensor in = tensor_of(input_of(world->rank(), total, 500 + rows, dtype), {n * rows, cols}, dtype);
      Tensor out = Tensor::empty({rows, cols}, dtype);
      world->reduce_scatter(ctx, in, out, ReduceOp::Sum);
      const auto all = reduce_reference(n, total, 500 + rows, dtype, ReduceOp::Sum);
      const std::vector<double> want(all.begin() + world->rank() * rows * cols,
                                     all.begin() + (world->rank() + 1) * rows * cols);
      EXPECT_EQ(out.to_doubles(), want) << dtype_name(dtype) << " rows=" << rows;
    }
  }
}

TEST(DistCollectives, AllGatherJoinsInRankOrder) {
  auto world = test_world();
  Context ctx = Context::cpu();
  const int n = world->size();
  for (DType dtype : {DType::F32, DType::BF16, DType::I64, DType::U8}) {
    const int64_t rows = 3, cols = 5;
    Tensor in = tensor_of(input_of(world->rank(), rows * cols, 7, DType::I32), {rows, cols}, DType::I32);
    Tensor in_t = Tensor::empty({rows, cols}, dtype);
    if (dtype == DType::U8) {
      for (int64_t i = 0; i < rows * cols; ++i) in_t.data<uint8_t>()[i] = static_cast<uint8_t>(i + 10 * world->rank());
    } else {
      in_t = tensor_of(in.to_doubles(), {rows, cols}, dtype);
    }
    Tensor out = Tensor::empty({n * rows, cols}, dtype);
    world->all_gather(ctx, in_t, out);
    const auto got = dtype == DType::U8 ? std::vector<double>() : out.to_doubles();
    for (int r = 0; r < n; ++r) {
      if (dtype == DType::U8) {
        for (int64_t i = 0; i < rows * cols; ++i)
          ASSERT_EQ(out.data<uint8_t>()[r * rows * cols + i], static_cast<uint8_t>(i + 10 * r));
        continue;
      }
      const auto want = tensor_of(input_of(r, rows * cols, 7, DType::I32), {rows, cols}, dtype).to_doubles();
      for (int64_t i = 0; i < rows * cols; ++i)
        ASSERT_EQ(got[static_cast<size_t>(r * rows * cols + i)], want[static_cast<size_t>(i)]) << dtype_name(dtype);
    }
    if (dtype == DType::U8) continue;
    // The asynchronous form (the CPU backends complete it at once): the same bits.
    Tensor out_async = Tensor::empty({n * rows, cols}, dtype);
    world->all_gather_async(ctx, in_t, out_async)->wait();
    EXPECT_EQ(out_async.to_doubles(), got) << dtype_name(dtype);
  }
}

TEST(DistCollectives, BroadcastFromEveryRoot) {
  auto world = test_world();
  Context ctx = Context::cpu();
  for (int root = 0; root < world->size(); ++root) {
    Tensor t = tensor_of(input_of(world->rank(), 33, 3, DType::F32), {3, 11}, DType::F32);
    world->broadcast(ctx, t, root);
    EXPECT_EQ(t.to_doubles(), input_of(root, 33, 3, DType::F32)) << "root " << root;
  }
  Tensor t = Tensor::zeros({2}, DType::F32);
  EXPECT_THROW(world->broadcast(ctx, t, world->size()), Error);
}

TEST(DistCollectives, AllToAllWithUnevenSplits) {
  auto world = test_world();
  Context ctx = Context::cpu();
  const int n = world->size(), me = world->rank();
  const int64_t cols = 2;
  // Rank r sends r + p + 1 rows to rank p; row j of that block holds (r, p, j).
  auto rows_between = [](int src, int dst) { return static_cast<int64_t>(src + dst + 1); };
  std::vector<int64_t> in_splits, out_splits;
  std::vector<float> values;
  for (int p = 0; p < n; ++p) {
    in_splits.push_back(rows_between(me, p));
    out_splits.push_back(rows_between(p, me));
    for (int64_t j = 0; j < rows_between(me, p); ++j) {
      values.push_back(static_cast<float>(100 * me + p));
      values.push_back(static_cast<float>(j));
    }
  }
  int64_t in_rows = 0, out_rows = 0;
  for (int p = 0; p < n; ++p) {
    in_rows += in_splits[static_cast<size_t>(p)];
    out_rows += out_splits[static_cast<size_t>(p)];
  }
  Tensor in = Tensor::from_floats(values, {in_rows, cols});
  Tensor out = Tensor::empty({out_rows, cols}, DType::F32);
  world->all_to_all(ctx, in, out, in_splits, out_splits);
  const auto got = out.to_floats();
  size_t at = 0;
  for (int p = 0; p < n; ++p) {
    for (int64_t j = 0; j < rows_between(p, me); ++j) {
      EXPECT_EQ(got[at++], static_cast<float>(100 * p + me));
      EXPECT_EQ(got[at++], static_cast<float>(j));
    }
  }
}

TEST(DistCollectives, SendAndReceiveAroundARing) {
  auto world = test_world();
  Context ctx = Context::cpu();
  const int n = world->size(), me = world->rank();
  if (n == 1) {
    Tensor t = Tensor::zeros({1}, DType::F32);
    EXPECT_THROW(world->send(ctx, t, 0), Error);
    return;
  }
  Tensor mine = Tensor::from_floats({static_cast<float>(me), 0.5f}, {2});
  Tensor got = Tensor::zeros({2}, DType::F32);
  const int next = (me + 1) % n, prev = (me + n - 1) % n;
  // Even ranks send first, odd ranks receive first: no rank waits on a rank that waits on it.
  if (me % 2 == 0) {
    world->send(ctx, mine, next);
    world->recv(ctx, got, prev);
  } else {
    world->recv(ctx, got, prev);
    world->send(ctx, mine, next);
  }
  EXPECT_EQ(got.to_floats(), (std::vector<float>{static_cast<float>(prev), 0.5f}));
}

TEST(DistCollectives, SubGroupsFromRankLists) {
  auto world = test_world();
  Context ctx = Context::cpu();
  const int n = world->size(), me = world->rank();
  std::vector<int> evens;
  for (int r = 0; r < n; r += 2) evens.push_back(r);
  auto group = world->new_group(evens);
  if (me % 2 != 0) {
    EXPECT_EQ(group, nullptr);
  } else {
    ASSERT_NE(group, nullptr);
    EXPECT_EQ(group->size(), static_cast<int>(evens.size()));
    EXPECT_EQ(group->rank(), me / 2);
    EXPECT_EQ(group->world_ranks(), evens);
    Tensor t = Tensor::from_floats({static_cast<float>(me)}, {1});
    group->all_reduce(ctx, t, ReduceOp::Sum);
    float want = 0;
    for (int r : evens) want += static_cast<float>(r);
    EXPECT_EQ(t.to_floats()[0], want);
  }
  // Reversed order: ranks follow the list.
  std::vector<int> all;
  for (int r = n - 1; r >= 0; --r) all.push_back(r);
  auto reversed = world->new_group(all);
  ASSERT_NE(reversed, nullptr);
  EXPECT_EQ(reversed->rank(), n - 1 - me);
  EXPECT_EQ(reversed->world_ranks(), all);
  EXPECT_THROW(world->new_group({0, 0}), Error);
}

TEST(DistCollectives, ParallelGridBuildsTheGroupsOfEveryLayout) {
  auto world = test_world();
  Context ctx = Context::cpu();
  const int n = world->size(), me = world->rank();
  for (int tp = 1; tp <= n; ++tp) {
    if (n % tp) continue;
    for (int pp = 1; pp * tp <= n; ++pp) {
      if (n % (tp * pp)) continue;
      dist::ParallelGrid grid(ctx, world, {.data = 0, .tensor = tp, .pipeline = pp});
      const int dp = n / (tp * pp);
      ASSERT_EQ(grid.data_size(), dp);
      EXPECT_EQ(grid.world_rank_of(grid.data_rank(), grid.tensor_rank(), grid.pipeline_rank()), me);
      EXPECT_EQ(grid.tensor->size(), tp);
      EXPECT_EQ(grid.data->size(), dp);
      EXPECT_EQ(grid.pipeline->size(), pp);
      EXPECT_EQ(grid.tensor->rank(), grid.tensor_rank());
      EXPECT_EQ(grid.data->rank(), grid.data_rank());
      for (int t = 0; t < tp; ++t)
        EXPECT_EQ(grid.tensor->world_ranks()[static_cast<size_t>(t)],
                  grid.world_rank_of(grid.data_rank(), t, grid.pipeline_rank()));
      for (int d = 0; d < dp; ++d)
        EXPECT_EQ(grid.data->world_ranks()[static_cast<size_t>(d)],
                  grid.world_rank_of(d, grid.tensor_rank(), grid.pipeline_rank()));
      const nn::ParallelContext pc = grid.context();
      EXPECT_EQ(pc.tensor_size, tp);
      EXPECT_EQ(pc.data_rank, grid.data_rank());
      EXPECT_EQ(pc.tensor_group, grid.tensor);
      // A sum over the tensor group adds the world ranks of its members.
      Tensor t = Tensor::from_floats({static_cast<float>(me)}, {1});
      grid.tensor->all_reduce(ctx, t, ReduceOp::Sum);
      float want = 0;
      for (int r : grid.tensor->world_ranks()) want += static_cast<float>(r);
      EXPECT_EQ(t.to_floats()[0], want);
    }
  }
  EXPECT_THROW(dist::ParallelGrid(ctx, world, {.data = n + 1, .tensor = 1, .pipeline = 1}), Error);
}

TEST(DistCollectives, RanksThatDisagreeAllStopWithTheSameError) {
  auto world = test_world();
  Context ctx = Context::cpu();
  EXPECT_NO_THROW(dist::check_consistent(ctx, *world, 42, "a value"));
  if (world->size() == 1) return;
  try {
    dist::check_consistent(ctx, *world, world->rank() == world->size() - 1 ? 7 : 42, "the model config");
    ADD_FAILURE() << "no error on rank " << world->rank();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("ranks disagree on the model config"), std::string::npos) << e.what();
  }
  // Grids with different sizes on different ranks are refused on every rank.
  if (world->size() % 2 == 0) {
    const int tp = world->rank() == 0 ? 1 : 2;
    EXPECT_THROW(dist::ParallelGrid(ctx, world, {.data = 0, .tensor = tp, .pipeline = 1}), Error);
  }
}

TEST(DistCollectives, LocalGroupIsAWorldOfOne) {
  auto g = dist::local_group();
  Context ctx = Context::cpu();
  EXPECT_EQ(g->size(), 1);
  EXPECT_STREQ(g->backend(), "local");
  Tensor t = Tensor::from_floats({1, 2, 3}, {3});
  g->all_reduce(ctx, t, ReduceOp::Avg);
  EXPECT_EQ(t.to_floats(), (std::vector<float>{1, 2, 3}));
  Tensor out = Tensor::empty({3}, DType::F32);
  g->all_gather(ctx, t, out);
  EXPECT_EQ(out.to_floats(), t.to_floats());
  g->reduce_scatter(ctx, t, out);
  EXPECT_EQ(out.to_floats(), t.to_floats());
  EXPECT_EQ(g->split(-1, 0), nullptr);
  EXPECT_NE(g->new_group({0}), nullptr);
}

TEST(DistCollectives, CpuTensorsOnlyOnMpiAndNcclSaysWhenAbsent) {
  if (!dist::nccl_available()) {
    Context ctx = Context::cpu();
    EXPECT_THROW(dist::nccl_group(ctx, *dist::local_group(), 0), Error);
  }
  SUCCEED();
}

TEST(DistCollectives, ParallelConfigReadsTheConfigBlock) {
  const auto c = dist::ParallelConfig::from_json(
      nlohmann::json::parse(R"({"data": 2, "tensor": 4, "pipeline": 1, "sequence_parallel": true, "bucket_mb": 8})"));
  EXPECT_EQ(c.data, 2);
  EXPECT_EQ(c.tensor, 4);
  EXPECT_EQ(c.pipeline, 1);
  EXPECT_TRUE(c.sequence_parallel);
  EXPECT_EQ(c.bucket_mb, 8u);
  EXPECT_EQ(dist::ParallelConfig::from_json(nlohmann::json::object()).data, 0);
  // tp_comm_overlap: off by default, read, written back.
  EXPECT_FALSE(c.tp_comm_overlap);
  const auto overlap =
      dist::ParallelConfig::from_json(nlohmann::json::parse(R"({"tensor": 2, "tp_comm_overlap": true})"));
  EXPECT_TRUE(overlap.tp_comm_overlap);
  EXPECT_TRUE(overlap.to_json().at("tp_comm_overlap").get<bool>());
  EXPECT_TRUE(dist::ParallelConfig::from_json(overlap.to_json()).tp_comm_overlap);
  auto message = [](const char* text) {
    try {
      dist::ParallelConfig::from_json(nlohmann::json::parse(text));
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message(R"({"tensr": 2})").find("unknown key \"tensr\""), std::string::npos);
  EXPECT_NE(message(R"({"tensor": 0})").find("parallel.tensor"), std::string::npos);
  EXPECT_NE(message(R"({"data": "two"})").find("parallel.data"), std::string::npos);
  EXPECT_NE(message(R"({"sequence_parallel": 1})").find("sequence_parallel"), std::string::npos);
  EXPECT_NE(message(R"({"tp_comm_overlap": "yes"})").find("parallel.tp_comm_overlap"), std::string::npos);
  // An unknown key's message lists the known ones, tp_comm_overlap among them.
  EXPECT_NE(message(R"({"tp_overlap": true})").find("tp_comm_overlap"), std::string::npos);
}
