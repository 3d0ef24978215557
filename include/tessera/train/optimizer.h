// The training optimizer: AdamW over a model's parameters with a warm-up + cosine
// learning-rate schedule and gradient clipping by global norm.
#pragma once

#include <utility>
#include <vector>

#include "tessera/nn/parameter.h"
#include "tessera/ops/optimizer.h"
#include "tessera/train/config.h"

namespace tessera::train {

// Learning rate at `step` (1-based): linear warm-up to lr, then cosine down to
// lr * min_lr_ratio at `total_steps`.
double learning_rate(const OptimizerConfig& config, int64_t step, int64_t total_steps);

class Optimizer {
 public:
  Optimizer(nn::ParameterList parameters, const OptimizerConfig& config);

  // Clips the gradients to config.grad_clip (global L2 norm), then applies one AdamW update
  // with learning rate `lr` and refreshes BF16 values from their FP32 masters. Returns the
  // gradient norm before clipping. Three launches on CUDA (global_grad_norm,
  // adamw_step_multi); the host waits once, at the end, to read the norm. The gradients
  // are left unclipped (they are only read).
  double step(Context& ctx, double lr);
  int64_t steps_taken() const { return step_; }

  // Optimizer state as named tensors ("<param>.exp_avg", "<param>.exp_avg_sq") plus the
  // step count, for checkpoints.
  std::vector<std::pair<std::string, Tensor>> state() const;
  void load_state(const std::vector<std::pair<std::string, Tensor>>& tensors, int64_t step);

 private:
  nn::ParameterList params_;
  OptimizerConfig config_;
  std::vector<Tensor> exp_avg_, exp_avg_sq_;
  Tensor norm_;                                  // F64 [1] on the parameters' device
  MultiTensorCache norm_cache_, adamw_cache_;    // device tables of the two multi-tensor ops
  int64_t step_ = 0;
};

}  // namespace tessera::train
