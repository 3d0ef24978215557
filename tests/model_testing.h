// Small whole-model fixtures shared by the model-level tests: tiny configurations and the
// state a training run ends with, compared bit for bit between two runs that must agree.
#pragma once

#include <string>
#include <vector>

#include "testing.h"
#include "tessera/fp8/recipe.h"
#include "tessera/models/config.h"
#include "tessera/models/fp8_model.h"
#include "tessera/models/transformer_lm.h"
#include "tessera/nn/mlp.h"
#include "tessera/train/optimizer.h"

namespace tessera::testing {

// A two-layer Mixtral of a few thousand parameters (4 experts, top-2, GQA 2/1, untied head):
// small enough for CPU tests that run several steps in several recipes.
inline models::ModelConfig tiny_mixtral_config() {
  models::ModelConfig c;
  c.architecture = "mixtral";
  c.vocab_size = 16;
  c.hidden_size = 32;
  c.num_layers = 2;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.intermediate_size = 48;
  c.max_seq_len = 16;
  c.tie_embeddings = false;
  c.num_experts = 4;
  c.num_experts_per_tok = 2;
  return c;
}

// Every parameter's value, master copy and gradient, in parameter order: what two runs
// that must be identical are compared on at the end (with same_bits).
inline std::vector<Tensor> parameter_state(models::TransformerLM& model) {
  std::vector<Tensor> state;
  for (nn::Parameter* p : model.parameters())
    for (const Tensor* t : {&p->value, &p->master, &p->grad}) state.push_back(*t);
  return state;
}

// Two runs' losses equal and their end states (parameter_state, plus anything appended)
// identical to the bit.
inline void expect_identical_runs(const std::vector<std::vector<double>>& losses,
                                  const std::vector<std::vector<Tensor>>& finals) {
  ASSERT_EQ(losses.size(), 2u);
  ASSERT_EQ(finals.size(), 2u);
  EXPECT_EQ(losses[0], losses[1]);
  ASSERT_EQ(finals[0].size(), finals[1].size());
  for (size_t i = 0; i < finals[0].size(); ++i) EXPECT_TRUE(same_bits(finals[0][i], finals[1][i])) << "tensor " << i;
}

// A tiny model of `arch` ("gpt2": biases, GELU; "llama": RMSNorm, SwiGLU) of two layers,
// two heads and a vocabulary of 64.
inline models::ModelConfig tiny_model_config(const std::string& arch, int64_t hidden, int64_t ffn, int64_t seq) {
  models::ModelConfig c;
  c.architecture = arch;
  c.vocab_size = 64;
  c.hidden_size = hidden;
  c.num_layers = 2;
  c.num_heads = 2;
  c.num_kv_heads = 2;
  c.intermediate_size = ffn;
  c.max_seq_len = seq;
  return c;
}

// Deterministic [batch, seq] I32 tokens and targets (a fixed function of the tokens, so a
// model can learn it) over `vocab`.
inline std::pair<Tensor, Tensor> cyclic_tokens(int64_t batch, int64_t seq, int64_t vocab) {
  Tensor inputs = Tensor::empty({batch, seq}, DType::I32), targets = Tensor::empty({batch, seq}, DType::I32);
  for (int64_t i = 0; i < batch * seq; ++i) {
    inputs.data<int32_t>()[i] = static_cast<int32_t>((i * 7) % vocab);
    targets.data<int32_t>()[i] = static_cast<int32_t>((3 * inputs.data<int32_t>()[i] + 1) % vocab);
  }
  return {inputs, targets};
}

// The model of `config` in FP8 (`recipe`), trained three optimizer steps twice on ctx's
// device (inputs and targets there already): with nn::MLP's fused activation casts and
// without. Losses and final weights must be the same bits. Restores the switch.
inline void expect_fused_fp8_activation_training_identical(Context& ctx, const models::ModelConfig& config,
                                                           const std::string& recipe, const Tensor& inputs,
                                                           const Tensor& targets) {
  const bool before = nn::MLP::fused_fp8_activation();
  std::vector<std::vector<double>> losses(2);
  std::vector<std::vector<Tensor>> finals(2);
  for (int k = 0; k < 2; ++k) {
    nn::MLP::set_fused_fp8_activation(k == 0);
    models::TransformerLM model(config, DType::BF16);
    if (ctx.device.is_cuda()) model.to(ctx.device);
    model.init(ctx, 5);
    auto scaling = models::enable_fp8(ctx, model, fp8::Recipe::from_json({{"recipe", recipe}}));
    train::OptimizerConfig oc;
    oc.lr = 1e-2;
    train::Optimizer optimizer(model.parameters(), oc);
    for (int step = 0; step < 3; ++step) {
      model.zero_grad();
      losses[k].push_back(model.forward_backward(ctx, inputs, targets));
      scaling->end_micro_batch(ctx);
      optimizer.step(ctx, oc.lr);
      scaling->end_step(ctx);
    }
    for (nn::Parameter* p : model.parameters()) finals[k].push_back(p->weights().to(Device::cpu()));
  }
  nn::MLP::set_fused_fp8_activation(before);
  expect_identical_runs(losses, finals);
}

// Plain SGD on the FP32 masters (w -= lr * grad), then the models' compute copies refreshed:
// the optimizer of the small "it learns" tests.
inline void sgd_step(Context& ctx, models::TransformerLM& model, double lr) {
  for (nn::Parameter* p : model.parameters()) {
    Tensor& w = p->weights();
    for (int64_t j = 0; j < w.numel(); ++j) w.set_item(j, w.item(j) - lr * p->grad.item(j));
  }
  model.refresh_values(ctx);
}

}  // namespace tessera::testing
