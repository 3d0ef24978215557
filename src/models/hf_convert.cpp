// Conversion between tessera's TransformerLM and Hugging Face transformers checkpoints.
//
// Each tessera parameter is described by the Hugging Face tensors it is made of ("pieces"):
// a range of its rows (dim 0) and whether the stored tensor is the transpose of that range.
// GPT-2's Conv1D layers store weights [in, out] (y = x W + b), so every GPT-2 linear weight
// is a transposed piece; Llama keeps q/k/v and gate/up as separate [out, in] projections,
// which are row ranges of tessera's fused qkv and fc weights. Both directions walk the same
// table, so save and load are exact inverses.
#include "tessera/models/hf_convert.h"

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <set>

#include "tessera/core/stream.h"
#include "tessera/io/atomic_file.h"
#include "tessera/io/safetensors.h"
#include "tessera/ops/elementwise.h"

namespace tessera::models {

namespace {

using nlohmann::json;

// ---- config.json ----------------------------------------------------------------------

// The value of `key`, or nullptr when it is absent or null (transformers treats both alike).
const json* find_key(const json& j, const char* key) {
  const auto it = j.find(key);
  return it == j.end() || it->is_null() ? nullptr : &*it;
}

int64_t int_key(const json& j, const char* key, int64_t fallback) {
  const json* v = find_key(j, key);
  if (!v) return fallback;
  TESSERA_CHECK(v->is_number_integer(), "config_from_hf: \"", key, "\" must be an integer, got ", v->dump());
  return v->get<int64_t>();
}

double number_key(const json& j, const char* key, double fallback) {
  const json* v = find_key(j, key);
  if (!v) return fallback;
  TESSERA_CHECK(v->is_number(), "config_from_hf: \"", key, "\" must be a number, got ", v->dump());
  return v->get<double>();
}

bool bool_key(const json& j, const char* key, bool fallback) {
  const json* v = find_key(j, key);
  if (!v) return fallback;
  TESSERA_CHECK(v->is_boolean(), "config_from_hf: \"", key, "\" must be true or false, got ", v->dump());
  return v->get<bool>();
}

std::string string_key(const json& j, const char* key, const std::string& fallback) {
  const json* v = find_key(j, key);
  if (!v) return fallback;
  TESSERA_CHECK(v->is_string(), "config_from_hf: \"", key, "\" must be a string, got ", v->dump());
  return v->get<std::string>();
}

// The shortest decimal that reads back as `value`, as a double: 1e-5f is written as 1e-05,
// not 9.999999747378752e-06.
double shortest_double(float value) {
  char text[32];
  for (int digits = 6; digits <= 9; ++digits) {
    std::snprintf(text, sizeof(text), "%.*g", digits, static_cast<double>(value));
    if (std::strtof(text, nullptr) == value) break;
  }
  return std::strtod(text, nullptr);
}

// A RoPE parameter object that asks for no scaling: {"rope_type": "default", ...}.
bool is_default_rope(const json& rope) {
  if (!rope.is_object()) return false;
  const std::string type = string_key(rope, "rope_type", string_key(rope, "type", "default"));
  return type == "default";
}

ModelConfig gpt2_config(const json& j) {
  ModelConfig c;
  c.architecture = "gpt2";
  // Defaults of transformers' GPT2Config.
  c.vocab_size = int_key(j, "vocab_size", 50257);
  c.max_seq_len = int_key(j, "n_positions", 1024);
  c.hidden_size = int_key(j, "n_embd", 768);
  c.num_layers = int_key(j, "n_layer", 12);
  c.num_heads = c.num_kv_heads = int_key(j, "n_head", 12);
  c.intermediate_size = int_key(j, "n_inner", 0);  // null: 4 * n_embd
  c.norm_eps = static_cast<float>(number_key(j, "layer_norm_epsilon", 1e-5));
  c.tie_embeddings = bool_key(j, "tie_word_embeddings", true);
  const std::string activation = string_key(j, "activation_function", "gelu_new");
  TESSERA_CHECK(activation == "gelu_new" || activation == "gelu_pytorch_tanh",
                "config_from_hf: gpt2 activation_function \"", activation,
                "\" is not supported: tessera's GPT-2 MLP uses the tanh GELU (gelu_new or gelu_pytorch_tanh)");
  TESSERA_CHECK(bool_key(j, "scale_attn_weights", true),
                "config_from_hf: gpt2 scale_attn_weights=false is not supported (tessera scales by 1/sqrt(head_dim))");
  TESSERA_CHECK(!bool_key(j, "scale_attn_by_inverse_layer_idx", false),
                "config_from_hf: gpt2 scale_attn_by_inverse_layer_idx=true is not supported");
  TESSERA_CHECK(!bool_key(j, "add_cross_attention", false),
                "config_from_hf: gpt2 add_cross_attention=true is not supported (decoder-only models)");
  return c;
}

ModelConfig llama_config(const json& j) {
  ModelConfig c;
  c.architecture = "llama";
  // Defaults of transformers' LlamaConfig.
  c.vocab_size = int_key(j, "vocab_size", 32000);
  c.hidden_size = int_key(j, "hidden_size", 4096);
  c.intermediate_size = int_key(j, "intermediate_size", 11008);
  c.num_layers = int_key(j, "num_hidden_layers", 32);
  c.num_heads = int_key(j, "num_attention_heads", 32);
  c.num_kv_heads = int_key(j, "num_key_value_heads", c.num_heads);
  c.max_seq_len = int_key(j, "max_position_embeddings", 2048);
  c.norm_eps = static_cast<float>(number_key(j, "rms_norm_eps", 1e-6));
  c.tie_embeddings = bool_key(j, "tie_word_embeddings", false);
  double theta = number_key(j, "rope_theta", 10000.0);

  const std::string activation = string_key(j, "hidden_act", "silu");
  TESSERA_CHECK(activation == "silu", "config_from_hf: llama hidden_act \"", activation,
                "\" is not supported: tessera's Llama MLP is SwiGLU (silu)");
  TESSERA_CHECK(!bool_key(j, "attention_bias", false),
                "config_from_hf: llama attention_bias=true is not supported (tessera's Llama has no biases)");
  TESSERA_CHECK(!bool_key(j, "mlp_bias", false),
                "config_from_hf: llama mlp_bias=true is not supported (tessera's Llama has no biases)");
  TESSERA_CHECK(c.num_heads > 0, "config_from_hf: num_attention_heads must be positive, got ", c.num_heads);
  if (const json* head_dim = find_key(j, "head_dim")) {
    TESSERA_CHECK(head_dim->is_number_integer() && head_dim->get<int64_t>() == c.hidden_size / c.num_heads,
                  "config_from_hf: llama head_dim ", head_dim->dump(), " is not supported: tessera needs head_dim = ",
                  "hidden_size / num_attention_heads = ", c.hidden_size / c.num_heads);
  }
  // transformers before 5 writes rope_scaling; 5 and later write rope_parameters (with the theta).
  if (const json* scaling = find_key(j, "rope_scaling")) {
    TESSERA_CHECK(is_default_rope(*scaling), "config_from_hf: rope_scaling ", scaling->dump(),
                  " is not supported: tessera's RoPE has no scaling support in this version");
  }
  if (const json* rope = find_key(j, "rope_parameters")) {
    TESSERA_CHECK(is_default_rope(*rope), "config_from_hf: rope_parameters ", rope->dump(),
                  " is not supported: tessera's RoPE has no scaling support in this version");
    theta = number_key(*rope, "rope_theta", theta);
  }
  c.rope_theta = static_cast<float>(theta);
  return c;
}

// MixtralConfig: Llama's keys with other defaults, plus the experts. Hugging Face routes
// with softmax -> top-k -> renormalise, which is tessera's default router. Its load-balancing
// loss (added only with output_router_logits) is top_k times tessera's (Megatron's
// normalisation), so the coefficient is scaled on the way in and out.
ModelConfig mixtral_config(const json& j) {
  json defaults = j;
  const auto set_default = [&](const char* key, const json& value) {
    if (!find_key(j, key)) defaults[key] = value;
  };
  set_default("intermediate_size", 14336);
  set_default("num_key_value_heads", 8);
  set_default("max_position_embeddings", 4096 * 32);
  set_default("rms_norm_eps", 1e-5);
  if (!find_key(j, "rope_parameters")) set_default("rope_theta", 1e6);
  ModelConfig c = llama_config(defaults);
  c.architecture = "mixtral";
  c.num_experts = int_key(j, "num_local_experts", 8);
  c.num_experts_per_tok = int_key(j, "num_experts_per_tok", 2);
  TESSERA_CHECK(number_key(j, "router_jitter_noise", 0.0) == 0.0,
                "config_from_hf: mixtral router_jitter_noise > 0 is not supported (tessera's router is deterministic)");
  if (const json* window = find_key(j, "sliding_window")) {
    TESSERA_CHECK(window->is_number_integer() && window->get<int64_t>() >= c.max_seq_len, "config_from_hf: mixtral ",
                  "sliding_window ", window->dump(), " is not supported (tessera's attention is full causal); it must ",
                  "be null or at least max_position_embeddings");
  }
  const double coef = number_key(j, "router_aux_loss_coef", 0.001);
  c.router_aux_loss_coef = bool_key(j, "output_router_logits", false) ? static_cast<float>(coef * c.num_experts_per_tok) : 0.0f;
  return c;
}

// ---- The name table ---------------------------------------------------------------------

struct Piece {
  std::string hf_name;
  int64_t row_begin = 0, row_end = 0;  // rows of the tessera parameter
  bool transposed = false;             // stored as [in, out] (GPT-2 Conv1D)
};

struct Mapping {
  nn::Parameter* param = nullptr;
  std::vector<Piece> pieces;
};

// The stored shape of `piece` of `param`.
Shape hf_shape(const nn::Parameter& param, const Piece& piece) {
  const int64_t rows = piece.row_end - piece.row_begin;
  if (param.weights().dim() == 1) return {rows};
  const int64_t cols = param.weights().size(1);
  return piece.transposed ? Shape{cols, rows} : Shape{rows, cols};
}

// The view of `param`'s full-precision weights that `piece` holds, in the stored layout.
Tensor piece_view(const nn::Parameter& param, const Piece& piece) {
  Tensor rows = param.weights().slice(0, piece.row_begin, piece.row_end);
  return piece.transposed ? rows.transpose(0, 1) : rows;
}

Mapping whole(nn::Parameter& p, const std::string& hf_name, bool transposed = false) {
  return {&p, {{hf_name, 0, p.weights().size(0), transposed}}};
}

// Every tessera parameter with its Hugging Face pieces. `prefix` is the head model's prefix
// of the base model's names ("transformer." for GPT-2, "model." for Llama) or "".
std::vector<Mapping> name_table(TransformerLM& model, const std::string& prefix) {
  const ModelConfig& c = model.config();
  std::vector<Mapping> table;
  if (c.is_gpt2()) {
    table.push_back(whole(model.token_embedding, prefix + "wte.weight"));
    table.push_back(whole(model.position_embedding, prefix + "wpe.weight"));
    for (size_t i = 0; i < model.layers.size(); ++i) {
      nn::TransformerLayer& layer = *model.layers[i];
      const std::string h = prefix + "h." + std::to_string(i) + ".";
      table.push_back(whole(layer.norm1.weight, h + "ln_1.weight"));
      table.push_back(whole(layer.norm1.bias, h + "ln_1.bias"));
      table.push_back(whole(layer.attn.qkv.weight, h + "attn.c_attn.weight", true));
      table.push_back(whole(layer.attn.qkv.bias, h + "attn.c_attn.bias"));
      table.push_back(whole(layer.attn.proj.weight, h + "attn.c_proj.weight", true));
      table.push_back(whole(layer.attn.proj.bias, h + "attn.c_proj.bias"));
      table.push_back(whole(layer.norm2.weight, h + "ln_2.weight"));
      table.push_back(whole(layer.norm2.bias, h + "ln_2.bias"));
      table.push_back(whole(layer.mlp.fc.weight, h + "mlp.c_fc.weight", true));
      table.push_back(whole(layer.mlp.fc.bias, h + "mlp.c_fc.bias"));
      table.push_back(whole(layer.mlp.proj.weight, h + "mlp.c_proj.weight", true));
      table.push_back(whole(layer.mlp.proj.bias, h + "mlp.c_proj.bias"));
    }
    table.push_back(whole(model.final_norm.weight, prefix + "ln_f.weight"));
    table.push_back(whole(model.final_norm.bias, prefix + "ln_f.bias"));
  } else {
    const int64_t q_rows = c.num_heads * c.head_dim(), kv_rows = c.num_kv_heads * c.head_dim(), f = c.ffn_size();
    table.push_back(whole(model.token_embedding, prefix + "embed_tokens.weight"));
    for (size_t i = 0; i < model.layers.size(); ++i) {
      nn::TransformerLayer& layer = *model.layers[i];
      const std::string l = prefix + "layers." + std::to_string(i) + ".";
      table.push_back(whole(layer.norm1.weight, l + "input_layernorm.weight"));
      table.push_back({&layer.attn.qkv.weight,
                       {{l + "self_attn.q_proj.weight", 0, q_rows, false},
                        {l + "self_attn.k_proj.weight", q_rows, q_rows + kv_rows, false},
                        {l + "self_attn.v_proj.weight", q_rows + kv_rows, q_rows + 2 * kv_rows, false}}});
      table.push_back(whole(layer.attn.proj.weight, l + "self_attn.o_proj.weight"));
      table.push_back(whole(layer.norm2.weight, l + "post_attention_layernorm.weight"));
      if (layer.is_moe()) {
        // Mixtral: gate = the router; expert e's w1 (gate) and w3 (up) are rows of the grouped
        // fc weight, its w2 (down) rows of the grouped proj weight.
        nn::MoELayer& moe = *layer.moe;
        const std::string b = l + "block_sparse_moe.";
        table.push_back(whole(moe.router.weight, b + "gate.weight"));
        Mapping fc{&moe.experts.fc.weight, {}}, proj{&moe.experts.proj.weight, {}};
        for (int64_t e = 0; e < c.num_experts; ++e) {
          const std::string x = b + "experts." + std::to_string(e) + ".";
          fc.pieces.push_back({x + "w1.weight", e * 2 * f, e * 2 * f + f, false});
          fc.pieces.push_back({x + "w3.weight", e * 2 * f + f, (e + 1) * 2 * f, false});
          proj.pieces.push_back({x + "w2.weight", e * c.hidden_size, (e + 1) * c.hidden_size, false});
        }
        table.push_back(fc);
        table.push_back(proj);
      } else {
        table.push_back({&layer.mlp.fc.weight,
                         {{l + "mlp.gate_proj.weight", 0, f, false}, {l + "mlp.up_proj.weight", f, 2 * f, false}}});
        table.push_back(whole(layer.mlp.proj.weight, l + "mlp.down_proj.weight"));
      }
    }
    table.push_back(whole(model.final_norm.weight, prefix + "norm.weight"));
  }
  if (!c.tie_embeddings) table.push_back(whole(model.lm_head, "lm_head.weight"));
  return table;
}

const char* base_prefix(const ModelConfig& c) { return c.is_gpt2() ? "transformer." : "model."; }

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Stored tensors that carry no weights tessera needs: GPT-2's causal-mask buffers, Llama's
// rotary frequencies, and the head of a tied model (a copy of the embedding).
bool ignorable(const std::string& name, const ModelConfig& c) {
  return ends_with(name, ".attn.bias") || ends_with(name, ".attn.masked_bias") || ends_with(name, "rotary_emb.inv_freq") ||
         (c.tie_embeddings && name == "lm_head.weight");
}

bool is_float_dtype(DType d) { return d == DType::F64 || d == DType::F32 || d == DType::F16 || d == DType::BF16; }

const char* torch_dtype_name(DType d) {
  switch (d) {
    case DType::F32: return "float32";
    case DType::BF16: return "bfloat16";
    case DType::F16: return "float16";
    default: TESSERA_FAIL("save_hf_model: dtype ", dtype_name(d), " is not supported; use f32, bf16 or f16");
  }
}

// `t` converted to `dtype` (itself when it already is), on the CPU.
Tensor converted(const Tensor& t, DType dtype) {
  if (t.dtype() == dtype) return t;
  Context ctx = Context::cpu();
  const Tensor src = t.contiguous().to(Device::cpu());
  Tensor out = Tensor::empty(src.shape(), dtype);
  cast(ctx, src, out);
  return out;
}

}  // namespace

ModelConfig config_from_hf(const json& j) {
  TESSERA_CHECK(j.is_object(), "config_from_hf: config.json must hold a JSON object, got ", j.type_name());
  TESSERA_CHECK(find_key(j, "model_type") && j["model_type"].is_string(),
                "config_from_hf: config.json has no string \"model_type\" (expected \"gpt2\", \"llama\" or \"mixtral\")");
  const std::string type = j["model_type"].get<std::string>();
  TESSERA_CHECK(type == "gpt2" || type == "llama" || type == "mixtral", "config_from_hf: model_type \"", type,
                "\" is not supported; tessera converts \"gpt2\", \"llama\" and \"mixtral\" models");
  ModelConfig c = type == "gpt2" ? gpt2_config(j) : type == "mixtral" ? mixtral_config(j) : llama_config(j);
  c.validate();
  return c;
}

json config_to_hf(const ModelConfig& c, std::optional<int64_t> bos_token_id, std::optional<int64_t> eos_token_id) {
  c.validate();
  json j;
  if (c.is_gpt2()) {
    j = {{"architectures", {"GPT2LMHeadModel"}},
         {"model_type", "gpt2"},
         {"vocab_size", c.vocab_size},
         {"n_positions", c.max_seq_len},
         {"n_ctx", c.max_seq_len},
         {"n_embd", c.hidden_size},
         {"n_layer", c.num_layers},
         {"n_head", c.num_heads},
         {"n_inner", c.ffn_size() == 4 * c.hidden_size ? json(nullptr) : json(c.ffn_size())},
         {"activation_function", "gelu_new"},
         {"layer_norm_epsilon", shortest_double(c.norm_eps)},
         {"initializer_range", 0.02},
         // tessera trains without dropout; these keep a model fine-tuned in transformers alike.
         {"resid_pdrop", 0.0},
         {"embd_pdrop", 0.0},
         {"attn_pdrop", 0.0},
         {"scale_attn_weights", true},
         {"scale_attn_by_inverse_layer_idx", false},
         {"reorder_and_upcast_attn", false},
         {"use_cache", true},
         {"tie_word_embeddings", c.tie_embeddings},
         {"torch_dtype", "float32"}};
  } else if (c.is_moe()) {
    TESSERA_CHECK(c.router_score == "softmax" && c.router_normalize && c.router_num_groups <= 1 &&
                      c.router_scaling == 1.0f && c.capacity_factor == 0.0f && c.expert_bias_rate == 0.0f,
                  "config_to_hf: this MoE router (", c.to_json().dump(), ") has no Hugging Face Mixtral equivalent: ",
                  "Mixtral routes with softmax, top-k and renormalisation, without groups, scaling, capacity or ",
                  "expert bias");
    j = {{"architectures", {"MixtralForCausalLM"}},
         {"model_type", "mixtral"},
         {"vocab_size", c.vocab_size},
         {"hidden_size", c.hidden_size},
         {"intermediate_size", c.ffn_size()},
         {"num_hidden_layers", c.num_layers},
         {"num_attention_heads", c.num_heads},
         {"num_key_value_heads", c.num_kv_heads},
         {"head_dim", c.head_dim()},
         {"hidden_act", "silu"},
         {"max_position_embeddings", c.max_seq_len},
         {"rms_norm_eps", shortest_double(c.norm_eps)},
         {"rope_theta", shortest_double(c.rope_theta)},
         {"sliding_window", nullptr},
         {"attention_dropout", 0.0},
         {"num_local_experts", c.num_experts},
         {"num_experts_per_tok", c.num_experts_per_tok},
         {"output_router_logits", c.router_aux_loss_coef > 0},
         {"router_aux_loss_coef", shortest_double(c.router_aux_loss_coef / static_cast<float>(c.num_experts_per_tok))},
         {"router_jitter_noise", 0.0},
         {"initializer_range", 0.02},
         {"use_cache", true},
         {"tie_word_embeddings", c.tie_embeddings},
         {"torch_dtype", "float32"}};
  } else {
    j = {{"architectures", {"LlamaForCausalLM"}},
         {"model_type", "llama"},
         {"vocab_size", c.vocab_size},
         {"hidden_size", c.hidden_size},
         {"intermediate_size", c.ffn_size()},
         {"num_hidden_layers", c.num_layers},
         {"num_attention_heads", c.num_heads},
         {"num_key_value_heads", c.num_kv_heads},
         {"head_dim", c.head_dim()},
         {"hidden_act", "silu"},
         {"max_position_embeddings", c.max_seq_len},
         {"rms_norm_eps", shortest_double(c.norm_eps)},
         {"rope_theta", shortest_double(c.rope_theta)},
         {"rope_scaling", nullptr},
         {"attention_bias", false},
         {"attention_dropout", 0.0},
         {"mlp_bias", false},
         {"pretraining_tp", 1},
         {"initializer_range", 0.02},
         {"use_cache", true},
         {"tie_word_embeddings", c.tie_embeddings},
         {"torch_dtype", "float32"}};
  }
  if (bos_token_id) j["bos_token_id"] = *bos_token_id;
  if (eos_token_id) j["eos_token_id"] = *eos_token_id;
  return j;
}

ModelConfig read_hf_config(const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / "config.json").string();
  TESSERA_CHECK(io::is_regular_file(path), "read_hf_config: ", dir, " has no config.json (not a Hugging Face model directory?)");
  json j;
  try {
    j = json::parse(io::read_file(path));
  } catch (const json::exception& e) {
    TESSERA_FAIL("read_hf_config: ", path, " is not valid JSON: ", e.what());
  }
  return config_from_hf(j);
}

void load_hf_model(const std::string& dir, TransformerLM& model) {
  const ModelConfig& c = model.config();
  const io::CheckpointReader reader(dir);
  // A head model's checkpoint prefixes the base model's names; a base model's does not.
  const std::string full = base_prefix(c);
  const std::string first = c.is_gpt2() ? "wte.weight" : "embed_tokens.weight";
  const std::string prefix = !reader.contains(full + first) && reader.contains(first) ? "" : full;
  const std::vector<Mapping> table = name_table(model, prefix);

  // Check everything before writing anything, so a bad file leaves the model as it was.
  std::set<std::string> used;
  for (const Mapping& m : table) {
    for (const Piece& piece : m.pieces) {
      TESSERA_CHECK(reader.contains(piece.hf_name), "load_hf_model: ", dir, " has no tensor '", piece.hf_name,
                    "' (needed for tessera's ", m.param->name, " ", m.param->value.shape_string(), ")");
      const io::TensorInfo& info = reader.info(piece.hf_name);
      const Shape want = hf_shape(*m.param, piece);
      TESSERA_CHECK(info.shape == want, "load_hf_model: tensor '", piece.hf_name, "' in ", dir, " has shape ",
                    shape_to_string(info.shape), ", expected ", shape_to_string(want), " (for tessera's ",
                    m.param->name, ")");
      TESSERA_CHECK(info.dtype && is_float_dtype(*info.dtype), "load_hf_model: tensor '", piece.hf_name, "' in ", dir,
                    " is stored as ", info.dtype_code, "; expected a floating dtype (F32, BF16, F16 or F64)");
      used.insert(piece.hf_name);
    }
  }
  std::vector<std::string> unexpected;
  for (const std::string& name : reader.names()) {
    if (!used.count(name) && !ignorable(name, c)) unexpected.push_back(name);
  }
  if (!unexpected.empty()) {
    std::string list;
    for (size_t i = 0; i < unexpected.size() && i < 5; ++i) list += (i ? ", '" : "'") + unexpected[i] + "'";
    if (unexpected.size() > 5) list += " and " + std::to_string(unexpected.size() - 5) + " more";
    TESSERA_FAIL("load_hf_model: ", dir, " holds tensors that a ", c.architecture, " model with ", c.num_layers,
                 " layers has no place for: ", list, " (does config.json describe these weights?)");
  }

  for (const Mapping& m : table) {
    for (const Piece& piece : m.pieces) {
      const Tensor stored = converted(reader.get(piece.hf_name), m.param->weights().dtype());
      Tensor dst = piece_view(*m.param, piece);
      dst.copy_from(stored.to(dst.device()));
    }
    Context ctx = context_on(m.param->value.device());  // the thread's current stream there
    m.param->refresh_value(ctx);
  }
}

std::unique_ptr<TransformerLM> load_hf_model_dir(const std::string& dir, DType dtype) {
  auto model = std::make_unique<TransformerLM>(read_hf_config(dir), dtype);
  load_hf_model(dir, *model);
  return model;
}

void save_hf_model(const std::string& dir, TransformerLM& model, DType dtype) {
  json config = config_to_hf(model.config());
  config["torch_dtype"] = torch_dtype_name(dtype);
  io::NamedTensors tensors;
  for (const Mapping& m : name_table(model, base_prefix(model.config()))) {
    for (const Piece& piece : m.pieces) tensors.emplace_back(piece.hf_name, converted(piece_view(*m.param, piece).to(Device::cpu()), dtype));
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  TESSERA_CHECK(!ec && std::filesystem::is_directory(dir), "save_hf_model: cannot create directory ", dir, ": ",
                ec ? ec.message() : "a file of that name exists");
  io::save_sharded(dir, tensors, 5'000'000'000ull, {{"format", "pt"}});
  io::write_file_atomically((std::filesystem::path(dir) / "config.json").string(), config.dump(2) + "\n");
}

}  // namespace tessera::models
