#include "tessera/models/config.h"

#include "tessera/core/error.h"

namespace tessera::models {

int64_t ModelConfig::ffn_size() const {
  if (intermediate_size > 0) return intermediate_size;
  if (is_gpt2()) return 4 * hidden_size;
  const int64_t f = 8 * hidden_size / 3;
  return (f + 63) / 64 * 64;
}

int64_t ModelConfig::num_parameters() const {
  const int64_t c = hidden_size, kv = num_kv_heads * head_dim(), f = ffn_size();
  const int64_t norm = is_gpt2() ? 2 * c : c;                              // LayerNorm has a bias
  const int64_t attention = c * (c + 2 * kv) + c * c + (is_gpt2() ? (c + 2 * kv) + c : 0);
  const int64_t mlp = is_gpt2() ? c * f + f + f * c + c : 2 * c * f + f * c;
  int64_t n = vocab_size * c + num_layers * (2 * norm + attention + mlp) + norm;
  if (is_gpt2()) n += max_seq_len * c;
  if (!tie_embeddings) n += vocab_size * c;
  return n;
}

void ModelConfig::validate() const {
  TESSERA_CHECK(architecture == "gpt2" || architecture == "llama", "model.architecture must be \"gpt2\" or \"llama\", got \"",
                architecture, "\"");
  TESSERA_CHECK(vocab_size > 0, "model.vocab_size must be positive, got ", vocab_size);
  TESSERA_CHECK(hidden_size > 0, "model.hidden_size must be positive, got ", hidden_size);
  TESSERA_CHECK(num_layers > 0, "model.num_layers must be positive, got ", num_layers);
  TESSERA_CHECK(num_heads > 0 && hidden_size % num_heads == 0, "model.num_heads (", num_heads,
                ") must divide model.hidden_size (", hidden_size, ")");
  TESSERA_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "model.num_kv_heads (", num_kv_heads,
                ") must divide model.num_heads (", num_heads, ")");
  TESSERA_CHECK(!is_gpt2() || num_kv_heads == num_heads, "model.num_kv_heads: gpt2 has no grouped-query attention");
  TESSERA_CHECK(is_gpt2() || head_dim() % 2 == 0, "model: llama needs an even head dimension for RoPE, got ", head_dim());
  TESSERA_CHECK(intermediate_size >= 0, "model.intermediate_size must be >= 0, got ", intermediate_size);
  TESSERA_CHECK(max_seq_len > 0, "model.max_seq_len must be positive, got ", max_seq_len);
  TESSERA_CHECK(norm_eps > 0, "model.norm_eps must be positive, got ", norm_eps);
  TESSERA_CHECK(rope_theta > 0, "model.rope_theta must be positive, got ", rope_theta);
}

namespace {
template <typename T>
void read_key(const nlohmann::json& j, const char* key, T& out) {
  if (!j.contains(key)) return;
  try {
    out = j.at(key).get<T>();
  } catch (const nlohmann::json::exception&) {
    TESSERA_FAIL("model.", key, ": wrong type (", j.at(key).dump(), ")");
  }
}
}  // namespace

ModelConfig ModelConfig::from_json(const nlohmann::json& j) {
  TESSERA_CHECK(j.is_object(), "model: expected a mapping of keys, got ", j.dump());
  static const char* kKeys[] = {"architecture", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                                "intermediate_size", "max_seq_len", "norm_eps", "rope_theta", "tie_embeddings"};
  for (auto it = j.begin(); it != j.end(); ++it) {
    bool known = false;
    for (const char* k : kKeys) known = known || it.key() == k;
    TESSERA_CHECK(known, "model: unknown key \"", it.key(), "\"");
  }
  ModelConfig c;
  read_key(j, "architecture", c.architecture);
  if (c.is_gpt2()) {  // family defaults before explicit keys
    c.norm_eps = 1e-5f;
  }
  read_key(j, "vocab_size", c.vocab_size);
  read_key(j, "hidden_size", c.hidden_size);
  read_key(j, "num_layers", c.num_layers);
  read_key(j, "num_heads", c.num_heads);
  c.num_kv_heads = c.num_heads;
  read_key(j, "num_kv_heads", c.num_kv_heads);
  read_key(j, "intermediate_size", c.intermediate_size);
  read_key(j, "max_seq_len", c.max_seq_len);
  read_key(j, "norm_eps", c.norm_eps);
  read_key(j, "rope_theta", c.rope_theta);
  read_key(j, "tie_embeddings", c.tie_embeddings);
  c.validate();
  return c;
}

nlohmann::json ModelConfig::to_json() const {
  return {{"architecture", architecture}, {"vocab_size", vocab_size},     {"hidden_size", hidden_size},
          {"num_layers", num_layers},     {"num_heads", num_heads},       {"num_kv_heads", num_kv_heads},
          {"intermediate_size", ffn_size()}, {"max_seq_len", max_seq_len}, {"norm_eps", norm_eps},
          {"rope_theta", rope_theta},     {"tie_embeddings", tie_embeddings}};
}

ModelConfig ModelConfig::gpt2_124m() {
  ModelConfig c;
  c.architecture = "gpt2";
  c.vocab_size = 50257;
  c.hidden_size = 768;
  c.num_layers = 12;
  c.num_heads = c.num_kv_heads = 12;
  c.max_seq_len = 1024;
  c.tie_embeddings = true;
  return c;
}

ModelConfig ModelConfig::llama32_1b() {
  ModelConfig c;
  c.architecture = "llama";
  c.vocab_size = 128256;
  c.hidden_size = 2048;
  c.num_layers = 16;
  c.num_heads = 32;
  c.num_kv_heads = 8;
  c.intermediate_size = 8192;
  c.max_seq_len = 131072;
  c.norm_eps = 1e-5f;
  c.rope_theta = 500000.0f;
  c.tie_embeddings = true;
  return c;
}

}  // namespace tessera::models
