// Training run configuration: one YAML or JSON file, plus `--set key=value` overrides.
//
// Sections: model (ModelConfig keys), data, optimizer, training. Unknown keys and values
// of the wrong type are errors that name the key (e.g. "training.batch_size").
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include <optional>

#include "tessera/dist/parallel_grid.h"
#include "tessera/fp8/recipe.h"
#include "tessera/models/config.h"

namespace tessera::train {

struct DataConfig {
  std::string path;                 // token file: llm.c shard (.bin) or Megatron prefix (.idx/.bin)
  std::string text;                 // or a text file, tokenized on the fly with `tokenizer`
  std::string tokenizer = "byte";   // "byte" or "gpt2" (then vocab + merges)
  std::string vocab, merges;        // GPT-2 BPE files
  double validation_fraction = 0.05;
};

struct OptimizerConfig {
  double lr = 3e-4;
  double min_lr_ratio = 0.1;   // cosine decays to lr * min_lr_ratio
  int64_t warmup_steps = 100;
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double weight_decay = 0.1;   // not applied to norms and biases
  double grad_clip = 1.0;      // global-norm clipping; 0 disables
  // Update each group of parameters as soon as the backward has finished their gradients,
  // overlapped with the rest of the backward (train::Optimizer::begin_step). Needs
  // grad_clip = 0 and one device without FP8; the same weights as the plain step.
  bool overlap_backward = false;
};

// Automatic rewind (see docs/checkpoints.md): detectors watch every step; on a trigger the
// run goes back to the last good state, skips the data of the offending step(s) and goes on.
struct RewindConfig {
  bool enabled = true;
  int64_t snapshot_interval = 100;  // steps between in-memory snapshots (host copies); 0: roll back to checkpoints only
  int64_t window = 100;             // recent good steps the spike detectors compare against
  int64_t min_history = 20;         // no spike detection before this many good steps
  double loss_z = 6.0;              // loss spike: robust z-score (median/MAD) above this; 0 disables
  double grad_norm_z = 0.0;         // gradient-norm spike threshold likewise; 0 disables
  int64_t skip_steps = 1;           // steps' worth of data skipped from the offending step on
  double lr_scale = 1.0;            // learning-rate factor after a rewind ...
  int64_t lr_scale_steps = 0;       // ... for this many steps
  int64_t max_rewinds = 3;          // give up after more than this many rewinds ...
  int64_t max_rewinds_window = 1000;  // ... within this many steps
};

// Deterministic faults for tests: each listed step misbehaves the first time it runs.
struct FaultInjectionConfig {
  std::vector<int64_t> nan_grad_at_step;    // a NaN in one gradient before the optimizer step
  std::vector<int64_t> loss_spike_at_step;  // the loss reads 10x (+10) as large
  int64_t nan_grad_from_step = 0;           // > 0: a NaN gradient at this step and every later one (persistent)
  // rank_fault {rank, step, kind}: world rank `rank` fails when step `step` begins, as a
  // rank of a multi-process run can: kind "exit" (exits with status 3, no cleanup), "kill"
  // (SIGKILL to itself) or "hang" (stops answering forever). For testing failure handling.
  int64_t fault_rank = -1;
  int64_t fault_step = 0;
  std::string fault_kind;
};

struct TrainingConfig {
  int64_t steps = 1000;
  int64_t batch_size = 8;
  int64_t seq_len = 128;
  int64_t grad_accum = 1;         // micro-batches per step and data-parallel rank
  // Sequences per optimizer step over all data-parallel ranks (Megatron's
  // --global-batch-size); 0: batch_size x grad_accum x data ranks. When set, grad_accum
  // follows from it (global / (batch_size x data ranks)), so one config trains the same
  // curve at any data-parallel size.
  int64_t global_batch_size = 0;
  dist::ParallelConfig parallel;  // training.parallel (see docs/distributed.md)
  int64_t eval_interval = 100;    // steps between validation losses; 0 disables
  int64_t eval_batches = 10;
  int64_t checkpoint_interval = 0;  // steps between checkpoints; 0: only at the end
  int64_t checkpoint_keep_last = 0;   // keep the newest N checkpoints; 0: all
  int64_t checkpoint_keep_every = 0;  // also keep every step that is a multiple of K; 0: none
  bool async_checkpoint = true;       // write checkpoints on a background thread
  std::vector<int64_t> skip_data_at_steps;  // the data these steps would read is skipped (as a rewind does)
  RewindConfig rewind;
  FaultInjectionConfig fault_injection;
  int64_t log_interval = 10;
  uint64_t seed = 1337;
  std::string out_dir = "runs/train";
  std::string device = "auto";    // auto (cuda when a GPU is present), cpu, cuda
  std::string precision = "auto"; // auto (bf16 on cuda, fp32 on cpu), fp32, bf16
  std::string attention_backend = "auto";  // CUDA attention: auto (faster per shape), tessera, cudnn
  std::string cuda_graph = "auto";  // capture the step into a CUDA graph: auto (when it can be), on, off
  bool deterministic_attention = true;  // bitwise-repeatable CUDA attention backward; false: atomic dQ, faster
  bool gemm_autotune = false;  // CUDA: time cuBLASLt's candidate algorithms per GEMM shape, keep the fastest
  double max_minutes = 0;         // stop (and checkpoint) after this long; 0: no limit
  std::string init_from;          // start from these weights: a tessera checkpoint or run dir, or a Hugging Face dir
  std::string sample_prompt;      // printed with a sample at the end when non-empty
  int64_t sample_tokens = 200;
};

struct RunConfig {
  models::ModelConfig model;
  DataConfig data;
  OptimizerConfig optimizer;
  TrainingConfig training;
  // The `fp8` section: the blocks' linear layers train in FP8 under this recipe (needs BF16
  // precision; see docs/fp8.md). Absent: no FP8.
  std::optional<fp8::Recipe> fp8;

  static RunConfig from_json(const nlohmann::json& j);
  nlohmann::json to_json() const;
};

// Reads YAML (or JSON, which is YAML) into JSON, then applies `key.path=value` overrides
// whose values are parsed as YAML scalars (numbers, booleans, strings).
nlohmann::json load_config_file(const std::string& path);
void apply_override(nlohmann::json& config, const std::string& assignment);
nlohmann::json yaml_text_to_json(const std::string& text, const std::string& source);

}  // namespace tessera::train
