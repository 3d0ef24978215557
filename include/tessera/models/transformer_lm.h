// TransformerLM: the decoder-only language model behind GPT-2 and Llama-3.
//
//   token embedding (+ learned positions for GPT-2) -> N TransformerLayers -> final norm
//   -> LM head (tied to the embedding or its own weight) -> cross-entropy
//
// The head is evaluated in chunks of rows, and its backward runs inside the same loop, so
// only one chunk of logits ([chunk, vocab]) exists at any time, never [B*T, vocab].
//
// Tensor parallelism: built with a ParallelContext whose tensor_size is tp > 1, the model
// holds this tensor rank's shard (src/models/parallel_lm.cpp): every layer is an
// nn::TensorParallelTransformerLayer (heads and FFN split), the embedding and head are
// vocab-parallel (nn/vocab_parallel.h; rows = ceil(V / tp) per rank, the last rank padded
// with zero rows), and with parallel.sequence_parallel the norms and residual adds run on
// B*T/tp rows per rank. `layers`, `token_embedding` and `lm_head` are then empty; the
// position embedding and final norm are replicated. Every tensor rank calls every method
// with the same inputs and targets (collectives inside) and gets the same loss. Parameter
// names are those of the single-device model; the full (single-device) layout is what
// full_state_dict() / load_full_state() read and write, so checkpoints in that layout load
// at any tensor size. See docs/distributed.md, "Tensor and sequence parallel".
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "tessera/fp8/recipe.h"
#include "tessera/models/config.h"
#include "tessera/nn/norm.h"
#include "tessera/nn/parallel_layout.h"
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
  // The device-resident form, for a step captured into a CUDA graph (train::CudaGraphStep):
  // nothing is read back or copied from the host. inputs and targets are [B, T] ids already
  // on ctx's device, and every target must be valid (none is kIgnoreIndex: the loss is then
  // the plain mean, whose chunk weights are known without reading the targets). Adds
  // loss / loss_divisor to loss_acc[0] (F64 [1] on ctx's device), bit for bit the double
  // that `acc += forward_backward(...) / loss_divisor` adds on the host; the gradients are
  // the same bits too. Dense models only: a mixture-of-experts forward reads its per-expert
  // token counts on the host.
  void forward_backward_into(Context& ctx, const Tensor& inputs, const Tensor& targets, float scale, Tensor& loss_acc,
                             double loss_divisor = 1.0);
  // The device buffers a step reads besides the parameters (GPT-2's cached position ids, the
  // padded LM head), for whoever keeps a captured step to hold on to.
  std::vector<Tensor> step_buffers() const;
  // For mixture-of-experts models the value returned is the cross-entropy plus every MoE
  // layer's auxiliary losses (load balancing and z-loss, with their coefficients), the
  // objective whose gradient this computes; last_aux_loss() is their part of it. The
  // per-expert loads of the step are added to each layer's statistics (expert_loads()).
  //
  // Mean loss only, no gradients (cross-entropy only, also for MoE models).
  double forward_loss(Context& ctx, const Tensor& inputs, const Tensor& targets);
  // Logits [B, T, V] (F32) for all positions; for generation and `eval --dump-logits`.
  // (Always the BF16/F32 head, also with the FP8 head on.)
  Tensor logits(Context& ctx, const Tensor& inputs);

  // The LM head alone on a final-norm output h [N, C] (the model's dtype, on ctx's device):
  // the mean cross-entropy against targets [N] (any device; kIgnoreIndex rows skipped), and
  // with d_h ([N, C], overwritten) also dL/dh times `scale`, the head weight's gradient
  // (times `scale`) ACCUMULATED. What forward_backward runs after the final norm; for tests.
  double head_forward_backward(Context& ctx, const Tensor& h, const Tensor& targets, Tensor* d_h, float scale = 1.0f);

  // ---- FP8 LM head (option `fp8.lm_head`, off by default; docs/fp8.md) ----
  // With a format set, a BF16 model runs its head's three GEMMs in FP8 with per-tensor
  // scales, whatever the blocks' recipe: W (all padded rows) and h cast to E4M3 with current
  // scaling (their own amax, margin 0) once per call, the logits GEMM with fast accumulation,
  // dlogits cast per chunk to the format's gradient dtype (E5M2 for hybrid) with a STATIC
  // scale, fp8_max * valid_targets / |scale|, from the bound |dlogits| <= |scale| / valid
  // (|softmax - onehot| <= 1), so no amax pass; dh and dW without fast accumulation, dW into
  // the F32 gradient with beta = 1. Calls whose rows, hidden size or (padded) vocabulary are
  // not multiples of 16, or a non-BF16 model, run the BF16 head. Not under tensor parallelism.
  void use_fp8_lm_head(std::optional<fp8::Format> format);
  bool fp8_lm_head() const { return fp8_head_format_.has_value(); }

  // Mixture of experts: the aux-loss part of the last forward_backward's value; the kept
  // tokens per expert of each MoE layer since the last update_expert_biases() (empty for
  // dense models), for logging; and the per-step balancing update, which moves each
  // layer's auxiliary-loss-free expert bias (when model.expert_bias_rate > 0) by the sign
  // of its load error and resets the loads. The trainer calls it after each optimizer step.
  double last_aux_loss() const { return last_aux_loss_; }
  std::vector<std::vector<int64_t>> expert_loads() const;
  // Every MoE layer's two expert GroupedLinears (fc, then proj), layer by layer; empty for
  // dense models and under tensor parallelism.
  std::vector<nn::GroupedLinear*> expert_linears();
  void update_expert_biases(Context& ctx);
  // The expert biases themselves, state that is not a parameter: "layers.<i>.expert_bias" ->
  // F32 [E] host copy, for every MoE layer that has one (empty otherwise). The trainer keeps
  // them with a checkpoint's and a rewind snapshot's state, so that a resumed or rewound run
  // routes as the uninterrupted one. load_expert_biases takes such a map: a missing name or
  // a wrong shape is an Error naming it; extra names are ignored.
  std::map<std::string, Tensor> expert_biases() const;
  void load_expert_biases(Context& ctx, const std::map<std::string, Tensor>& biases);

  // ---- Tensor parallelism and the full (single-device) layout ----
  // Named tensors, as io::NamedTensors.
  using NamedTensors = std::vector<std::pair<std::string, Tensor>>;
  // The config checks of a tensor size: head counts, K/V heads (split when num_kv_heads
  // divides by tp, replicated when tp divides by num_kv_heads), the FFN size; dense models
  // only. Throws Error naming the key. The constructor runs it; callers may run it earlier.
  static void validate_parallel(const ModelConfig& config, const nn::ParallelContext& parallel);
  const nn::ParallelContext& parallel() const { return parallel_; }
  bool tensor_parallel() const { return tp_ != nullptr; }
  // Where each of parameters() sits in the full tensor (all replicated at tensor size 1).
  std::vector<nn::ShardLayout> shard_layouts();
  // The full single-device state: every parameter's full-precision weights (FP32 masters
  // of a BF16 model) under its name, gathered over the tensor group, in parameters() order
  // (the single-device model's order) on `dst`. Collective over the tensor group; every
  // tensor rank gets the same result. At tensor size 1, copies.
  NamedTensors full_state_dict(Context& ctx, Device dst = Device::cpu());
  // Fills this rank's shard of every parameter from a full state (names and shapes of the
  // single-device model, any dtype and device; extra names are ignored, a missing or
  // mis-shaped one is an Error naming it) and refreshes the compute values. Local: no
  // communication, so each rank may read the full state itself.
  void load_full_state(Context& ctx, const NamedTensors& full);
  // The same two conversions for other per-parameter tensors, e.g. AdamW moments named
  // "<parameter>.exp_avg": a tensor is matched to the parameter whose name is its name or
  // its longest dotted prefix, and has that parameter's local (gather_full) or full
  // (shard_full) shape. gather_full is collective over the tensor group.
  NamedTensors gather_full(Context& ctx, const NamedTensors& local, Device dst = Device::cpu());
  NamedTensors shard_full(const NamedTensors& full);
  // The global gradient norm as the single-device model has it (split parameters' squares
  // summed over the tensor group, replicated ones counted once). Collective over the tensor
  // group. Global-norm clipping under tensor parallelism must use this norm.
  double grad_norm(Context& ctx);
  // grad_norm(), then every gradient scaled by max_norm / (norm + 1e-6) when norm >
  // max_norm > 0 (train::Optimizer's rule; step the optimizer with its clipping off).
  // Returns the norm before clipping. Collective over the tensor group.
  double clip_grad_norm(Context& ctx, double max_norm);

  // Gradient-ready notifications, for a data-parallel reduction that overlaps backward
  // (dist::DataParallel::mark_ready): forward_backward calls `hook` once per parameter, as
  // soon as that parameter's gradient of the call is final (accumulated into its grad, and
  // under tensor parallelism complete over the tensor group): a layer's parameters right
  // after its backward (layers finish in reverse order), the embedding, positions, final
  // norm and head, and under sequence parallelism the norms (summed at the end), once the
  // whole backward is done. Every parameter exactly once per call, in the same order on
  // every rank. An empty hook (the default) turns it off; the CUDA-graph step never calls it.
  using GradReadyHook = std::function<void(Context&, nn::Parameter&)>;
  void set_grad_ready_hook(GradReadyHook hook) { grad_ready_ = std::move(hook); }

  nn::ParameterList parameters();
  int64_t num_parameters();  // this rank's (with its vocabulary padding rows) under tensor parallelism
  // Gradients read as zero from here on, once the next backward has run (or after
  // materialize_grads): the gradients of Linear and GroupedLinear weights and the LM head are
  // not cleared here but overwritten by their first writer (nn::Parameter::grad_unwritten).
  void zero_grad();
  // Zeroes every gradient zero_grad left unwritten that no writer has written since. The
  // backward does it at its end, so only code that reads gradients without one needs it.
  void materialize_grads(Context& ctx);
  const ModelConfig& config() const { return config_; }
  DType dtype() const { return dtype_; }

  static constexpr int64_t kIgnoreIndex = -100;
  // Rows of h per LM-head chunk: the chunk's logits (rows x vocabulary) exist, never all of
  // them. 2048 against 1024 measured 1.5% faster on the Llama-1B step (its head's dW GEMMs
  // make half as many passes over the FP32 gradient) for 0.25 GiB more peak memory.
  static constexpr int64_t kHeadChunkRows = 2048;

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
  // targets null: every target is valid (forward_backward_into).
  HeadLoss head_loss(Context& ctx, const Tensor& h, const Tensor* targets, const Tensor& device_targets, Tensor* d_h,
                     float scale);
  // Forward and backward of one micro-batch, everything queued, the loss left on the device.
  HeadLoss forward_backward_queued(Context& ctx, const Tensor& ids, const Tensor* targets, const Tensor& device_targets,
                                   float scale, Saved& saved);

  ModelConfig config_;
  DType dtype_;
  nn::ParallelContext parallel_;
  // Tensor parallelism: the sharded trunk, embedding and head (src/models/parallel_lm.h);
  // null at tensor size 1. (shared_ptr: the type is complete only in the .cpp files.)
  struct TensorParallelParts;
  std::shared_ptr<TensorParallelParts> tp_;
  // The initialisation rule of one full parameter tensor (shared by init() and the
  // tensor-parallel init, which draws each full tensor and keeps its shard).
  static void init_tensor(Context& ctx, const std::string& name, Tensor& w, int64_t num_layers, uint64_t seed,
                          uint64_t stream);
  // On CUDA with a vocabulary that is not a multiple of 64: the head weight's value and
  // gradient with zero padding rows; the Parameter holds views of their first V rows.
  Tensor head_value_padded_, head_grad_padded_;
  // The FP8 head's format (unset: BF16 head), and a device F32 [1] 1.0 the static dlogits
  // scale is made from by a scale kernel (no host copy per call, so a CUDA graph captures it).
  std::optional<fp8::Format> fp8_head_format_;
  Tensor fp8_head_one_;
  bool head_runs_fp8(int64_t rows, const Tensor& h, const Tensor& w_full) const;
  // Position ids [B*T] (i % T) on the device for GPT-2's position-embedding backward,
  // cached for the last (batch, seq) shape.
  Tensor positions_;
  int64_t positions_seq_ = 0;
  double last_aux_loss_ = 0;
  GradReadyHook grad_ready_;
  std::vector<const nn::Parameter*> grads_notified_;  // this call's, while a hook is set
  // The hook for `ps` (a layer's parameters); notify_rest: for every parameter not yet told.
  void notify_grads_ready(Context& ctx, const nn::ParameterList& ps);
  void notify_rest(Context& ctx);

 public:
  nn::Parameter token_embedding;     // [V, C] (empty under tensor parallelism)
  nn::Parameter position_embedding;  // [max_seq_len, C], GPT-2 only
  std::vector<std::unique_ptr<nn::TransformerLayer>> layers;  // empty under tensor parallelism
  nn::Norm final_norm;
  nn::Parameter lm_head;  // [V, C], only when embeddings are untied (empty under tensor parallelism)
};

}  // namespace tessera::models
