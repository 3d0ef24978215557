// DataLoader: batches of (inputs, targets) for next-token prediction from a TokenFile.
//
// The token stream is split once: the last `val_fraction` of the tokens (rounded down) is
// the validation split, the rest the training split. A split is cut into non-overlapping
// windows of T tokens; window w covers tokens [begin + w*T, begin + w*T + T] (T + 1 tokens,
// the last one only as a target), so no window reads past its split and the two splits
// never share a token. Each epoch visits the windows in an order drawn from Philox(seed,
// epoch) (or file order with shuffle off), B windows per batch; the num_windows % B left
// over at the end of an epoch are skipped for that epoch.
//
//   inputs[b, t]  = token[start_b + t]
//   targets[b, t] = token[start_b + t + 1]      (both I32, shape [B, T], on the CPU)
//
// The position (epoch, index of the next batch in that epoch) is all the state there is:
// state() saves it as JSON with the settings it depends on, and a new loader over the same
// file restored with load_state() yields the identical next batches.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <vector>

#include "tessera/core/tensor.h"
#include "tessera/data/token_file.h"

namespace tessera::data {

enum class Split : uint8_t { Train, Validation };
const char* split_name(Split split);  // "train", "validation"

struct LoaderOptions {
  int64_t batch_size = 1;    // B
  int64_t seq_len = 1;       // T
  Split split = Split::Train;
  double val_fraction = 0.0;  // in [0, 1): the held-out tail of the token stream
  uint64_t seed = 0;
  bool shuffle = true;        // false: windows in file order every epoch
  int64_t vocab_size = 0;     // > 0: a token outside [0, vocab_size) in a batch throws Error
};

struct LoaderPosition {
  int64_t epoch = 0;
  int64_t index = 0;  // the next batch within the epoch

  nlohmann::json to_json() const;
  static LoaderPosition from_json(const nlohmann::json& j);  // throws Error for a malformed object
  bool operator==(const LoaderPosition& o) const { return epoch == o.epoch && index == o.index; }
};

struct Batch {
  Tensor inputs;   // I32 [B, T]
  Tensor targets;  // I32 [B, T]
};

class DataLoader {
 public:
  // Throws Error for B or T < 1, val_fraction outside [0, 1), an empty validation split,
  // or a split with fewer than B*T + 1 tokens (the message gives both numbers).
  DataLoader(TokenFile file, const LoaderOptions& options);

  // The batch at the current position, then advances (to the next epoch after its last batch).
  Batch next();
  // The same into caller-allocated contiguous CPU I32 [B, T] tensors.
  void next(Tensor& inputs, Tensor& targets);

  LoaderPosition position() const { return position_; }
  // Throws Error unless epoch >= 0 and 0 <= index < batches_per_epoch().
  void set_position(const LoaderPosition& position);
  void reset() { set_position({}); }

  // {"epoch", "index"} and the settings the order depends on (batch_size, seq_len, seed,
  // shuffle, split, split_begin, split_end). load_state() throws Error when these differ
  // from this loader's, since the same position would then mean other batches.
  nlohmann::json state() const;
  void load_state(const nlohmann::json& state);

  const LoaderOptions& options() const { return options_; }
  const TokenFile& file() const { return file_; }
  int64_t split_begin() const { return split_begin_; }  // the split is tokens [split_begin, split_end)
  int64_t split_end() const { return split_end_; }
  int64_t num_windows() const { return num_windows_; }
  int64_t batches_per_epoch() const { return num_windows_ / options_.batch_size; }
  // The first token of row `row` of batch `index` in `epoch` (its inputs start there).
  int64_t window_start(int64_t epoch, int64_t index, int64_t row) const;

 private:
  const std::vector<int64_t>& order(int64_t epoch) const;

  TokenFile file_;
  LoaderOptions options_;
  int64_t split_begin_ = 0, split_end_ = 0, num_windows_ = 0;
  LoaderPosition position_;
  std::vector<int32_t> row_buffer_;
  mutable int64_t order_epoch_ = -1;  // the epoch order_ was drawn for
  mutable std::vector<int64_t> order_;
};

}  // namespace tessera::data
