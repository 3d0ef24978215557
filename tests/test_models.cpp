// Whole-model checks: parameter counts, and the gradient of the loss of a tiny GPT-2 and
// a tiny Llama against FP64 finite differences, through every module at once.
#include "tessera/models/transformer_lm.h"

#include "tessera/ops/elementwise.h"
#include "tessera/train/optimizer.h"
#include "testing.h"

using namespace tessera;
using namespace tessera::testing;
using models::ModelConfig;
using models::TransformerLM;

TEST(ModelConfig, ParameterCountsOfPublishedModels) {
  EXPECT_EQ(ModelConfig::gpt2_124m().num_parameters(), 124439808);
  EXPECT_EQ(ModelConfig::llama32_1b().num_parameters(), 1235814400);
}

TEST(ModelConfig, CountMatchesTheBuiltModel) {
  for (const char* arch : {"gpt2", "llama"}) {
    for (bool tied : {true, false}) {
      ModelConfig c;
      c.architecture = arch;
      c.vocab_size = 37;
      c.hidden_size = 24;
      c.num_layers = 2;
      c.num_heads = 4;
      c.num_kv_heads = c.is_gpt2() ? 4 : 2;
      c.max_seq_len = 16;
      c.tie_embeddings = tied;
      TransformerLM model(c);
      EXPECT_EQ(model.num_parameters(), c.num_parameters()) << arch << " tied=" << tied;
    }
  }
}

TEST(ModelConfig, Gpt2SmallBuildsWithTheExactCount) {
  TransformerLM model(ModelConfig::gpt2_124m());
  EXPECT_EQ(model.num_parameters(), 124439808);
}

TEST(ModelConfig, BadValuesNameTheKey) {
  auto message = [](const nlohmann::json& j) {
    try {
      ModelConfig::from_json(j);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message({{"hidden_sise", 64}}).find("unknown key \"hidden_sise\""), std::string::npos);
  EXPECT_NE(message({{"num_heads", 5}, {"hidden_size", 64}}).find("num_heads"), std::string::npos);
  EXPECT_NE(message({{"architecture", "bert"}}).find("architecture"), std::string::npos);
  EXPECT_NE(message({{"vocab_size", "many"}}).find("vocab_size"), std::string::npos);
  const ModelConfig c = ModelConfig::from_json(ModelConfig::llama32_1b().to_json());
  EXPECT_EQ(c.num_parameters(), 1235814400);
}

static ModelConfig tiny(const char* arch, bool tied) {
  ModelConfig c;
  c.architecture = arch;
  c.vocab_size = 11;
  c.hidden_size = 8;
  c.num_layers = 2;
  c.num_heads = 2;
  c.num_kv_heads = c.is_gpt2() ? 2 : 1;
  c.intermediate_size = 12;
  c.max_seq_len = 8;
  c.rope_theta = 100.0f;
  c.tie_embeddings = tied;
  return c;
}

// Every parameter's analytic gradient against central differences of the mean loss.
static void check_model_gradients(const ModelConfig& config) {
  Context ctx = Context::cpu();
  TransformerLM model(config, DType::F64);
  model.init(ctx, 5);
  // Larger weights than the 0.02 init so every path carries a visible gradient.
  for (nn::Parameter* p : model.parameters())
    if (p->name.find("norm") == std::string::npos) p->value.copy_from(random_tensor(p->value.shape(), DType::F64, p->numel(), -0.5f, 0.5f));
  Tensor inputs = Tensor::from_ints({1, 4, 7, 2, 9, 0, 3, 3, 10, 5}, {2, 5});
  Tensor targets = Tensor::from_ints({4, 7, 2, 9, -100, 3, 3, 10, 5, 1}, {2, 5});
  model.zero_grad();
  const double loss = model.forward_backward(ctx, inputs, targets);
  EXPECT_TRUE(std::isfinite(loss));
  for (nn::Parameter* p : model.parameters()) {
    expect_gradient(p->grad, p->value, [&] { return model.forward_loss(ctx, inputs, targets); },
                    config.architecture + " " + p->name, 1e-6);
  }
}

TEST(ModelGradients, TinyGpt2MatchesFiniteDifferences) { check_model_gradients(tiny("gpt2", true)); }
TEST(ModelGradients, TinyLlamaMatchesFiniteDifferences) { check_model_gradients(tiny("llama", false)); }
TEST(ModelGradients, TinyLlamaTiedMatchesFiniteDifferences) { check_model_gradients(tiny("llama", true)); }

TEST(TransformerLM, LogitsAgreeWithTheLoss) {
  Context ctx = Context::cpu();
  TransformerLM model(tiny("llama", false), DType::F64);
  model.init(ctx, 3);
  Tensor inputs = Tensor::from_ints({1, 2, 3}, {1, 3}), targets = Tensor::from_ints({2, 3, 4}, {1, 3});
  const Tensor logits = model.logits(ctx, inputs);
  double want = 0;
  for (int t = 0; t < 3; ++t) {
    double m = -1e300, s = 0;
    for (int v = 0; v < 11; ++v) m = std::max(m, logits.item(t * 11 + v));
    for (int v = 0; v < 11; ++v) s += std::exp(logits.item(t * 11 + v) - m);
    want += (m + std::log(s) - logits.item(t * 11 + targets.item(t))) / 3;
  }
  EXPECT_NEAR(model.forward_loss(ctx, inputs, targets), want, 1e-6);  // logits are F32
}

TEST(TransformerLM, RejectsBadInputs) {
  Context ctx = Context::cpu();
  TransformerLM model(tiny("gpt2", true));
  model.init(ctx, 1);
  Tensor too_long = Tensor::zeros({1, 9}, DType::I32);
  EXPECT_THROW(model.forward_loss(ctx, too_long, too_long), Error);
  Tensor bad_id = Tensor::from_ints({1, 11}, {1, 2});
  EXPECT_THROW(model.forward_loss(ctx, bad_id, Tensor::from_ints({1, 1}, {1, 2})), Error);
  EXPECT_THROW(TransformerLM(tiny("gpt2", true), DType::F16), Error);
}

// Mixed precision: BF16 values, FP32 master weights and gradients. The BF16 model computes
// nearly the F32 model's loss, and an optimizer step updates the master and refreshes the
// BF16 value from it.
TEST(TransformerLM, Bf16MixedPrecisionKeepsFp32MastersAndGradients) {
  Context ctx = Context::cpu();
  TransformerLM f32(tiny("llama", false), DType::F32), bf16(tiny("llama", false), DType::BF16);
  f32.init(ctx, 7);
  bf16.init(ctx, 7);
  Tensor inputs = Tensor::from_ints({1, 4, 7, 2, 9, 0, 3, 3}, {2, 4});
  Tensor targets = Tensor::from_ints({4, 7, 2, 9, 0, 3, 3, 10}, {2, 4});
  f32.zero_grad();
  bf16.zero_grad();
  const double want = f32.forward_backward(ctx, inputs, targets);
  const double got = bf16.forward_backward(ctx, inputs, targets);
  EXPECT_NEAR(got, want, 1e-2 * want);
  auto a = f32.parameters(), b = bf16.parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(b[i]->value.dtype(), DType::BF16) << b[i]->name;
    ASSERT_EQ(b[i]->master.dtype(), DType::F32) << b[i]->name;
    ASSERT_EQ(b[i]->grad.dtype(), DType::F32) << b[i]->name;
    // Same initial weights up to BF16 rounding of the values.
    EXPECT_EQ(relative_error(b[i]->master, a[i]->value), 0.0) << b[i]->name;
    EXPECT_LT(relative_error(b[i]->grad, a[i]->grad), 5e-2) << b[i]->name;
  }
  train::OptimizerConfig oc;
  oc.warmup_steps = 0;
  train::Optimizer optimizer(bf16.parameters(), oc);
  optimizer.step(ctx, 1e-2);
  for (nn::Parameter* p : bf16.parameters()) {
    Tensor rounded = Tensor::empty(p->value.shape(), DType::BF16);
    cast(ctx, p->master, rounded);
    EXPECT_EQ(relative_error(p->value, rounded), 0.0) << p->name << ": value must be the rounded master";
  }
}
