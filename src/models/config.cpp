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
  const int64_t dense_mlp = is_gpt2() ? c * f + f + f * c + c : 2 * c * f + f * c;
  const int64_t mlp = is_moe() ? num_experts * (2 * c * f + f * c) + c * num_experts : dense_mlp;
  int64_t n = vocab_size * c + num_layers * (2 * norm + attention + mlp) + norm;
  if (is_gpt2()) n += max_seq_len * c;
  if (!tie_embeddings) n += vocab_size * c;
  return n;
}

void ModelConfig::validate() const {
  TESSERA_CHECK(architecture == "gpt2" || architecture == "llama" || architecture == "mixtral",
                "model.architecture must be \"gpt2\", \"llama\" or \"mixtral\", got \"", architecture, "\"");
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
  TESSERA_CHECK(keep_activation_layers >= 0 && keep_activation_layers <= num_layers,
                "model.keep_activation_layers must be between 0 and num_layers (", num_layers, "), got ",
                keep_activation_layers);
  TESSERA_CHECK(norm_eps > 0, "model.norm_eps must be positive, got ", norm_eps);
  TESSERA_CHECK(rope_theta > 0, "model.rope_theta must be positive, got ", rope_theta);
  if (!is_moe()) return;
  TESSERA_CHECK(num_experts >= 1 && num_experts <= 1024, "model.num_experts must be in [1, 1024], got ", num_experts);
  TESSERA_CHECK(num_experts_per_tok >= 1 && num_experts_per_tok <= num_experts, "model.num_experts_per_tok must be in [1, ",
                num_experts, "], got ", num_experts_per_tok);
  TESSERA_CHECK(router_score == "softmax" || router_score == "sigmoid",
                "model.router_score must be \"softmax\" or \"sigmoid\", got \"", router_score, "\"");
  if (router_num_groups > 1) {
    TESSERA_CHECK(num_experts % router_num_groups == 0, "model.router_num_groups (", router_num_groups,
                  ") must divide model.num_experts (", num_experts, ")");
    TESSERA_CHECK(router_topk_groups >= 1 && router_topk_groups <= router_num_groups &&
                      router_topk_groups * (num_experts / router_num_groups) >= num_experts_per_tok,
                  "model.router_topk_groups must be in [1, ", router_num_groups, "] and its groups must hold ",
                  num_experts_per_tok, " experts, got ", router_topk_groups);
  }
  TESSERA_CHECK(router_aux_loss_coef >= 0 && router_z_loss_coef >= 0, "model.router_aux_loss_coef and ",
                "model.router_z_loss_coef must be >= 0");
  TESSERA_CHECK(capacity_factor >= 0, "model.capacity_factor must be >= 0, got ", capacity_factor);
  TESSERA_CHECK(expert_bias_rate >= 0, "model.expert_bias_rate must be >= 0, got ", expert_bias_rate);
}

namespace {
template <typename T>
void read_key(const nlohmann::json& j, const char* key, T& out) {
  if (!j.contains(key)) return;
  // get<int64_t>() of a float truncates it, and is undefined behaviour beyond int64's range.
  if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>)
    TESSERA_CHECK(j.at(key).is_number_integer(), "model.", key, ": expected an integer, got ",
                  j.at(key).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
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
                                "intermediate_size", "max_seq_len", "norm_eps", "rope_theta", "tie_embeddings",
                                "num_experts", "num_experts_per_tok", "router_score", "router_normalize",
                                "router_num_groups", "router_topk_groups", "router_scaling", "router_aux_loss_coef",
                                "router_z_loss_coef", "capacity_factor", "expert_bias_rate",
                                "moe_recompute_activation", "recompute_activation", "keep_activation_layers"};
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
  read_key(j, "num_experts", c.num_experts);
  read_key(j, "num_experts_per_tok", c.num_experts_per_tok);
  read_key(j, "router_score", c.router_score);
  read_key(j, "router_normalize", c.router_normalize);
  read_key(j, "router_num_groups", c.router_num_groups);
  read_key(j, "router_topk_groups", c.router_topk_groups);
  read_key(j, "router_scaling", c.router_scaling);
  read_key(j, "router_aux_loss_coef", c.router_aux_loss_coef);
  read_key(j, "router_z_loss_coef", c.router_z_loss_coef);
  read_key(j, "capacity_factor", c.capacity_factor);
  read_key(j, "expert_bias_rate", c.expert_bias_rate);
  read_key(j, "moe_recompute_activation", c.moe_recompute_activation);
  read_key(j, "recompute_activation", c.recompute_activation);
  read_key(j, "keep_activation_layers", c.keep_activation_layers);
  TESSERA_CHECK(c.architecture == "llama" || !j.contains("recompute_activation"),
                "model.recompute_activation applies to the llama architecture only (its SwiGLU MLP; mixtral has "
                "model.moe_recompute_activation)");
  TESSERA_CHECK(c.architecture == "llama" || !j.contains("keep_activation_layers"),
                "model.keep_activation_layers applies to the llama architecture only");
  if (!c.is_moe()) {
    for (const char* key : {"num_experts", "num_experts_per_tok", "router_score", "router_normalize", "router_num_groups",
                            "router_topk_groups", "router_scaling", "router_aux_loss_coef", "router_z_loss_coef",
                            "capacity_factor", "expert_bias_rate", "moe_recompute_activation"})
      TESSERA_CHECK(!j.contains(key), "model.", key, " applies to the mixtral architecture only");
  }
  c.validate();
  return c;
}

nlohmann::json ModelConfig::to_json() const {
  nlohmann::json j = {{"architecture", architecture}, {"vocab_size", vocab_size},     {"hidden_size", hidden_size},
          {"num_layers", num_layers},     {"num_heads", num_heads},       {"num_kv_heads", num_kv_heads},
          {"intermediate_size", ffn_size()}, {"max_seq_len", max_seq_len}, {"norm_eps", norm_eps},
          {"rope_theta", rope_theta},     {"tie_embeddings", tie_embeddings}};
  if (is_moe()) {
    j["num_experts"] = num_experts;
    j["num_experts_per_tok"] = num_experts_per_tok;
    j["router_score"] = router_score;
    j["router_normalize"] = router_normalize;
    j["router_num_groups"] = router_num_groups;
    j["router_topk_groups"] = router_topk_groups;
    j["router_scaling"] = router_scaling;
    j["router_aux_loss_coef"] = router_aux_loss_coef;
    j["router_z_loss_coef"] = router_z_loss_coef;
    j["capacity_factor"] = capacity_factor;
    j["expert_bias_rate"] = expert_bias_rate;
    if (moe_recompute_activation) j["moe_recompute_activation"] = true;  // written only when set
  }
  if (architecture == "llama" && !recompute_activation) j["recompute_activation"] = false;  // written only when off
  if (keep_activation_layers != 0) j["keep_activation_layers"] = keep_activation_layers;   // written only when set
  return j;
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
