// Training checkpoints: a directory per save, written so that nothing saved is ever lost and
// nothing damaged is ever loaded.
//
//   OUT/checkpoints/step-000100/model.safetensors      parameters (tessera names, F32)
//                              /optimizer.safetensors  AdamW moments
//                              /state.json             step, data positions, config
//                              /manifest.json          step, config hash, size + CRC-32 of each file
//   OUT/checkpoints/latest                             name of the newest complete save (for people)
//
// Each file is written atomically (temporary, fsync, rename) into "step-NNNNNN.tmp", the
// manifest last; the directory is then renamed into place and `latest` replaced. A crash at
// any point leaves the previous checkpoints loadable, and a checkpoint damaged afterwards
// (a flipped byte, a truncated file) fails verification against its manifest.
//
// Saving is split in two so that it can run in the background (see async_checkpoint.h):
// snapshot_training_state() copies everything to host memory (the only part the training
// loop has to wait for), write_checkpoint() serialises a snapshot. Both paths produce the
// same bytes.
//
// Several ranks, one checkpoint (data parallelism; see docs/distributed.md):
//   OUT/checkpoints/step-000100/model.safetensors, state.json    written by rank 0
//                              /optimizer.safetensors            rank 0, when every rank holds
//                                                                the whole optimizer state
//                              /optimizer-zero1-00001-of-00004.safetensors
//                                                                each data rank its ZeRO-1 shard
//                              /manifest.json                    rank 0, once every rank's
//                                                                files are complete
// Rank 0 empties "step-NNNNNN.tmp" (begin_checkpoint) before a barrier; then every rank
// writes its files and a part-RRRRR.json listing them (sizes and CRCs); rank 0 waits for all
// parts (bounded by the writers' timeout), merges them into the manifest and renames the
// directory into place as a single-rank save does. A checkpoint of any data-parallel size
// loads at any other: load_checkpoint re-splits the optimizer moments (a per-parameter
// optimizer.safetensors and ZeRO-1 shards are two layouts of one flat state).
#pragma once

#include <nlohmann/json.hpp>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tessera/io/safetensors.h"
#include "tessera/models/transformer_lm.h"
#include "tessera/train/optimizer.h"

namespace tessera::train {

// Who writes one checkpoint: this process is `rank` of `ranks` (all ranks of the job);
// rank 0 waits at most timeout_s for the others' files (0: forever).
struct CheckpointWriters {
  int rank = 0;
  int ranks = 1;
  double timeout_s = 300;
};

struct CheckpointState {
  int64_t step = 0;
  nlohmann::json data_position;  // the train loader's state
  nlohmann::json config;         // the run config (model section is checked on load)
  nlohmann::json extra;          // trainer state beyond the above (data skipped by rewinds); may be null
};

// Everything a checkpoint holds, copied to host memory (owned tensors, independent of the
// model and optimizer, which may go on training).
struct CheckpointSnapshot {
  int64_t step = 0;
  int64_t optimizer_step = 0;
  nlohmann::json data_position, config, extra, model_config;
  io::NamedTensors params;     // FP32 master weights, CPU
  io::NamedTensors optimizer;  // AdamW moments, CPU; empty without an optimizer
  bool has_optimizer = false;
  nlohmann::json optimizer_layout;  // OptimizerBase::state_layout(): null per parameter, else a shard
  // A tensor-parallel model's: true when params / optimizer are in the full layout (the
  // optimizer per parameter), false when they are this rank's shards (`tensor_shards`).
  bool full_layout = false;
  bool tensor_shards = false;
  CheckpointWriters writers;
  // Pinned host memory the tensors above live in when copied from a GPU (recycled for the
  // next snapshot once this one is gone); empty on the CPU.
  std::vector<std::shared_ptr<void>> host_buffers;
  size_t bytes() const;        // tensor bytes held
};

// Which layout a snapshot of a tensor-parallel model holds (the same at tensor size 1).
//   Full   the single-device layout (TransformerLM::full_state_dict, the optimizer's
//          per_parameter_state gathered with gather_full): what checkpoints hold, so that
//          they load at any data and tensor size. Collective over the tensor group (and the
//          data group for ZeRO-1); every rank gets the whole state, world rank 0 writes it.
//   Local  this rank's shards as they are (in-memory rewind snapshots; not writable).
enum class SnapshotLayout { Full, Local };

CheckpointSnapshot snapshot_training_state(models::TransformerLM& model, const OptimizerBase* optimizer,
                                           const CheckpointState& state, const CheckpointWriters& writers = {},
                                           SnapshotLayout layout = SnapshotLayout::Full);

// Page-locking the host buffers of a snapshot ahead of time. Pinning 14 GB (the Llama-1B
// state) takes seconds; done on a background thread at the start of a run, the first
// checkpoints no longer stall training for it. snapshot_buffer_bytes (on the training
// thread) gives the sizes of the buffers snapshot_training_state takes (none without
// CUDA); reserve_pinned_host (on any thread) pins `copies` sets of them and leaves them in
// the pool that snapshot_training_state draws from.
std::vector<size_t> snapshot_buffer_bytes(models::TransformerLM& model, const OptimizerBase* optimizer);
void reserve_pinned_host(const std::vector<size_t>& buffer_bytes, int copies);

// Puts a snapshot back into `model` (and `optimizer`, of the layout it was taken from; a
// full-layout snapshot of a tensor-parallel model is cut into this rank's shards):
// bit-exact, used by rewinds.
void restore_snapshot(const CheckpointSnapshot& snapshot, models::TransformerLM& model, OptimizerBase* optimizer);

// Which older checkpoints to delete after a successful save. keep_last > 0 keeps the newest
// keep_last; keep_every > 0 also keeps every step that is a multiple of it. Both 0: keep all.
struct Retention {
  int64_t keep_last = 0;
  int64_t keep_every = 0;
};

// Writes a snapshot as OUT/checkpoints/step-NNNNNN (replacing an older save of that step),
// applies `retention` and returns the directory. With snapshot.writers.ranks > 1 this is
// this rank's part of a multi-rank save (see the top of this file): begin_checkpoint must
// have run on rank 0 first, and only rank 0 returns after the directory is complete.
std::string write_checkpoint(const std::string& out_dir, const CheckpointSnapshot& snapshot, const Retention& retention = {});

// Rank 0 of a multi-rank save, before a barrier of all ranks: an empty step-NNNNNN.tmp.
void begin_checkpoint(const std::string& out_dir, int64_t step);

// snapshot_training_state + write_checkpoint (one rank).
std::string save_checkpoint(const std::string& out_dir, models::TransformerLM& model, const OptimizerBase* optimizer,
                            const CheckpointState& state, const Retention& retention = {});

// What is wrong with a checkpoint directory (missing or malformed manifest, a file missing,
// of the wrong size or with the wrong checksum), naming the file; nullopt when it verifies.
std::optional<std::string> checkpoint_problem(const std::string& checkpoint_dir);
// Error with checkpoint_problem()'s message unless the checkpoint verifies.
void verify_checkpoint(const std::string& checkpoint_dir);

// "step-000100": the directory name of a step's checkpoint.
std::string checkpoint_dir_name(int64_t step);

// The complete checkpoint directories (step-NNNNNN, not .tmp) under OUT/checkpoints, oldest
// first. Not verified.
std::vector<std::string> list_checkpoints(const std::string& out_dir);

// The newest checkpoint under out_dir that verifies, if any. Newer ones that do not verify
// are skipped with a warning on stderr (unless `warn` is false); `skipped` collects them.
std::optional<std::string> latest_checkpoint(const std::string& out_dir, bool warn = true,
                                             std::vector<std::string>* skipped = nullptr);

// Verifies the checkpoint (unless `verify` is false: another rank did), then loads
// parameters into `model` (and the moments into `optimizer`, whatever layout the checkpoint
// and the optimizer have: per parameter or ZeRO-1 shards of any data-parallel size). A
// directory without manifest.json but with state.json (written before manifests existed)
// loads with a warning; latest_checkpoint() never picks one. Error when it does not verify,
// when the checkpoint's model config differs (another architecture or shape) or a tensor is
// missing or malformed.
CheckpointState load_checkpoint(const std::string& checkpoint_dir, models::TransformerLM& model, OptimizerBase* optimizer,
                                bool verify = true);

// Reads only the model config recorded in a checkpoint (to build the model first).
models::ModelConfig checkpoint_model_config(const std::string& checkpoint_dir);

// CRC-32 (zlib's polynomial) of a byte range, continuing from `crc`, and of a whole file.
uint32_t crc32_bytes(const void* data, size_t size, uint32_t crc = 0);
uint32_t crc32_file(const std::string& path, uint64_t* size = nullptr);

}  // namespace tessera::train
