// The training loop end to end on a tiny model: loss falls, resume is bit-identical,
// configs and data are validated, checkpoints are atomic and architecture-checked.
#include "tessera/train/trainer.h"

#include <filesystem>
#include <fstream>

#include "tessera/io/atomic_file.h"
#include "tessera/train/checkpoint.h"
#include "testing.h"

using namespace tessera;
namespace fs = std::filesystem;

namespace {

std::string temp_dir(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("tessera_trainer_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

std::string write_text(const std::string& dir, size_t repeats) {
  std::string text;
  for (size_t i = 0; i < repeats; ++i) text += "the quick brown fox jumps over the lazy dog " + std::to_string(i % 7) + ". ";
  const std::string path = dir + "/corpus.txt";
  io::write_file_atomically(path, text);
  return path;
}

std::vector<double> losses(const std::string& dir) {
  std::vector<double> out;
  std::ifstream in(dir + "/metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (j.contains("loss")) out.push_back(j.at("loss").get<double>());  // checkpoint lines have none
  }
  return out;
}

}  // namespace

static nlohmann::json make_config(const std::string& dir, const std::string& text) {
  nlohmann::json j = nlohmann::json::parse(R"({
    "model": {"architecture": "llama", "vocab_size": 257, "hidden_size": 32, "num_layers": 2, "num_heads": 4,
              "num_kv_heads": 2, "intermediate_size": 48, "max_seq_len": 32, "rope_theta": 10000},
    "data": {"tokenizer": "byte", "validation_fraction": 0.1},
    "optimizer": {"lr": 0.01, "warmup_steps": 2},
    "training": {"steps": 8, "batch_size": 4, "seq_len": 16, "eval_interval": 4, "eval_batches": 2, "grad_accum": 2}
  })");
  j["data"]["text"] = text;
  j["training"]["out_dir"] = dir;
  return j;
}

TEST(Trainer, LossFallsAndCheckpointsAreWritten) {
  const std::string dir = temp_dir("falls");
  const std::string text = write_text(dir, 400);
  nlohmann::json j = make_config(dir, text);
  j["training"]["steps"] = 30;
  const train::TrainResult r = train::train(train::RunConfig::from_json(j), {.quiet = true});
  const std::vector<double> l = losses(dir);
  ASSERT_EQ(l.size(), 30u);
  EXPECT_LT(l.back(), l.front() * 0.7) << "first " << l.front() << " last " << l.back();
  EXPECT_TRUE(std::isfinite(r.last_val_loss));
  ASSERT_TRUE(train::latest_checkpoint(dir).has_value());
  EXPECT_TRUE(fs::exists(*train::latest_checkpoint(dir) + "/model.safetensors"));
}

TEST(Trainer, ResumeIsBitIdentical) {
  const std::string straight = temp_dir("straight"), halves = temp_dir("halves");
  const std::string text = write_text(straight, 300);
  train::train(train::RunConfig::from_json(make_config(straight, text)), {.quiet = true});
  const train::RunConfig split = train::RunConfig::from_json(make_config(halves, text));
  train::train(split, {.quiet = true, .stop_after = 4});
  EXPECT_EQ(losses(halves).size(), 4u);
  train::train(split, {.resume = true, .quiet = true});
  const std::vector<double> a = losses(straight), b = losses(halves);
  ASSERT_EQ(a.size(), 8u);
  ASSERT_EQ(b.size(), 8u);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i], b[i]) << "step " << i + 1;
}

// With an fp8 section the blocks' linears train in FP8 (delayed scaling), and a resumed run
// continues exactly: the amax history and scales are part of the checkpoint.
TEST(Trainer, Fp8RunsAndResumesBitIdentically) {
  const std::string straight = temp_dir("fp8_straight"), halves = temp_dir("fp8_halves"), plain = temp_dir("fp8_plain");
  const std::string text = write_text(straight, 300);
  auto fp8_config = [&](const std::string& dir) {
    nlohmann::json j = make_config(dir, text);
    j["training"]["precision"] = "bf16";
    j["fp8"] = {{"recipe", "delayed"}, {"history_len", 4}};
    return j;
  };
  train::train(train::RunConfig::from_json(fp8_config(straight)), {.quiet = true});
  const train::RunConfig split = train::RunConfig::from_json(fp8_config(halves));
  train::train(split, {.quiet = true, .stop_after = 4});
  train::train(split, {.resume = true, .quiet = true});
  const std::vector<double> a = losses(straight), b = losses(halves);
  ASSERT_EQ(a.size(), 8u);
  ASSERT_EQ(b.size(), 8u);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i], b[i]) << "step " << i + 1;
  // FP8 really ran: the same run in BF16 gives other losses (but similar ones).
  nlohmann::json bf16 = make_config(plain, text);
  bf16["training"]["precision"] = "bf16";
  train::train(train::RunConfig::from_json(bf16), {.quiet = true});
  const std::vector<double> c = losses(plain);
  ASSERT_EQ(c.size(), 8u);
  EXPECT_NE(a.back(), c.back());
  EXPECT_NEAR(a.back(), c.back(), 0.15 * c.back());
  // FP8 needs BF16 compute, and the recipe's keys are checked.
  nlohmann::json f32 = fp8_config(plain);
  f32["training"]["precision"] = "fp32";
  EXPECT_THROW(train::train(train::RunConfig::from_json(f32), {.quiet = true}), Error);
  nlohmann::json bad = fp8_config(plain);
  bad["fp8"]["histroy_len"] = 3;
  EXPECT_THROW(train::RunConfig::from_json(bad), Error);
}

// Under gradient accumulation the FP8 weights are cast once per step (fp8.cache_weights, on
// by default): the run gives the same losses and weights as casting in every micro-batch.
TEST(Trainer, Fp8WeightCacheUnderGradientAccumulationChangesNoBit) {
  const std::string cached = temp_dir("fp8_cached"), uncached = temp_dir("fp8_uncached");
  const std::string text = write_text(cached, 300);
  auto config = [&](const std::string& dir, bool cache) {
    nlohmann::json j = make_config(dir, text);
    j["training"]["precision"] = "bf16";
    j["training"]["grad_accum"] = 3;
    j["training"]["steps"] = 4;
    j["fp8"] = {{"recipe", "delayed"}, {"history_len", 4}, {"cache_weights", cache}};
    return j;
  };
  train::train(train::RunConfig::from_json(config(cached, true)), {.quiet = true});
  train::train(train::RunConfig::from_json(config(uncached, false)), {.quiet = true});
  const std::vector<double> a = losses(cached), b = losses(uncached);
  ASSERT_EQ(a.size(), 4u);
  EXPECT_EQ(a, b);
  auto newest_model = [](const std::string& dir) {
    return io::read_file(dir + "/checkpoints/step-000004/model.safetensors");
  };
  EXPECT_EQ(newest_model(cached), newest_model(uncached));
}

TEST(Trainer, DatasetShorterThanOneBatchIsAClearError) {
  const std::string dir = temp_dir("short");
  const std::string text = write_text(dir, 1);  // ~50 bytes: fewer than 4 x 16 + 1 tokens
  try {
    train::train(train::RunConfig::from_json(make_config(dir, text)), {.quiet = true});
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("token"), std::string::npos) << e.what();
  }
}

TEST(Trainer, BadConfigsNameTheKey) {
  const std::string dir = temp_dir("badcfg");
  auto message = [&](nlohmann::json j) {
    try {
      train::RunConfig::from_json(j);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  nlohmann::json j = make_config(dir, "x");
  j["training"]["batchsize"] = 3;
  EXPECT_NE(message(j).find("training.batchsize"), std::string::npos);
  j = make_config(dir, "x");
  j["training"]["batch_size"] = "four";
  EXPECT_NE(message(j).find("training.batch_size"), std::string::npos);
  j = make_config(dir, "x");
  j["training"]["seq_len"] = 64;  // > model.max_seq_len
  EXPECT_NE(message(j).find("training.seq_len"), std::string::npos);
  j = make_config(dir, "x");
  j["optimizer"]["lr"] = -1;
  EXPECT_NE(message(j).find("optimizer.lr"), std::string::npos);
  j = make_config(dir, "x");
  j["model"]["num_heads"] = 5;
  EXPECT_NE(message(j).find("num_heads"), std::string::npos);
  j = make_config(dir, "x");
  j["model"]["vocab_size"] = 2.5e51;  // found by fuzz/fuzz_config: was undefined behaviour
  EXPECT_NE(message(j).find("vocab_size"), std::string::npos);
  j = make_config(dir, "x");
  j["training"]["rewind"]["loss_z"] = -1;
  EXPECT_NE(message(j).find("training.rewind"), std::string::npos);
  j = make_config(dir, "x");
  j["training"]["rewind"]["windw"] = 3;
  EXPECT_NE(message(j).find("training.rewind.windw"), std::string::npos);
  j = make_config(dir, "x");
  j["training"]["fault_injection"]["nan_grad_at_step"] = "three";
  EXPECT_NE(message(j).find("training.fault_injection.nan_grad_at_step"), std::string::npos);
  // Text that is not UTF-8 (found by fuzz/fuzz_config: the error message itself used to throw).
  try {
    train::yaml_text_to_json("model: {architecture: \xff\xfe}", "test");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("UTF-8"), std::string::npos) << e.what();
  }
}

TEST(Trainer, OverridesParseAsYamlScalars) {
  nlohmann::json j = nlohmann::json::object();
  train::apply_override(j, "training.steps=12");
  train::apply_override(j, "optimizer.lr=3e-4");
  train::apply_override(j, "training.out_dir=runs/x");
  train::apply_override(j, "model.tie_embeddings=false");
  EXPECT_EQ(j["training"]["steps"], 12);
  EXPECT_DOUBLE_EQ(j["optimizer"]["lr"].get<double>(), 3e-4);
  EXPECT_EQ(j["training"]["out_dir"], "runs/x");
  EXPECT_EQ(j["model"]["tie_embeddings"], false);
  EXPECT_THROW(train::apply_override(j, "noequals"), Error);
  EXPECT_THROW(train::apply_override(j, "training.steps.deeper=1"), Error);
}

TEST(Trainer, CheckpointOfAnotherArchitectureIsRefused) {
  const std::string dir = temp_dir("arch");
  const std::string text = write_text(dir, 300);
  nlohmann::json j = make_config(dir, text);
  j["training"]["steps"] = 2;
  train::train(train::RunConfig::from_json(j), {.quiet = true});
  const std::string ckpt = *train::latest_checkpoint(dir);
  const std::string before = io::read_file(ckpt + "/model.safetensors");
  j["model"]["architecture"] = "gpt2";
  j["model"]["num_kv_heads"] = 4;
  EXPECT_THROW(train::train(train::RunConfig::from_json(j), {.resume = true, .quiet = true}), Error);
  EXPECT_EQ(io::read_file(ckpt + "/model.safetensors"), before);  // nothing overwritten
}

TEST(Trainer, CorruptCheckpointIsAClearError) {
  const std::string dir = temp_dir("corrupt");
  const std::string text = write_text(dir, 300);
  nlohmann::json j = make_config(dir, text);
  j["training"]["steps"] = 2;
  train::train(train::RunConfig::from_json(j), {.quiet = true});
  const std::string model_file = *train::latest_checkpoint(dir) + "/model.safetensors";
  const std::string bytes = io::read_file(model_file);
  io::write_file_atomically(model_file, bytes.substr(0, bytes.size() / 2));
  EXPECT_THROW(train::train(train::RunConfig::from_json(j), {.resume = true, .quiet = true}), Error);
}

TEST(Trainer, InitFromAnotherRunsCheckpointStartsFromItsWeights) {
  const std::string first = temp_dir("init_a"), second = temp_dir("init_b");
  const std::string text = write_text(first, 300);
  nlohmann::json j = make_config(first, text);
  j["training"]["steps"] = 6;
  train::train(train::RunConfig::from_json(j), {.quiet = true});
  const double trained = losses(first).back();
  nlohmann::json k = make_config(second, text);
  k["training"]["steps"] = 1;
  k["training"]["init_from"] = first;
  train::train(train::RunConfig::from_json(k), {.quiet = true});
  // The first step of the fine-tune starts from trained weights, not from the random init.
  EXPECT_LT(losses(second).front(), losses(first).front());
  EXPECT_NEAR(losses(second).front(), trained, 0.5);
  k["training"]["init_from"] = second + "/nothing-here";
  EXPECT_THROW(train::train(train::RunConfig::from_json(k), {.quiet = true}), Error);
}
