// model.recompute_activation (llama): the SwiGLU output is dropped after the forward and
// rewritten by the activation's backward. The training step must not change by a bit: loss
// and every gradient equal with the key on and off, on the CPU and (when present) the GPU.
// Also the config rules: default on, written only when off, an error outside llama; and
// model.keep_activation_layers, which exempts the last N layers.
#include "tessera/models/transformer_lm.h"
#include "gpu_testing.h"
#include "testing.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

models::ModelConfig small_llama() {
  models::ModelConfig c;
  c.architecture = "llama";
  c.vocab_size = 29;
  c.hidden_size = 16;
  c.num_layers = 2;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.intermediate_size = 24;  // F = 24: the CUDA kernels' 8-wide vector path
  c.max_seq_len = 16;
  return c;
}

// Loss and gradients of one forward_backward of a model built from c.
struct StepResult {
  double loss;
  std::vector<std::vector<double>> grads;
};

StepResult step(const models::ModelConfig& c, DType dtype, Context& ctx) {
  models::TransformerLM model(c, dtype);
  model.to(ctx.device);
  model.init(ctx, 5);
  const Tensor inputs = random_ids({2, 12}, c.vocab_size, 1).to(ctx.device);
  const Tensor targets = random_ids({2, 12}, c.vocab_size, 2).to(ctx.device);
  model.zero_grad();
  StepResult r{model.forward_backward(ctx, inputs, targets), {}};
  for (nn::Parameter* p : model.parameters()) r.grads.push_back(p->grad.to(Device::cpu()).to_doubles());
  return r;
}

void expect_equal(const StepResult& a, const StepResult& b, const std::string& what) {
  EXPECT_EQ(a.loss, b.loss) << what;
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (size_t i = 0; i < a.grads.size(); ++i) EXPECT_EQ(a.grads[i], b.grads[i]) << what << " parameter " << i;
}

// Every layer keeping h, every layer recomputing it, and the last layer alone keeping it
// (model.keep_activation_layers = 1): the same step to the bit.
void expect_same_step(Context& ctx, DType dtype) {
  models::ModelConfig keep = small_llama();
  keep.recompute_activation = false;
  const models::ModelConfig recompute = small_llama();
  models::ModelConfig partial = small_llama();
  partial.keep_activation_layers = 1;
  const StepResult a = step(keep, dtype, ctx), b = step(recompute, dtype, ctx), c = step(partial, dtype, ctx);
  expect_equal(a, b, std::string(dtype_name(dtype)) + " keep / recompute");
  expect_equal(a, c, std::string(dtype_name(dtype)) + " keep / keep in the last layer");
}

}  // namespace

TEST(RecomputeActivation, ConfigDefaultsOnAndRoundTrips) {
  const models::ModelConfig c = small_llama();
  EXPECT_TRUE(c.recompute_activation);
  EXPECT_FALSE(c.to_json().contains("recompute_activation"));  // the default is not written
  models::ModelConfig off = c;
  off.recompute_activation = false;
  EXPECT_FALSE(models::ModelConfig::from_json(off.to_json()).recompute_activation);
  models::TransformerLM on_model(c, DType::F32), off_model(off, DType::F32);
  EXPECT_TRUE(on_model.layers[0]->mlp.recompute_activation);
  EXPECT_FALSE(off_model.layers[0]->mlp.recompute_activation);

  nlohmann::json gpt2 = c.to_json();
  gpt2["architecture"] = "gpt2";
  gpt2["recompute_activation"] = false;
  EXPECT_THROW(models::ModelConfig::from_json(gpt2), Error);
}

TEST(RecomputeActivation, KeepActivationLayersPicksTheLastLayers) {
  models::ModelConfig c = small_llama();
  c.num_layers = 3;
  c.keep_activation_layers = 2;
  const models::ModelConfig back = models::ModelConfig::from_json(c.to_json());
  EXPECT_EQ(back.keep_activation_layers, 2);
  EXPECT_FALSE(small_llama().to_json().contains("keep_activation_layers"));  // the default is not written
  models::TransformerLM model(c, DType::F32);
  EXPECT_TRUE(model.layers[0]->mlp.recompute_activation);
  EXPECT_FALSE(model.layers[1]->mlp.recompute_activation);
  EXPECT_FALSE(model.layers[2]->mlp.recompute_activation);

  nlohmann::json too_many = c.to_json();
  too_many["keep_activation_layers"] = 4;
  EXPECT_THROW(models::ModelConfig::from_json(too_many), Error);
  too_many["keep_activation_layers"] = -1;
  EXPECT_THROW(models::ModelConfig::from_json(too_many), Error);
  nlohmann::json gpt2 = small_llama().to_json();
  gpt2["architecture"] = "gpt2";
  gpt2["keep_activation_layers"] = 1;
  EXPECT_THROW(models::ModelConfig::from_json(gpt2), Error);
}

TEST(RecomputeActivation, CpuStepIsBitIdentical) {
  Context ctx = Context::cpu();
  for (DType dtype : {DType::F32, DType::BF16}) expect_same_step(ctx, dtype);
}

TEST(RecomputeActivation, GpuStepIsBitIdentical) {
  REQUIRE_GPU();
  Context ctx = Context::cuda();
  for (DType dtype : {DType::F32, DType::BF16}) expect_same_step(ctx, dtype);
}
