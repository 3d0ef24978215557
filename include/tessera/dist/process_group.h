// ProcessGroup: the ranks that take part in a collective, and the collectives over tensors.
//
// Three backends behind one interface:
//   local  a world of one (every collective is a copy or nothing); always built, so code
//          written for N ranks runs unchanged on one
//   mpi    CPU tensors over MPI (TESSERA_WITH_MPI); also the bootstrap of NCCL
//   nccl   CUDA tensors over NCCL (TESSERA_WITH_NCCL), queued on the Context's stream
//
// Conventions:
// - Every rank of a group calls the same collectives in the same order with tensors of the
//   same shape and dtype (a mismatch is a deadlock or garbage in MPI and NCCL; use
//   check_consistent() to turn a suspected mismatch into an error on every rank).
// - Tensors are contiguous. Reduce-scatter and all-gather split and join along dimension 0:
//   all_gather(in [n, ...]) -> out [size * n, ...] in rank order; reduce_scatter(in
//   [size * n, ...]) -> out [n, ...], rank r keeping rows [r n, (r + 1) n).
// - The MPI backend reduces in rank order (0 + 1 + ... + size-1) for every element, so its
//   results are bitwise identical on every rank and from run to run, whatever MPI's own
//   algorithms would do. F32/F64 are summed in their own precision; BF16/F16 in F32 and
//   rounded once.
// - On CUDA (NCCL), collectives are asynchronous with respect to the host: they are queued
//   on ctx.stream like any kernel. On the CPU they complete before returning.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tessera/core/context.h"
#include "tessera/core/tensor.h"

namespace tessera::dist {

enum class ReduceOp { Sum, Avg, Max, Min };
const char* reduce_op_name(ReduceOp op);

// An asynchronous collective. wait() returns once the result may be read on the host (CPU)
// or once later work queued on the caller's stream will see it (CUDA). completed() says
// whether the collective itself has finished.
class Work {
 public:
  virtual ~Work() = default;
  virtual void wait() {}
  virtual bool completed() const { return true; }
};

class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;

  int rank() const { return rank_; }  // within this group
  int size() const { return size_; }
  // The rank of each member in the world group, in this group's rank order.
  const std::vector<int>& world_ranks() const { return world_ranks_; }
  virtual const char* backend() const = 0;  // "local", "mpi", "nccl"

  // ---- Collectives ----
  virtual void all_reduce(Context& ctx, Tensor& tensor, ReduceOp op = ReduceOp::Sum) = 0;  // in place
  virtual void reduce_scatter(Context& ctx, const Tensor& in, Tensor& out, ReduceOp op = ReduceOp::Sum) = 0;
  virtual void all_gather(Context& ctx, const Tensor& in, Tensor& out) = 0;
  virtual void broadcast(Context& ctx, Tensor& tensor, int root) = 0;  // root: rank in this group
  // Rank r sends in_splits[p] rows (dimension 0) of `in`, in rank order, to rank p and
  // receives out_splits[p] rows from p into `out`, in rank order (uneven splits allowed;
  // every rank's in_splits[p] must equal rank p's out_splits[r]).
  virtual void all_to_all(Context& ctx, const Tensor& in, Tensor& out, const std::vector<int64_t>& in_splits,
                          const std::vector<int64_t>& out_splits) = 0;
  virtual void send(Context& ctx, const Tensor& tensor, int dst) = 0;
  virtual void recv(Context& ctx, Tensor& tensor, int src) = 0;
  virtual void barrier() = 0;

  // The asynchronous form: the default runs the collective now and returns a completed
  // handle (the CPU backends). NCCL returns at once: the reduction is queued on the group's
  // own communication stream after the work already queued on ctx.stream, so it runs beside
  // the work queued on ctx.stream later; wait() makes ctx.stream wait for it (no host
  // synchronisation). The tensor must stay alive and unwritten until then.
  virtual std::unique_ptr<Work> all_reduce_async(Context& ctx, Tensor& tensor, ReduceOp op = ReduceOp::Sum);
  // The same for reduce_scatter (ZeRO-1's gradient buckets): `in` and `out` must stay alive,
  // `in` unwritten and `out` unread until wait().
  virtual std::unique_ptr<Work> reduce_scatter_async(Context& ctx, const Tensor& in, Tensor& out,
                                                     ReduceOp op = ReduceOp::Sum);
  // The same for all_gather (sequence parallelism's gather of dy beside a weight-gradient
  // GEMM): `in` unwritten and `out` untouched until wait().
  virtual std::unique_ptr<Work> all_gather_async(Context& ctx, const Tensor& in, Tensor& out);

  // ---- Sub-groups ----
  // Collective over this group: every member calls split with its color; the members with
  // the same color form a new group, ranked by (key, rank). A negative color joins no group
  // (nullptr is returned).
  virtual std::shared_ptr<ProcessGroup> split(int color, int key) = 0;
  // Collective over this group: the listed ranks (of this group) in that order form a new
  // group; the others get nullptr.
  std::shared_ptr<ProcessGroup> new_group(const std::vector<int>& ranks);

 protected:
  int rank_ = 0, size_ = 1;
  std::vector<int> world_ranks_{0};
};

using GroupPtr = std::shared_ptr<ProcessGroup>;

// A world of one.
GroupPtr local_group();

// The world group for this process:
//   - MPI's world when an MPI launcher started it (mpirun / mpiexec / srun with PMI) and MPI
//     is built in (an MPI launch of several ranks without MPI built in is an error);
//   - else, when WORLD_SIZE > 1 (`tessera launch`, torchrun-style launchers), the TCP
//     backend (tcp_group.h) over RANK, WORLD_SIZE, MASTER_ADDR (default 127.0.0.1) and
//     MASTER_PORT (default 29500); the rendezvous waits at most TESSERA_DIST_TIMEOUT_S
//     seconds when set, else 300;
//   - else a local group of one.
// Idempotent: later calls return the same group. MPI is finalized at exit or by finalize().
// Also sets the rank the watchdog's messages name.
GroupPtr init_from_env();
// The group init_from_env() returned (initializing on first use).
GroupPtr world();
// Finalizes MPI when this process initialized it (no-op otherwise). Every group must be
// released, or at least no longer used, first.
void finalize();
// True when this build has the MPI backend.
bool mpi_available();
// True when the environment says an MPI launcher started this process.
bool launched_by_mpi();

// Ends the whole job at once after an error on this rank: MPI_Abort when this process is one
// rank of an MPI world of several (the MPI launcher kills the others, which would otherwise
// wait in their next collective); nothing otherwise (TCP peers see the closed connections,
// `tessera launch` stops the other ranks when one exits with an error).
void abort_job(int status);

// This process's rank on its host: LOCAL_RANK, or the MPI launchers' variables
// (OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID, SLURM_LOCALID); 0 when none is set.
int local_rank();

// Strings between the ranks of a group of CPU transport (local, mpi, tcp).
// broadcast_string: every rank returns root's `s`. all_gather_strings: every rank's, in
// rank order.
std::string broadcast_string(ProcessGroup& group, const std::string& s, int root = 0);
std::vector<std::string> all_gather_strings(ProcessGroup& group, const std::string& s);

// Stops every rank with the same clear error when the ranks disagree on `value` (a hash of a
// config, of shapes, of a parameter list). `what` names it in the message.
void check_consistent(Context& ctx, ProcessGroup& group, uint64_t value, const std::string& what);
// FNV-1a over bytes, for building the values check_consistent compares.
uint64_t hash_bytes(const void* data, size_t bytes, uint64_t seed = 14695981039346656037ull);
uint64_t hash_string(const std::string& s, uint64_t seed = 14695981039346656037ull);

}  // namespace tessera::dist
