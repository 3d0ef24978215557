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
//
// The master weights of the range are taken from the parameters at the start of every step
// (they equal the parameters' full-precision weights after each all-gather), so weights
// loaded into the model (a checkpoint, a rewind, an import) need no separate hand-over.
// Checkpoints hold each rank's moments as one shard of the flat space (state() and
// state_layout()); train/checkpoint.cpp re-splits them when the data-parallel size changes.
#pragma once

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "tessera/dist/process_group.h"
#include "tessera/nn/parallel_layout.h"
#include "tessera/nn/parameter.h"
#include "tessera/train/config.h"
#include "tessera/train/optimizer.h"

namespace tessera::dist {

class DistributedOptimizer : public train::OptimizerBase {
 public:
  // Collective over `group`. The parameters' full-precision weights must be equal on every
  // rank (DataParallel::broadcast_parameters) and share one dtype and device.
  DistributedOptimizer(Context& ctx, nn::ParameterList parameters, GroupPtr group, const train::OptimizerConfig& config);

  // Tensor parallelism: the parameters are this tensor rank's shards (`layouts`, parallel to
  // the parameter list: TransformerLM::shard_layouts()), and the clipping norm becomes the
  // single-device model's: each rank sums the squares of the elements of its range that it
  // counts (replicated parameters on tensor rank 0 only, K/V rows held by several ranks on
  // the lowest), then the sum goes over the data group and the tensor group. Call once,
  // right after construction, on every rank.
  void set_tensor_parallel(GroupPtr tensor_group, const std::vector<nn::ShardLayout>& layouts);

  // Gradients: this rank's, not yet reduced. Returns the global gradient norm before clipping.
  double step(Context& ctx, double lr) override;
  int64_t steps_taken() const override { return step_; }
  // This rank's range of the flat index space, [begin, end) (end may pass the last element:
  // padding).
  std::pair<int64_t, int64_t> shard_range() const { return {shard_begin_, shard_begin_ + shard_}; }
  int64_t total_elements() const { return total_; }

  // The moments of this rank's range without the padding, [begin, min(end, total)):
  // "exp_avg" and "exp_avg_sq", 1-D.
  std::vector<std::pair<std::string, Tensor>> state() const override;
  // {"kind": "zero1", "rank", "size", "begin", "end" (without padding), "total",
  //  "parameters": [[name, numel], ...] in flat order}
  nlohmann::json state_layout() const override;
  // Tensors as state() gives them (this rank's range), and the step count.
  void load_state(const std::vector<std::pair<std::string, Tensor>>& tensors, int64_t step) override;
  // Every parameter's moments (all-gathered over the group: collective), and the reverse
  // (local: this rank takes its range).
  std::vector<std::pair<std::string, Tensor>> per_parameter_state(Context& ctx) const override;
  void load_per_parameter_state(const std::vector<std::pair<std::string, Tensor>>& tensors, int64_t step) override;

 private:
  struct Segment {                  // a parameter's part inside this rank's range
    nn::Parameter* parameter;
    int64_t shard_offset, length;   // in the shard
    int64_t param_offset;           // of the part within the parameter
  };
  int64_t owned() const { return std::max<int64_t>(0, std::min(shard_begin_ + shard_, total_) - shard_begin_); }
  nn::ParameterList params_;
  std::vector<int64_t> offsets_;    // of each parameter in the flat index space
  GroupPtr group_;
  train::OptimizerConfig config_;
  int64_t total_ = 0, shard_ = 0, shard_begin_ = 0;
  std::vector<Segment> segments_;
  Tensor flat_grad_, flat_weights_;              // [size * shard]
  Tensor grad_shard_, weights_shard_, exp_avg_, exp_avg_sq_;  // [shard]
  GroupPtr tensor_group_;                        // set_tensor_parallel; null otherwise
  std::vector<std::pair<int64_t, int64_t>> norm_pieces_;  // [begin, end) of the shard this rank counts
  int64_t step_ = 0;
};

}  // namespace tessera::dist
