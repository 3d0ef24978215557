// Small whole-model fixtures shared by the model-level tests: tiny configurations and the
// state a training run ends with, compared bit for bit between two runs that must agree.
#pragma once

#include <vector>

#include "testing.h"
#include "tessera/models/config.h"
#include "tessera/models/transformer_lm.h"

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

}  // namespace tessera::testing
