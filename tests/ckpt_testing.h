// Shared by the checkpoint, rewind and kill tests: a tiny run config over a small text.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tessera/io/atomic_file.h"

namespace ckpt_testing {

inline std::string temp_dir(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() / ("tessera_ckpt_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

inline std::string write_text(const std::string& dir, size_t repeats = 300) {
  std::string text;
  for (size_t i = 0; i < repeats; ++i) text += "the quick brown fox jumps over the lazy dog " + std::to_string(i % 7) + ". ";
  const std::string path = dir + "/corpus.txt";
  tessera::io::write_file_atomically(path, text);
  return path;
}

inline nlohmann::json tiny_config(const std::string& out_dir, const std::string& text) {
  nlohmann::json j = nlohmann::json::parse(R"({
    "model": {"architecture": "llama", "vocab_size": 257, "hidden_size": 32, "num_layers": 2, "num_heads": 4,
              "num_kv_heads": 2, "intermediate_size": 48, "max_seq_len": 32, "rope_theta": 10000},
    "data": {"tokenizer": "byte", "validation_fraction": 0.1},
    "optimizer": {"lr": 0.01, "warmup_steps": 2},
    "training": {"steps": 8, "batch_size": 4, "seq_len": 16, "eval_interval": 0, "eval_batches": 2}
  })");
  j["data"]["text"] = text;
  j["training"]["out_dir"] = out_dir;
  return j;
}

// step -> loss from OUT/metrics.jsonl (the last line of a step wins).
inline std::map<int64_t, double> losses(const std::string& out_dir) {
  std::map<int64_t, double> out;
  std::ifstream in(out_dir + "/metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (j.contains("loss")) out[j.at("step").get<int64_t>()] = j.at("loss").get<double>();
  }
  return out;
}

inline std::vector<nlohmann::json> lines(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

}  // namespace ckpt_testing
