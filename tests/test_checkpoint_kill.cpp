// SIGKILL at random moments of a run that checkpoints every step (so most kills land in a
// checkpoint write, foreground or background): after every kill the newest checkpoint that
// verifies loads, and resuming until the end reproduces an uninterrupted run exactly.
//
// The run under test is a child process: this test binary again (/proc/self/exe), told by
// an environment variable to run CheckpointKill.Child, which trains with --resume semantics.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <random>
#include <thread>

#include "ckpt_testing.h"
#include "testing.h"
#include "tessera/train/checkpoint.h"
#include "tessera/train/trainer.h"

using namespace tessera;
using namespace ckpt_testing;
namespace fs = std::filesystem;

namespace {
constexpr const char* kChildEnv = "TESSERA_KILL_TEST_CONFIG";
constexpr int kSteps = 60;

nlohmann::json kill_config(const std::string& dir, const std::string& tokens, bool async) {
  nlohmann::json j = tiny_config(dir, "");
  j["data"].erase("text");
  j["data"]["path"] = tokens;
  j["training"]["steps"] = kSteps;
  j["training"]["checkpoint_interval"] = 1;
  j["training"]["checkpoint_keep_last"] = 3;
  j["training"]["async_checkpoint"] = async;
  return j;
}
}  // namespace

TEST(CheckpointKill, Child) {
  const char* config = std::getenv(kChildEnv);
  if (!config) GTEST_SKIP() << "runs only as the child process of CheckpointKill.SigkillDuringCheckpointWrites";
  train::train(train::RunConfig::from_json(nlohmann::json::parse(io::read_file(config))), {.resume = true, .quiet = true});
}

TEST(CheckpointKill, SigkillDuringCheckpointWrites) {
  const std::string work = temp_dir("kill");
  const std::string tokens = work + "/tokens.bin";
  train::prepare_text(write_text(work), *train::make_tokenizer({}), tokens);
  const std::string ref = work + "/ref";
  const auto ref_start = std::chrono::steady_clock::now();
  train::train(train::RunConfig::from_json(kill_config(ref, tokens, true)), {.quiet = true});
  const int ref_ms = static_cast<int>(
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - ref_start).count());
  const std::string ref_model = io::read_file(ref + "/checkpoints/step-000060/model.safetensors");
  // Kills land within the first fifth of a whole run's time after start-up, so that every
  // child (each resuming where the last one stopped) is still running on a fast machine
  // as on a slow one, for most of the rounds. The reference run's time is a poor guide on
  // a loaded machine (CI runs tests side by side), so a child that finishes before its kill
  // halves the window for the rounds after it.
  int kill_window_ms = 40 + std::max(20, ref_ms / 5);

  std::mt19937 rng(20261129);
  int killed_mid_run = 0, advanced = 0;
  for (bool async : {true, false}) {
    const std::string dir = work + (async ? "/async" : "/sync");
    const std::string config_path = work + (async ? "/async.json" : "/sync.json");
    io::write_file_atomically(config_path, kill_config(dir, tokens, async).dump());
    ::setenv(kChildEnv, config_path.c_str(), 1);
    int64_t last_step = 0;
    for (int round = 0; round < 10; ++round) {
      const pid_t pid = ::fork();
      ASSERT_GE(pid, 0);
      if (pid == 0) {
        ::execl("/proc/self/exe", "test_checkpoint_kill", "--gtest_filter=CheckpointKill.Child", static_cast<char*>(nullptr));
        ::_exit(127);
      }
      // Process start-up takes a few tens of ms; a step plus its checkpoint a few more.
      std::this_thread::sleep_for(
          std::chrono::milliseconds(std::uniform_int_distribution<int>(20, kill_window_ms)(rng)));
      ::kill(pid, SIGKILL);
      int status = 0;
      ASSERT_EQ(::waitpid(pid, &status, 0), pid);
      if (WIFSIGNALED(status)) {
        ++killed_mid_run;
      } else {
        ASSERT_EQ(WEXITSTATUS(status), 0) << "the child failed";
        kill_window_ms = std::max(30, kill_window_ms / 2);
      }
      // The newest checkpoint that verifies loads; checkpoints never go backwards.
      if (auto latest = train::latest_checkpoint(dir, false)) {
        models::TransformerLM model(train::checkpoint_model_config(*latest));
        const train::RunConfig rc = train::RunConfig::from_json(kill_config(dir, tokens, async));
        train::Optimizer optimizer(model.parameters(), rc.optimizer);
        const train::CheckpointState state = train::load_checkpoint(*latest, model, &optimizer);
        EXPECT_GE(state.step, last_step);
        if (state.step > last_step && WIFSIGNALED(status)) ++advanced;
        last_step = state.step;
      }
    }
    ::unsetenv(kChildEnv);
    // Finish in this process and compare with the uninterrupted run.
    const train::TrainResult r =
        train::train(train::RunConfig::from_json(kill_config(dir, tokens, async)), {.resume = true, .quiet = true});
    EXPECT_EQ(r.step, kSteps);
    EXPECT_EQ(losses(dir), losses(ref)) << (async ? "async" : "sync");
    EXPECT_EQ(io::read_file(dir + "/checkpoints/step-000060/model.safetensors"), ref_model) << (async ? "async" : "sync");
  }
  EXPECT_GE(killed_mid_run, 5) << "too few kills landed while a run was in progress";
  // Not asserted (it depends on the machine's speed), but worth seeing in the log.
  std::printf("%d of 20 children killed, %d of them after writing at least one new checkpoint\n", killed_mid_run,
              advanced);
  if (!HasFailure()) fs::remove_all(work);
}
