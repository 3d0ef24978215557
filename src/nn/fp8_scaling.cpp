#include "tessera/nn/fp8_scaling.h"

#include <algorithm>

#include "tessera/ops/quantize.h"

namespace tessera::nn {

Fp8Scaling::Fp8Scaling(Context& ctx, const fp8::Recipe& recipe, int64_t num_linears)
    : recipe_(recipe), num_linears_(num_linears), keep_weight_transpose_(recipe.keep_weight_transpose) {
  TESSERA_CHECK(num_linears >= 0, "Fp8Scaling: num_linears must be >= 0, got ", num_linears);
  if (const auto* delayed = std::get_if<fp8::DelayedScalingConfig>(&recipe_.config)) {
    std::vector<fp8::Role> roles;
    for (int64_t l = 0; l < num_linears; ++l)
      roles.insert(roles.end(), {fp8::Role::Forward, fp8::Role::Forward, fp8::Role::Gradient});
    delayed_.emplace(ctx, *delayed, std::move(roles));
    format_ = delayed->format;
  } else if (const auto* current = std::get_if<fp8::CurrentScalingConfig>(&recipe_.config)) {
    margin_ = current->margin;
    power_of_two_ = current->power_of_two_scales;
    format_ = current->format;
  } else if (const auto* block = std::get_if<fp8::BlockScalingConfig>(&recipe_.config)) {
    kind_ = Kind::Block;
    format_ = block->format;
    power_of_two_ = block->power_of_two_scales;
  } else {
    kind_ = Kind::Mxfp8;
    format_ = std::get<fp8::Mxfp8Config>(recipe_.config).format;
  }
}

void Fp8Scaling::check_layer(int64_t layer) const {
  TESSERA_CHECK(layer >= 0 && layer < num_linears_, "Fp8Scaling: layer ", layer, " outside [0, ", num_linears_, ")");
}

DType Fp8Scaling::dtype(Slot slot) const {
  return fp8::fp8_dtype(format_, slot == kGradOutput ? fp8::Role::Gradient : fp8::Role::Forward);
}

fp8::QuantizedTensor Fp8Scaling::quantize(Context& ctx, const Tensor& x, int64_t layer, Slot slot, Tensor* scale_out) {
  check_layer(layer);
  TESSERA_CHECK(per_tensor(), "Fp8Scaling::quantize: the recipe \"", recipe_.name(),
                "\" is not per-tensor scaled (use quantize_block / quantize_mx)");
  return cast_with(
      ctx, layer, slot, [&](Tensor& x_amax) { amax(ctx, x, x_amax); },
      [&](const Tensor& scale, Tensor* x_amax) {
        if (scale_out) *scale_out = scale;
        return fp8::quantize_with_transpose(ctx, x, scale, dtype(slot), x_amax);
      });
}

fp8::BlockQuantizedTensor Fp8Scaling::quantize_block(Context& ctx, const Tensor& x, int64_t layer, Slot slot) const {
  check_layer(layer);
  TESSERA_CHECK(kind_ == Kind::Block, "Fp8Scaling::quantize_block: the recipe is \"", recipe_.name(), "\", not block");
  const auto& config = std::get<fp8::BlockScalingConfig>(recipe_.config);
  const BlockScaling blocks = slot == kWeight ? config.weights() : slot == kInput ? config.activations()
                                                                                  : config.gradients();
  return fp8::quantize_blockwise_with_transpose(ctx, x, blocks, dtype(slot));
}

fp8::MxQuantizedTensor Fp8Scaling::quantize_mx(Context& ctx, const Tensor& x, int64_t layer, Slot slot) const {
  check_layer(layer);
  TESSERA_CHECK(kind_ == Kind::Mxfp8, "Fp8Scaling::quantize_mx: the recipe is \"", recipe_.name(), "\", not mxfp8");
  return fp8::quantize_mxfp8_with_transpose(ctx, x, dtype(slot));
}

Fp8Scaling::CastTarget Fp8Scaling::cast_target(Context& ctx, int64_t layer, Slot slot) {
  check_layer(layer);
  TESSERA_CHECK(per_tensor(), "Fp8Scaling::cast_target: the recipe \"", recipe_.name(),
                "\" scales blocks, not tensors: a norm cannot cast its output for it (run the norm, then the "
                "linear layer's own block cast)");
  if (delayed_) return {delayed_->scale(3 * layer + slot), delayed_->pending_amax(3 * layer + slot)};
  return {Tensor(), Tensor::empty({1}, DType::F32, ctx.device)};
}

Tensor Fp8Scaling::current_scale(Context& ctx, const Tensor& amax, Slot slot) const {
  TESSERA_CHECK(!delayed_ && per_tensor(), "Fp8Scaling::current_scale: the recipe is \"", recipe_.name(),
                "\", not current scaling");
  Tensor scale = Tensor::empty({1}, DType::F32, ctx.device);
  fp8::scale_from_amax(ctx, amax, dtype(slot), margin_, power_of_two_, scale);
  return scale;
}

std::shared_ptr<fp8::DeviceDelayedScaling> Fp8Scaling::make_expert_state(Context& ctx, std::vector<fp8::Role> roles) {
  const auto* delayed = std::get_if<fp8::DelayedScalingConfig>(&recipe_.config);
  if (!delayed) return nullptr;
  TESSERA_CHECK(!expert_delayed_, "Fp8Scaling::make_expert_state: the experts' state exists already");
  expert_delayed_ = std::make_shared<fp8::DeviceDelayedScaling>(ctx, *delayed, std::move(roles));
  return expert_delayed_;
}

void Fp8Scaling::begin_step(int64_t micro_batches) {
  TESSERA_CHECK(!weight_cache_->has_deferred(), "Fp8Scaling::begin_step: the previous step's deferred weight ",
                "gradients were never computed (end_micro_batch or end_step missing)");
  cached_micro_batches_left_ = recipe_.cache_weights && micro_batches > 1 ? micro_batches : 0;
  if (cached_micro_batches_left_ > 0) {
    weight_cache_->open();
  } else if (weight_cache_->has_primed() || recipe_.cast_in_optimizer) {
    // fp8.cast_in_optimizer: the optimizer's casts serve this step, nothing else is kept;
    // with one micro-batch each is served once and then left to its user. Open without
    // primed casts too (the first step, after a resume or a rewind): the experts' forwards
    // then cast every expert, recording every expert's amax as the optimizer's casts do,
    // so that such a run repeats the uninterrupted one to the bit.
    cached_micro_batches_left_ = std::max<int64_t>(micro_batches, 1);
    weight_cache_->open(/*keep_new=*/false, /*serve_once=*/micro_batches <= 1);
  } else {
    weight_cache_->close();
  }
}

void Fp8Scaling::end_micro_batch(Context& ctx) {
  // After the step's last micro-batch nothing reads the casts again: they go before the
  // optimizer changes the weights, not only at end_step.
  if (cached_micro_batches_left_ > 0 && --cached_micro_batches_left_ == 0) {
    weight_cache_->flush(ctx);  // e.g. the experts' deferred weight gradients
    weight_cache_->close();
  }
  if (delayed_) delayed_->record(ctx);
  if (expert_delayed_) expert_delayed_->record(ctx);
}

void Fp8Scaling::end_step(Context& ctx) {
  // Deferred work left here missed the optimizer: done now so the state stays whole, then an error.
  const bool late = weight_cache_->has_deferred();
  weight_cache_->flush(ctx);
  weight_cache_->close();
  if (delayed_) delayed_->update(ctx);
  if (expert_delayed_) expert_delayed_->update(ctx);
  TESSERA_CHECK(!late, "Fp8Scaling::end_step: weight gradients were still deferred after the optimizer step (call ",
                "end_micro_batch after each of the micro-batches begin_step announced)");
}

std::map<std::string, Tensor> Fp8Scaling::state_dict() const {
  std::map<std::string, Tensor> out = delayed_ ? delayed_->state_dict("fp8.") : std::map<std::string, Tensor>{};
  if (expert_delayed_) out.merge(expert_delayed_->state_dict("fp8.experts."));
  return out;
}

void Fp8Scaling::load_state_dict(Context& ctx, const std::map<std::string, Tensor>& tensors) {
  if (delayed_) delayed_->load_state_dict(ctx, tensors, "fp8.");
  if (expert_delayed_ && tensors.count("fp8.experts.amax_history"))
    expert_delayed_->load_state_dict(ctx, tensors, "fp8.experts.");
}

}  // namespace tessera::nn
