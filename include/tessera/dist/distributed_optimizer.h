// DistributedOptimizer: AdamW with the optimizer state and FP32 master weights sharded over
// the data-parallel ranks (ZeRO stage 1, Megatron's "distributed optimizer").
//
// The parameters are laid end to end in one flat index space (list order), padded to a
// multiple of the group size; rank r owns the contiguous range [r S, (r+1) S). A step:
//   1. packs the local gradients and reduce-scatters them (average): each rank gets the
//      averaged gradient of its range only (no all-reduce and no DataParallel needed)
//   2. the global gradient norm: sum of squares of its range, summed over the group
//   3. clips as train::Optimizer does (max_norm / (norm + 1e-6) when norm > max_norm)
//   4. AdamW on its range of master weights and moments (weight decay per parameter)
//   5. all-gathers the updated weights into every parameter and refreshes BF16 values
// Memory per rank: 12 bytes/param of state becomes 12/D, plus a flat gradient and weight
// buffer. Results equal train::Optimizer after DataParallel averaging up to the rounding
// of the gradient norm (the same when clipping is off).
#pragma once

#include <utility>
#include <vector>

#include "tessera/dist/process_group.h"
#include "tessera/nn/parameter.h"
#include "tessera/train/config.h"

namespace tessera::dist {

class DistributedOptimizer {
 public:
  // Collective over `group`. The parameters' full-precision weights must be equal on every
  // rank (DataParallel::broadcast_parameters) and share one dtype and device.
  DistributedOptimizer(Context& ctx, nn::ParameterList parameters, GroupPtr group, const train::OptimizerConfig& config);

  // Gradients: this rank's, not yet reduced. Returns the global gradient norm before clipping.
  double step(Context& ctx, double lr);
  int64_t steps_taken() const { return step_; }
  // This rank's range of the flat index space, [begin, end).
  std::pair<int64_t, int64_t> shard_range() const { return {shard_begin_, shard_begin_ + shard_}; }
  int64_t total_elements() const { return total_; }

 private:
  struct Segment {                  // a parameter's part inside this rank's range
    nn::Parameter* parameter;
    int64_t shard_offset, length;   // in the shard
  };
  nn::ParameterList params_;
  std::vector<int64_t> offsets_;    // of each parameter in the flat index space
  GroupPtr group_;
  train::OptimizerConfig config_;
  int64_t total_ = 0, shard_ = 0, shard_begin_ = 0;
  std::vector<Segment> segments_;
  Tensor flat_grad_, flat_weights_;              // [size * shard]
  Tensor grad_shard_, weights_shard_, exp_avg_, exp_avg_sq_;  // [shard]
  int64_t step_ = 0;
};

}  // namespace tessera::dist
