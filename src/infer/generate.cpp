#include "tessera/infer/generate.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "tessera/core/philox.h"

namespace tessera::infer {

int64_t sample_token(const float* logits, int64_t vocab, const SamplingOptions& o, uint64_t draw) {
  TESSERA_CHECK(o.temperature >= 0, "sampling: temperature must be >= 0, got ", o.temperature);
  TESSERA_CHECK(o.top_p > 0 && o.top_p <= 1, "sampling: top_p must be in (0, 1], got ", o.top_p);
  TESSERA_CHECK(o.top_k >= 0, "sampling: top_k must be >= 0, got ", o.top_k);
  if (o.temperature == 0) return std::max_element(logits, logits + vocab) - logits;
  // Candidates sorted by logit, cut by top-k, then by cumulative probability (top-p).
  std::vector<int64_t> order(static_cast<size_t>(vocab));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return logits[a] > logits[b]; });
  if (o.top_k > 0 && o.top_k < vocab) order.resize(static_cast<size_t>(o.top_k));
  std::vector<double> p(order.size());
  double total = 0;
  for (size_t i = 0; i < order.size(); ++i) total += p[i] = std::exp((logits[order[i]] - logits[order[0]]) / o.temperature);
  size_t keep = order.size();
  if (o.top_p < 1) {
    double cumulative = 0;
    for (size_t i = 0; i < order.size(); ++i) {
      cumulative += p[i] / total;
      if (cumulative >= o.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  double mass = 0;
  for (size_t i = 0; i < keep; ++i) mass += p[i];
  double u = uniform_from_word(philox_word(o.seed, 0, draw)) * mass;
  for (size_t i = 0; i < keep; ++i) {
    if ((u -= p[i]) < 0) return order[i];
  }
  return order[keep - 1];
}

std::vector<int32_t> generate(Context& ctx, models::TransformerLM& model, std::vector<int32_t>& tokens,
                              const SamplingOptions& o, const std::function<void(int32_t)>& on_token) {
  TESSERA_CHECK(!tokens.empty(), "generate: the prompt must hold at least one token");
  const int64_t vocab = model.config().vocab_size, window = model.config().max_seq_len;
  for (int32_t t : tokens) TESSERA_CHECK(t >= 0 && t < vocab, "generate: prompt token ", t, " is outside the vocabulary of ", vocab);
  std::vector<int32_t> produced;
  for (int64_t i = 0; i < o.max_new_tokens; ++i) {
    const int64_t start = std::max<int64_t>(0, static_cast<int64_t>(tokens.size()) - window);
    const int64_t len = static_cast<int64_t>(tokens.size()) - start;
    Tensor input = Tensor::empty({1, len}, DType::I32);
    std::copy(tokens.begin() + start, tokens.end(), input.data<int32_t>());
    const Tensor logits = model.logits(ctx, input.to(ctx.device)).to(Device::cpu());
    const int32_t next = static_cast<int32_t>(sample_token(logits.data<float>() + (len - 1) * vocab, vocab, o, i));
    tokens.push_back(next);
    produced.push_back(next);
    if (on_token) on_token(next);
    if (next == o.stop_token) break;
  }
  return produced;
}

}  // namespace tessera::infer
