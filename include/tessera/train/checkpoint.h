// Training checkpoints: a directory per save, written so that nothing saved is ever lost.
//
//   OUT/checkpoints/step-000100/model.safetensors      parameters (tessera names, F32)
//                              /optimizer.safetensors  AdamW moments
//                              /state.json             step, data positions, config
//   OUT/checkpoints/latest                             name of the newest complete save
//
// Each file is written atomically (temporary, fsync, rename) into a temporary directory
// that is renamed into place only when complete; `latest` is replaced last. A crash at
// any point leaves the previous checkpoint loadable.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "tessera/models/transformer_lm.h"
#include "tessera/train/optimizer.h"

namespace tessera::train {

struct CheckpointState {
  int64_t step = 0;
  nlohmann::json data_position;  // the train loader's state
  nlohmann::json config;         // the run config (model section is checked on load)
};

// Writes a checkpoint of `model` (and `optimizer`, when given) and returns its directory.
std::string save_checkpoint(const std::string& out_dir, models::TransformerLM& model, const Optimizer* optimizer,
                            const CheckpointState& state);

// The directory of the newest complete checkpoint under out_dir, if any.
std::optional<std::string> latest_checkpoint(const std::string& out_dir);

// Loads parameters into `model`; Error when the checkpoint's model config differs
// (another architecture or shape) or a tensor is missing or malformed.
CheckpointState load_checkpoint(const std::string& checkpoint_dir, models::TransformerLM& model, Optimizer* optimizer);

// Reads only the model config recorded in a checkpoint (to build the model first).
models::ModelConfig checkpoint_model_config(const std::string& checkpoint_dir);

}  // namespace tessera::train
