// The MPI backend: collectives over CPU tensors.
//
// Reductions are not MPI_Allreduce: MPI chooses its algorithm by message size and rank
// count, and its summation order (hence the rounding) with it. Here every reduction is an
// all-to-all of chunks, a local sum in rank order, and (for all-reduce) an all-gather, so
// each element is always (x0 + x1) + x2 + ... and the result is bitwise the same on every
// rank and in every run. The traffic is that of a reduce-scatter + all-gather ring
// (2 (p-1)/p of the tensor per rank), the bandwidth-optimal amount.
#if TESSERA_WITH_MPI

#include "mpi_group.h"

#include "collective_math.h"
#include "tessera/dist/watchdog.h"

// The C API only: Open MPI's and MPICH's mpi.h otherwise pull in the removed C++ bindings.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <limits>

namespace tessera::dist::detail {
namespace {

#define TESSERA_MPI_CHECK(call)                                                           \
  do {                                                                                    \
    int mpi_status_ = (call);                                                             \
    if (mpi_status_ != MPI_SUCCESS) {                                                     \
      char text_[MPI_MAX_ERROR_STRING];                                                   \
      int length_ = 0;                                                                    \
      MPI_Error_string(mpi_status_, text_, &length_);                                     \
      TESSERA_FAIL(#call, " failed: ", std::string(text_, static_cast<size_t>(length_))); \
    }                                                                                     \
  } while (0)

bool we_initialized = false;

bool mpi_live() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized && !finalized;
}

int to_int(int64_t n, const char* op) {
  TESSERA_CHECK(n >= 0 && n <= INT_MAX, op, ": ", n, " elements exceed MPI's int count; split the tensor");
  return static_cast<int>(n);
}

MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::F64: return MPI_DOUBLE;
    case DType::F32: return MPI_FLOAT;
    case DType::I64: return MPI_INT64_T;
    default: return MPI_BYTE;
  }
}

void check_cpu(const Tensor& t, const char* op, const char* name) { check_cpu_tensor(t, "MPI", op, name); }

class MpiGroup final : public ProcessGroup {
 public:
  MpiGroup(MPI_Comm comm, bool owned) : comm_(comm), owned_(owned) {
    TESSERA_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
    TESSERA_MPI_CHECK(MPI_Comm_size(comm_, &size_));
    MPI_Group group, world_group;
    TESSERA_MPI_CHECK(MPI_Comm_group(comm_, &group));
    TESSERA_MPI_CHECK(MPI_Comm_group(MPI_COMM_WORLD, &world_group));
    std::vector<int> mine(static_cast<size_t>(size_));
    for (int i = 0; i < size_; ++i) mine[static_cast<size_t>(i)] = i;
    world_ranks_.assign(static_cast<size_t>(size_), 0);
    TESSERA_MPI_CHECK(MPI_Group_translate_ranks(group, size_, mine.data(), world_group, world_ranks_.data()));
    MPI_Group_free(&group);
    MPI_Group_free(&world_group);
  }
  ~MpiGroup() override {
    if (owned_ && mpi_live()) MPI_Comm_free(&comm_);
  }
  const char* backend() const override { return "mpi"; }

  void all_reduce(Context&, Tensor& tensor, ReduceOp op) override {
    BlockingScope watch("MPI all_reduce", this);
    check_cpu(tensor, "all_reduce", "tensor");
    if (size_ == 1) return;
    const DType acc = accumulate_dtype(tensor.dtype(), "all_reduce");
    const int64_t n = tensor.numel();
    const int64_t chunk = (n + size_ - 1) / size_;
    // Padded to size * chunk so that every rank owns one equal chunk.
    Tensor send = Tensor::zeros({size_ * chunk}, acc);
    Tensor head = send.slice(0, 0, n);
    convert(tensor.reshape({n}), head);
    Tensor mine = reduce_chunks(send, chunk, op, acc);
    Tensor gathered = Tensor::empty({size_ * chunk}, acc);
    TESSERA_MPI_CHECK(MPI_Allgather(mine.raw_data(), to_int(chunk, "all_reduce"), mpi_type(acc), gathered.raw_data(),
                                    to_int(chunk, "all_reduce"), mpi_type(acc), comm_));
    Tensor flat = tensor.reshape({n});
    convert(gathered.slice(0, 0, n), flat);
  }

  void reduce_scatter(Context&, const Tensor& in, Tensor& out, ReduceOp op) override {
    BlockingScope watch("MPI reduce_scatter", this);
    check_cpu(in, "reduce_scatter", "in");
    check_cpu(out, "reduce_scatter", "out");
    TESSERA_CHECK(in.dtype() == out.dtype() && in.numel() == out.numel() * size_, "reduce_scatter: in ", in.describe(),
                  " must hold ", size_, " x out ", out.describe());
    const DType acc = accumulate_dtype(in.dtype(), "reduce_scatter");
    const int64_t chunk = out.numel();
    Tensor send = Tensor::empty({in.numel()}, acc);
    convert(in.reshape({in.numel()}), send);
    Tensor mine = reduce_chunks(send, chunk, op, acc);
    Tensor flat = out.reshape({chunk});
    convert(mine, flat);
  }

  void all_gather(Context&, const Tensor& in, Tensor& out) override {
    BlockingScope watch("MPI all_gather", this);
    check_cpu(in, "all_gather", "in");
    check_cpu(out, "all_gather", "out");
    TESSERA_CHECK(in.dtype() == out.dtype() && out.numel() == in.numel() * size_, "all_gather: out ", out.describe(),
                  " must hold ", size_, " x in ", in.describe());
    TESSERA_MPI_CHECK(MPI_Allgather(in.raw_data(), to_int(static_cast<int64_t>(in.nbytes()), "all_gather"), MPI_BYTE,
                                    out.raw_data(), to_int(static_cast<int64_t>(in.nbytes()), "all_gather"), MPI_BYTE,
                                    comm_));
  }

  void broadcast(Context&, Tensor& tensor, int root) override {
    BlockingScope watch("MPI broadcast", this);
    check_cpu(tensor, "broadcast", "tensor");
    TESSERA_CHECK(root >= 0 && root < size_, "broadcast: root ", root, " is outside a group of ", size_);
    TESSERA_MPI_CHECK(MPI_Bcast(tensor.raw_data(), to_int(static_cast<int64_t>(tensor.nbytes()), "broadcast"),
                                MPI_BYTE, root, comm_));
  }

  void all_to_all(Context&, const Tensor& in, Tensor& out, const std::vector<int64_t>& in_splits,
                  const std::vector<int64_t>& out_splits) override {
    BlockingScope watch("MPI all_to_all", this);
    check_cpu(in, "all_to_all", "in");
    check_cpu(out, "all_to_all", "out");
    TESSERA_CHECK(in.dtype() == out.dtype(), "all_to_all: in and out dtypes differ");
    TESSERA_CHECK(in_splits.size() == static_cast<size_t>(size_) && out_splits.size() == static_cast<size_t>(size_),
                  "all_to_all: need ", size_, " splits, got ", in_splits.size(), " and ", out_splits.size());
    TESSERA_CHECK(in.dim() >= 1 && out.dim() >= 1, "all_to_all: tensors need a row dimension");
    const int64_t row_bytes = in.size(0) ? static_cast<int64_t>(in.nbytes()) / in.size(0) : 0;
    const int64_t out_row_bytes = out.size(0) ? static_cast<int64_t>(out.nbytes()) / out.size(0) : 0;
    TESSERA_CHECK(in.size(0) == 0 || out.size(0) == 0 || row_bytes == out_row_bytes,
                  "all_to_all: rows of in and out differ in size");
    const int64_t rb = std::max(row_bytes, out_row_bytes);
    std::vector<int> sc(static_cast<size_t>(size_)), sd(sc.size()), rc(sc.size()), rd(sc.size());
    int64_t s_off = 0, r_off = 0;
    for (size_t p = 0; p < sc.size(); ++p) {
      TESSERA_CHECK(in_splits[p] >= 0 && out_splits[p] >= 0, "all_to_all: negative split");
      sc[p] = to_int(in_splits[p] * rb, "all_to_all");
      sd[p] = to_int(s_off, "all_to_all");
      rc[p] = to_int(out_splits[p] * rb, "all_to_all");
      rd[p] = to_int(r_off, "all_to_all");
      s_off += in_splits[p] * rb;
      r_off += out_splits[p] * rb;
    }
    TESSERA_CHECK(s_off == static_cast<int64_t>(in.nbytes()) && r_off == static_cast<int64_t>(out.nbytes()),
                  "all_to_all: splits sum to ", s_off / std::max<int64_t>(rb, 1), " and ",
                  r_off / std::max<int64_t>(rb, 1), " rows, but in has ", in.size(0), " and out ", out.size(0));
    TESSERA_MPI_CHECK(MPI_Alltoallv(in.raw_data(), sc.data(), sd.data(), MPI_BYTE, out.raw_data(), rc.data(),
                                    rd.data(), MPI_BYTE, comm_));
  }

  void send(Context&, const Tensor& tensor, int dst) override {
    BlockingScope watch("MPI send", this);
    check_cpu(tensor, "send", "tensor");
    TESSERA_CHECK(dst >= 0 && dst < size_ && dst != rank_, "send: bad destination ", dst);
    TESSERA_MPI_CHECK(MPI_Send(tensor.raw_data(), to_int(static_cast<int64_t>(tensor.nbytes()), "send"), MPI_BYTE, dst,
                               kTag, comm_));
  }
  void recv(Context&, Tensor& tensor, int src) override {
    BlockingScope watch("MPI recv", this);
    check_cpu(tensor, "recv", "tensor");
    TESSERA_CHECK(src >= 0 && src < size_ && src != rank_, "recv: bad source ", src);
    MPI_Status status;
    TESSERA_MPI_CHECK(MPI_Recv(tensor.raw_data(), to_int(static_cast<int64_t>(tensor.nbytes()), "recv"), MPI_BYTE, src,
                               kTag, comm_, &status));
    int got = 0;
    MPI_Get_count(&status, MPI_BYTE, &got);
    TESSERA_CHECK(got == static_cast<int>(tensor.nbytes()), "recv: expected ", tensor.nbytes(), " bytes from rank ",
                  src, ", got ", got, " (the ranks disagree on the shape)");
  }
  void barrier() override {
    BlockingScope watch("MPI barrier", this);
    TESSERA_MPI_CHECK(MPI_Barrier(comm_));
  }

  std::shared_ptr<ProcessGroup> split(int color, int key) override {
    BlockingScope watch("MPI split", this);
    MPI_Comm sub = MPI_COMM_NULL;
    TESSERA_MPI_CHECK(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &sub));
    if (sub == MPI_COMM_NULL) return nullptr;
    return std::make_shared<MpiGroup>(sub, true);
  }

 private:
  static constexpr int kTag = 7;

  // `send` holds size_ chunks of `chunk` elements (acc dtype), chunk p for rank p. Returns
  // this rank's chunk reduced over all ranks in rank order.
  Tensor reduce_chunks(const Tensor& send, int64_t chunk, ReduceOp op, DType acc) {
    Tensor recv = Tensor::empty({size_ * chunk}, acc);
    const int count = to_int(chunk, "reduce");
    TESSERA_MPI_CHECK(MPI_Alltoall(send.raw_data(), count, mpi_type(acc), recv.raw_data(), count, mpi_type(acc), comm_));
    return reduce_received(recv, chunk, size_, op, acc);
  }

  MPI_Comm comm_;
  bool owned_;
};

}  // namespace

GroupPtr mpi_world() {
  int initialized = 0;
  TESSERA_MPI_CHECK(MPI_Initialized(&initialized));
  if (!initialized) {
    int provided = 0;
    TESSERA_MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided));
    we_initialized = true;
    // Finalize at exit when the program does not: a rank that returns from main without
    // MPI_Finalize makes mpirun report the whole job as failed.
    std::atexit([] { mpi_finalize(); });
  }
  return std::make_shared<MpiGroup>(MPI_COMM_WORLD, false);
}

void mpi_finalize() {
  if (we_initialized && mpi_live()) MPI_Finalize();
}

void mpi_abort(int status) {
  if (mpi_live()) MPI_Abort(MPI_COMM_WORLD, status);
}

}  // namespace tessera::dist::detail

#endif  // TESSERA_WITH_MPI
