// The training optimizer: AdamW over a model's parameters with a warm-up + cosine
// learning-rate schedule and gradient clipping by global norm.
#pragma once

#include <algorithm>
#include <functional>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

#include "tessera/core/stream.h"
#include "tessera/nn/parameter.h"
#include "tessera/ops/optimizer.h"
#include "tessera/train/config.h"

namespace tessera::models {
class TransformerLM;  // tessera/models/transformer_lm.h
}

namespace tessera::train {

// Learning rate at `step` (1-based): linear warm-up to lr, then cosine down to
// lr * min_lr_ratio at `total_steps`.
double learning_rate(const OptimizerConfig& config, int64_t step, int64_t total_steps);

// What the trainer, checkpoints and rewinds need of an optimizer. train::Optimizer (state
// replicated on every data-parallel rank) and dist::DistributedOptimizer (ZeRO-1, a shard of
// the state per rank) implement it.
class OptimizerBase {
 public:
  virtual ~OptimizerBase() = default;
  // One AdamW update from the parameters' gradients; returns the global gradient norm
  // before clipping.
  virtual double step(Context& ctx, double lr) = 0;
  virtual int64_t steps_taken() const = 0;
  // The moments as named tensors (handles to the optimizer's own tensors). state_layout()
  // says how they are laid out: null for one tensor per parameter ("<param>.exp_avg",
  // "<param>.exp_avg_sq", the whole model); an object for one shard of the flat state
  // (dist::DistributedOptimizer::state_layout()).
  virtual std::vector<std::pair<std::string, Tensor>> state() const = 0;
  virtual nlohmann::json state_layout() const { return nullptr; }
  // Restores tensors of this optimizer's own layout, and the step count.
  virtual void load_state(const std::vector<std::pair<std::string, Tensor>>& tensors, int64_t step) = 0;
  // The moments one tensor per parameter ("<param>.exp_avg", "<param>.exp_avg_sq", in the
  // parameters' shapes) whatever the layout: state() for train::Optimizer; ZeRO-1 gathers
  // its shards over the data group (collective). Tensor-parallel checkpoints are written
  // from this (gathered over the tensor group by TransformerLM::gather_full).
  virtual std::vector<std::pair<std::string, Tensor>> per_parameter_state(Context&) const { return state(); }
  // The reverse: this optimizer's part of per-parameter moments, and the step count.
  virtual void load_per_parameter_state(const std::vector<std::pair<std::string, Tensor>>& tensors, int64_t step) {
    load_state(tensors, step);
  }
};

class Optimizer : public OptimizerBase {
 public:
  Optimizer(nn::ParameterList parameters, const OptimizerConfig& config);

  // Clips the gradients to config.grad_clip (global L2 norm), then applies one AdamW update
  // with learning rate `lr` and refreshes BF16 values from their FP32 masters. Returns the
  // gradient norm before clipping. Three launches on CUDA (global_grad_norm,
  // adamw_step_multi); the host waits once, at the end, to read the norm. The gradients
  // are left unclipped (they are only read).
  double step(Context& ctx, double lr) override;
  int64_t steps_taken() const override { return step_; }

  // The device-resident form, for a step captured into a CUDA graph (train::CudaGraphStep):
  // queues the work step() does, with the same results, and reads nothing back. The
  // learning rate and step count come from step_scalars (F64 [4] on ctx's device, as
  // adamw_step_scalars lays them out: step_scalars_for(lr) is what the next step puts
  // there, written before the queued work runs); the norm stays in grad_norm().
  // steps_taken() does not move: call count_step() once for each queued step that ran.
  void queue_step(Context& ctx, const Tensor& step_scalars);
  std::array<double, kAdamWStepScalars> step_scalars_for(double lr) const;
  void count_step() { step_ += 1; }
  // F64 [1] on the device: the last step's gradient norm, before clipping.
  const Tensor& grad_norm() const { return norm_; }
  // The device buffers a step reads besides parameters, gradients and moments (the norm, the
  // multi-tensor tables), for whoever keeps a captured step to hold on to.
  std::vector<Tensor> step_buffers() const;
  // Forgets the multi-tensor tables, which the next step uploads again (after a capture
  // that was abandoned: its upload, if it made one, never ran).
  void reset_device_tables();

  // The update overlapped with the backward (OptimizerConfig::overlap_backward): begin_step
  // arms the coming step with its learning rate; then each parameter passed to mark_ready
  // (TransformerLM::set_grad_ready_hook, once the backward has finished its gradient) joins a
  // bucket, and each full bucket is updated at once on a side stream that waits for the
  // backward queued so far, while the backward of the earlier layers goes on. step(ctx, lr)
  // with the same lr updates whatever is left, makes ctx's stream wait for the side stream
  // and returns the norm; the new weights are the bits the plain step gives. The returned
  // norm combines the buckets' norms (sqrt of the sum of their squares), so it may differ
  // from the plain step's in its last bits. Needs grad_clip = 0 (clipping scales every
  // gradient by the norm of all of them, known only at the end) and config.overlap_backward;
  // begin_step fails otherwise. mark_ready is a no-op while no step is armed. Without a
  // begin_step, step() is the plain step.
  void begin_step(Context& ctx, double lr);
  void mark_ready(Context& ctx, nn::Parameter& parameter);
  bool armed() const { return armed_; }
  // A bucket is updated once it holds this many elements (Llama-3.2-1B: a few buckets a
  // layer; GPT-2 124M: about one a layer): big enough that its three launches cost little
  // beside its bytes, small enough that most of the update runs while the backward goes on.
  static constexpr int64_t kOverlapBucketElements = int64_t(8) << 20;
  void set_overlap_bucket_elements(int64_t elements) { overlap_bucket_elements_ = std::max<int64_t>(1, elements); }

  // A parameter whose update `update` runs instead of the multi-tensor pass, with the step's
  // tensors and scalars (after that pass, in the order set): fp8.cast_in_optimizer's
  // nn::GroupedLinear::optimizer_update. The gradient norm still covers it. A captured step
  // (queue_step) and an overlapped one update it as any other parameter (and so clear its
  // Parameter::value_stale). An empty function removes it.
  using CustomUpdate = std::function<void(Context&, AdamWTensorStep&)>;
  void set_custom_update(const nn::Parameter& parameter, CustomUpdate update);

  // Optimizer state as named tensors ("<param>.exp_avg", "<param>.exp_avg_sq") plus the
  // step count, for checkpoints.
  std::vector<std::pair<std::string, Tensor>> state() const override;
  void load_state(const std::vector<std::pair<std::string, Tensor>>& tensors, int64_t step) override;

 private:
  nn::ParameterList params_;
  OptimizerConfig config_;
  std::vector<Tensor> exp_avg_, exp_avg_sq_;
  Tensor norm_;                                  // F64 [1] on the parameters' device
  MultiTensorCache norm_cache_, adamw_cache_;    // device tables of the two multi-tensor ops
  int64_t step_ = 0;
  std::vector<size_t> custom_order_;        // parameters with a custom update, in the order set
  std::vector<CustomUpdate> custom_;        // per parameter; empty: the multi-tensor pass

  // The overlapped step (begin_step .. step): the armed learning rate, which parameters are
  // updated already, the bucket being filled (indices into params_) and its elements, the
  // side stream, and per bucket of the step (in the order they fill, the same every step)
  // its multi-tensor tables and its gradients' norm (F64 [params]; slot b is bucket b's).
  int64_t overlap_bucket_elements_ = kOverlapBucketElements;
  bool armed_ = false;
  double armed_lr_ = 0;
  std::vector<bool> updated_;
  std::vector<size_t> bucket_;
  int64_t bucket_elements_ = 0;
  size_t buckets_queued_ = 0;
  Stream side_;
  std::vector<MultiTensorCache> bucket_norm_caches_, bucket_adamw_caches_;
  Tensor bucket_norms_;

  // The multi-tensor ops' lists (handles) for the parameters at `indices`, in that order.
  // `writes_values`: the plain update will write each BF16 copy in `values`, so a copy whose
  // memory is lent to FP8 codes (Parameter::value_memory_lent) gets memory of its own first,
  // and codes a forward or a pending backward still holds keep their bits. A custom update
  // gets the copy as it is and keeps that rule itself (GroupedLinear::optimizer_update).
  struct Lists {
    std::vector<Tensor> weights, grads, values, exp_avg, exp_avg_sq;
    std::vector<float> weight_decays;
  };
  Lists lists_for(const std::vector<size_t>& indices, bool writes_values);
  AdamWOptions options_for(double lr, int64_t step) const;
  void queue(Context& ctx, const AdamWOptions& options, const Tensor& step_scalars);
  void queue_bucket(Context& ctx);
  double finish_overlapped_step(Context& ctx, double lr);
};

// fp8.cast_in_optimizer: every MoE layer's expert weights (fc and proj) updated by
// nn::GroupedLinear::optimizer_update (Optimizer::set_custom_update), which also writes their
// FP8 casts for the next step. The model's FP8 must be on (models::enable_fp8, delayed
// recipe) for the casts; without it the update is the plain one. Returns how many weights.
int use_cast_in_optimizer(models::TransformerLM& model, Optimizer& optimizer);

}  // namespace tessera::train
