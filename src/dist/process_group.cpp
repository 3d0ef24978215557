// The backend-independent parts of dist/: the world of one, choosing the world group from
// the environment, sub-groups from rank lists, and the cross-rank consistency check.
#include "tessera/dist/process_group.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "tessera/dist/parallel_grid.h"
#include "tessera/dist/tcp_group.h"
#include "tessera/dist/watchdog.h"

#include <nlohmann/json.hpp>

#if TESSERA_WITH_MPI
#include "mpi_group.h"
#endif

namespace tessera::dist {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Avg: return "avg";
    case ReduceOp::Max: return "max";
    case ReduceOp::Min: return "min";
  }
  return "?";
}

std::unique_ptr<Work> ProcessGroup::all_reduce_async(Context& ctx, Tensor& tensor, ReduceOp op) {
  all_reduce(ctx, tensor, op);
  return std::make_unique<Work>();
}

std::unique_ptr<Work> ProcessGroup::reduce_scatter_async(Context& ctx, const Tensor& in, Tensor& out, ReduceOp op) {
  reduce_scatter(ctx, in, out, op);
  return std::make_unique<Work>();
}

std::unique_ptr<Work> ProcessGroup::all_gather_async(Context& ctx, const Tensor& in, Tensor& out) {
  all_gather(ctx, in, out);
  return std::make_unique<Work>();
}

std::shared_ptr<ProcessGroup> ProcessGroup::new_group(const std::vector<int>& ranks) {
  int position = -1;
  std::vector<bool> seen(static_cast<size_t>(size_), false);
  for (size_t i = 0; i < ranks.size(); ++i) {
    TESSERA_CHECK(ranks[i] >= 0 && ranks[i] < size_, "new_group: rank ", ranks[i], " is outside a group of ", size_);
    TESSERA_CHECK(!seen[static_cast<size_t>(ranks[i])], "new_group: rank ", ranks[i], " is listed twice");
    seen[static_cast<size_t>(ranks[i])] = true;
    if (ranks[i] == rank_) position = static_cast<int>(i);
  }
  return split(position >= 0 ? 0 : -1, position);
}

namespace {

// Shape rules shared by the backends' argument checks.
void check_rows(const Tensor& in, const Tensor& out, int64_t in_factor, int64_t out_factor, const char* op) {
  check_defined(in, op, "in");
  check_defined(out, op, "out");
  check_contiguous(in, op, "in");
  check_contiguous(out, op, "out");
  TESSERA_CHECK(in.dtype() == out.dtype(), op, ": in and out dtypes differ (", dtype_name(in.dtype()), " vs ",
                dtype_name(out.dtype()), ")");
  TESSERA_CHECK(in.numel() * out_factor == out.numel() * in_factor, op, ": in ", in.shape_string(), " and out ",
                out.shape_string(), " do not match a group of ", in_factor * out_factor);
}

class LocalGroup final : public ProcessGroup {
 public:
  const char* backend() const override { return "local"; }
  void all_reduce(Context&, Tensor& tensor, ReduceOp) override { check_defined(tensor, "all_reduce", "tensor"); }
  void reduce_scatter(Context&, const Tensor& in, Tensor& out, ReduceOp) override {
    check_rows(in, out, 1, 1, "reduce_scatter");
    if (!in.shares_storage(out) || in.offset() != out.offset()) out.copy_from(in.reshape(out.shape()));
  }
  void all_gather(Context&, const Tensor& in, Tensor& out) override {
    check_rows(in, out, 1, 1, "all_gather");
    if (!in.shares_storage(out) || in.offset() != out.offset()) out.copy_from(in.reshape(out.shape()));
  }
  void broadcast(Context&, Tensor& tensor, int root) override {
    TESSERA_CHECK(root == 0, "broadcast: root ", root, " is outside a group of 1");
    check_defined(tensor, "broadcast", "tensor");
  }
  void all_to_all(Context&, const Tensor& in, Tensor& out, const std::vector<int64_t>& in_splits,
                  const std::vector<int64_t>& out_splits) override {
    TESSERA_CHECK(in_splits.size() == 1 && out_splits.size() == 1 && in_splits[0] == out_splits[0] &&
                      in.dim() > 0 && in_splits[0] == in.size(0),
                  "all_to_all: a group of 1 needs one split equal to the rows of in");
    check_rows(in, out, 1, 1, "all_to_all");
    out.copy_from(in.reshape(out.shape()));
  }
  void send(Context&, const Tensor&, int dst) override { TESSERA_FAIL("send: no rank ", dst, " in a group of 1"); }
  void recv(Context&, Tensor&, int src) override { TESSERA_FAIL("recv: no rank ", src, " in a group of 1"); }
  void barrier() override {}
  std::shared_ptr<ProcessGroup> split(int color, int) override {
    if (color < 0) return nullptr;
    return std::make_shared<LocalGroup>();
  }
};

std::mutex world_mutex;
GroupPtr world_group;

bool env_set(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] != '\0';
}

}  // namespace

GroupPtr local_group() { return std::make_shared<LocalGroup>(); }

bool mpi_available() { return TESSERA_WITH_MPI != 0; }

bool launched_by_mpi() {
  // Open MPI, MPICH / Intel MPI (Hydra's PMI), PMIx launchers (srun --mpi=pmix, prterun).
  return env_set("OMPI_COMM_WORLD_SIZE") || env_set("PMI_SIZE") || env_set("PMIX_RANK") ||
         env_set("MPI_LOCALNRANKS");
}

static int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  TESSERA_CHECK(end != v && *end == '\0' && n >= 0 && n <= (1 << 30), name, "=", v, " is not a non-negative integer");
  return static_cast<int>(n);
}

GroupPtr init_from_env() {
  std::lock_guard<std::mutex> lock(world_mutex);
  if (world_group) return world_group;
  if (launched_by_mpi()) {
#if TESSERA_WITH_MPI
    world_group = detail::mpi_world();
    set_message_rank(world_group->rank());
    return world_group;
#else
    const char* n = std::getenv("OMPI_COMM_WORLD_SIZE");
    if (n == nullptr) n = std::getenv("PMI_SIZE");
    TESSERA_CHECK(n == nullptr || std::atoi(n) <= 1, "launched by an MPI launcher with ", n,
                  " ranks, but this build of tessera has no MPI (reconfigure with MPI installed, TESSERA_MPI=ON, ",
                  "or start the ranks with `tessera launch --nproc ", n, "`)");
#endif
  } else if (const int size = env_int("WORLD_SIZE", 1); size > 1) {
    TESSERA_CHECK(env_set("RANK"), "WORLD_SIZE=", size, " but RANK is not set (each process needs its rank)");
    const int rank = env_int("RANK", 0);
    TESSERA_CHECK(rank < size, "RANK=", rank, " is outside WORLD_SIZE=", size);
    const char* addr = std::getenv("MASTER_ADDR");
    const int port = env_int("MASTER_PORT", 29500);
    const double wait = timeout() > 0 ? timeout() : 300;
    set_message_rank(rank);
    world_group = tcp_group(rank, size, addr != nullptr && *addr != '\0' ? addr : "127.0.0.1", port, wait);
    return world_group;
  }
  world_group = local_group();
  return world_group;
}

GroupPtr world() { return init_from_env(); }

void finalize() {
  std::lock_guard<std::mutex> lock(world_mutex);
  world_group.reset();
#if TESSERA_WITH_MPI
  detail::mpi_finalize();
#endif
}

void abort_job(int status) {
#if TESSERA_WITH_MPI
  std::lock_guard<std::mutex> lock(world_mutex);
  if (world_group && world_group->size() > 1 && std::string(world_group->backend()) == "mpi") {
    std::fflush(stdout);
    std::fflush(stderr);
    detail::mpi_abort(status);
  }
#else
  (void)status;
#endif
}

int local_rank() {
  for (const char* name : {"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"})
    if (env_set(name)) return env_int(name, 0);
  return 0;
}

namespace {

void check_host_group(const ProcessGroup& group, const char* op) {
  TESSERA_CHECK(std::string(group.backend()) != "nccl", op, ": needs a group of CPU transport (mpi, tcp or local), ",
                "not nccl");
}

}  // namespace

std::string broadcast_string(ProcessGroup& group, const std::string& s, int root) {
  check_host_group(group, "broadcast_string");
  if (group.size() == 1) return s;
  Context cpu = Context::cpu();
  Tensor length = Tensor::from_ints({static_cast<int64_t>(s.size())}, {1}, DType::I64);
  group.broadcast(cpu, length, root);
  const int64_t n = length.to_ints()[0];
  Tensor bytes = Tensor::zeros({std::max<int64_t>(n, 1)}, DType::U8);
  if (group.rank() == root && n > 0) std::memcpy(bytes.raw_data(), s.data(), static_cast<size_t>(n));
  group.broadcast(cpu, bytes, root);
  return std::string(static_cast<const char*>(bytes.raw_data()), static_cast<size_t>(n));
}

std::vector<std::string> all_gather_strings(ProcessGroup& group, const std::string& s) {
  check_host_group(group, "all_gather_strings");
  if (group.size() == 1) return {s};
  Context cpu = Context::cpu();
  Tensor mine = Tensor::from_ints({static_cast<int64_t>(s.size())}, {1}, DType::I64);
  Tensor lengths = Tensor::empty({group.size()}, DType::I64);
  group.all_gather(cpu, mine, lengths);
  const std::vector<int64_t> n = lengths.to_ints();
  const int64_t longest = std::max<int64_t>(1, *std::max_element(n.begin(), n.end()));
  Tensor padded = Tensor::zeros({longest}, DType::U8);
  if (!s.empty()) std::memcpy(padded.raw_data(), s.data(), s.size());
  Tensor all = Tensor::empty({group.size() * longest}, DType::U8);
  group.all_gather(cpu, padded, all);
  std::vector<std::string> out;
  const char* base = static_cast<const char*>(all.raw_data());
  for (int r = 0; r < group.size(); ++r)
    out.emplace_back(base + static_cast<int64_t>(r) * longest, static_cast<size_t>(n[static_cast<size_t>(r)]));
  return out;
}

uint64_t hash_bytes(const void* data, size_t bytes, uint64_t seed) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t h = seed;
  for (size_t i = 0; i < bytes; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h;
}

uint64_t hash_string(const std::string& s, uint64_t seed) { return hash_bytes(s.data(), s.size(), seed); }

void check_consistent(Context& ctx, ProcessGroup& group, uint64_t value, const std::string& what) {
  if (group.size() == 1) return;
  Tensor mine = Tensor::from_ints({static_cast<int64_t>(value)}, {1}, DType::I64).to(ctx.device);
  Tensor all = Tensor::empty({group.size()}, DType::I64, ctx.device);
  group.all_gather(ctx, mine, all);
  synchronize(ctx);  // NCCL: the gather is queued on ctx.stream
  const std::vector<int64_t> values = all.to(Device::cpu()).to_ints();
  for (int r = 1; r < group.size(); ++r) {
    TESSERA_CHECK(values[static_cast<size_t>(r)] == values[0], "ranks disagree on ", what, ": rank ",
                  group.world_ranks()[0], " has ", static_cast<uint64_t>(values[0]), ", rank ",
                  group.world_ranks()[static_cast<size_t>(r)], " has ",
                  static_cast<uint64_t>(values[static_cast<size_t>(r)]), " (every rank stops)");
  }
}

// ---- ParallelGrid ----

namespace {
// JSON text for messages (never throws on bad UTF-8).
std::string safe_dump(const nlohmann::json& j) { return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace); }
}  // namespace

ParallelConfig ParallelConfig::from_json(const nlohmann::json& j) {
  TESSERA_CHECK(j.is_object(), "parallel: expected a mapping of keys, got ", safe_dump(j));
  ParallelConfig c;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& key = it.key();
    const nlohmann::json& v = it.value();
    if (key == "sequence_parallel" || key == "distributed_optimizer" || key == "overlap_grad_reduce" ||
        key == "tp_comm_overlap") {
      TESSERA_CHECK(v.is_boolean(), "parallel.", key, ": expected true or false, got ", safe_dump(v));
      (key == "sequence_parallel"       ? c.sequence_parallel
       : key == "distributed_optimizer" ? c.distributed_optimizer
       : key == "overlap_grad_reduce"   ? c.overlap_grad_reduce
                                        : c.tp_comm_overlap) = v.get<bool>();
      continue;
    }
    if (key == "timeout_s") {
      TESSERA_CHECK(v.is_number() && v.get<double>() >= 0, "parallel.timeout_s: expected a number of seconds >= 0 ",
                    "(0 waits forever), got ", safe_dump(v));
      c.timeout_s = v.get<double>();
      continue;
    }
    TESSERA_CHECK(key == "data" || key == "tensor" || key == "pipeline" || key == "bucket_mb", "parallel: unknown key \"",
                  key, "\" (known: data, tensor, pipeline, sequence_parallel, bucket_mb, distributed_optimizer, timeout_s, ",
                  "overlap_grad_reduce, tp_comm_overlap)");
    // data 0: what is left; bucket_mb 0: a bucket per parameter.
    const int64_t least = key == "data" || key == "bucket_mb" ? 0 : 1;
    TESSERA_CHECK(v.is_number_integer() && v.get<int64_t>() >= least && v.get<int64_t>() <= 1 << 20, "parallel.", key,
                  ": expected an integer >= ", least, ", got ", safe_dump(v));
    const int n = v.get<int>();
    if (key == "data") c.data = n;
    if (key == "tensor") c.tensor = n;
    if (key == "pipeline") c.pipeline = n;
    if (key == "bucket_mb") c.bucket_mb = static_cast<size_t>(n);
  }
  return c;
}

nlohmann::json ParallelConfig::to_json() const {
  return {{"data", data},           {"tensor", tensor},
          {"pipeline", pipeline},   {"sequence_parallel", sequence_parallel},
          {"bucket_mb", bucket_mb}, {"distributed_optimizer", distributed_optimizer},
          {"timeout_s", timeout_s}, {"overlap_grad_reduce", overlap_grad_reduce},
          {"tp_comm_overlap", tp_comm_overlap}};
}

ParallelGrid::ParallelGrid(Context& ctx, GroupPtr world_, const ParallelConfig& config)
    : world(std::move(world_)),
      tensor_(config.tensor),
      pipeline_(config.pipeline),
      sequence_parallel_(config.sequence_parallel),
      tp_comm_overlap_(config.tp_comm_overlap) {
  TESSERA_CHECK(world != nullptr, "ParallelGrid: no world group");
  const int n = world->size();
  TESSERA_CHECK(tensor_ >= 1 && pipeline_ >= 1 && config.data >= 0, "ParallelGrid: sizes must be positive, got data ",
                config.data, " tensor ", tensor_, " pipeline ", pipeline_);
  TESSERA_CHECK(n % (tensor_ * pipeline_) == 0, "ParallelGrid: a world of ", n,
                " ranks is not a multiple of tensor x pipeline = ", tensor_ * pipeline_);
  data_ = config.data == 0 ? n / (tensor_ * pipeline_) : config.data;
  TESSERA_CHECK(data_ * tensor_ * pipeline_ == n, "ParallelGrid: data x tensor x pipeline = ", data_, " x ", tensor_,
                " x ", pipeline_, " = ", data_ * tensor_ * pipeline_, ", but the world has ", n, " ranks");
  uint64_t h = hash_bytes(&data_, sizeof data_);
  h = hash_bytes(&tensor_, sizeof tensor_, h);
  h = hash_bytes(&pipeline_, sizeof pipeline_, h);
  h = hash_bytes(&sequence_parallel_, sizeof sequence_parallel_, h);
  h = hash_bytes(&tp_comm_overlap_, sizeof tp_comm_overlap_, h);
  check_consistent(ctx, *world, h, "the parallel layout (data, tensor, pipeline, sequence_parallel, tp_comm_overlap)");

  const int r = world->rank();
  tensor_rank_ = r % tensor_;
  data_rank_ = (r / tensor_) % data_;
  pipeline_rank_ = r / (tensor_ * data_);
  // One split per kind: the color names the group, the key orders its members.
  tensor = world->split(pipeline_rank_ * data_ + data_rank_, tensor_rank_);
  data = world->split(pipeline_rank_ * tensor_ + tensor_rank_, data_rank_);
  pipeline = world->split(data_rank_ * tensor_ + tensor_rank_, pipeline_rank_);
}

int ParallelGrid::world_rank_of(int data_rank, int tensor_rank, int pipeline_rank) const {
  return (pipeline_rank * data_ + data_rank) * tensor_ + tensor_rank;
}

nn::ParallelContext ParallelGrid::context() const {
  nn::ParallelContext p;
  p.data_size = data_;
  p.data_rank = data_rank_;
  p.tensor_size = tensor_;
  p.tensor_rank = tensor_rank_;
  p.pipeline_size = pipeline_;
  p.pipeline_rank = pipeline_rank_;
  p.sequence_parallel = sequence_parallel_ && tensor_ > 1;
  p.tp_comm_overlap = tp_comm_overlap_ && tensor_ > 1;
  p.data_group = data;
  p.tensor_group = tensor;
  p.pipeline_group = pipeline;
  return p;
}

}  // namespace tessera::dist
