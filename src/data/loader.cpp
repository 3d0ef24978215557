// DataLoader: next-token batches over non-overlapping windows of a token split, in a
// per-epoch order drawn from Philox, with a position that saves to and restores from JSON.
#include "tessera/data/loader.h"

#include <cmath>
#include <cstdint>
#include <numeric>
#include <string>

#include "tessera/core/error.h"
#include "tessera/core/philox.h"

namespace tessera::data {
namespace {

// Separates the loader's Philox stream from other users of the same seed (weight init,
// dropout), which count from offset 0 with counter_hi 0.
constexpr uint64_t kShuffleStream = 0x5EED'DA7Aull;

int64_t json_int(const nlohmann::json& j, const char* key, const char* what) {
  TESSERA_CHECK(j.is_object(), what, ": expected a JSON object, got ", j.dump());
  const auto it = j.find(key);
  TESSERA_CHECK(it != j.end() && it->is_number_integer(), what, ": '", key, "' must be an integer in ", j.dump());
  return it->get<int64_t>();
}

}  // namespace

const char* split_name(Split split) { return split == Split::Train ? "train" : "validation"; }

nlohmann::json LoaderPosition::to_json() const { return {{"epoch", epoch}, {"index", index}}; }

LoaderPosition LoaderPosition::from_json(const nlohmann::json& j) {
  LoaderPosition p;
  p.epoch = json_int(j, "epoch", "data loader position");
  p.index = json_int(j, "index", "data loader position");
  TESSERA_CHECK(p.epoch >= 0 && p.index >= 0, "data loader position: epoch and index must be >= 0, got ", j.dump());
  return p;
}

DataLoader::DataLoader(TokenFile file, const LoaderOptions& options) : file_(std::move(file)), options_(options) {
  const int64_t B = options.batch_size, T = options.seq_len;
  TESSERA_CHECK(B >= 1 && T >= 1, "data loader: batch_size and seq_len must be >= 1, got B=", B, " T=", T);
  TESSERA_CHECK(options.val_fraction >= 0.0 && options.val_fraction < 1.0,
                "data loader: val_fraction must be in [0, 1), got ", options.val_fraction);
  TESSERA_CHECK(options.vocab_size >= 0, "data loader: vocab_size must be >= 0, got ", options.vocab_size);
  const int64_t total = file_.num_tokens();
  const int64_t val_tokens = static_cast<int64_t>(std::floor(static_cast<double>(total) * options.val_fraction));
  if (options.split == Split::Train) {
    split_begin_ = 0;
    split_end_ = total - val_tokens;
  } else {
    TESSERA_CHECK(val_tokens > 0, "data loader: the validation split of '", file_.path(), "' is empty (",
                  total, " tokens, val_fraction ", options.val_fraction, ")");
    split_begin_ = total - val_tokens;
    split_end_ = total;
  }
  const int64_t have = split_end_ - split_begin_;
  // Overflow-safe form of have >= B*T + 1.
  const bool enough = have >= 1 && (have - 1) / T >= B;
  const std::string needed = B <= (INT64_MAX - 1) / T ? std::to_string(B * T + 1) : std::string("more than 2^63");
  TESSERA_CHECK(enough, "data loader: the ", split_name(options.split), " split of '", file_.path(), "' has ", have,
                " tokens, but a batch of B=", B, " sequences of T=", T, " tokens needs at least B*T+1 = ", needed,
                " tokens (", total, " tokens in the file, val_fraction ", options.val_fraction, ")");
  num_windows_ = (have - 1) / T;
  row_buffer_.resize(static_cast<size_t>(T + 1));
}

const std::vector<int64_t>& DataLoader::order(int64_t epoch) const {
  if (order_epoch_ == epoch) return order_;
  order_.resize(static_cast<size_t>(num_windows_));
  std::iota(order_.begin(), order_.end(), int64_t{0});
  if (options_.shuffle) {
    // Fisher-Yates; draw i depends only on (seed, epoch, i), so any epoch is reproducible
    // without replaying the ones before it.
    for (int64_t i = num_windows_ - 1; i > 0; --i) {
      const Philox4 r = philox4x32(options_.seed, static_cast<uint64_t>(i),
                                   (kShuffleStream << 32) ^ static_cast<uint64_t>(epoch));
      const uint64_t word = (static_cast<uint64_t>(r.x[0]) << 32) | r.x[1];
      const int64_t j = static_cast<int64_t>(word % static_cast<uint64_t>(i + 1));
      std::swap(order_[i], order_[j]);
    }
  }
  order_epoch_ = epoch;
  return order_;
}

int64_t DataLoader::window_start(int64_t epoch, int64_t index, int64_t row) const {
  TESSERA_CHECK(epoch >= 0 && index >= 0 && index < batches_per_epoch() && row >= 0 && row < options_.batch_size,
                "data loader: window_start(epoch ", epoch, ", index ", index, ", row ", row,
                ") outside epoch >= 0, index in [0, ", batches_per_epoch(), "), row in [0, ", options_.batch_size, ")");
  const int64_t window = order(epoch)[index * options_.batch_size + row];
  return split_begin_ + window * options_.seq_len;
}

void DataLoader::next(Tensor& inputs, Tensor& targets) {
  const int64_t B = options_.batch_size, T = options_.seq_len;
  for (const Tensor* t : {&inputs, &targets}) {
    const char* name = t == &inputs ? "inputs" : "targets";
    check_defined(*t, "data loader", name);
    TESSERA_CHECK(t->device().is_cpu(), "data loader: ", name, " must be on the CPU, got ", t->describe());
    check_dtype(*t, DType::I32, "data loader", name);
    check_shape(*t, {B, T}, "data loader", name);
    check_contiguous(*t, "data loader", name);
  }
  int32_t* in = inputs.data<int32_t>();
  int32_t* out = targets.data<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t start = window_start(position_.epoch, position_.index, b);
    file_.read(start, row_buffer_);
    if (options_.vocab_size > 0) {
      for (int64_t t = 0; t <= T; ++t) {
        const int32_t token = row_buffer_[t];
        TESSERA_CHECK(token >= 0 && token < options_.vocab_size, "data loader: token ", token, " at position ",
                      start + t, " of '", file_.path(), "' is outside the vocabulary [0, ", options_.vocab_size, ")");
      }
    }
    std::copy(row_buffer_.begin(), row_buffer_.begin() + T, in + b * T);
    std::copy(row_buffer_.begin() + 1, row_buffer_.end(), out + b * T);
  }
  if (++position_.index == batches_per_epoch()) {
    position_.index = 0;
    ++position_.epoch;
  }
}

Batch DataLoader::next() {
  Batch batch{Tensor::empty({options_.batch_size, options_.seq_len}, DType::I32),
              Tensor::empty({options_.batch_size, options_.seq_len}, DType::I32)};
  next(batch.inputs, batch.targets);
  return batch;
}

void DataLoader::set_position(const LoaderPosition& position) {
  TESSERA_CHECK(position.epoch >= 0 && position.index >= 0 && position.index < batches_per_epoch(),
                "data loader: position (epoch ", position.epoch, ", index ", position.index,
                ") is outside epoch >= 0, index in [0, ", batches_per_epoch(), ")");
  position_ = position;
}

nlohmann::json DataLoader::state() const {
  nlohmann::json j = position_.to_json();
  j["batch_size"] = options_.batch_size;
  j["seq_len"] = options_.seq_len;
  j["seed"] = options_.seed;
  j["shuffle"] = options_.shuffle;
  j["split"] = split_name(options_.split);
  j["split_begin"] = split_begin_;
  j["split_end"] = split_end_;
  return j;
}

void DataLoader::load_state(const nlohmann::json& state) {
  const LoaderPosition position = LoaderPosition::from_json(state);
  const nlohmann::json mine = this->state();
  for (const char* key : {"batch_size", "seq_len", "seed", "shuffle", "split", "split_begin", "split_end"}) {
    const auto it = state.find(key);
    TESSERA_CHECK(it != state.end(), "data loader: cannot resume: the saved state lacks '", key, "': ", state.dump());
    TESSERA_CHECK(*it == mine[key], "data loader: cannot resume: the saved state has ", key, " = ", it->dump(),
                  " but this loader has ", mine[key].dump(), "; the same position would give other batches");
  }
  set_position(position);
}

}  // namespace tessera::data
