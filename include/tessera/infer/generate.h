// Sampling text from a TransformerLM: temperature, top-k and top-p (nucleus) sampling
// driven by the Philox stream of a seed, so a (model, prompt, seed) triple always gives
// the same text. Each new token re-runs the model over the last max_seq_len tokens; the
// KV-cache engine of infer/ will replace that loop.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "tessera/models/transformer_lm.h"

namespace tessera::infer {

struct SamplingOptions {
  float temperature = 0.8f;  // 0: greedy
  int64_t top_k = 0;         // 0: no limit
  float top_p = 1.0f;        // 1: no limit
  uint64_t seed = 0;
  int64_t max_new_tokens = 100;
  int64_t stop_token = -1;   // stop after emitting this id (e.g. end of text); -1: never
};

// Picks one token id from `logits` (length V); `draw` indexes the random stream.
int64_t sample_token(const float* logits, int64_t vocab, const SamplingOptions& options, uint64_t draw);

// Appends sampled tokens to `tokens` (the prompt) and returns the new ones. `on_token`
// is called as each token is produced (for streaming output).
std::vector<int32_t> generate(Context& ctx, models::TransformerLM& model, std::vector<int32_t>& tokens,
                              const SamplingOptions& options, const std::function<void(int32_t)>& on_token = {});

}  // namespace tessera::infer
