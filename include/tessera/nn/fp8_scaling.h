// FP8 for the linear layers of a model: the recipe and the scaling state they share.
//
// A linear layer in FP8 quantizes three tensors: its input and its weight (forward role,
// E4M3) and the gradient of its output (gradient role: E5M2 under the hybrid format). The
// recipes (fp8/recipe.h):
//  - "current" / "delayed" (per-tensor): one scale per tensor, either from its own amax just
//    before the cast ("current": one amax pass and a one-thread scale kernel, nothing read by
//    the host) or from the amax history of earlier steps ("delayed": DeviceDelayedScaling,
//    whose update runs once per step in one launch). quantize() gives a QuantizedTensor; the
//    GEMMs run in FP8 with FP32 accumulation (fp8_gemm: cuBLASLt on CUDA, the dequantized
//    reference on the CPU), the forward one with fast accumulation as Transformer Engine
//    does, the backward ones without.
//  - "block": one scale per 1x128 block of the input and of the output gradient, per 128x128
//    tile of the weight (quantize_block: a BlockQuantizedTensor with both orientations, each
//    blocked along its own K), multiplied by cuBLASLt's block-scaled FP8 GEMMs on CUDA and
//    the dequantized reference on the CPU (fp8_gemm_blockwise). No state.
//  - "mxfp8": 1x32 blocks with E8M0 scales for all three tensors (quantize_mx), EMULATED on
//    both devices (Hopper has no MXFP8 tensor cores): dequantized to BF16, BF16 GEMM
//    (fp8::mxfp8_gemm_emulated). The numerics of the recipe, no speed gain. No state.
#pragma once

#include <memory>
#include <optional>

#include "tessera/fp8/block_quantized_tensor.h"
#include "tessera/fp8/device_scaling.h"
#include "tessera/fp8/mx_quantized_tensor.h"
#include "tessera/fp8/quantized_tensor.h"
#include "tessera/fp8/recipe.h"
#include "tessera/fp8/weight_cache.h"

namespace tessera::nn {

class Fp8Scaling {
 public:
  // Which of a linear layer's three tensors.
  enum Slot { kInput = 0, kWeight = 1, kGradOutput = 2 };

  // How the recipe scales: one scale per tensor (current, delayed), 1x128 / 128x128 blocks
  // (block), or MXFP8's 1x32 E8M0 blocks (mxfp8).
  enum class Kind { PerTensor, Block, Mxfp8 };

  // State for `num_linears` layers on ctx.device, for any of the four recipes.
  Fp8Scaling(Context& ctx, const fp8::Recipe& recipe, int64_t num_linears);

  const fp8::Recipe& recipe() const { return recipe_; }
  Kind kind() const { return kind_; }
  bool per_tensor() const { return kind_ == Kind::PerTensor; }
  int64_t num_linears() const { return num_linears_; }
  // The FP8 dtype of tensor `slot` (the recipe's format: E5M2 for kGradOutput under hybrid).
  DType dtype(Slot slot) const;

  // fp8.keep_weight_transpose (recipe.h): whether the linear layers keep W^T's codes from
  // forward to backward (true) or re-cast them in backward from the BF16 weight with the
  // forward's scale (false, the default: the same bits, less memory held). Settable for tests.
  bool keep_weight_transpose() const { return keep_weight_transpose_; }
  void set_keep_weight_transpose(bool keep) { keep_weight_transpose_ = keep; }

  // Per-tensor recipes: x cast to FP8 with its transposed copy, scaled as the recipe says, for
  // tensor `slot` of linear `layer`. Under delayed scaling the amax lands in the state's
  // pending slot. Throws for block and mxfp8 (quantize_block / quantize_mx). scale_out, when
  // given, receives the scale the codes were cast with (F32 [1] on the device: delayed
  // scaling's state slot, which only end_step changes, or current scaling's fresh scale), so
  // that a later fp8::quantize_with_transpose of the same x with it gives the same codes.
  fp8::QuantizedTensor quantize(Context& ctx, const Tensor& x, int64_t layer, Slot slot, Tensor* scale_out = nullptr);

  // The one place that says how a per-tensor recipe casts tensor `slot` of `layer`, for every
  // cast (quantize, a norm's FP8 output, the fused SwiGLU casts):
  //  - delayed scaling: at once with the state's scale, recording the amax in its pending
  //    slot: cast(scale, &pending_amax);
  //  - current scaling: the amax first, amax(amax_out) (a pass over the values to be cast,
  //    filling the F32 [1] amax_out), then cast(scale_made_from_it, nullptr).
  // cast(const Tensor& scale, Tensor* amax_or_null) returns what cast_with returns.
  template <typename Amax, typename Cast>
  auto cast_with(Context& ctx, int64_t layer, Slot slot, Amax&& amax, Cast&& cast) {
    CastTarget target = cast_target(ctx, layer, slot);
    if (scale_known_before_cast()) return cast(target.scale, &target.amax);
    amax(target.amax);
    return cast(current_scale(ctx, target.amax, slot), static_cast<Tensor*>(nullptr));
  }
  // "block": x cast in both orientations with the slot's blocks (kWeight: 128x128 tiles; kInput,
  // kGradOutput: 1x128 blocks, the column-wise copy quantized separately from x^T).
  fp8::BlockQuantizedTensor quantize_block(Context& ctx, const Tensor& x, int64_t layer, Slot slot) const;
  // "mxfp8": x cast in both orientations with 1x32 E8M0 blocks.
  fp8::MxQuantizedTensor quantize_mx(Context& ctx, const Tensor& x, int64_t layer, Slot slot) const;

  // For a cast made outside quantize (a norm writing FP8 straight into the linear layer,
  // ops/norm.h's *_forward_fp8), per-tensor recipes only (block and mxfp8 throw: their layers
  // run the norm unfused, then the block cast): what tensor `slot` of `layer` is cast with. Delayed scaling:
  // its current scale and the pending amax slot the cast writes (the cast can run at once).
  // Current scaling: scale undefined and a fresh amax, which the cast must fill first (the
  // norm's statistics pass); current_scale then gives the scale to cast with.
  struct CastTarget {
    Tensor scale, amax;
  };
  CastTarget cast_target(Context& ctx, int64_t layer, Slot slot);
  bool scale_known_before_cast() const { return delayed_.has_value(); }
  Tensor current_scale(Context& ctx, const Tensor& amax, Slot slot) const;

  // Before a step's first micro-batch: with the recipe's cache_weights and more than one
  // micro-batch, opens the weight cache, so that each FP8 weight is cast once this step
  // (fp8/weight_cache.h); the `micro_batches`-th end_micro_batch closes it again, before the
  // optimizer changes the weights. Without begin_step nothing is cached.
  void begin_step(int64_t micro_batches);
  // After each micro-batch / once per step (delayed scaling's bookkeeping; no-ops for
  // current). end_step also closes the weight cache.
  void end_micro_batch(Context& ctx);
  void end_step(Context& ctx);
  // The cache the linear layers and MoE experts take their weights' casts from (never null).
  const std::shared_ptr<fp8::WeightCache>& weight_cache() const { return weight_cache_; }

  // Delayed scaling of a model's MoE experts (GroupedMLP::delayed_roles of every MoE layer,
  // one after another): a second DeviceDelayedScaling with the recipe's config, made once,
  // then recorded and updated with the linears' state by end_micro_batch / end_step and kept
  // in the checkpoint under "fp8.experts." (a checkpoint without those tensors, from before
  // the experts had delayed scales, leaves the fresh state). Null for the other recipes.
  std::shared_ptr<fp8::DeviceDelayedScaling> make_expert_state(Context& ctx, std::vector<fp8::Role> roles);
  const std::shared_ptr<fp8::DeviceDelayedScaling>& expert_state() const { return expert_delayed_; }
  // Delayed scaling's state, for checkpoints (empty for current, block and mxfp8: no history).
  std::map<std::string, Tensor> state_dict() const;
  void load_state_dict(Context& ctx, const std::map<std::string, Tensor>& tensors);

 private:
  void check_layer(int64_t layer) const;

  fp8::Recipe recipe_;
  Kind kind_ = Kind::PerTensor;
  fp8::Format format_ = fp8::Format::Hybrid;
  int64_t num_linears_;
  std::optional<fp8::DeviceDelayedScaling> delayed_;
  std::shared_ptr<fp8::DeviceDelayedScaling> expert_delayed_;
  float margin_ = 0;
  bool power_of_two_ = false;
  bool keep_weight_transpose_ = false;
  std::shared_ptr<fp8::WeightCache> weight_cache_ = std::make_shared<fp8::WeightCache>();
  int64_t cached_micro_batches_left_ = 0;  // end_micro_batch calls until the cache closes
};

// The FP8 setting of one linear layer: the shared state and the layer's index in it.
struct Fp8Binding {
  std::shared_ptr<Fp8Scaling> scaling;
  int64_t layer = 0;
};

}  // namespace tessera::nn
