// What the training-step benchmarks share: the named model shapes and the FLOP count.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>

#include "tessera/models/config.h"

namespace tessera::bench {

// "gpt2-124m", "llama3.2-1b", or a model config as JSON (the keys of the model section).
inline models::ModelConfig named_or_json(const std::string& text) {
  if (text == "gpt2-124m") return models::ModelConfig::gpt2_124m();
  if (text == "llama3.2-1b") return models::ModelConfig::llama32_1b();
  return models::ModelConfig::from_json(nlohmann::json::parse(text));
}

// Model FLOPs per token of a training step (PaLM's count): 6 per parameter plus the
// attention score and value products, 12 * layers * hidden * seq (no causal discount).
inline double flops_per_token(const models::ModelConfig& c, int64_t params, int64_t seq) {
  return 6.0 * double(params) + 12.0 * double(c.num_layers) * double(c.hidden_size) * double(seq);
}

}  // namespace tessera::bench
