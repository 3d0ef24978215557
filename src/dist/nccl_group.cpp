// The NCCL backend (see tessera/dist/nccl_group.h). Without TESSERA_WITH_NCCL the entry
// points say so.
#include "tessera/dist/nccl_group.h"

#include "tessera/dist/watchdog.h"
#include "tessera/core/stream.h"

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <thread>

#if TESSERA_WITH_NCCL
#include <cuda_runtime.h>
#include <nccl.h>
#endif

namespace tessera::dist {

#if !TESSERA_WITH_NCCL

bool nccl_available() { return false; }
GroupPtr nccl_group(Context&, ProcessGroup&, int) {
  TESSERA_FAIL("nccl_group: this build of tessera has no NCCL (needs the CUDA backend and nccl.h / libnccl)");
}
GroupPtr nccl_group_from_file(int, int, const std::string&, int, double) {
  TESSERA_FAIL("nccl_group_from_file: this build of tessera has no NCCL");
}

#else

#define TESSERA_NCCL_CHECK(call)                                                                    \
  do {                                                                                              \
    ncclResult_t nccl_status_ = (call);                                                             \
    if (nccl_status_ != ncclSuccess)                                                                \
      TESSERA_FAIL(#call, " failed: ", ncclGetErrorString(nccl_status_), " (", ncclGetLastError(nullptr), ")"); \
  } while (0)

#define TESSERA_NCCL_CUDA_CHECK(call)                                                    \
  do {                                                                                   \
    cudaError_t cuda_status_ = (call);                                                   \
    if (cuda_status_ != cudaSuccess) TESSERA_FAIL(#call, " failed: ", cudaGetErrorString(cuda_status_)); \
  } while (0)

namespace {

ncclDataType_t nccl_type(DType t, const char* op) {
  switch (t) {
    case DType::F64: return ncclFloat64;
    case DType::F32: return ncclFloat32;
    case DType::F16: return ncclFloat16;
    case DType::BF16: return ncclBfloat16;
    case DType::I64: return ncclInt64;
    case DType::I32: return ncclInt32;
    case DType::U8: return ncclUint8;
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 24, 0)
    case DType::E4M3: return ncclFloat8e4m3;
    case DType::E5M2: return ncclFloat8e5m2;
#endif
    default: TESSERA_FAIL(op, ": NCCL has no type for ", dtype_name(t));
  }
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return ncclSum;
    case ReduceOp::Avg: return ncclAvg;
    case ReduceOp::Max: return ncclMax;
    case ReduceOp::Min: return ncclMin;
  }
  return ncclSum;
}

cudaStream_t stream_of(const Context& ctx) { return static_cast<cudaStream_t>(ctx.stream); }

// all_reduce_async's handle: `reduced` is recorded on the communication stream after the
// reduction. wait() queues a wait for it on the caller's stream (no host synchronisation);
// a handle dropped without wait() still orders the caller's stream, so that nothing queued
// later can read or reuse the tensor while it is being reduced.
class NcclWork final : public Work {
 public:
  NcclWork(cudaEvent_t reduced, cudaStream_t caller) : reduced_(reduced), caller_(caller) {}
  ~NcclWork() override {
    if (!waited_) cudaStreamWaitEvent(caller_, reduced_, 0);
    cudaEventDestroy(reduced_);  // safe while pending: CUDA releases it once it completes
  }
  void wait() override {
    if (waited_) return;
    TESSERA_NCCL_CUDA_CHECK(cudaStreamWaitEvent(caller_, reduced_, 0));
    waited_ = true;
  }
  bool completed() const override { return cudaEventQuery(reduced_) != cudaErrorNotReady; }

 private:
  cudaEvent_t reduced_;
  cudaStream_t caller_;
  bool waited_ = false;
};

class NcclGroup final : public ProcessGroup {
 public:
  // Takes ownership of `comm`. `world_ranks` in this group's rank order.
  NcclGroup(ncclComm_t comm, int device, std::vector<int> world_ranks, GroupPtr bootstrap)
      : comm_(comm), device_(device), bootstrap_(std::move(bootstrap)) {
    TESSERA_NCCL_CHECK(ncclCommUserRank(comm_, &rank_));
    TESSERA_NCCL_CHECK(ncclCommCount(comm_, &size_));
    world_ranks_ = std::move(world_ranks);
    if (world_ranks_.size() != static_cast<size_t>(size_)) {
      world_ranks_.resize(static_cast<size_t>(size_));
      for (int i = 0; i < size_; ++i) world_ranks_[static_cast<size_t>(i)] = i;
    }
    // On a timeout the watchdog aborts the communicator, so that no kernel keeps waiting
    // for a peer that is gone (see watchdog.h).
    abort_hook_ = add_abort_hook([comm = comm_] { ncclCommAbort(comm); });
  }
  ~NcclGroup() override {
    remove_abort_hook(abort_hook_);
    if (comm_stream_ != nullptr) {
      cudaStreamSynchronize(comm_stream_);  // no reduction may outlive the communicator
      cudaStreamDestroy(comm_stream_);
    }
    if (comm_ != nullptr) ncclCommDestroy(comm_);
  }
  const char* backend() const override { return "nccl"; }

  void all_reduce(Context& ctx, Tensor& t, ReduceOp op) override {
    check(ctx, t, "all_reduce", "tensor");
    TESSERA_NCCL_CHECK(ncclAllReduce(t.raw_data(), t.raw_data(), static_cast<size_t>(t.numel()),
                                     nccl_type(t.dtype(), "all_reduce"), nccl_op(op), comm_, stream_of(ctx)));
    watch(ctx, "all_reduce");
  }
  // The asynchronous collectives run on the group's own communication stream, so that they
  // run beside the computation queued on ctx.stream after them (the rest of backward)
  // instead of behind it. Their tensors must stay alive and untouched until wait().
  std::unique_ptr<Work> all_reduce_async(Context& ctx, Tensor& t, ReduceOp op) override {
    check(ctx, t, "all_reduce_async", "tensor");
    return on_comm_stream(ctx, "all_reduce", [&](cudaStream_t comm) {
      TESSERA_NCCL_CHECK(ncclAllReduce(t.raw_data(), t.raw_data(), static_cast<size_t>(t.numel()),
                                       nccl_type(t.dtype(), "all_reduce"), nccl_op(op), comm_, comm));
    });
  }
  std::unique_ptr<Work> reduce_scatter_async(Context& ctx, const Tensor& in, Tensor& out, ReduceOp op) override {
    check(ctx, in, "reduce_scatter_async", "in");
    check(ctx, out, "reduce_scatter_async", "out");
    TESSERA_CHECK(in.dtype() == out.dtype() && in.numel() == out.numel() * size_, "reduce_scatter_async: in ",
                  in.describe(), " must hold ", size_, " x out ", out.describe());
    return on_comm_stream(ctx, "reduce_scatter", [&](cudaStream_t comm) {
      TESSERA_NCCL_CHECK(ncclReduceScatter(in.raw_data(), out.raw_data(), static_cast<size_t>(out.numel()),
                                           nccl_type(in.dtype(), "reduce_scatter"), nccl_op(op), comm_, comm));
    });
  }
  std::unique_ptr<Work> all_gather_async(Context& ctx, const Tensor& in, Tensor& out) override {
    check(ctx, in, "all_gather_async", "in");
    check(ctx, out, "all_gather_async", "out");
    TESSERA_CHECK(in.dtype() == out.dtype() && out.numel() == in.numel() * size_, "all_gather_async: out ",
                  out.describe(), " must hold ", size_, " x in ", in.describe());
    return on_comm_stream(ctx, "all_gather", [&](cudaStream_t comm) {
      TESSERA_NCCL_CHECK(ncclAllGather(in.raw_data(), out.raw_data(), in.nbytes(), ncclUint8, comm_, comm));
    });
  }
  void reduce_scatter(Context& ctx, const Tensor& in, Tensor& out, ReduceOp op) override {
    check(ctx, in, "reduce_scatter", "in");
    check(ctx, out, "reduce_scatter", "out");
    TESSERA_CHECK(in.dtype() == out.dtype() && in.numel() == out.numel() * size_, "reduce_scatter: in ",
                  in.describe(), " must hold ", size_, " x out ", out.describe());
    TESSERA_NCCL_CHECK(ncclReduceScatter(in.raw_data(), out.raw_data(), static_cast<size_t>(out.numel()),
                                         nccl_type(in.dtype(), "reduce_scatter"), nccl_op(op), comm_, stream_of(ctx)));
    watch(ctx, "reduce_scatter");
  }
  void all_gather(Context& ctx, const Tensor& in, Tensor& out) override {
    check(ctx, in, "all_gather", "in");
    check(ctx, out, "all_gather", "out");
    TESSERA_CHECK(in.dtype() == out.dtype() && out.numel() == in.numel() * size_, "all_gather: out ", out.describe(),
                  " must hold ", size_, " x in ", in.describe());
    TESSERA_NCCL_CHECK(ncclAllGather(in.raw_data(), out.raw_data(), in.nbytes(), ncclUint8, comm_, stream_of(ctx)));
    watch(ctx, "all_gather");
  }
  void broadcast(Context& ctx, Tensor& t, int root) override {
    check(ctx, t, "broadcast", "tensor");
    TESSERA_CHECK(root >= 0 && root < size_, "broadcast: root ", root, " is outside a group of ", size_);
    TESSERA_NCCL_CHECK(ncclBroadcast(t.raw_data(), t.raw_data(), t.nbytes(), ncclUint8, root, comm_, stream_of(ctx)));
    watch(ctx, "broadcast");
  }
  void all_to_all(Context& ctx, const Tensor& in, Tensor& out, const std::vector<int64_t>& in_splits,
                  const std::vector<int64_t>& out_splits) override {
    check(ctx, in, "all_to_all", "in");
    check(ctx, out, "all_to_all", "out");
    TESSERA_CHECK(in.dtype() == out.dtype() && in.dim() >= 1 && out.dim() >= 1, "all_to_all: bad tensors");
    TESSERA_CHECK(in_splits.size() == static_cast<size_t>(size_) && out_splits.size() == static_cast<size_t>(size_),
                  "all_to_all: need ", size_, " splits");
    const size_t rb = in.size(0) ? in.nbytes() / static_cast<size_t>(in.size(0))
                                 : (out.size(0) ? out.nbytes() / static_cast<size_t>(out.size(0)) : 0);
    size_t s = 0, r = 0;
    for (int p = 0; p < size_; ++p) {
      s += static_cast<size_t>(in_splits[static_cast<size_t>(p)]) * rb;
      r += static_cast<size_t>(out_splits[static_cast<size_t>(p)]) * rb;
    }
    TESSERA_CHECK(s == in.nbytes() && r == out.nbytes(), "all_to_all: splits do not cover in / out");
    auto* src = static_cast<char*>(in.raw_data());
    auto* dst = static_cast<char*>(out.raw_data());
    TESSERA_NCCL_CHECK(ncclGroupStart());
    for (int p = 0; p < size_; ++p) {
      const size_t sn = static_cast<size_t>(in_splits[static_cast<size_t>(p)]) * rb;
      const size_t rn = static_cast<size_t>(out_splits[static_cast<size_t>(p)]) * rb;
      if (sn) TESSERA_NCCL_CHECK(ncclSend(src, sn, ncclUint8, p, comm_, stream_of(ctx)));
      if (rn) TESSERA_NCCL_CHECK(ncclRecv(dst, rn, ncclUint8, p, comm_, stream_of(ctx)));
      src += sn;
      dst += rn;
    }
    TESSERA_NCCL_CHECK(ncclGroupEnd());
    watch(ctx, "all_to_all");
  }
  void send(Context& ctx, const Tensor& t, int dst) override {
    check(ctx, t, "send", "tensor");
    TESSERA_NCCL_CHECK(ncclSend(t.raw_data(), t.nbytes(), ncclUint8, dst, comm_, stream_of(ctx)));
    watch(ctx, "send");
  }
  void recv(Context& ctx, Tensor& t, int src) override {
    check(ctx, t, "recv", "tensor");
    TESSERA_NCCL_CHECK(ncclRecv(t.raw_data(), t.nbytes(), ncclUint8, src, comm_, stream_of(ctx)));
    watch(ctx, "recv");
  }
  void barrier() override {
    TESSERA_NCCL_CUDA_CHECK(cudaSetDevice(device_));
    if (!scratch_.defined()) scratch_ = Tensor::zeros({1}, DType::F32, Device::cuda(device_));
    // On the run's current stream: the legacy stream would not wait for work queued on a
    // non-blocking one (the trainer's), so the barrier would not order anything.
    auto stream = static_cast<cudaStream_t>(current_stream(Device::cuda(device_)));
    TESSERA_NCCL_CHECK(ncclAllReduce(scratch_.raw_data(), scratch_.raw_data(), 1, ncclFloat32, ncclSum, comm_, stream));
    BlockingScope scope("NCCL barrier", this);
    TESSERA_NCCL_CUDA_CHECK(cudaStreamSynchronize(stream));
  }

  std::shared_ptr<ProcessGroup> split(int color, int key) override {
    ncclComm_t sub = nullptr;
    TESSERA_NCCL_CHECK(ncclCommSplit(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &sub, nullptr));
    // The members' world ranks: from the bootstrap group's own split when there is one.
    GroupPtr sub_bootstrap = bootstrap_ ? bootstrap_->split(color, key) : nullptr;
    if (sub == nullptr) return nullptr;
    std::vector<int> ranks = sub_bootstrap ? sub_bootstrap->world_ranks() : std::vector<int>{};
    return std::make_shared<NcclGroup>(sub, device_, std::move(ranks), sub_bootstrap);
  }

 private:
  void check(const Context& ctx, const Tensor& t, const char* op, const char* name) const {
    check_defined(t, op, name);
    check_contiguous(t, op, name);
    TESSERA_CHECK(t.device() == Device::cuda(device_), op, ": the NCCL group lives on cuda:", device_, ", ", name,
                  " is ", t.describe());
    TESSERA_CHECK(ctx.device == t.device(), op, ": ctx is on ", ctx.device.to_string(), ", ", name, " on ",
                  t.device().to_string());
  }

  // The communication stream of all_reduce_async, made on first use. Non-blocking (the
  // legacy stream must not order it) and of the highest priority, so that its kernels get
  // SMs as soon as the compute kernels ahead of them leave some, as Megatron and PyTorch DDP
  // give theirs.
  cudaStream_t comm_stream() {
    if (comm_stream_ == nullptr) {
      TESSERA_NCCL_CUDA_CHECK(cudaSetDevice(device_));
      int least = 0, greatest = 0;
      TESSERA_NCCL_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
      TESSERA_NCCL_CUDA_CHECK(cudaStreamCreateWithPriority(&comm_stream_, cudaStreamNonBlocking, greatest));
    }
    return comm_stream_;
  }
  // Queues `collective(comm)` on the communication stream after what ctx.stream has queued
  // so far (the producer of its tensors); the handle's wait() makes ctx.stream wait for it.
  template <typename Collective>
  std::unique_ptr<Work> on_comm_stream(Context& ctx, const char* op, Collective&& collective) {
    cudaStream_t comm = comm_stream();
    cudaEvent_t produced = make_event();
    TESSERA_NCCL_CUDA_CHECK(cudaEventRecord(produced, stream_of(ctx)));
    TESSERA_NCCL_CUDA_CHECK(cudaStreamWaitEvent(comm, produced, 0));
    TESSERA_NCCL_CUDA_CHECK(cudaEventDestroy(produced));  // the wait above is already queued
    collective(comm);
    watch(comm, op);
    cudaEvent_t done = make_event();
    TESSERA_NCCL_CUDA_CHECK(cudaEventRecord(done, comm));
    return std::make_unique<NcclWork>(done, stream_of(ctx));
  }
  static cudaEvent_t make_event() {
    cudaEvent_t event = nullptr;
    TESSERA_NCCL_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    return event;
  }

  // With a timeout set: a CUDA event after the collective, which the watchdog polls.
  void watch(const Context& ctx, const char* op) const { watch(stream_of(ctx), op); }
  void watch(cudaStream_t stream, const char* op) const {
    if (timeout() <= 0) return;
    cudaEvent_t event = nullptr;
    if (cudaEventCreateWithFlags(&event, cudaEventDisableTiming) != cudaSuccess ||
        cudaEventRecord(event, stream) != cudaSuccess) {
      (void)cudaGetLastError();  // unwatched, not an error of the collective
      if (event != nullptr) cudaEventDestroy(event);
      return;
    }
    watch_async(std::string("NCCL ") + op + " over " + std::to_string(size_) + " ranks",
                [event] { return cudaEventQuery(event) != cudaErrorNotReady; }, [event] { cudaEventDestroy(event); });
  }

  ncclComm_t comm_ = nullptr;
  cudaStream_t comm_stream_ = nullptr;
  long abort_hook_ = -1;
  int device_ = 0;
  GroupPtr bootstrap_;  // CPU group with the same members, for world ranks of sub-groups
  Tensor scratch_;
};

GroupPtr make_group(const ncclUniqueId& id, int rank, int size, int device, std::vector<int> world_ranks,
                    GroupPtr bootstrap) {
  TESSERA_NCCL_CUDA_CHECK(cudaSetDevice(device));
  ncclComm_t comm = nullptr;
  TESSERA_NCCL_CHECK(ncclCommInitRank(&comm, size, id, rank));
  return std::make_shared<NcclGroup>(comm, device, std::move(world_ranks), std::move(bootstrap));
}

}  // namespace

bool nccl_available() { return true; }

GroupPtr nccl_group(Context& ctx, ProcessGroup& bootstrap, int device) {
  (void)ctx;
  ncclUniqueId id{};
  if (bootstrap.rank() == 0) TESSERA_NCCL_CHECK(ncclGetUniqueId(&id));
  Tensor bytes = Tensor::wrap(&id, {static_cast<int64_t>(sizeof id)}, DType::U8);
  Context cpu = Context::cpu();
  bootstrap.broadcast(cpu, bytes, 0);
  // A CPU twin of the bootstrap group keeps world ranks for the sub-groups' splits.
  GroupPtr twin = bootstrap.split(0, bootstrap.rank());
  return make_group(id, bootstrap.rank(), bootstrap.size(), device, bootstrap.world_ranks(), twin);
}

GroupPtr nccl_group_from_file(int rank, int size, const std::string& path, int device, double timeout_s) {
  TESSERA_CHECK(size >= 1 && rank >= 0 && rank < size, "nccl_group_from_file: rank ", rank, " of ", size);
  ncclUniqueId id{};
  namespace fs = std::filesystem;
  if (rank == 0) {
    TESSERA_NCCL_CHECK(ncclGetUniqueId(&id));
    // Written beside, then renamed: a reader never sees half an id.
    const std::string tmp = path + ".tmp";
    {
      std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
      TESSERA_CHECK(out.good(), "nccl_group_from_file: cannot write ", tmp);
      out.write(reinterpret_cast<const char*>(&id), sizeof id);
    }
    fs::rename(tmp, path);
  } else {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    for (;;) {
      std::error_code ec;
      if (fs::exists(path, ec) && fs::file_size(path, ec) == sizeof id) break;
      TESSERA_CHECK(std::chrono::steady_clock::now() < deadline, "nccl_group_from_file: rank 0 did not write ", path,
                    " within ", timeout_s, " s");
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    std::ifstream in(path, std::ios::binary);
    in.read(reinterpret_cast<char*>(&id), sizeof id);
    TESSERA_CHECK(in.gcount() == sizeof id, "nccl_group_from_file: short read of ", path);
  }
  std::vector<int> ranks(static_cast<size_t>(size));
  for (int i = 0; i < size; ++i) ranks[static_cast<size_t>(i)] = i;
  return make_group(id, rank, size, device, std::move(ranks), nullptr);
}

#endif  // TESSERA_WITH_NCCL

}  // namespace tessera::dist
