// The training step captured into a CUDA graph (training.cuda_graph, docs/training.md).
//
// A step of a small model is bound by the host: hundreds of kernel launches, each costing
// a few microseconds, for kernels that run for less. CudaGraphStep records the whole step,
// "zero the gradients, forward and backward over grad_accum micro-batches, AdamW with
// clipping", once, and afterwards launches it as one graph. What changes from step to
// step lives in device memory the graph reads: the token ids (copied into fixed buffers
// before each replay) and the learning rate and step count (four doubles, copied with
// them). FP8 scaling state (delayed scaling's amax history, scales and ring position)
// lives on the device too, and its per-micro-batch and per-step bookkeeping is part of the
// graph. The loss and the gradient norm stay on the device until the end of the step,
// which is its one host synchronisation.
//
// The first `warmup_steps` steps run the same device-resident work uncaptured: they fill
// the caches that must not be filled during a capture (cuBLASLt plans, cuDNN graphs, the
// attention backend's per-shape choice, GPT-2's position ids, the optimizer's tensor
// tables), and since they run exactly the work the graph holds, a run's numbers do not
// depend on when the capture happens: eager steps, uncaptured steps and replays give the
// same bits. When the capture fails (failure() says why) the step runs uncaptured, and so
// does every later one.
//
// Memory: the graph's temporaries come from a private pool of the caching allocator
// (backend/cuda/runtime.cu), released when this object goes; the buffers the graph reads
// that other objects own (parameters, gradients, optimizer state, the model's and the
// optimizer's step_buffers()) must not be reallocated while it lives. Restoring a
// snapshot or loading a checkpoint writes them in place and is fine.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tessera/core/context.h"
#include "tessera/data/loader.h"
#include "tessera/models/transformer_lm.h"
#include "tessera/train/config.h"
#include "tessera/train/optimizer.h"

namespace tessera::train {

// Why this run's training step cannot be captured, or nullopt when it can. `device` is where
// it trains; `distributed`: it runs over several ranks (data or tensor parallel), which
// communicate and read the global gradient norm between backward and the optimizer. Pure:
// depends on the configuration only (per-step exceptions, such as a batch with ignored
// targets or an injected NaN gradient, are the trainer's to handle).
std::optional<std::string> cuda_graph_blocker(const RunConfig& config, Device device, bool distributed = false);

// What training.cuda_graph decides for a run: use the captured step, or not and why (the
// reason is empty when cuda_graph is off, i.e. nothing to report).
struct CudaGraphChoice {
  bool use = false;
  std::string reason;
};
CudaGraphChoice choose_cuda_graph(const RunConfig& config, Device device, bool distributed = false);

class CudaGraphStep {
 public:
  struct Options {
    int64_t batch_size = 1, seq_len = 1, grad_accum = 1;
    int64_t warmup_steps = 2;  // uncaptured steps before the capture (at least 1)
  };
  struct Result {
    double loss = 0;       // mean over the micro-batches, as the eager loop sums it
    double grad_norm = 0;  // before clipping; NaN when the loss is not finite, as the eager loop reports
    bool replayed = false; // this step was a replay of the graph
  };

  // ctx: a CUDA device and a stream of its own (not the default stream, which cannot be
  // captured). The model must be dense (no mixture of experts) and stay on that device.
  CudaGraphStep(const Context& ctx, models::TransformerLM& model, Optimizer& optimizer, const Options& options);
  ~CudaGraphStep();
  CudaGraphStep(const CudaGraphStep&) = delete;
  CudaGraphStep& operator=(const CudaGraphStep&) = delete;

  // Whether step() takes these micro-batches: grad_accum host tensors of [batch, seq] ids
  // (I32 or I64) with every target valid (none is TransformerLM::kIgnoreIndex).
  bool accepts(const std::vector<data::Batch>& batches) const;
  // One optimizer step at learning rate lr, the same work and bits as the eager loop's
  // zero_grad / forward_backward per micro-batch / Optimizer::step. With FP8 linears
  // (models::enable_fp8) the scaling's end_micro_batch after each micro-batch and end_step
  // after the optimizer are part of the step (and of the graph): the caller must not call
  // them for a step taken here. Waits for the GPU once,
  // at the end, then reports an out-of-range token id the kernels met, as the eager ops do.
  Result step(const std::vector<data::Batch>& batches, double lr);

  bool captured() const;
  const std::string& failure() const { return failure_; }
  int64_t steps() const { return steps_; }

 private:
  struct Impl;
  void stage(const std::vector<data::Batch>& batches, double lr);
  void queue_step();
  void capture();
  Result finish(bool replayed);

  Context ctx_;
  [[maybe_unused]] models::TransformerLM& model_;  // used by the CUDA build only
  [[maybe_unused]] Optimizer& optimizer_;
  Options options_;
  std::shared_ptr<nn::Fp8Scaling> fp8_;  // the model's FP8 scaling (models::fp8_scaling_of), or null
  std::unique_ptr<Impl> impl_;
  int64_t steps_ = 0;
  std::string failure_;
};

}  // namespace tessera::train
