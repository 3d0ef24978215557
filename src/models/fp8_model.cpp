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
  // MoE experts: current scaling in the recipe's format (per-expert weight scales; the
  // router stays BF16). See docs/ops/moe.md, "FP8".
  for (auto& layer : model.layers)
    if (layer->moe) layer->moe->experts.use_fp8(MoEFp8Options::from_recipe(recipe));
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
