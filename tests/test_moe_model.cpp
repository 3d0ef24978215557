// MoE modules and the Mixtral model on the CPU: MoELayer against finite differences
// (aux losses included), a one-expert MoELayer equal bit for bit to the dense SwiGLU MLP,
// a tiny Mixtral's every parameter gradient against finite differences, the load
// statistics and the expert-bias update, and the config keys.
#include "tessera/nn/moe.h"

#include <cmath>

#include "tessera/models/transformer_lm.h"
#include "tessera/nn/mlp.h"
#include "model_testing.h"
#include "testing.h"

using namespace tessera;
using namespace tessera::testing;
using models::ModelConfig;
using models::TransformerLM;

namespace {

void randomize(nn::ParameterList params, uint64_t seed, float scale = 0.5f) {
  for (nn::Parameter* p : params) p->value.copy_from(random_tensor(p->value.shape(), p->value.dtype(), ++seed, -scale, scale));
}

nn::MoEOptions small_options() {
  nn::MoEOptions o;
  o.hidden = 6;
  o.ffn = 5;
  o.num_experts = 4;
  o.router.top_k = 2;
  o.router.aux_loss_coeff = 0.3f;
  o.router.z_loss_coeff = 0.2f;
  return o;
}

}  // namespace

TEST(MoELayer, GradientsMatchFiniteDifferences) {
  for (int variant = 0; variant < 3; ++variant) {
    Context ctx = Context::cpu();
    nn::MoEOptions o = small_options();
    if (variant == 1) {
      o.router.score = RouterScore::Sigmoid;
      o.router.num_groups = 2;
      o.router.topk_groups = 1;
    }
    if (variant == 2) o.router.capacity_factor = 0.6f;  // some tokens dropped
    nn::MoELayer layer("moe", o, DType::F64);
    nn::ParameterList params;
    layer.parameters(params);
    randomize(params, 100 + variant);
    Tensor x = random_tensor({7, 6}, DType::F64, 7 + variant);
    const Tensor w = random_tensor({7, 6}, DType::F64, 8 + variant);
    const float loss_scale = 0.5f;
    const auto loss = [&] {
      nn::MoELayer::Saved s;
      const Tensor y = layer.forward(ctx, x, s);
      const Tensor l = s.losses;
      return weighted_sum(y, w) + loss_scale * (l.item(0) + l.item(1));
    };
    nn::MoELayer::Saved saved;
    layer.forward(ctx, x, saved);
    if (variant == 2) {
      int64_t kept = 0;
      for (int64_t c : saved.splits) kept += c;
      EXPECT_LT(kept, 14) << "the capacity limit should drop some assignments";
    }
    saved.loss_scale = loss_scale;
    for (nn::Parameter* p : params) p->grad.fill_zero();
    const Tensor dx = layer.backward_input(ctx, w, saved);
    layer.backward_weight(ctx, w, saved);
    const std::string what = "variant " + std::to_string(variant);
    expect_gradient(dx, x, loss, what + " dx", 1e-6);
    for (nn::Parameter* p : params) expect_gradient(p->grad, p->value, loss, what + " " + p->name, 1e-6);
  }
}

TEST(MoELayer, OneExpertIsTheDenseSwigluMlpBitForBit) {
  Context ctx = Context::cpu();
  nn::MoEOptions o;
  o.hidden = 8;
  o.ffn = 6;
  o.num_experts = 1;
  o.router.top_k = 1;
  for (DType dt : {DType::F32, DType::BF16}) {
    nn::MoELayer moe("moe", o, dt);
    nn::MLP mlp("mlp", 8, 6, nn::Activation::SwiGLU, false, dt);
    nn::ParameterList params;
    moe.parameters(params);
    randomize(params, 3);
    mlp.fc.weight.value.copy_from(moe.experts.fc.weight.value);
    mlp.proj.weight.value.copy_from(moe.experts.proj.weight.value);
    const Tensor x = random_tensor({9, 8}, dt, 4);
    nn::MoELayer::Saved ms;
    nn::MLP::Saved ds;
    const Tensor a = moe.forward(ctx, x, ms), b = mlp.forward(ctx, x, ds);
    EXPECT_EQ(a.to_doubles(), b.to_doubles());
    const Tensor dy = random_tensor({9, 8}, dt, 5);
    const Tensor dxa = moe.backward_input(ctx, dy, ms), dxb = mlp.backward_input(ctx, dy, ds);
    // The router's softmax over one expert is constant 1: its gradient adds exact zeros.
    EXPECT_EQ(dxa.to_doubles(), dxb.to_doubles());
    moe.backward_weight(ctx, dy, ms);
    mlp.backward_weight(ctx, dy, ds);
    EXPECT_EQ(moe.experts.fc.weight.grad.to_doubles(), mlp.fc.weight.grad.to_doubles());
    EXPECT_EQ(moe.experts.proj.weight.grad.to_doubles(), mlp.proj.weight.grad.to_doubles());
  }
}

TEST(MoELayer, AllTokensOnOneExpertAndLoadStatistics) {
  Context ctx = Context::cpu();
  nn::MoEOptions o = small_options();
  o.router.top_k = 1;
  o.expert_bias_rate = 0.1f;
  nn::MoELayer layer("moe", o, DType::F32);
  nn::ParameterList params;
  layer.parameters(params);
  randomize(params, 9);
  // A router that sends everything to expert 2.
  Tensor router = Tensor::zeros({4, 6}, DType::F32);
  for (int64_t c = 0; c < 6; ++c) router.set_item(2 * 6 + c, 5.0);
  layer.router.weight.value.copy_from(router);
  const Tensor x = random_tensor({5, 6}, DType::F32, 10, 0.5f, 1.0f);
  nn::MoELayer::Saved s;
  const Tensor y = layer.forward(ctx, x, s);
  EXPECT_EQ(s.splits, (std::vector<int64_t>{0, 0, 5, 0}));
  for (double v : y.to_doubles()) EXPECT_TRUE(std::isfinite(v));
  const Tensor dx = layer.backward_input(ctx, random_tensor({5, 6}, DType::F32, 11), s);
  layer.backward_weight(ctx, Tensor(), s);
  for (double v : dx.to_doubles()) EXPECT_TRUE(std::isfinite(v));
  layer.record_load(s);
  layer.record_load(s);
  EXPECT_EQ(layer.load, (std::vector<int64_t>{0, 0, 10, 0}));
  layer.update_expert_bias(ctx);
  EXPECT_EQ(layer.load, (std::vector<int64_t>{0, 0, 0, 0}));
  const std::vector<float> bias = layer.expert_bias.to_floats();
  EXPECT_FLOAT_EQ(bias[0], 0.1f);
  EXPECT_FLOAT_EQ(bias[2], -0.1f);
}

namespace {

ModelConfig tiny_mixtral() {
  ModelConfig c;
  c.architecture = "mixtral";
  c.vocab_size = 11;
  c.hidden_size = 8;
  c.num_layers = 2;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.intermediate_size = 6;
  c.max_seq_len = 8;
  c.rope_theta = 100.0f;
  c.tie_embeddings = false;
  c.num_experts = 4;
  c.num_experts_per_tok = 2;
  c.router_aux_loss_coef = 0.05f;
  c.router_z_loss_coef = 0.01f;
  return c;
}

}  // namespace

TEST(Mixtral, ConfigKeysRoundTripAndCount) {
  const ModelConfig c = tiny_mixtral();
  const ModelConfig back = ModelConfig::from_json(c.to_json());
  EXPECT_EQ(back.to_json(), c.to_json());
  TransformerLM model(c);
  EXPECT_EQ(model.num_parameters(), c.num_parameters());
  // Dense configs keep their JSON (no MoE keys) and reject MoE keys.
  ModelConfig llama = c;
  llama.architecture = "llama";
  EXPECT_FALSE(llama.to_json().contains("num_experts"));
  nlohmann::json bad = llama.to_json();
  bad["num_experts"] = 4;
  EXPECT_THROW(ModelConfig::from_json(bad), Error);
  nlohmann::json bad_k = c.to_json();
  bad_k["num_experts_per_tok"] = 5;
  EXPECT_THROW(ModelConfig::from_json(bad_k), Error);
}

TEST(Mixtral, EveryGradientMatchesFiniteDifferences) {
  Context ctx = Context::cpu();
  TransformerLM model(tiny_mixtral(), DType::F64);
  model.init(ctx, 5);
  for (nn::Parameter* p : model.parameters())
    if (p->name.find("norm") == std::string::npos)
      p->value.copy_from(random_tensor(p->value.shape(), DType::F64, p->numel(), -0.5f, 0.5f));
  const Tensor inputs = Tensor::from_ints({1, 4, 7, 2, 9, 0, 3, 3, 10, 5}, {2, 5});
  const Tensor targets = Tensor::from_ints({4, 7, 2, 9, -100, 3, 3, 10, 5, 1}, {2, 5});
  model.zero_grad();
  const double loss = model.forward_backward(ctx, inputs, targets);
  EXPECT_GT(model.last_aux_loss(), 0.0);
  EXPECT_NEAR(loss - model.last_aux_loss(), model.forward_loss(ctx, inputs, targets), 1e-12);
  std::vector<Tensor> grads;
  for (nn::Parameter* p : model.parameters()) grads.push_back(p->grad.clone());
  // forward_backward's value is the objective (cross-entropy + aux losses); the gradients it
  // accumulates meanwhile are not looked at.
  size_t i = 0;
  for (nn::Parameter* p : model.parameters())
    expect_gradient(grads[i++], p->value, [&] { return model.forward_backward(ctx, inputs, targets); },
                    "mixtral " + p->name, 1e-6);
  // Every forward_backward above recorded its loads: 2 layers of 4 experts.
  const auto loads = model.expert_loads();
  ASSERT_EQ(loads.size(), 2u);
  int64_t total = 0;
  for (int64_t v : loads[0]) total += v;
  EXPECT_EQ(total % 20, 0);  // 10 tokens x top-2 per call
}

TEST(Mixtral, Bf16StepIsFiniteAndLossDrops) {
  Context ctx = Context::cpu();
  ModelConfig c = tiny_mixtral();
  c.expert_bias_rate = 0.01f;
  TransformerLM model(c, DType::BF16);
  model.init(ctx, 1);
  const Tensor inputs = Tensor::from_ints({1, 4, 7, 2, 9, 0, 3, 3, 10, 5}, {2, 5});
  const Tensor targets = Tensor::from_ints({4, 7, 2, 9, 6, 3, 3, 10, 5, 1}, {2, 5});
  double first = 0, last = 0;
  for (int step = 0; step < 30; ++step) {
    model.zero_grad();
    const double loss = model.forward_backward(ctx, inputs, targets);
    ASSERT_TRUE(std::isfinite(loss));
    if (step == 0) first = loss;
    last = loss;
    sgd_step(ctx, model, 0.5);
    model.update_expert_biases(ctx);
  }
  EXPECT_LT(last, first - 0.5);
}
