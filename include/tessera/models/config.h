// Model configuration for decoder-only Transformer language models (GPT-2, Llama-3).
//
// One config describes both families; `architecture` picks the defaults that differ:
//   gpt2:  LayerNorm, GELU (tanh) MLP, biases, learned positions, tied embeddings
//   llama: RMSNorm, SwiGLU MLP, no biases, RoPE, grouped-query attention
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace tessera::models {

struct ModelConfig {
  std::string architecture = "llama";  // "gpt2" or "llama"
  int64_t vocab_size = 257;
  int64_t hidden_size = 256;
  int64_t num_layers = 4;
  int64_t num_heads = 4;
  int64_t num_kv_heads = 4;       // < num_heads: grouped-query attention (llama only)
  int64_t intermediate_size = 0;  // 0: 4 * hidden (gpt2) or the Llama rule (8/3 hidden, multiple of 64)
  int64_t max_seq_len = 256;
  float norm_eps = 1e-5f;
  float rope_theta = 500000.0f;
  bool tie_embeddings = true;

  bool is_gpt2() const { return architecture == "gpt2"; }
  int64_t head_dim() const { return hidden_size / num_heads; }
  int64_t ffn_size() const;
  // Exact parameter count of the model this config builds, without allocating it.
  int64_t num_parameters() const;
  void validate() const;  // throws Error naming the bad key

  // Keys as in the docs; unknown keys and wrong types are errors that name the key.
  static ModelConfig from_json(const nlohmann::json& j);
  nlohmann::json to_json() const;

  static ModelConfig gpt2_124m();
  static ModelConfig llama32_1b();
};

}  // namespace tessera::models
