// What the distributed trainer tests (test_dist_trainer.cpp, test_dist_tp_trainer.cpp) share:
// the tiny Llama run they train, the curve a run leaves in metrics.jsonl, and running the
// trainer on a sub-group of the world.
#pragma once

#include <nlohmann/json.hpp>

#include <fstream>
#include <string>
#include <vector>

#include "ckpt_testing.h"
#include "dist_testing.h"
#include "tessera/train/trainer.h"

namespace tessera::testing {

// ckpt_testing's tiny Llama (GQA 4/2, vocabulary 257) with 8 sequences of 16 tokens per
// step over all ranks (batch_size 2 per rank and micro-batch), 10 steps, validation every
// 5. The callers add training.parallel.
inline nlohmann::json tiny_llama_run(const std::string& out_dir, const std::string& text) {
  nlohmann::json j = ckpt_testing::tiny_config(out_dir, text);
  j["training"].update({{"steps", 10}, {"batch_size", 2}, {"global_batch_size", 8}, {"eval_interval", 5},
                        {"eval_batches", 4}, {"log_interval", 100}});
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
