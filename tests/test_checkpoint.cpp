// Checkpoint hardening: manifests and checksums catch damaged files, --resume falls back
// to the newest checkpoint that verifies, retention deletes the right ones, and background
// writes produce exactly the bytes of synchronous ones.
#include "tessera/train/checkpoint.h"

#include <zlib.h>

#include <filesystem>

#include "ckpt_testing.h"
#include "testing.h"
#include "tessera/train/trainer.h"
#include "train/async_checkpoint.h"

using namespace tessera;
using namespace ckpt_testing;
namespace fs = std::filesystem;

namespace {

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

void flip_byte(const std::string& path, size_t offset) {
  std::string bytes = io::read_file(path);
  ASSERT_LT(offset, bytes.size());
  bytes[offset] = static_cast<char>(bytes[offset] ^ 0x5a);
  io::write_file_atomically(path, bytes);
}

std::map<std::string, std::string> files_of(const std::string& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out[e.path().filename().string()] = io::read_file(e.path().string());
  return out;
}

// A run with checkpoints at steps 2, 4, 6.
std::string run_with_checkpoints(const std::string& name, bool async = true) {
  const std::string dir = temp_dir(name);
  nlohmann::json j = tiny_config(dir, write_text(dir));
  j["training"]["steps"] = 6;
  j["training"]["checkpoint_interval"] = 2;
  j["training"]["async_checkpoint"] = async;
  train::train(train::RunConfig::from_json(j), {.quiet = true});
  return dir;
}

}  // namespace

TEST(Checkpoint, ManifestListsEveryFileWithItsChecksum) {
  const std::string dir = run_with_checkpoints("manifest");
  const std::vector<std::string> all = train::list_checkpoints(dir);
  ASSERT_EQ(all.size(), 3u);
  EXPECT_EQ(fs::path(all.back()).filename(), "step-000006");
  const auto manifest = nlohmann::json::parse(io::read_file(all.back() + "/manifest.json"));
  EXPECT_EQ(manifest["step"], 6);
  EXPECT_EQ(manifest["config_hash"].get<std::string>().rfind("crc32:", 0), 0u);
  for (const char* f : {"model.safetensors", "optimizer.safetensors", "state.json"}) {
    ASSERT_TRUE(manifest["files"].contains(f)) << f;
    EXPECT_EQ(manifest["files"][f]["bytes"].get<uint64_t>(), fs::file_size(all.back() + "/" + f));
    char crc[16];
    std::snprintf(crc, sizeof(crc), "%08x", train::crc32_file(all.back() + "/" + f));
    EXPECT_EQ(manifest["files"][f]["crc32"], crc);
  }
  for (const auto& d : all) EXPECT_EQ(train::checkpoint_problem(d), std::nullopt) << d;
  EXPECT_EQ(*train::latest_checkpoint(dir), all.back());
  // A checkpoint from before manifests (no manifest.json) is never picked by --resume auto,
  // but loads when named explicitly.
  fs::remove(all[0] + "/manifest.json");
  EXPECT_NE(train::checkpoint_problem(all[0])->find("manifest.json is missing"), std::string::npos);
  models::TransformerLM model(train::checkpoint_model_config(all[0]));
  EXPECT_EQ(train::load_checkpoint(all[0], model, nullptr).step, 2);
  // Known CRC-32 of "123456789" (the check value of the zlib polynomial).
  EXPECT_EQ(train::crc32_bytes("123456789", 9), 0xcbf43926u);
  // A buffer large enough to be summed on several threads gives zlib's one-pass value.
  std::vector<unsigned char> big(size_t(100) << 20);
  uint32_t state = 12345;
  for (auto& b : big) b = static_cast<unsigned char>((state = state * 1664525u + 1013904223u) >> 24);
  uLong serial = ::crc32(0, big.data(), static_cast<uInt>(big.size()));
  EXPECT_EQ(train::crc32_bytes(big.data(), big.size()), static_cast<uint32_t>(serial));
  serial = ::crc32(7, big.data(), static_cast<uInt>(big.size()));
  EXPECT_EQ(train::crc32_bytes(big.data(), big.size(), 7), static_cast<uint32_t>(serial));
}

TEST(Checkpoint, DamageIsDetectedAndNamedAndResumeFallsBack) {
  const std::string dir = run_with_checkpoints("damage");
  const std::vector<std::string> all = train::list_checkpoints(dir);
  const std::string newest = all[2], middle = all[1];

  // A flipped byte in the tensor data, deep in the file.
  const std::string model = newest + "/model.safetensors";
  flip_byte(model, fs::file_size(model) - 7);
  auto problem = train::checkpoint_problem(newest);
  ASSERT_TRUE(problem.has_value());
  EXPECT_NE(problem->find(model), std::string::npos) << *problem;
  EXPECT_NE(problem->find("corrupt"), std::string::npos) << *problem;
  EXPECT_NE(message_of([&] { train::verify_checkpoint(newest); }).find("model.safetensors"), std::string::npos);
  // load_checkpoint refuses it with the same message, naming the file.
  {
    models::TransformerLM m(train::checkpoint_model_config(newest));
    EXPECT_NE(message_of([&] { train::load_checkpoint(newest, m, nullptr); }).find("corrupt"), std::string::npos);
  }
  std::vector<std::string> skipped;
  EXPECT_EQ(*train::latest_checkpoint(dir, false, &skipped), middle);
  ASSERT_EQ(skipped.size(), 1u);

  // A truncated optimizer file in the middle one: the oldest is used.
  const std::string opt = middle + "/optimizer.safetensors";
  io::write_file_atomically(opt, io::read_file(opt).substr(0, 100));
  problem = train::checkpoint_problem(middle);
  ASSERT_TRUE(problem.has_value());
  EXPECT_NE(problem->find("truncated"), std::string::npos) << *problem;
  EXPECT_NE(problem->find("optimizer.safetensors"), std::string::npos) << *problem;
  EXPECT_EQ(*train::latest_checkpoint(dir, false), all[0]);

  // A damaged state.json and a missing manifest.
  flip_byte(all[0] + "/state.json", 3);
  EXPECT_NE(train::checkpoint_problem(all[0])->find("state.json"), std::string::npos);
  fs::remove(all[0] + "/manifest.json");
  EXPECT_NE(train::checkpoint_problem(all[0])->find("manifest.json"), std::string::npos);
  EXPECT_EQ(train::latest_checkpoint(dir, false), std::nullopt);
  // Resuming with checkpoints of which none verifies is an error, not a silent fresh start.
  nlohmann::json j = tiny_config(dir, dir + "/corpus.txt");
  j["training"]["steps"] = 6;
  const std::string msg = message_of([&] { train::train(train::RunConfig::from_json(j), {.resume = true, .quiet = true}); });
  EXPECT_NE(msg.find("verifies"), std::string::npos) << msg;
}

TEST(Checkpoint, ResumeAutoUsesTheOlderCheckpointAndReproducesTheRun) {
  const std::string straight = run_with_checkpoints("straight_ref");
  const std::string dir = run_with_checkpoints("fallback");
  const auto all = train::list_checkpoints(dir);
  flip_byte(all[2] + "/model.safetensors", 20);  // in the header
  nlohmann::json j = tiny_config(dir, dir + "/corpus.txt");
  j["training"]["steps"] = 6;
  j["training"]["checkpoint_interval"] = 2;
  const train::TrainResult r = train::train(train::RunConfig::from_json(j), {.resume = true, .quiet = true});
  EXPECT_EQ(r.step, 6);
  EXPECT_EQ(losses(dir), losses(straight));  // steps 5 and 6 redone from step 4, identically
  EXPECT_EQ(io::read_file(all[2] + "/model.safetensors"), io::read_file(straight + "/checkpoints/step-000006/model.safetensors"));
}

TEST(Checkpoint, RetentionKeepsTheNewestAndTheMilestones) {
  const std::string dir = temp_dir("retention");
  nlohmann::json j = tiny_config(dir, write_text(dir));
  j["training"]["steps"] = 9;
  j["training"]["checkpoint_interval"] = 1;
  j["training"]["checkpoint_keep_last"] = 2;
  j["training"]["checkpoint_keep_every"] = 4;
  train::train(train::RunConfig::from_json(j), {.quiet = true});
  std::vector<std::string> names;
  for (const auto& d : train::list_checkpoints(dir)) names.push_back(fs::path(d).filename().string());
  EXPECT_EQ(names, (std::vector<std::string>{"step-000004", "step-000008", "step-000009"}));
  for (const auto& e : fs::directory_iterator(dir + "/checkpoints"))
    EXPECT_EQ(e.path().string().find(".tmp"), std::string::npos) << e.path();
}

TEST(Checkpoint, AsyncWritesTheSameBytesAsSync) {
  const std::string src = run_with_checkpoints("async_src");
  models::TransformerLM model(train::checkpoint_model_config(src + "/checkpoints/step-000006"));
  const train::RunConfig config = train::RunConfig::from_json(tiny_config(src, src + "/corpus.txt"));
  train::Optimizer optimizer(model.parameters(), config.optimizer);
  const train::CheckpointState state = train::load_checkpoint(src + "/checkpoints/step-000006", model, &optimizer);
  const train::CheckpointSnapshot snapshot = train::snapshot_training_state(model, &optimizer, state);
  EXPECT_GT(snapshot.bytes(), 0u);

  const std::string sync_dir = temp_dir("sync_out"), async_dir = temp_dir("async_out");
  const std::string a = train::write_checkpoint(sync_dir, snapshot);
  std::string b;
  {
    train::AsyncCheckpointer writer(async_dir, {});
    // Two requests back to back: the second waits for the first (at most one in flight).
    writer.request(std::make_shared<const train::CheckpointSnapshot>(snapshot));
    writer.request(std::make_shared<const train::CheckpointSnapshot>(snapshot));
    writer.wait();
    b = writer.last_written();
  }
  EXPECT_EQ(fs::path(a).filename(), fs::path(b).filename());
  EXPECT_EQ(files_of(a), files_of(b));
  // And the source checkpoint, which the trainer wrote asynchronously, is reproduced too.
  EXPECT_EQ(files_of(a), files_of(src + "/checkpoints/step-000006"));
}

TEST(Checkpoint, AsyncAndSyncTrainingRunsWriteIdenticalCheckpoints) {
  const std::string a = run_with_checkpoints("run_sync", false), b = run_with_checkpoints("run_async", true);
  EXPECT_EQ(losses(a), losses(b));
  for (const char* step : {"step-000002", "step-000004", "step-000006"}) {
    const std::string da = a + "/checkpoints/" + step, db = b + "/checkpoints/" + step;
    EXPECT_EQ(io::read_file(da + "/model.safetensors"), io::read_file(db + "/model.safetensors")) << step;
    EXPECT_EQ(io::read_file(da + "/optimizer.safetensors"), io::read_file(db + "/optimizer.safetensors")) << step;
    // state.json records the config, which differs in out_dir and async_checkpoint only.
    auto sa = nlohmann::json::parse(io::read_file(da + "/state.json"));
    auto sb = nlohmann::json::parse(io::read_file(db + "/state.json"));
    for (auto* s : {&sa, &sb}) {
      (*s)["config"]["training"].erase("out_dir");
      (*s)["config"]["training"].erase("async_checkpoint");
      (*s)["config"]["data"].erase("text");
    }
    EXPECT_EQ(sa, sb) << step;
  }
  // Each checkpoint's stall is in the metrics.
  int stall_lines = 0;
  for (const auto& line : lines(b + "/metrics.jsonl"))
    if (line.contains("checkpoint_stall_ms")) {
      ++stall_lines;
      EXPECT_GE(line["checkpoint_stall_ms"].get<double>(), 0.0);
      EXPECT_TRUE(line["checkpoint_async"].get<bool>());
    }
  EXPECT_EQ(stall_lines, 3);
}
