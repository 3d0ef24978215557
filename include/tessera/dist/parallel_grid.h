// ParallelGrid: splits a world of data x tensor x pipeline ranks into its groups.
//
// Rank layout (tensor fastest, as Megatron orders it, so that a tensor-parallel group sits
// on neighbouring GPUs of one host, where NVLink is):
//   world_rank = (pipeline_rank * data + data_rank) * tensor + tensor_rank
// The config block it reads (training.parallel in a YAML config):
//   parallel: {data: 2, tensor: 2, pipeline: 1, sequence_parallel: true,
//              distributed_optimizer: false, timeout_s: 300, bucket_mb: 25,
//              overlap_grad_reduce: true, tp_comm_overlap: false}
// data may be 0 ("whatever is left": world / (tensor * pipeline)).
#pragma once

#include <nlohmann/json.hpp>

#include "tessera/dist/process_group.h"
#include "tessera/nn/parameter.h"

namespace tessera::dist {

struct ParallelConfig {
  int data = 0;  // 0: world size / (tensor * pipeline)
  int tensor = 1;
  int pipeline = 1;
  bool sequence_parallel = false;
  size_t bucket_mb = 25;  // DataParallel's bucket size (0: a bucket per parameter)
  bool distributed_optimizer = false;  // ZeRO-1: shard the optimizer state over the data ranks
  double timeout_s = 300;  // a wait on another rank longer than this stops the run (0: forever)
  // The trainer starts each gradient bucket's reduction during backward, as soon as its
  // parameters' gradients are final (false: all buckets after the whole backward).
  bool overlap_grad_reduce = true;
  // The tensor-parallel layers overlap their backward collectives (the input gradient's
  // all-reduce / reduce-scatter) with the weight-gradient GEMMs that do not need them, and
  // the vocab-parallel LM head its d_h reduction with its last weight-gradient GEMM. The
  // results are bit-identical either way; only the order of independent work changes.
  bool tp_comm_overlap = false;

  // From the training.parallel block; unknown keys and bad values are errors naming the key.
  static ParallelConfig from_json(const nlohmann::json& j);
  nlohmann::json to_json() const;
};

class ParallelGrid {
 public:
  // Collective over `world`: every rank constructs its grid with the same config (checked:
  // ranks that disagree stop with an error naming the sizes). Throws when the sizes do not
  // multiply to the world size.
  ParallelGrid(Context& ctx, GroupPtr world, const ParallelConfig& config);

  int data_size() const { return data_; }
  int tensor_size() const { return tensor_; }
  int pipeline_size() const { return pipeline_; }
  int data_rank() const { return data_rank_; }
  int tensor_rank() const { return tensor_rank_; }
  int pipeline_rank() const { return pipeline_rank_; }
  // The world rank at grid coordinates (data, tensor, pipeline).
  int world_rank_of(int data_rank, int tensor_rank, int pipeline_rank) const;

  // Sizes, ranks and groups for the modules.
  nn::ParallelContext context() const;

  GroupPtr world, data, tensor, pipeline;

 private:
  int data_ = 1, tensor_ = 1, pipeline_ = 1;
  int data_rank_ = 0, tensor_rank_ = 0, pipeline_rank_ = 0;
  bool sequence_parallel_ = false;
  bool tp_comm_overlap_ = false;
};

}  // namespace tessera::dist
