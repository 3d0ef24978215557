// The NCCL backend: collectives over CUDA tensors, queued on the Context's stream.
//
// An NCCL communicator needs one ncclUniqueId shared by all its ranks. Two ways to get it
// there:
//   nccl_group(bootstrap, device)       rank 0 of `bootstrap` (usually the MPI world, or any
//                                       group of CPU tensors) makes the id and broadcasts it
//   nccl_group_from_file(rank, size, path, device)
//                                       without MPI: rank 0 writes the id to `path` (a file
//                                       every rank can read: one host, or a shared disk),
//                                       the others wait for it (RANK / WORLD_SIZE launches)
// Sub-groups come from ncclCommSplit. barrier() synchronizes the device as well.
// Every collective is asynchronous with respect to the host; a tensor is ready for the
// host after synchronize(ctx). The tensors must be on the group's device.
#pragma once

#include <string>

#include "tessera/dist/process_group.h"

namespace tessera::dist {

// True when this build has the NCCL backend.
bool nccl_available();

// Collective over `bootstrap`: a communicator with the same ranks, on CUDA device `device`.
GroupPtr nccl_group(Context& ctx, ProcessGroup& bootstrap, int device);

// Collective over `size` processes that agree on `path`; `timeout_s` bounds the wait for
// rank 0's file (an error names the file when it does not appear). Rank 0 removes a stale
// file first, so start rank 0 before or with the others, never after they began waiting.
GroupPtr nccl_group_from_file(int rank, int size, const std::string& path, int device, double timeout_s = 300);

}  // namespace tessera::dist
