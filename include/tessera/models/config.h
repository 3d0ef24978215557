// Model configuration for decoder-only Transformer language models (GPT-2, Llama-3).
//
// One config describes all families; `architecture` picks the defaults that differ:
//   gpt2:    LayerNorm, GELU (tanh) MLP, biases, learned positions, tied embeddings
//   llama:   RMSNorm, SwiGLU MLP, no biases, RoPE, grouped-query attention
//   mixtral: llama attention, and a mixture-of-experts FFN (nn::MoELayer) in every block;
//            intermediate_size is then each expert's FFN width
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace tessera::models {

struct ModelConfig {
  std::string architecture = "llama";  // "gpt2", "llama" or "mixtral"
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

  // Mixture of experts (mixtral only; see docs/models.md and tessera/ops/moe.h).
  int64_t num_experts = 8;
  int64_t num_experts_per_tok = 2;       // top-k
  std::string router_score = "softmax";  // "softmax" or "sigmoid"
  bool router_normalize = true;          // renormalise the k selected probabilities
  int64_t router_num_groups = 0;         // > 1: group-limited top-k
  int64_t router_topk_groups = 0;
  float router_scaling = 1.0f;
  float router_aux_loss_coef = 0.001f;   // load-balancing loss (Megatron's normalisation)
  float router_z_loss_coef = 0.0f;
  float capacity_factor = 0.0f;          // > 0: token dropping
  float expert_bias_rate = 0.0f;         // > 0: auxiliary-loss-free balancing bias
  // Recompute the experts' SwiGLU output in the backward instead of keeping it (BF16 path;
  // bit-identical; saves M x ffn x 2 bytes per MoE layer, nn::GroupedMLP).
  bool moe_recompute_activation = false;
  // llama: recompute the SwiGLU output in the backward, inside the activation's backward
  // pass, instead of keeping it from the forward (bit-identical; saves N x ffn x 2 bytes per
  // layer, nn::MLP::recompute_activation). On by default, as torch.compile does.
  bool recompute_activation = true;
  // llama, with recompute_activation on: the last N layers keep their SwiGLU output anyway.
  // Memory for speed, a layer at a time (N x tokens x ffn x 2 bytes more at the activation
  // peak): the budget a step has left under a memory ceiling is spent on the recompute it
  // saves. 0 (the default): every layer recomputes.
  int64_t keep_activation_layers = 0;

  bool is_gpt2() const { return architecture == "gpt2"; }
  bool is_moe() const { return architecture == "mixtral"; }
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
