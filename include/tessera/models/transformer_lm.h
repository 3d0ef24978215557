// TransformerLM: the decoder-only language model behind GPT-2 and Llama-3.
//
//   token embedding (+ learned positions for GPT-2) -> N TransformerLayers -> final norm
//   -> LM head (tied to the embedding or its own weight) -> cross-entropy
//
// The head is evaluated in chunks of rows, and its backward runs inside the same loop, so
// only one chunk of logits ([chunk, vocab]) exists at any time, never [B*T, vocab].
#pragma once

#include <memory>
#include <vector>

#include "tessera/models/config.h"
#include "tessera/nn/norm.h"
#include "tessera/nn/transformer_layer.h"

namespace tessera::models {

class TransformerLM {
 public:
  // `dtype` is the compute dtype: F32, F64 (gradient checks) or BF16 (mixed precision: BF16
  // weights and activations, FP32 master weights and gradients; see nn::Parameter). The
  // model is built on the CPU; `to` moves it.
  TransformerLM(const ModelConfig& config, DType dtype = DType::F32, const nn::ParallelContext& parallel = {});

  // Moves every parameter (values, gradients, master weights) to `device`.
  void to(Device device);
  // Recomputes the BF16 values from the master weights after they were loaded or updated.
  void refresh_values(Context& ctx);

  // Random initialisation (GPT-2 style: N(0, 0.02), residual projections scaled by
  // 1/sqrt(2 * layers), norms at 1, biases at 0), from the Philox stream of `seed`.
  void init(Context& ctx, uint64_t seed);

  // inputs and targets are [B, T] token ids on any device (the loader's host tensors are
  // copied to ctx's device). Gradients are in each parameter's grad (F32 for BF16 models).
  // Mean cross-entropy over the targets that are not `ignore_index`, and the gradients of
  // every parameter ACCUMULATED (gradient accumulation is the caller's loop). `scale`
  // multiplies the gradients (1 / micro-batches when accumulating).
  double forward_backward(Context& ctx, const Tensor& inputs, const Tensor& targets, float scale = 1.0f);
  // For mixture-of-experts models the value returned is the cross-entropy plus every MoE
  // layer's auxiliary losses (load balancing and z-loss, with their coefficients), the
  // objective whose gradient this computes; last_aux_loss() is their part of it. The
  // per-expert loads of the step are added to each layer's statistics (expert_loads()).
  //
  // Mean loss only, no gradients (cross-entropy only, also for MoE models).
  double forward_loss(Context& ctx, const Tensor& inputs, const Tensor& targets);
  // Logits [B, T, V] (F32) for all positions; for generation and `eval --dump-logits`.
  Tensor logits(Context& ctx, const Tensor& inputs);

  // Mixture of experts: the aux-loss part of the last forward_backward's value; the kept
  // tokens per expert of each MoE layer since the last update_expert_biases() (empty for
  // dense models), for logging; and the per-step balancing update, which moves each
  // layer's auxiliary-loss-free expert bias (when model.expert_bias_rate > 0) by the sign
  // of its load error and resets the loads. The trainer calls it after each optimizer step.
  double last_aux_loss() const { return last_aux_loss_; }
  std::vector<std::vector<int64_t>> expert_loads() const;
  void update_expert_biases(Context& ctx);

  nn::ParameterList parameters();
  int64_t num_parameters();
  void zero_grad();
  const ModelConfig& config() const { return config_; }
  DType dtype() const { return dtype_; }

  static constexpr int64_t kIgnoreIndex = -100;
  static constexpr int64_t kHeadChunkRows = 1024;

 private:
  struct Saved {
    std::vector<nn::TransformerLayer::Saved> layers;
    nn::Norm::Saved final_norm;
  };
  Tensor embed(Context& ctx, const Tensor& inputs) const;                   // [B*T, C]
  Tensor trunk_forward(Context& ctx, const Tensor& inputs, Saved& saved);  // final-norm output [B*T, C]
  nn::Parameter& head_weight() { return config_.tie_embeddings ? token_embedding : lm_head; }
  // targets on any device (read on the host to count the valid ones); device_targets the
  // same ids on ctx's device.
  // The mean loss stays on the device (one slot per chunk, with its weight) until read(),
  // so forward_backward can queue the whole backward before it waits for the GPU.
  struct HeadLoss {
    Tensor chunk_losses;          // undefined when no target is valid (the loss is 0)
    std::vector<double> weights;  // valid targets of the chunk / valid targets in all
    double read() const;
  };
  HeadLoss head_loss(Context& ctx, const Tensor& h, const Tensor& targets, const Tensor& device_targets, Tensor* d_h,
                     float scale);

  ModelConfig config_;
  DType dtype_;
  // On CUDA with a vocabulary that is not a multiple of 64: the head weight's value and
  // gradient with zero padding rows; the Parameter holds views of their first V rows.
  Tensor head_value_padded_, head_grad_padded_;
  // Position ids [B*T] (i % T) on the device for GPT-2's position-embedding backward,
  // cached for the last (batch, seq) shape.
  Tensor positions_;
  int64_t positions_seq_ = 0;
  double last_aux_loss_ = 0;

 public:
  nn::Parameter token_embedding;     // [V, C]
  nn::Parameter position_embedding;  // [max_seq_len, C], GPT-2 only
  std::vector<std::unique_ptr<nn::TransformerLayer>> layers;
  nn::Norm final_norm;
  nn::Parameter lm_head;  // [V, C], only when embeddings are untied
};

}  // namespace tessera::models
