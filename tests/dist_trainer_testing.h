// What the distributed trainer tests (test_dist_trainer.cpp, test_dist_tp_trainer.cpp) share:
// the tiny Llama run they train, the curve a run leaves in metrics.jsonl, and running the
// trainer on a sub-group of the world.
#pragma once

#include <nlohmann/json.hpp>

#include <fstream>
#include <string>
#include <vector>

#include "dist_testing.h"
#include "tessera/train/trainer.h"

namespace tessera::testing {

// Tiny Llama (GQA 4/2, vocabulary 257), 8 sequences of 16 tokens per step over all ranks
// (batch_size 2 per rank and micro-batch), 10 steps, validation every 5. The callers add
// training.parallel.
inline nlohmann::json tiny_llama_run(const std::string& out_dir, const std::string& text) {
  nlohmann::json j = nlohmann::json::parse(R"({
    "model": {"architecture": "llama", "vocab_size": 257, "hidden_size": 32, "num_layers": 2, "num_heads": 4,
              "num_kv_heads": 2, "intermediate_size": 48, "max_seq_len": 32, "rope_theta": 10000},
    "data": {"tokenizer": "byte", "validation_fraction": 0.1},
    "optimizer": {"lr": 0.01, "warmup_steps": 2},
    "training": {"steps": 10, "batch_size": 2, "global_batch_size": 8, "seq_len": 16, "eval_interval": 5,
                 "eval_batches": 4, "log_interval": 100}
  })");
  j["data"]["text"] = text;
  j["training"]["out_dir"] = out_dir;
  return j;
}

struct Curve {
  std::vector<double> loss, val_loss, grad_norm;
};

inline Curve read_curve(const std::string& dir) {
  Curve c;
  std::ifstream in(dir + "/metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (j.contains("loss")) c.loss.push_back(j["loss"].get<double>());
    if (j.contains("grad_norm")) c.grad_norm.push_back(j["grad_norm"].get<double>());
    if (j.contains("val_loss")) c.val_loss.push_back(j["val_loss"].get<double>());
  }
  return c;
}

// Runs train() on `group` (the ranks not in it, a null group, skip) and returns the curve
// rank 0 of the world sees. Collective over `world`.
inline Curve run(dist::ProcessGroup& world, dist::GroupPtr group, const nlohmann::json& j,
                 train::TrainOptions options = {}) {
  options.quiet = true;
  if (group) {
    options.world = group;
    train::train(train::RunConfig::from_json(j), options);
  }
  world.barrier();
  return read_curve(j["training"]["out_dir"].get<std::string>());
}

}  // namespace tessera::testing
