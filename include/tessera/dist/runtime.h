// Everything a training process needs from dist/, set up in one collective call:
//
//   auto rt = dist::init_from_env(config.training.parallel, Context::cuda());
//   TransformerLM model(config.model, dtype, rt.grid->context());
//   ... rt.host->data for host values (losses, flags, strings), rt.grid->data for gradients
//
// The world comes from the environment (init_from_env(): MPI under mpirun, TCP under
// `tessera launch` or RANK/WORLD_SIZE, else one rank). On CUDA each rank takes GPU
// local_rank() % (visible GPUs) and the model's collectives run over NCCL (bootstrapped over
// the host world), while small host values keep using the host transport.
#pragma once

#include <memory>

#include "tessera/dist/parallel_grid.h"
#include "tessera/dist/process_group.h"

namespace tessera::dist {

struct Runtime {
  GroupPtr world;                      // host transport: mpi, tcp or local
  std::shared_ptr<ParallelGrid> host;  // the grid's groups over `world` (host tensors)
  std::shared_ptr<ParallelGrid> grid;  // the groups for the model's tensors: NCCL on CUDA, else `host`
  Context ctx;                         // this rank's device (and the stream the caller gave)
  int local_rank = 0;

  int rank() const { return world->rank(); }
  int size() const { return world->size(); }
  bool is_main() const { return world->rank() == 0; }
};

// Collective over the world (`world`, or init_from_env() when null): sets the watchdog's
// timeout from config.timeout_s, checks that every rank has the same parallel layout, builds
// both grids. `device`: a CPU context, or a CUDA one whose device index is replaced by this
// rank's GPU (its stream is kept). CUDA with more than one rank needs NCCL.
Runtime init_from_env(const ParallelConfig& config, Context device, GroupPtr world = nullptr);

}  // namespace tessera::dist
