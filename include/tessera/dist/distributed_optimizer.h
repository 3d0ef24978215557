// DistributedOptimizer: AdamW with the optimizer state and FP32 master weights sharded over
// the data-parallel ranks (ZeRO stage 1, Megatron's "distributed optimizer"), with the
// gradient reduction split into buckets that can start during backward.
//
// Layout. The parameters are grouped into buckets as DataParallel groups them (reverse list
// order, the order backward finishes them; about `bucket_bytes` each). Each bucket is one
// flat buffer padded to a multiple of the group size D; rank r owns the r-th 1/D chunk of
// EVERY bucket. A rank's shard is its chunks of all buckets end to end. So a bucket's
// gradients can be reduce-scattered as soon as they are final, and each rank ends up with
// the averaged gradients of exactly the elements it updates.
//
// A step:
//   1. each bucket: pack the local gradients, reduce-scatter (average) into this rank's
//      chunk. Either all in step(), or started during backward: mark_ready(p) once p's
//      gradient is final, and a bucket starts when its last parameter is marked
//      (ProcessGroup::reduce_scatter_async: on NCCL on the group's communication stream).
//      step() starts what is left and waits for all of them.
//   2. the global gradient norm: sum of squares of the shard, summed over the group
//   3. clips as train::Optimizer does (max_norm / (norm + 1e-6) when norm > max_norm)
//   4. AdamW on the shard's master weights and moments (weight decay per parameter)
//   5. each bucket: all-gather the updated weights (into the bucket's buffer, which the
//      gradients no longer need), copy them into the parameters, refresh BF16 values
// Memory per rank: 12 bytes/param of state becomes 12/D, plus one flat buffer per bucket.
// Each element is reduced exactly as a whole-model reduce-scatter or DataParallel's
// all-reduce reduces it (in rank order on MPI), so results equal train::Optimizer after
// DataParallel averaging up to the rounding of the gradient norm (the same when clipping is
// off), and the overlapped form equals the after-backward one bit for bit.
//
// The master weights of the shard are taken from the parameters at the start of every step
// (they equal the parameters' full-precision weights after each all-gather), so weights
// loaded into the model (a checkpoint, a rewind, an import) need no separate hand-over.
// Checkpoints hold each rank's moments as the pieces of the parameters it owns (state(),
// state_layout(): kind "zero1-buckets"); train/checkpoint.cpp re-splits them when the
// data-parallel size or the bucketing changes, and still reads the older contiguous "zero1"
// layout.
#pragma once

#include <algorithm>
#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tessera/dist/process_group.h"
#include "tessera/nn/parallel_layout.h"
#include "tessera/nn/parameter.h"
#include "tessera/train/config.h"
#include "tessera/train/optimizer.h"

namespace tessera::dist {

struct DistributedOptimizerOptions {
  size_t bucket_bytes = size_t{25} << 20;  // 0: a bucket per parameter
};

// A run of one parameter's elements inside a rank's shard (bucketed ZeRO-1 layout).
struct Zero1Piece {
  size_t parameter;      // index in the parameter list
  int64_t param_offset;  // first element within the parameter
  int64_t length;
  int64_t shard_offset;  // in the rank's (padded) shard
  int64_t packed_offset; // in the rank's owned elements without padding (state()'s tensors)
};
// The pieces rank `rank` of `size` owns, in shard order, given the parameters' element
// counts and the buckets (parameter indices in bucket order, each bucket's parameters in
// the order they are packed). Shared by the optimizer and the checkpoint loader.
std::vector<Zero1Piece> zero1_pieces(const std::vector<int64_t>& numels, const std::vector<std::vector<size_t>>& buckets,
                                     int size, int rank);
// The buckets DataParallel forms: reverse list order, a new bucket when the next gradient
// would take the bucket past `bucket_bytes` (a parameter larger than that gets its own).
std::vector<std::vector<size_t>> zero1_buckets(const std::vector<int64_t>& numels, size_t element_bytes,
                                               size_t bucket_bytes);

class DistributedOptimizer : public train::OptimizerBase {
 public:
  // Collective over `group`. The parameters' full-precision weights must be equal on every
  // rank (DataParallel::broadcast_parameters) and share one dtype and device.
  DistributedOptimizer(Context& ctx, nn::ParameterList parameters, GroupPtr group, const train::OptimizerConfig& config,
                       const DistributedOptimizerOptions& options = {});
  ~DistributedOptimizer() override;

  // Tensor parallelism: the parameters are this tensor rank's shards (`layouts`, parallel to
  // the parameter list: TransformerLM::shard_layouts()), and the clipping norm becomes the
  // single-device model's: each rank sums the squares of the elements of its shard that it
  // counts (replicated parameters on tensor rank 0 only, K/V rows held by several ranks on
  // the lowest), then the sum goes over the data group and the tensor group. Call once,
  // right after construction, on every rank.
  void set_tensor_parallel(GroupPtr tensor_group, const std::vector<nn::ShardLayout>& layouts);

  // Overlap (optional): during the backward of the last micro-batch, mark each parameter
  // once its gradient for this step is final; a bucket's reduce-scatter starts when its
  // last parameter is marked. Marking a parameter twice before the step is an error.
  void mark_ready(Context& ctx, const nn::Parameter& parameter);
  // Starts the buckets not started yet and waits for all of them (step() does this itself;
  // call it to finish what the backward started when the step is then skipped).
  void reduce_gradients(Context& ctx);
  // Forgets the marks and any reduced gradients of a step that was not taken (waits for
  // reductions still in flight). Call before a backward whose gradients start anew.
  void begin_backward();

  // Gradients: this rank's, not yet reduced (or reduced by reduce_gradients / the marks).
  // Returns the global gradient norm before clipping.
  double step(Context& ctx, double lr) override;
  int64_t steps_taken() const override { return step_; }
  int64_t total_elements() const { return total_; }
  int64_t shard_elements() const { return shard_; }         // with padding
  int64_t owned_elements() const { return owned_; }         // without padding
  const std::vector<std::vector<size_t>>& bucket_parameters() const { return bucket_params_; }

  // The moments of the elements this rank owns (its pieces in shard order, no padding):
  // "exp_avg" and "exp_avg_sq", 1-D.
  std::vector<std::pair<std::string, Tensor>> state() const override;
  // {"kind": "zero1-buckets", "rank", "size", "total", "parameters": [[name, numel], ...] in
  //  list order, "buckets": [[parameter index, ...], ...]}: with zero1_pieces, any rank's
  //  pieces follow from it.
  nlohmann::json state_layout() const override;
  // Tensors as state() gives them (this rank's pieces), and the step count.
  void load_state(const std::vector<std::pair<std::string, Tensor>>& tensors, int64_t step) override;
  // Every parameter's moments (all-gathered over the group: collective), and the reverse
  // (local: this rank takes its pieces).
  std::vector<std::pair<std::string, Tensor>> per_parameter_state(Context& ctx) const override;
  void load_per_parameter_state(const std::vector<std::pair<std::string, Tensor>>& tensors, int64_t step) override;

 private:
  struct Bucket {
    std::vector<size_t> parameters;  // indices, in packing order
    std::vector<int64_t> offsets;    // of each in `flat`
    int64_t chunk = 0;               // elements per rank (flat holds size * chunk)
    int64_t shard_offset = 0;        // of this rank's chunk in the shard
    Tensor flat;                     // gradients in, then the updated weights out
    int ready = 0;
    std::unique_ptr<Work> work;
    bool started = false;
  };
  void start(Context& ctx, Bucket& bucket);
  void wait_all();

  nn::ParameterList params_;
  GroupPtr group_;
  train::OptimizerConfig config_;
  int64_t total_ = 0, shard_ = 0, owned_ = 0;
  std::vector<std::vector<size_t>> bucket_params_;
  std::vector<Bucket> buckets_;
  std::vector<std::pair<const nn::Parameter*, size_t>> bucket_of_;  // sorted by pointer
  std::vector<const nn::Parameter*> marked_;
  std::vector<Zero1Piece> pieces_;
  Tensor grad_shard_, weights_shard_, exp_avg_, exp_avg_sq_;  // [shard]
  GroupPtr tensor_group_;                        // set_tensor_parallel; null otherwise
  std::vector<std::pair<int64_t, int64_t>> norm_pieces_;  // [begin, end) of the shard this rank counts
  int64_t step_ = 0;
  bool reduced_ = false;                         // this step's gradients are in grad_shard_
};

}  // namespace tessera::dist
