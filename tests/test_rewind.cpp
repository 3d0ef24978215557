// Automatic rewinds: injected NaN gradients and loss spikes roll the run back to the last
// good state and skip the offending data, leaving exactly the model of a run that never
// saw that data; a persistent fault stops the run with a diagnosis.
#include <filesystem>

#include "ckpt_testing.h"
#include "testing.h"
#include "tessera/train/checkpoint.h"
#include "tessera/train/trainer.h"
#include "train/rewind.h"

using namespace tessera;
using namespace ckpt_testing;
namespace fs = std::filesystem;

namespace {

nlohmann::json rewind_config(const std::string& dir, const std::string& text) {
  nlohmann::json j = tiny_config(dir, text);
  j["training"]["steps"] = 16;
  j["training"]["rewind"] = {{"snapshot_interval", 4}, {"window", 20}, {"min_history", 5}, {"loss_z", 6.0}};
  return j;
}

std::vector<nlohmann::json> events(const std::string& dir) {
  return fs::exists(dir + "/events.jsonl") ? lines(dir + "/events.jsonl") : std::vector<nlohmann::json>{};
}

std::string final_model(const std::string& dir) { return io::read_file(*train::latest_checkpoint(dir) + "/model.safetensors"); }

}  // namespace

TEST(Rewind, RobustZScore) {
  const std::deque<double> h = {1.0, 1.1, 0.9, 1.0, 1.05, 0.95, 50.0};  // one outlier barely moves it
  EXPECT_NEAR(train::robust_z_score(h, 1.0), 0.0, 1e-9);
  EXPECT_GT(train::robust_z_score(h, 2.0), 6.0);
  EXPECT_LT(train::robust_z_score(h, 0.5), 0.0);
  EXPECT_TRUE(std::isnan(train::robust_z_score({1.0, 2.0}, 3.0)));
  // A constant history: the 1% floor keeps small wiggles from counting.
  EXPECT_LT(train::robust_z_score({2.0, 2.0, 2.0, 2.0}, 2.01), 1.0);

  train::RewindConfig c;
  c.min_history = 3;
  c.window = 5;
  c.grad_norm_z = 6;
  train::AnomalyDetector d(c);
  EXPECT_TRUE(d.check(1, NAN, 1.0).has_value());
  EXPECT_TRUE(d.check(1, 1.0, INFINITY).has_value());
  EXPECT_FALSE(d.check(1, 100.0, 100.0).has_value());  // too little history to call it a spike
  for (int s = 1; s <= 5; ++s) d.accept(s, 2.0 - 0.01 * s, 1.0 + 0.01 * s);
  EXPECT_FALSE(d.check(6, 1.9, 1.05).has_value());
  EXPECT_NE(d.check(6, 5.0, 1.05)->find("loss spike"), std::string::npos);
  EXPECT_NE(d.check(6, 1.9, 9.0)->find("gradient-norm spike"), std::string::npos);
}

TEST(Rewind, NanGradientAndLossSpikeRollBackAndSkipTheirData) {
  const std::string dir = temp_dir("rewind"), ref = temp_dir("rewind_ref");
  const std::string text = write_text(dir);
  nlohmann::json j = rewind_config(dir, text);
  j["training"]["fault_injection"] = {{"nan_grad_at_step", {7}}, {"loss_spike_at_step", {13}}};
  const train::TrainResult r = train::train(train::RunConfig::from_json(j), {.quiet = true});
  EXPECT_EQ(r.rewinds, 2);
  EXPECT_EQ(r.step, 16);
  const auto ev = events(dir);
  ASSERT_EQ(ev.size(), 2u);
  EXPECT_EQ(ev[0]["event"], "rewind");
  EXPECT_EQ(ev[0]["step"], 7);
  EXPECT_EQ(ev[0]["back_to_step"], 4);
  EXPECT_NE(ev[0]["reason"].get<std::string>().find("non-finite gradient norm"), std::string::npos) << ev[0];
  EXPECT_EQ(ev[1]["step"], 13);
  EXPECT_EQ(ev[1]["back_to_step"], 12);
  EXPECT_NE(ev[1]["reason"].get<std::string>().find("loss spike"), std::string::npos) << ev[1];

  // The same run without faults, told to skip the data of steps 7 and 13.
  nlohmann::json k = rewind_config(ref, text);
  k["training"]["skip_data_at_steps"] = {7, 13};
  const train::TrainResult rr = train::train(train::RunConfig::from_json(k), {.quiet = true});
  EXPECT_EQ(rr.rewinds, 0);
  EXPECT_EQ(final_model(dir), final_model(ref));
  EXPECT_EQ(losses(dir), losses(ref));  // metrics.jsonl holds no trace of the undone steps
  EXPECT_EQ(losses(dir).size(), 16u);
}

TEST(Rewind, FallsBackToTheLastVerifiedCheckpointWithoutSnapshots) {
  const std::string dir = temp_dir("rewind_ckpt"), ref = temp_dir("rewind_ckpt_ref");
  const std::string text = write_text(dir);
  nlohmann::json j = rewind_config(dir, text);
  j["training"]["steps"] = 8;
  j["training"]["checkpoint_interval"] = 3;
  j["training"]["rewind"]["snapshot_interval"] = 0;
  j["training"]["fault_injection"] = {{"nan_grad_at_step", {5}}};
  const train::TrainResult r = train::train(train::RunConfig::from_json(j), {.quiet = true});
  EXPECT_EQ(r.rewinds, 1);
  const auto ev = events(dir);
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0]["back_to_step"], 3);
  EXPECT_NE(ev[0]["from"].get<std::string>().find("step-000003"), std::string::npos);
  nlohmann::json k = rewind_config(ref, text);
  k["training"]["steps"] = 8;
  k["training"]["checkpoint_interval"] = 3;
  k["training"]["skip_data_at_steps"] = {5};
  train::train(train::RunConfig::from_json(k), {.quiet = true});
  EXPECT_EQ(final_model(dir), final_model(ref));
  EXPECT_EQ(losses(dir), losses(ref));
}

TEST(Rewind, PersistentFaultGivesUpWithADiagnosis) {
  const std::string dir = temp_dir("rewind_persistent");
  nlohmann::json j = rewind_config(dir, write_text(dir));
  j["training"]["rewind"]["max_rewinds"] = 2;
  j["training"]["fault_injection"] = {{"nan_grad_from_step", 6}};
  try {
    train::train(train::RunConfig::from_json(j), {.quiet = true});
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("giving up"), std::string::npos) << msg;
    EXPECT_NE(msg.find("3 faults within 1000 steps"), std::string::npos) << msg;
    EXPECT_NE(msg.find("non-finite gradient norm"), std::string::npos) << msg;
  }
  const auto ev = events(dir);
  ASSERT_EQ(ev.size(), 3u);
  EXPECT_EQ(ev[0]["event"], "rewind");
  EXPECT_EQ(ev[2]["event"], "give_up");
}

TEST(Rewind, DisabledKeepsTheOldHardError) {
  const std::string dir = temp_dir("rewind_off");
  nlohmann::json j = rewind_config(dir, write_text(dir));
  j["training"]["rewind"]["enabled"] = false;
  j["training"]["fault_injection"] = {{"nan_grad_at_step", {3}}};
  // The NaN gradient poisons the weights; the next step's loss is NaN.
  EXPECT_THROW(train::train(train::RunConfig::from_json(j), {.quiet = true}), Error);
}

TEST(Rewind, LowersTheLearningRateForAWhileWhenAsked) {
  const std::string dir = temp_dir("rewind_lr");
  nlohmann::json j = rewind_config(dir, write_text(dir));
  j["training"]["steps"] = 10;
  j["training"]["rewind"]["lr_scale"] = 0.5;
  j["training"]["rewind"]["lr_scale_steps"] = 2;
  j["training"]["fault_injection"] = {{"nan_grad_at_step", {6}}};
  train::train(train::RunConfig::from_json(j), {.quiet = true});
  const train::RunConfig c = train::RunConfig::from_json(j);
  for (const auto& line : lines(dir + "/metrics.jsonl")) {
    if (!line.contains("lr")) continue;
    const int64_t step = line["step"];
    const double expected = train::learning_rate(c.optimizer, step, 10) * (step == 6 || step == 7 ? 0.5 : 1.0);
    EXPECT_DOUBLE_EQ(line["lr"].get<double>(), expected) << "step " << step;
  }
}

// A mixture-of-experts model with auxiliary-loss-free balancing: the expert biases are state
// outside the parameters, moved after every step. A rewind puts them back with the weights,
// and a resumed run reads them from the checkpoint, so both equal the uninterrupted run.
TEST(Rewind, MixtureOfExpertsBiasesRollBackAndResume) {
  const std::string dir = temp_dir("rewind_moe"), ref = temp_dir("rewind_moe_ref"), halves = temp_dir("rewind_moe_halves");
  const std::string text = write_text(dir);
  auto moe_config = [&](const std::string& out) {
    nlohmann::json j = rewind_config(out, text);
    j["model"]["architecture"] = "mixtral";
    j["model"]["num_experts"] = 4;
    j["model"]["num_experts_per_tok"] = 2;
    j["model"]["expert_bias_rate"] = 0.05;
    j["model"]["tie_embeddings"] = false;
    return j;
  };
  nlohmann::json j = moe_config(dir);
  j["training"]["fault_injection"] = {{"nan_grad_at_step", {7}}};
  EXPECT_EQ(train::train(train::RunConfig::from_json(j), {.quiet = true}).rewinds, 1);
  nlohmann::json k = moe_config(ref);
  k["training"]["skip_data_at_steps"] = {7};
  train::train(train::RunConfig::from_json(k), {.quiet = true});
  EXPECT_EQ(losses(dir), losses(ref));
  EXPECT_EQ(final_model(dir), final_model(ref));
  // Every step logs its tokens per expert and layer: top-2 of 4 experts, 4 x 16 tokens.
  for (const nlohmann::json& line : lines(ref + "/metrics.jsonl")) {
    if (!line.contains("loss")) continue;
    ASSERT_TRUE(line.contains("expert_load")) << line;
    ASSERT_EQ(line["expert_load"].size(), 2u);
    for (const auto& layer : line["expert_load"]) {
      int64_t kept = 0;
      for (const auto& n : layer) kept += n.get<int64_t>();
      EXPECT_EQ(kept, 4 * 16 * 2) << line;
    }
  }
  // The checkpoint holds the biases (they moved: not all zero), and resuming at step 8
  // continues exactly.
  const nlohmann::json state =
      nlohmann::json::parse(io::read_file(*train::latest_checkpoint(ref) + "/state.json")).at("trainer");
  ASSERT_TRUE(state.contains("expert_bias"));
  EXPECT_EQ(state["expert_bias"].size(), 2u);  // one per layer
  bool moved = false;
  for (const auto& [name, entry] : state["expert_bias"].items())
    for (uint32_t bits : entry.at("f32_bits").get<std::vector<uint32_t>>()) moved = moved || bits != 0;
  EXPECT_TRUE(moved);
  nlohmann::json h = moe_config(halves);
  h["training"]["skip_data_at_steps"] = {7};
  const train::RunConfig split = train::RunConfig::from_json(h);
  train::train(split, {.quiet = true, .stop_after = 8});
  train::train(split, {.resume = true, .quiet = true});
  EXPECT_EQ(losses(halves), losses(ref));
}
