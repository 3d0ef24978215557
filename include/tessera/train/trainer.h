// The training loop behind `tessera train`.
//
// Per step: zero gradients, `grad_accum` micro-batches of forward+backward, clip by global
// norm, one AdamW update at the scheduled learning rate. Validation loss every
// eval_interval steps on a fixed set of held-out batches; checkpoints every
// checkpoint_interval steps and at the end (in the background unless
// training.async_checkpoint is false); detectors that roll the run back to the last good
// state on a NaN or a spike (training.rewind); one JSON line of metrics per step in
// OUT/metrics.jsonl, rewinds in OUT/events.jsonl; a live progress line with loss, tokens/s
// and ETA. See docs/training.md and docs/checkpoints.md.
//
// Under a launcher (mpirun -np N, tessera launch --nproc N) every rank calls train() with the
// same config: each data-parallel rank computes its own micro-batches of every global batch,
// gradients are averaged (or reduce-scattered by the ZeRO-1 optimizer), rank 0 alone prints
// and writes metrics, and checkpoints are written by all ranks together. See
// docs/distributed.md.
#pragma once

#include <memory>
#include <string>

#include "tessera/data/tokenizer.h"
#include "tessera/dist/process_group.h"
#include "tessera/train/config.h"

namespace tessera::train {

struct TrainOptions {
  bool resume = false;   // continue from the newest verified checkpoint in OUT/checkpoints, when there is one
  std::string resume_from;  // with resume: this checkpoint directory (verified when it has a manifest) instead of the newest
  bool quiet = false;    // no progress line or summary (tests)
  int64_t stop_after = 0;  // stop (with a checkpoint) after this many steps of this call; 0: run to the end
  // The ranks of this run: null takes dist::init_from_env() (MPI under mpirun, TCP under
  // `tessera launch`, else one rank). Tests pass sub-groups to run several sizes in one job.
  dist::GroupPtr world;
};

struct TrainResult {
  int64_t step = 0;            // last step completed
  double last_loss = 0;        // training loss of that step
  double last_val_loss = NAN;  // the last validation loss measured, NaN if none
  double tokens_per_second = 0;
  std::string checkpoint;      // the last checkpoint written
  int64_t checkpoints = 0;     // checkpoints written by this call
  double mean_checkpoint_stall_ms = 0, max_checkpoint_stall_ms = 0;  // training time lost per checkpoint
  int64_t rewinds = 0;         // automatic rewinds (see training.rewind)
};

TrainResult train(const RunConfig& config, const TrainOptions& options = {});

// The tokenizer a config names ("byte", or "gpt2" with data.vocab and data.merges).
std::unique_ptr<data::Tokenizer> make_tokenizer(const DataConfig& config);

// Tokenizes a text file into an llm.c token shard (uint16, or uint32 when the vocabulary
// needs it). Returns the number of tokens written.
int64_t prepare_text(const std::string& text_path, const data::Tokenizer& tokenizer, const std::string& out_path);

}  // namespace tessera::train
