// The AdamW update overlapped with the backward (optimizer.overlap_backward,
// train::Optimizer::begin_step / mark_ready): the same weights, BF16 values and moments as
// the plain step to the bit, with one bucket, a bucket per parameter and buckets in between;
// the returned norm the plain step's to rounding; the update really runs inside the backward
// (on the CPU the weights have moved before step() is called); misuse is a clear error. On
// the CPU, and on the GPU where one is present (the side stream and its ordering against the
// backward; skipped, saying so, without one).
#include <cmath>

#include "tessera/models/transformer_lm.h"
#include "tessera/train/config.h"
#include "tessera/train/optimizer.h"
#include "gpu_testing.h"

using namespace tessera;
using namespace tessera::testing;
using models::ModelConfig;
using models::TransformerLM;

namespace {

// fn throws tessera::Error with `needle` in its message.
template <typename Fn>
void expect_error_contains(Fn&& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one saying \"" << needle << "\"";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

ModelConfig small_llama() {
  ModelConfig c;
  c.architecture = "llama";
  c.vocab_size = 301;
  c.hidden_size = 128;
  c.num_layers = 3;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.intermediate_size = 344;
  c.max_seq_len = 64;
  c.rope_theta = 10000.0f;
  c.tie_embeddings = true;  // the head's weight is final only once the embedding's backward is done
  return c;
}

train::OptimizerConfig optimizer_config(bool overlap) {
  train::OptimizerConfig oc;
  oc.lr = 3e-3;
  oc.warmup_steps = 0;
  oc.grad_clip = 0;
  oc.weight_decay = 0.1;
  oc.overlap_backward = overlap;
  return oc;
}

struct Run {
  std::vector<double> norms;
  std::vector<Tensor> weights, values, moments;  // on the CPU
};

// `steps` steps of a fresh model (init seed 5) on ctx, plain or overlapped with buckets of
// `bucket` elements.
Run train(Context& ctx, DType dtype, bool overlap, int64_t bucket, int steps) {
  TransformerLM model(small_llama(), dtype);
  model.to(ctx.device);
  model.init(ctx, 5);
  train::Optimizer optimizer(model.parameters(), optimizer_config(overlap));
  optimizer.set_overlap_bucket_elements(bucket);
  if (overlap) model.set_grad_ready_hook([&](Context& c, nn::Parameter& p) { optimizer.mark_ready(c, p); });
  Run run;
  for (int step = 1; step <= steps; ++step) {
    const double lr = 3e-3 / step;
    const Tensor inputs = random_ids({2, 33}, 301, 10 + step), targets = random_ids({2, 33}, 301, 20 + step);
    model.zero_grad();
    if (overlap) optimizer.begin_step(ctx, lr);
    model.forward_backward(ctx, inputs, targets);
    run.norms.push_back(optimizer.step(ctx, lr));
  }
  for (nn::Parameter* p : model.parameters()) {
    run.weights.push_back(p->weights().to(Device::cpu()));
    if (p->master.defined()) run.values.push_back(p->value.to(Device::cpu()));
  }
  for (const auto& [name, t] : optimizer.state()) run.moments.push_back(t.to(Device::cpu()));
  return run;
}

void expect_same_run(const Run& got, const Run& want, const std::string& what) {
  ASSERT_EQ(got.weights.size(), want.weights.size());
  for (size_t i = 0; i < want.weights.size(); ++i)
    EXPECT_EQ(bytes_of(got.weights[i]), bytes_of(want.weights[i])) << what << ": weights of parameter " << i;
  ASSERT_EQ(got.values.size(), want.values.size());
  for (size_t i = 0; i < want.values.size(); ++i)
    EXPECT_EQ(bytes_of(got.values[i]), bytes_of(want.values[i])) << what << ": BF16 values of parameter " << i;
  ASSERT_EQ(got.moments.size(), want.moments.size());
  for (size_t i = 0; i < want.moments.size(); ++i)
    EXPECT_EQ(bytes_of(got.moments[i]), bytes_of(want.moments[i])) << what << ": moment " << i;
  ASSERT_EQ(got.norms.size(), want.norms.size());
  for (size_t i = 0; i < want.norms.size(); ++i) {
    EXPECT_GT(want.norms[i], 0) << what;
    EXPECT_NEAR(got.norms[i], want.norms[i], 1e-12 * want.norms[i]) << what << ": norm of step " << i + 1;
  }
}

void check_equals_plain(Context& ctx, DType dtype) {
  const Run plain = train(ctx, dtype, false, 0, 3);
  // One bucket (nothing is full before step()), a bucket per parameter, and buckets of a
  // few parameters each.
  for (int64_t bucket : {int64_t(1) << 40, int64_t(1), int64_t(40000)})
    expect_same_run(train(ctx, dtype, true, bucket, 3), plain,
                    std::string(dtype_name(dtype)) + " buckets of " + std::to_string(bucket) + " elements");
}

}  // namespace

TEST(OptimizerOverlap, EqualsThePlainStepOnTheCpu) {
  Context cpu = Context::cpu();
  check_equals_plain(cpu, DType::F32);
  check_equals_plain(cpu, DType::BF16);
}

TEST(OptimizerOverlap, EqualsThePlainStepOnTheGpu) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  check_equals_plain(gpu, DType::BF16);
  check_equals_plain(gpu, DType::F32);
}

// On the CPU every op runs when called: with a bucket per parameter, the blocks' weights
// have their new values as soon as forward_backward returns, before step().
TEST(OptimizerOverlap, UpdatesDuringTheBackward) {
  Context cpu = Context::cpu();
  TransformerLM model(small_llama(), DType::F32);
  model.init(cpu, 5);
  train::Optimizer optimizer(model.parameters(), optimizer_config(true));
  optimizer.set_overlap_bucket_elements(1);
  model.set_grad_ready_hook([&](Context& c, nn::Parameter& p) { optimizer.mark_ready(c, p); });
  std::vector<Tensor> before;
  for (nn::Parameter* p : model.parameters()) before.push_back(p->weights().clone());
  model.zero_grad();
  optimizer.begin_step(cpu, 1e-3);
  EXPECT_TRUE(optimizer.armed());
  model.forward_backward(cpu, random_ids({2, 17}, 301, 1), random_ids({2, 17}, 301, 2));
  int moved = 0;
  const auto params = model.parameters();
  for (size_t i = 0; i < params.size(); ++i) moved += bytes_of(params[i]->weights()) != bytes_of(before[i]);
  EXPECT_EQ(moved, static_cast<int>(params.size())) << "every parameter is marked (and so updated) in the backward";
  optimizer.step(cpu, 1e-3);
  EXPECT_FALSE(optimizer.armed());
  EXPECT_EQ(optimizer.steps_taken(), 1);
}

TEST(OptimizerOverlap, MisuseIsAClearError) {
  Context cpu = Context::cpu();
  TransformerLM model(small_llama(), DType::F32);
  model.init(cpu, 5);
  {
    train::Optimizer off(model.parameters(), optimizer_config(false));
    EXPECT_THROW(off.begin_step(cpu, 1e-3), Error);  // overlap_backward is off
  }
  {
    train::OptimizerConfig clipped = optimizer_config(true);
    clipped.grad_clip = 1.0;
    train::Optimizer optimizer(model.parameters(), clipped);
    expect_error_contains([&] { optimizer.begin_step(cpu, 1e-3); }, "grad_clip = 0");
  }
  train::Optimizer optimizer(model.parameters(), optimizer_config(true));
  nn::Parameter stranger("stranger", {4}, DType::F32, false);
  optimizer.mark_ready(cpu, stranger);  // not armed: ignored
  optimizer.begin_step(cpu, 1e-3);
  EXPECT_THROW(optimizer.begin_step(cpu, 1e-3), Error);  // armed twice
  expect_error_contains([&] { optimizer.mark_ready(cpu, stranger); }, "not one of this optimizer's parameters");
  nn::Parameter* first = model.parameters()[0];
  first->grad.fill_zero();
  optimizer.mark_ready(cpu, *first);
  expect_error_contains([&] { optimizer.mark_ready(cpu, *first); }, "marked twice");
  expect_error_contains([&] { optimizer.step(cpu, 2e-3); }, "begin_step armed");
  EXPECT_FALSE(optimizer.armed());  // the failed step disarmed it
}

TEST(OptimizerOverlap, ConfigNeedsNoClipping) {
  const nlohmann::json clipped = {{"optimizer", {{"overlap_backward", true}, {"grad_clip", 1.0}}}};
  expect_error_contains([&] { train::RunConfig::from_json(clipped); }, "overlap_backward needs optimizer.grad_clip = 0");
  const train::RunConfig ok =
      train::RunConfig::from_json({{"optimizer", {{"overlap_backward", true}, {"grad_clip", 0.0}}}});
  EXPECT_TRUE(ok.optimizer.overlap_backward);
  EXPECT_TRUE(ok.to_json()["optimizer"]["overlap_backward"].get<bool>());
}
