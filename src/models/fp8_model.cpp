#include "tessera/models/fp8_model.h"

namespace tessera::models {

namespace {

template <typename F>
void for_each_block_linear(TransformerLM& model, F&& f) {
  for (auto& layer : model.layers) {
    f(layer->attn.qkv);
    f(layer->attn.proj);
    f(layer->mlp.fc);
    f(layer->mlp.proj);
  }
}

}  // namespace

std::shared_ptr<nn::Fp8Scaling> enable_fp8(Context& ctx, TransformerLM& model, const fp8::Recipe& recipe) {
  int64_t count = 0;
  for_each_block_linear(model, [&](nn::Linear&) { ++count; });
  auto scaling = std::make_shared<nn::Fp8Scaling>(ctx, recipe, count);
  int64_t index = 0;
  for_each_block_linear(model, [&](nn::Linear& linear) { linear.use_fp8({scaling, index++}); });
  // MoE experts: per-expert weight scales in the recipe's format; delayed scaling from a
  // state of their own (every MoE layer's slots, one after another), the other recipes
  // current scaling. The router stays BF16. See docs/ops/moe.md, "FP8".
  std::vector<fp8::Role> expert_roles;
  for (auto& layer : model.layers)
    if (layer->moe) {
      const std::vector<fp8::Role> roles = layer->moe->experts.delayed_roles();
      expert_roles.insert(expert_roles.end(), roles.begin(), roles.end());
    }
  const auto expert_state =
      expert_roles.empty() ? nullptr : scaling->make_expert_state(ctx, std::move(expert_roles));
  int64_t base = 0;
  for (auto& layer : model.layers)
    if (layer->moe) {
      MoEFp8Options options = MoEFp8Options::from_recipe(recipe);
      options.delayed = expert_state;
      options.weight_cache = scaling->weight_cache();
      options.delayed_base = base;
      base += layer->moe->experts.delayed_slots();
      layer->moe->experts.use_fp8(options);
    }
  // fp8.lm_head: the head in FP8, per-tensor scaled whatever the recipe, in its format.
  if (recipe.lm_head) model.use_fp8_lm_head(std::visit([](const auto& c) { return c.format; }, recipe.config));
  return scaling;
}

void disable_fp8(TransformerLM& model) {
  for_each_block_linear(model, [](nn::Linear& linear) { linear.use_fp8({}); });
  for (auto& layer : model.layers)
    if (layer->moe) layer->moe->experts.use_fp8(std::nullopt);
  model.use_fp8_lm_head(std::nullopt);
}

std::shared_ptr<nn::Fp8Scaling> fp8_scaling_of(TransformerLM& model) {
  std::shared_ptr<nn::Fp8Scaling> found;
  for_each_block_linear(model, [&](nn::Linear& linear) {
    const auto& scaling = linear.fp8_binding().scaling;
    if (!scaling) return;
    TESSERA_CHECK(!found || found == scaling, "fp8_scaling_of: the block linears are bound to several Fp8Scaling ",
                  "states (bind them with one enable_fp8 call)");
    found = scaling;
  });
  return found;
}

}  // namespace tessera::models
