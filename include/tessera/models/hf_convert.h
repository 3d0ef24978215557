// Hugging Face interoperability: read and write GPT-2 (GPT2LMHeadModel) and Llama
// (LlamaForCausalLM) checkpoints in the layout and naming of the transformers library.
//
// A Hugging Face model directory holds config.json and model.safetensors (or the sharded
// model-0000k-of-0000n.safetensors + model.safetensors.index.json). The conversion is exact:
// tensors are only renamed, transposed (GPT-2's Conv1D stores linear weights [in, out]) and
// concatenated or split (tessera fuses q/k/v into one projection and gate/up into one fc),
// so an F32 model saved and loaded again is bit-identical.
//
//   auto model = models::load_hf_model_dir("gpt2-hf");      // config.json + weights
//   models::save_hf_model("out-hf", *model, DType::BF16);    // transformers can load out-hf
//
// The name mapping table is in docs/convert.md. Every problem (unsupported config, missing
// tensor, wrong shape, unreadable file) raises tessera::Error naming the tensor or key; a
// failed load leaves the model's parameters untouched and a failed save leaves the files
// already in the directory untouched.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "tessera/models/transformer_lm.h"

namespace tessera::models {

// The tessera config of a Hugging Face config.json. Supports model_type "gpt2" (gelu_new /
// gelu_pytorch_tanh activation), "llama" (silu, no attention or MLP bias, no RoPE
// scaling) and "mixtral" (Llama attention with a mixture-of-experts MLP; checkpoint layout
// block_sparse_moe.gate / experts.{e}.w1, w2, w3). Keys the file leaves out take the transformers defaults of that model type.
// Error for another model type, an unsupported option, or a key of the wrong type.
ModelConfig config_from_hf(const nlohmann::json& config_json);

// A config.json that transformers loads into GPT2LMHeadModel or LlamaForCausalLM (torch_dtype
// "float32"; the token ids are written only when given).
nlohmann::json config_to_hf(const ModelConfig& config, std::optional<int64_t> bos_token_id = std::nullopt,
                            std::optional<int64_t> eos_token_id = std::nullopt);

// config_from_hf() of <dir>/config.json; Error when it is missing or not JSON.
ModelConfig read_hf_config(const std::string& dir);

// Fills every parameter of `model` from the Hugging Face weights in `dir` (model.safetensors
// or a sharded index), converting F32/BF16/F16/F64 to the model's dtype. The names may carry
// the head model's prefix ("transformer.", "model.") or not (a base model's checkpoint).
// lm_head.weight is read only for untied models; GPT-2's attn.bias / attn.masked_bias
// buffers and Llama's rotary_emb.inv_freq are ignored. Every tensor is checked (present,
// shape, dtype) before any parameter is written. Error for a missing tensor, a wrong shape
// (naming the tensor, its shape and the expected one) or a tensor the model has no place for.
void load_hf_model(const std::string& dir, TransformerLM& model);

// Builds the model that <dir>/config.json describes (with `dtype` master weights) and loads
// its weights.
std::unique_ptr<TransformerLM> load_hf_model_dir(const std::string& dir, DType dtype = DType::F32);

// Writes <dir>/config.json and the weights in Hugging Face naming and layout, stored as
// `dtype` (F32, BF16 or F16), with safetensors metadata {"format": "pt"}. Tied models have no
// lm_head.weight. Creates `dir`; every file is written atomically, the weights first and
// config.json last. Models over 5 GB of weights are sharded as transformers does.
void save_hf_model(const std::string& dir, TransformerLM& model, DType dtype = DType::F32);

}  // namespace tessera::models
