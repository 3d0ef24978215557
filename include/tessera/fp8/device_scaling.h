// Delayed scaling with its state on the device: the amax history, scales and inverse scales
// of N FP8 tensors live in tensors on the context's device, and the step's bookkeeping is
// one launch per micro-batch (fold the amaxes) and one per step (update every scale), with
// nothing read back to the host. DelayedScalingState (recipe.h) is the host reference; the
// two give the same bits (the tests check it on the CPU and on CUDA).
//
// The ring position (which history column is this step's slot) is state on the device too,
// an I64 [1] tensor the kernels read and advance there: record and update take no host
// value that changes from step to step, so a CUDA graph that captured them replays them
// correctly (train/cuda_graph_step.h). On the CPU the same tensor lives in host memory.
//
// Use, per tensor i of the recipe (a linear layer's input, weight and output gradient):
//   quantize_per_tensor(ctx, x, state.scale(i), x_fp8, state.pending_amax(i));  // writes amax
//   ... GEMMs read state.scale_inv(i) ...
//   state.record(ctx);   // after each micro-batch: fold the pending amaxes into this step's slot
//   state.update(ctx);   // once per step, after record (and any cross-rank max of history)
// A tensor that is not quantized in a micro-batch leaves its pending amax at 0, which folds
// to nothing.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "tessera/core/context.h"
#include "tessera/core/tensor.h"
#include "tessera/fp8/recipe.h"

namespace tessera::fp8 {

class DeviceDelayedScaling {
 public:
  // State on ctx.device; scales start at 1, history and pending amaxes at 0.
  DeviceDelayedScaling(Context& ctx, const DelayedScalingConfig& config, std::vector<Role> roles);

  int64_t size() const { return static_cast<int64_t>(roles_.size()); }
  const DelayedScalingConfig& config() const { return config_; }
  DType dtype(int64_t i) const { return fp8_dtype(config_.format, roles_.at(static_cast<size_t>(i))); }
  // The current ring slot, copied to the host (it waits for the stream: for tests and
  // checkpoints, never called by the training step).
  int64_t position() const;

  // F32 [1] views into the state, for the quantize and GEMM calls of tensor i.
  Tensor scale(int64_t i) const;
  Tensor scale_inv(int64_t i) const;
  Tensor pending_amax(int64_t i) const;

  // The whole state: history [N, history_len] (column = ring slot), scale, scale_inv and
  // pending amax [N], all F32 on the device.
  const Tensor& history() const { return history_; }
  const Tensor& scales() const { return scale_; }
  const Tensor& scale_invs() const { return scale_inv_; }
  const Tensor& pending_amaxes() const { return pending_; }
  // I64 [1] on the device: the ring slot record folds into.
  const Tensor& position_tensor() const { return position_; }

  // history[i, position] = fold(history[i, position], pending[i]) for every i, then pending = 0.
  // fold is DelayedScalingState::record's: NaN is sticky, otherwise the max.
  void record(Context& ctx);
  // record, then DelayedScalingState::update's rule for every tensor in one launch: the
  // window's amax (max ignoring NaN, or the current slot), the new scale and scale_inv when
  // that amax is finite and > 0, and the ring advanced (on the device) with the new slot zeroed.
  void update(Context& ctx);

  // The same tensors and names as DelayedScalingState::state_dict (host copies; "position"
  // is I64 [1]), so either class loads the other's checkpoint. load_state_dict checks every
  // tensor (position within [0, history_len)) before it writes anything, and writes the
  // state in place: buffers a captured graph reads stay where they are.
  std::map<std::string, Tensor> state_dict(const std::string& prefix = "fp8.") const;
  void load_state_dict(Context& ctx, const std::map<std::string, Tensor>& tensors, const std::string& prefix = "fp8.");

 private:
  DelayedScalingConfig config_;
  std::vector<Role> roles_;
  Tensor history_, scale_, scale_inv_, pending_, fp8_max_;  // fp8_max_: each tensor's format's largest value
  Tensor position_;                                         // I64 [1], in [0, history_len)
};

// Current scaling's scale from a tensor's amax, on the device: scale[0] =
// fp8_scale_from_amax(amax[0], fp8, margin, power_of_two) (1 for an amax of 0, NaN or Inf).
// amax and scale are F32 [1] on ctx.device; nothing is read back to the host.
void scale_from_amax(Context& ctx, const Tensor& amax, DType fp8, float margin, bool power_of_two, Tensor& scale);

}  // namespace tessera::fp8
