// fp8.keep_weight_transpose (Fp8Scaling::keep_weight_transpose): with it off (the default)
// an FP8 linear layer keeps only its weight's scale from forward to backward and re-casts
// W^T in backward_input; with it on it keeps W^T's codes. On the CPU (the bit-matching
// emulation of the CUDA casts and GEMMs): a layer stack and small models (GPT-2 with biases
// and GELU, Llama with the fused SwiGLU casts and the FP8 LM head) give bit-identical
// outputs, losses, input and weight gradients, parameters and scaling state over several
// steps in every recipe, and the forward holds out x in bytes less per layer; the MoE FP8
// experts (a tiny Mixtral, one GroupedLinear) likewise.
#include <gtest/gtest.h>

#include "fp8_weight_transpose_testing.h"
#include "model_testing.h"
#include "testing.h"
#include "tessera/core/philox.h"
#include "tessera/models/fp8_model.h"
#include "tessera/models/transformer_lm.h"
#include "tessera/nn/moe.h"
#include "tessera/ops/moe.h"
#include "tessera/train/optimizer.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

const char* const kRecipes[] = {"delayed", "current", "block", "mxfp8"};

Tensor random_tokens(const Shape& shape, int64_t vocab, uint64_t seed) {
  Tensor t = Tensor::empty(shape, DType::I32);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<int32_t>()[i] = static_cast<int32_t>(philox_word(seed, 0, i) % vocab);
  return t;
}

size_t bytes_of_defined(std::initializer_list<const Tensor*> tensors) {
  size_t sum = 0;
  for (const Tensor* t : tensors)
    if (t->defined()) sum += t->nbytes();
  return sum;
}

// What a Linear keeps of its weight between forward and backward.
size_t weight_bytes_kept(const nn::Linear::Saved& s) {
  return bytes_of_defined({&s.w_fp8.data, &s.w_fp8.data_t, &s.w_fp8.scale_inv, &s.w_scale, &s.w_block.data,
                           &s.w_block.data_t, &s.w_block.scale_inv, &s.w_block.scale_inv_t, &s.w_block.gemm_scale_inv,
                           &s.w_block.gemm_scale_inv_t, &s.w_mx.data, &s.w_mx.data_t, &s.w_mx.scales,
                           &s.w_mx.scales_t});
}

// Everything a Linear keeps between forward and backward.
size_t bytes_kept(const nn::Linear::Saved& s) {
  return weight_bytes_kept(s) + bytes_of_defined({&s.x, &s.x_fp8.data, &s.x_fp8.data_t, &s.x_fp8.scale_inv,
                                                  &s.x_block.data, &s.x_block.data_t, &s.x_block.scale_inv,
                                                  &s.x_block.scale_inv_t, &s.x_mx.data, &s.x_mx.data_t,
                                                  &s.x_mx.scales, &s.x_mx.scales_t});
}

}  // namespace

TEST(Fp8WeightTranspose, DefaultIsOffAndTheKeyRoundTrips) {
  EXPECT_FALSE(fp8::Recipe::from_json({{"recipe", "delayed"}}).keep_weight_transpose);
  const fp8::Recipe on = fp8::Recipe::from_json({{"recipe", "block"}, {"keep_weight_transpose", true}});
  EXPECT_TRUE(on.keep_weight_transpose);
  EXPECT_TRUE(fp8::Recipe::from_json(on.to_json()).keep_weight_transpose);
  EXPECT_FALSE(fp8::Recipe::from_json({{"recipe", "delayed"}}).to_json().contains("keep_weight_transpose"));
  EXPECT_THROW(fp8::Recipe::from_json({{"recipe", "current"}, {"keep_weight_transpose", 3}}), Error);
  Context ctx = Context::cpu();
  EXPECT_TRUE(nn::Fp8Scaling(ctx, on, 1).keep_weight_transpose());
}

TEST(Fp8WeightTranspose, LayerStackIsBitIdentical) {
  Context ctx = Context::cpu();
  for (const char* recipe : kRecipes) {
    SCOPED_TRACE(recipe);
    const std::vector<Tensor> kept = run_fp8_stack(ctx, recipe, true, 3);
    const std::vector<Tensor> recast = run_fp8_stack(ctx, recipe, false, 3);
    ASSERT_EQ(kept.size(), recast.size());
    for (size_t i = 0; i < kept.size(); ++i) EXPECT_TRUE(same_bits(kept[i], recast[i])) << "result " << i;
  }
}

// Small models, three steps of two micro-batches each, with AdamW: the losses and, at the
// end, every parameter (value, master copy, gradient) and the scaling state.
TEST(Fp8WeightTranspose, ModelStepsAreBitIdentical) {
  Context ctx = Context::cpu();
  for (const char* arch : {"gpt2", "llama"}) {
    for (const char* recipe : kRecipes) {
      SCOPED_TRACE(std::string(arch) + " " + recipe);
      const models::ModelConfig c = tiny_model_config(arch, 32, 64, 16);
      const int64_t batch = 2, seq = 16;
      std::vector<std::vector<double>> losses;
      std::vector<std::vector<Tensor>> finals;
      for (const bool keep : {true, false}) {
        models::TransformerLM model(c, DType::BF16);
        model.init(ctx, 5);
        const bool head = std::string(arch) == "llama";
        auto scaling = models::enable_fp8(
            ctx, model,
            fp8::Recipe::from_json({{"recipe", recipe}, {"lm_head", head}, {"keep_weight_transpose", keep}}));
        EXPECT_EQ(scaling->keep_weight_transpose(), keep);
        train::OptimizerConfig oc;
        oc.lr = 1e-2;
        train::Optimizer optimizer(model.parameters(), oc);
        std::vector<double> step_losses;
        for (int step = 0; step < 3; ++step) {
          model.zero_grad();
          for (int micro = 0; micro < 2; ++micro) {
            Tensor inputs = random_tokens({batch, seq}, c.vocab_size, 10 * step + micro);
            Tensor targets = random_tokens({batch, seq}, c.vocab_size, 100 + 10 * step + micro);
            step_losses.push_back(model.forward_backward(ctx, inputs, targets, 0.5f));
            scaling->end_micro_batch(ctx);
          }
          optimizer.step(ctx, oc.lr);
          scaling->end_step(ctx);
        }
        losses.push_back(step_losses);
        std::vector<Tensor> final_state = parameter_state(model);
        for (const auto& [name, t] : scaling->state_dict()) final_state.push_back(t);
        finals.push_back(final_state);
      }
      expect_identical_runs(losses, finals);
    }
  }
}

// The memory the option saves: what each layer keeps from forward to backward is exactly
// its W^T codes (out x in bytes) less without it (per-tensor recipes keep the 4-byte scale
// instead of scale_inv; block and mxfp8 keep nothing of W instead of W^T and its scales).
TEST(Fp8WeightTranspose, ForwardKeepsLessByTheWeightTransposes) {
  Context ctx = Context::cpu();
  for (const char* recipe : kRecipes) {
    SCOPED_TRACE(recipe);
    nn::Norm norm("n", nn::NormKind::RMSNorm, 128, 1e-5f, DType::BF16);
    nn::MLP mlp("m", 128, 256, nn::Activation::SwiGLU, false, DType::BF16);
    nn::LayerNormMLP block(norm, mlp);
    nn::ParameterList params;
    block.parameters(params);
    uint64_t seed = 1;
    for (nn::Parameter* p : params) p->value.copy_from(random_tensor(p->value.shape(), DType::BF16, seed++));
    auto scaling = std::make_shared<nn::Fp8Scaling>(ctx, fp8::Recipe::from_json({{"recipe", recipe}}), 2);
    mlp.fc.use_fp8({scaling, 0});
    mlp.proj.use_fp8({scaling, 1});
    const Tensor x = random_tensor({64, 128}, DType::BF16, 50);
    size_t kept[2], weights[2];
    for (const bool keep : {false, true}) {
      scaling->set_keep_weight_transpose(keep);
      nn::LayerNormMLP::Saved saved;
      block.forward(ctx, x, saved);
      kept[keep] = bytes_kept(saved.mlp.fc_in) + bytes_kept(saved.mlp.proj_in);
      weights[keep] = weight_bytes_kept(saved.mlp.fc_in) + weight_bytes_kept(saved.mlp.proj_in);
      // The backward still runs from what was kept.
      block.backward_input(ctx, random_tensor({64, 128}, DType::BF16, 51), saved.norm, saved.mlp);
    }
    const size_t transposes = (512 * 128 + 128 * 256) * 1;  // fc [2 ffn, hidden], proj [hidden, ffn], FP8
    const bool per_tensor = std::string(recipe) == "delayed" || std::string(recipe) == "current";
    EXPECT_EQ(weights[0], per_tensor ? 2 * sizeof(float) : 0) << "off: the scales only";
    if (per_tensor) EXPECT_EQ(weights[1], transposes + 2 * sizeof(float));  // W^T + scale_inv
    else EXPECT_GT(weights[1], transposes);                                  // W^T + its block scales
    EXPECT_EQ(kept[1] - kept[0], weights[1] - weights[0]);
    EXPECT_GE(kept[1] - kept[0], transposes - 2 * sizeof(float));
  }
}

// The MoE FP8 experts: each expert's W^T re-cast in backward_input_fp8 with its kept scale.
// A tiny Mixtral (FP8 attention linears and experts), three steps: the same bits.
TEST(Fp8WeightTranspose, MixtralExpertsAreBitIdentical) {
  Context ctx = Context::cpu();
  const models::ModelConfig c = tiny_mixtral_config();
  for (const char* recipe : {"current", "delayed"}) {
    SCOPED_TRACE(recipe);
    std::vector<std::vector<double>> losses;
    std::vector<std::vector<Tensor>> finals;
    for (const bool keep : {true, false}) {
      models::TransformerLM model(c, DType::BF16);
      model.init(ctx, 3);
      auto scaling = models::enable_fp8(
          ctx, model, fp8::Recipe::from_json({{"recipe", recipe}, {"keep_weight_transpose", keep}}));
      EXPECT_EQ(model.layers[0]->moe->experts.fc.fp8_options()->keep_weight_transpose, keep);
      train::OptimizerConfig oc;
      oc.lr = 1e-2;
      train::Optimizer optimizer(model.parameters(), oc);
      std::vector<double> step_losses;
      for (int step = 0; step < 3; ++step) {
        model.zero_grad();
        step_losses.push_back(model.forward_backward(ctx, random_tokens({2, 16}, c.vocab_size, step),
                                                     random_tokens({2, 16}, c.vocab_size, 50 + step)));
        scaling->end_micro_batch(ctx);
        optimizer.step(ctx, oc.lr);
        scaling->end_step(ctx);
      }
      losses.push_back(step_losses);
      finals.push_back(parameter_state(model));
    }
    expect_identical_runs(losses, finals);
  }
}

// What a GroupedLinear keeps of its experts' weights: W^T per expert with rows (on), or only
// their scales (off); the dgrad is the same either way.
TEST(Fp8WeightTranspose, GroupedLinearKeepsOnlyTheScales) {
  Context ctx = Context::cpu();
  const std::vector<int64_t> splits = {5, 0, 11};
  nn::GroupedLinear layer("g", 3, 32, 48, DType::BF16);
  layer.weight.value.copy_from(random_tensor(layer.weight.value.shape(), DType::BF16, 7));
  const Tensor x = random_tensor({16, 32}, DType::BF16, 8), dy = random_tensor({16, 48}, DType::BF16, 9);
  Tensor dx[2];
  for (const bool keep : {false, true}) {
    MoEFp8Options o;
    o.keep_weight_transpose = keep;
    layer.use_fp8(o);
    nn::GroupedLinear::Fp8Saved saved;
    layer.forward_fp8(ctx, moe_fp8_quantize_rows(ctx, x, splits, o.forward_dtype(), o), saved);
    ASSERT_EQ(saved.w.experts.size(), 3u);
    for (size_t e = 0; e < 3; ++e) {
      EXPECT_FALSE(saved.w.experts[e].data.defined());
      EXPECT_EQ(saved.w.experts[e].data_t.defined(), keep && splits[e] > 0) << e;
    }
    EXPECT_EQ(saved.w.scales.empty(), keep);
    if (!keep) EXPECT_TRUE(saved.w.scales[0].defined() && !saved.w.scales[1].defined() && saved.w.scales[2].defined());
    dx[keep] = layer.backward_input_fp8(ctx, dy, saved);
  }
  EXPECT_TRUE(same_bits(dx[0], dx[1]));
}
