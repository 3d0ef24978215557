// DataParallel: keeps the replicas of a model equal across the ranks of a data-parallel
// group by averaging (or summing) their gradients after backward.
//
// Gradients are reduced in buckets of about `bucket_bytes`: parameters are taken in reverse
// order (the order backward finishes them, last layer first), grouped by gradient dtype and
// device, and packed into one flat buffer per bucket, so that a step makes a few large
// collectives instead of one per tensor. The assignment depends only on the parameter list,
// so every rank builds the same buckets (checked at construction: ranks whose parameter
// names, shapes or dtypes differ stop with an error).
//
// Two ways to use it in a step:
//   synchronous     forward_backward ...; dp.all_reduce_gradients(ctx); optimizer.step(...)
//   overlap-ready   during backward, dp.mark_ready(ctx, p) once p's gradient for this step is
//                   final; a bucket's reduction starts when its last parameter is marked.
//                   dp.finish(ctx) starts what is left, waits, and writes the results back.
// With gradient accumulation, reduce only after the last micro-batch.
//
// On the MPI backend the reduction is in rank order, so the averaged gradients are bitwise
// identical on every rank and equal to a one-rank run that accumulated the same
// micro-batches with scale 1/data_size (an exact power-of-two scaling when the group size is
// a power of two).
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "tessera/dist/process_group.h"
#include "tessera/nn/parameter.h"

namespace tessera::dist {

// Copies rank `root`'s full-precision weights of `parameters` to every rank of `group` and
// refreshes the compute copies (collective; what DataParallel::broadcast_parameters does).
void broadcast_parameters(Context& ctx, const nn::ParameterList& parameters, ProcessGroup& group, int root = 0);

struct DataParallelOptions {
  size_t bucket_bytes = size_t{25} << 20;
  bool average = true;  // false: sum the gradients instead (the caller scales the loss)
};

class DataParallel {
 public:
  // Collective over `group` (it checks the parameter lists agree).
  DataParallel(Context& ctx, nn::ParameterList parameters, GroupPtr group, const DataParallelOptions& options = {});

  // Copies rank `root`'s weights to every rank (full-precision weights, then the compute
  // copies are refreshed). Call once after init or load when the ranks might differ.
  void broadcast_parameters(Context& ctx, int root = 0);

  // Reduces every gradient now.
  void all_reduce_gradients(Context& ctx);

  // Overlap-ready form (see above). Marking a parameter twice in a step is an error.
  void mark_ready(Context& ctx, const nn::Parameter& parameter);
  void finish(Context& ctx);

  struct Bucket {
    std::vector<nn::Parameter*> parameters;
    std::vector<int64_t> offsets;  // of each parameter's gradient in `flat`
    Tensor flat;                   // the packed gradients
    int ready = 0;                 // parameters marked this step
    std::unique_ptr<Work> work;    // the reduction in flight, when started
  };
  const std::vector<Bucket>& buckets() const { return buckets_; }
  ProcessGroup& group() { return *group_; }

 private:
  void start(Context& ctx, Bucket& bucket);
  void unpack(Context& ctx, Bucket& bucket);

  GroupPtr group_;
  DataParallelOptions options_;
  std::vector<Bucket> buckets_;
  std::vector<std::pair<const nn::Parameter*, size_t>> bucket_of_;  // sorted by pointer
  std::vector<const nn::Parameter*> marked_;
  nn::ParameterList parameters_;
};

}  // namespace tessera::dist
