// Hugging Face conversion: exact round trips of tiny GPT-2 and Llama models, hand-built
// HF-layout files landing in the right places, config.json translation, clear errors that
// leave models and files untouched, and (when Python has them) the exported directory
// checked against transformers itself and against an independent numpy forward pass.
#include "tessera/models/hf_convert.h"

#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "io_testing.h"
#include "tessera/io/atomic_file.h"
#include "testing.h"

using namespace tessera;
using namespace tessera::testing;
using models::ModelConfig;
using models::TransformerLM;
using nlohmann::json;

namespace {

ModelConfig tiny_gpt2(bool tied, int64_t inner = 0) {
  ModelConfig c;
  c.architecture = "gpt2";
  c.vocab_size = 13;
  c.hidden_size = 12;
  c.num_layers = 2;
  c.num_heads = c.num_kv_heads = 3;
  c.intermediate_size = inner;
  c.max_seq_len = 10;
  c.tie_embeddings = tied;
  return c;
}

ModelConfig tiny_llama(bool tied, int64_t kv_heads = 2) {
  ModelConfig c;
  c.architecture = "llama";
  c.vocab_size = 17;
  c.hidden_size = 16;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = kv_heads;
  c.intermediate_size = 24;
  c.max_seq_len = 16;
  c.norm_eps = 1e-6f;
  c.rope_theta = 100.0f;  // fast rotation, so a wrong RoPE convention shows in the logits
  c.tie_embeddings = tied;
  return c;
}

ModelConfig tiny_mixtral(bool tied, int64_t experts = 4, int64_t top_k = 2) {
  ModelConfig c = tiny_llama(tied, 2);
  c.architecture = "mixtral";
  c.intermediate_size = 12;
  c.num_experts = experts;
  c.num_experts_per_tok = top_k;
  c.router_aux_loss_coef = 0.02f;
  return c;
}

// Distinct random values in every parameter (init leaves biases at 0 and norms at 1, under
// which a swapped bias or norm would go unnoticed).
void randomize(TransformerLM& model, uint64_t seed) {
  Context ctx = Context::cpu();
  model.init(ctx, seed);
  uint64_t s = seed * 1000;
  for (nn::Parameter* p : model.parameters()) {
    const bool norm_weight = p->name.find("norm") != std::string::npos && p->name.find(".weight") != std::string::npos;
    p->value.copy_from(norm_weight ? random_tensor(p->value.shape(), p->value.dtype(), ++s, 0.5f, 1.5f)
                                   : random_tensor(p->value.shape(), p->value.dtype(), ++s, -0.5f, 0.5f));
  }
}

std::map<std::string, std::string> snapshot(TransformerLM& model) {
  std::map<std::string, std::string> out;
  for (nn::Parameter* p : model.parameters()) out[p->name] = bytes_of(p->value);
  return out;
}

const std::vector<int64_t> kTokens = {3, 1, 4, 1, 5, 9, 2, 6};

Tensor logits_of(TransformerLM& model) {
  Context ctx = Context::cpu();
  std::vector<int64_t> ids;
  for (int64_t t : kTokens) ids.push_back(t % model.config().vocab_size);
  return model.logits(ctx, Tensor::from_ints(ids, {1, static_cast<int64_t>(ids.size())}));
}

// The message of the Error `f` throws, or "" (a test failure) when it throws none.
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a tessera::Error";
  return "";
}

#define EXPECT_CONTAINS(text, part) EXPECT_NE(std::string(text).find(part), std::string::npos) << (text)

void write_config(const TempDir& dir, const json& config) {
  io::write_file_atomically(dir.file("config.json"), config.dump(2));
}

}  // namespace

// ---- Round trips --------------------------------------------------------------------------

class HfRoundTrip : public ::testing::TestWithParam<ModelConfig> {};

TEST_P(HfRoundTrip, ParametersAndLogitsAreBitIdentical) {
  const ModelConfig config = GetParam();
  TransformerLM model(config);
  randomize(model, 7);
  TempDir dir;
  const std::string hf = dir.file("hf");
  models::save_hf_model(hf, model);

  const std::vector<std::string> files = {"config.json", "model.safetensors"};
  std::vector<std::string> found;
  for (const auto& e : std::filesystem::directory_iterator(hf)) found.push_back(e.path().filename().string());
  std::sort(found.begin(), found.end());
  EXPECT_EQ(found, files);
  const io::SafetensorsFile file(hf + "/model.safetensors");
  EXPECT_EQ(file.metadata().at("format"), "pt");
  EXPECT_EQ(file.contains("lm_head.weight"), !config.tie_embeddings);
  for (const io::TensorInfo& info : file.infos()) EXPECT_EQ(info.dtype_code, "F32") << info.name;

  const auto loaded = models::load_hf_model_dir(hf);
  EXPECT_EQ(loaded->config().to_json(), config.to_json());
  const auto want = snapshot(model), got = snapshot(*loaded);
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, bytes] : want) EXPECT_TRUE(got.at(name) == bytes) << name << " differs after the round trip";
  EXPECT_EQ(bytes_of(logits_of(*loaded)), bytes_of(logits_of(model)));
}

INSTANTIATE_TEST_SUITE_P(Models, HfRoundTrip,
                         ::testing::Values(tiny_gpt2(true), tiny_gpt2(false, 20), tiny_llama(true), tiny_llama(false),
                                           tiny_llama(false, 1), tiny_llama(true, 4), tiny_mixtral(false),
                                           tiny_mixtral(true, 3, 1)),
                         [](const auto& info) {
                           const ModelConfig& c = info.param;
                           return c.architecture + "_kv" + std::to_string(c.num_kv_heads) +
                                  (c.tie_embeddings ? "_tied" : "_untied") + "_" + std::to_string(info.index);
                         });

TEST(HfConvert, Bf16ExportRoundsEachWeightOnce) {
  TransformerLM model(tiny_llama(false));
  randomize(model, 3);
  TempDir dir;
  models::save_hf_model(dir.file("hf"), model, DType::BF16);
  EXPECT_EQ(json::parse(io::read_file(dir.file("hf/config.json")))["torch_dtype"], "bfloat16");
  const io::SafetensorsFile file(dir.file("hf/model.safetensors"));
  for (const io::TensorInfo& info : file.infos()) EXPECT_EQ(info.dtype_code, "BF16") << info.name;
  const auto loaded = models::load_hf_model_dir(dir.file("hf"));
  const auto params = model.parameters(), loaded_params = loaded->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor rounded = Tensor::from_floats(params[i]->value.to_floats(), params[i]->value.shape(), DType::BF16);
    EXPECT_EQ(loaded_params[i]->value.to_floats(), rounded.to_floats()) << params[i]->name;
  }
}

TEST(HfConvert, F64ModelLoadsF32Weights) {
  TransformerLM model(tiny_gpt2(true));
  randomize(model, 4);
  TempDir dir;
  models::save_hf_model(dir.file("hf"), model);
  const auto loaded = models::load_hf_model_dir(dir.file("hf"), DType::F64);
  const auto params = model.parameters(), loaded_params = loaded->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(loaded_params[i]->value.dtype(), DType::F64);
    EXPECT_EQ(loaded_params[i]->value.to_doubles(), params[i]->value.to_doubles()) << params[i]->name;
  }
}

// ---- Hand-built Hugging Face files --------------------------------------------------------

namespace {

// value = id * 10000 + flat index: exact in F32, and tells which tensor and element it was.
Tensor coded(const Shape& shape, int id) {
  std::vector<float> v(static_cast<size_t>(shape_numel(shape)));
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(id * 10000 + static_cast<int64_t>(i));
  return Tensor::from_floats(v, shape);
}

double at(const nn::Parameter& p, int64_t row, int64_t col = 0) {
  return p.value.item(p.value.dim() == 1 ? row : row * p.value.size(1) + col);
}

// A GPT-2 checkpoint as transformers writes it: Conv1D weights [in, out], mask buffers.
io::NamedTensors hf_gpt2_tensors(const ModelConfig& c, const std::string& prefix) {
  const int64_t C = c.hidden_size, F = c.ffn_size();
  io::NamedTensors t;
  int id = 1;
  t.emplace_back(prefix + "wte.weight", coded({c.vocab_size, C}, id++));
  t.emplace_back(prefix + "wpe.weight", coded({c.max_seq_len, C}, id++));
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string h = prefix + "h." + std::to_string(i) + ".";
    t.emplace_back(h + "ln_1.weight", coded({C}, id++));
    t.emplace_back(h + "ln_1.bias", coded({C}, id++));
    t.emplace_back(h + "attn.bias", coded({1, 1, c.max_seq_len, c.max_seq_len}, 999));
    t.emplace_back(h + "attn.masked_bias", coded({1}, 998));
    t.emplace_back(h + "attn.c_attn.weight", coded({C, 3 * C}, id++));
    t.emplace_back(h + "attn.c_attn.bias", coded({3 * C}, id++));
    t.emplace_back(h + "attn.c_proj.weight", coded({C, C}, id++));
    t.emplace_back(h + "attn.c_proj.bias", coded({C}, id++));
    t.emplace_back(h + "ln_2.weight", coded({C}, id++));
    t.emplace_back(h + "ln_2.bias", coded({C}, id++));
    t.emplace_back(h + "mlp.c_fc.weight", coded({C, F}, id++));
    t.emplace_back(h + "mlp.c_fc.bias", coded({F}, id++));
    t.emplace_back(h + "mlp.c_proj.weight", coded({F, C}, id++));
    t.emplace_back(h + "mlp.c_proj.bias", coded({C}, id++));
  }
  t.emplace_back(prefix + "ln_f.weight", coded({C}, id++));
  t.emplace_back(prefix + "ln_f.bias", coded({C}, id++));
  if (!c.tie_embeddings) t.emplace_back("lm_head.weight", coded({c.vocab_size, C}, id++));
  return t;
}

io::NamedTensors hf_llama_tensors(const ModelConfig& c, DType dtype = DType::F32) {
  const int64_t C = c.hidden_size, D = c.head_dim(), F = c.ffn_size();
  io::NamedTensors t;
  int id = 1;
  auto add = [&](const std::string& name, const Shape& shape) {
    Tensor v = coded(shape, id++);
    if (dtype != DType::F32) {  // small integers, exact in BF16 / F16
      std::vector<float> small = v.to_floats();
      for (float& x : small) x = static_cast<float>(static_cast<int64_t>(x) % 97 - 48);
      v = Tensor::from_floats(small, shape, dtype);
    }
    t.emplace_back(name, v);
  };
  add("model.embed_tokens.weight", {c.vocab_size, C});
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string l = "model.layers." + std::to_string(i) + ".";
    add(l + "input_layernorm.weight", {C});
    add(l + "self_attn.q_proj.weight", {c.num_heads * D, C});
    add(l + "self_attn.k_proj.weight", {c.num_kv_heads * D, C});
    add(l + "self_attn.v_proj.weight", {c.num_kv_heads * D, C});
    add(l + "self_attn.o_proj.weight", {C, C});
    add(l + "self_attn.rotary_emb.inv_freq", {D / 2});
    add(l + "post_attention_layernorm.weight", {C});
    add(l + "mlp.gate_proj.weight", {F, C});
    add(l + "mlp.up_proj.weight", {F, C});
    add(l + "mlp.down_proj.weight", {C, F});
  }
  add("model.norm.weight", {C});
  if (!c.tie_embeddings) add("lm_head.weight", {c.vocab_size, C});
  return t;
}

const Tensor& find(const io::NamedTensors& t, const std::string& name) {
  for (const auto& [n, v] : t)
    if (n == name) return v;
  throw std::runtime_error("test: no tensor " + name);
}

double hf_at(const io::NamedTensors& t, const std::string& name, int64_t row, int64_t col = 0) {
  const Tensor& v = find(t, name);
  return v.item(v.dim() == 1 ? row : row * v.size(1) + col);
}

}  // namespace

TEST(HfConvert, Gpt2Conv1DWeightsAreTransposedIntoPlace) {
  for (const std::string prefix : {"transformer.", ""}) {  // head model and base model checkpoints
    const ModelConfig c = tiny_gpt2(false, 20);
    const io::NamedTensors hf = hf_gpt2_tensors(c, prefix);
    TempDir dir;
    write_config(dir, models::config_to_hf(c));
    io::save_safetensors(dir.file("model.safetensors"), hf, {{"format", "pt"}});
    const auto model = models::load_hf_model_dir(dir.path.string());
    const int64_t C = c.hidden_size;
    const nn::TransformerLayer& l1 = *model->layers[1];
    const std::string h1 = prefix + "h.1.";
    EXPECT_EQ(at(model->token_embedding, 5, 7), hf_at(hf, prefix + "wte.weight", 5, 7));
    EXPECT_EQ(at(model->position_embedding, 9, 2), hf_at(hf, prefix + "wpe.weight", 9, 2));
    EXPECT_EQ(at(l1.norm1.weight, 3), hf_at(hf, h1 + "ln_1.weight", 3));
    EXPECT_EQ(at(l1.norm1.bias, 4), hf_at(hf, h1 + "ln_1.bias", 4));
    // qkv row r (output feature r) is column r of c_attn: q rows, then k (r >= C), then v.
    for (int64_t r : {int64_t(0), int64_t(5), C + 1, 2 * C + 11})
      for (int64_t col : {0, 3, 11}) EXPECT_EQ(at(l1.attn.qkv.weight, r, col), hf_at(hf, h1 + "attn.c_attn.weight", col, r));
    EXPECT_EQ(at(l1.attn.qkv.bias, 2 * C + 1), hf_at(hf, h1 + "attn.c_attn.bias", 2 * C + 1));
    EXPECT_EQ(at(l1.attn.proj.weight, 2, 9), hf_at(hf, h1 + "attn.c_proj.weight", 9, 2));
    EXPECT_EQ(at(l1.attn.proj.bias, 6), hf_at(hf, h1 + "attn.c_proj.bias", 6));
    EXPECT_EQ(at(l1.norm2.weight, 1), hf_at(hf, h1 + "ln_2.weight", 1));
    EXPECT_EQ(at(l1.norm2.bias, 1), hf_at(hf, h1 + "ln_2.bias", 1));
    EXPECT_EQ(at(l1.mlp.fc.weight, 19, 4), hf_at(hf, h1 + "mlp.c_fc.weight", 4, 19));
    EXPECT_EQ(at(l1.mlp.fc.bias, 19), hf_at(hf, h1 + "mlp.c_fc.bias", 19));
    EXPECT_EQ(at(l1.mlp.proj.weight, 4, 19), hf_at(hf, h1 + "mlp.c_proj.weight", 19, 4));
    EXPECT_EQ(at(l1.mlp.proj.bias, 11), hf_at(hf, h1 + "mlp.c_proj.bias", 11));
    EXPECT_EQ(at(model->final_norm.weight, 0), hf_at(hf, prefix + "ln_f.weight", 0));
    EXPECT_EQ(at(model->final_norm.bias, 11), hf_at(hf, prefix + "ln_f.bias", 11));
    EXPECT_EQ(at(model->lm_head, 12, 11), hf_at(hf, "lm_head.weight", 12, 11));
    // And the first layer is not the second.
    EXPECT_EQ(at(model->layers[0]->attn.qkv.weight, 1, 2), hf_at(hf, prefix + "h.0.attn.c_attn.weight", 2, 1));
  }
}

TEST(HfConvert, LlamaProjectionsAreConcatenatedIntoPlace) {
  for (DType dtype : {DType::F32, DType::BF16, DType::F16}) {
    const ModelConfig c = tiny_llama(false, 2);
    const io::NamedTensors hf = hf_llama_tensors(c, dtype);
    TempDir dir;
    write_config(dir, models::config_to_hf(c));
    // Sharded, as large Hugging Face checkpoints are.
    io::save_sharded(dir.path.string(), hf, 3000, {{"format", "pt"}});
    ASSERT_TRUE(io::is_regular_file(dir.file("model.safetensors.index.json")));
    const auto model = models::load_hf_model_dir(dir.path.string());
    const int64_t q_rows = c.num_heads * c.head_dim(), kv_rows = c.num_kv_heads * c.head_dim(), F = c.ffn_size();
    const nn::TransformerLayer& l0 = *model->layers[0];
    const std::string p = "model.layers.0.";
    EXPECT_EQ(at(model->token_embedding, 16, 15), hf_at(hf, "model.embed_tokens.weight", 16, 15));
    EXPECT_EQ(at(l0.norm1.weight, 7), hf_at(hf, p + "input_layernorm.weight", 7));
    EXPECT_EQ(at(l0.attn.qkv.weight, 15, 3), hf_at(hf, p + "self_attn.q_proj.weight", 15, 3));
    EXPECT_EQ(at(l0.attn.qkv.weight, q_rows + 2, 5), hf_at(hf, p + "self_attn.k_proj.weight", 2, 5));
    EXPECT_EQ(at(l0.attn.qkv.weight, q_rows + kv_rows + 7, 1), hf_at(hf, p + "self_attn.v_proj.weight", 7, 1));
    EXPECT_EQ(at(l0.attn.proj.weight, 4, 13), hf_at(hf, p + "self_attn.o_proj.weight", 4, 13));
    EXPECT_EQ(at(l0.norm2.weight, 2), hf_at(hf, p + "post_attention_layernorm.weight", 2));
    EXPECT_EQ(at(l0.mlp.fc.weight, 3, 9), hf_at(hf, p + "mlp.gate_proj.weight", 3, 9));
    EXPECT_EQ(at(l0.mlp.fc.weight, F + 3, 9), hf_at(hf, p + "mlp.up_proj.weight", 3, 9));
    EXPECT_EQ(at(l0.mlp.proj.weight, 15, 23), hf_at(hf, p + "mlp.down_proj.weight", 15, 23));
    EXPECT_EQ(at(model->final_norm.weight, 3), hf_at(hf, "model.norm.weight", 3));
    EXPECT_EQ(at(model->lm_head, 1, 2), hf_at(hf, "lm_head.weight", 1, 2));
  }
}

TEST(HfConvert, TiedHeadInTheFileIsIgnored) {
  ModelConfig c = tiny_llama(true);
  io::NamedTensors hf = hf_llama_tensors(c);
  hf.emplace_back("lm_head.weight", coded({c.vocab_size, c.hidden_size}, 500));
  TempDir dir;
  write_config(dir, models::config_to_hf(c));
  io::save_safetensors(dir.file("model.safetensors"), hf, {{"format", "pt"}});
  const auto model = models::load_hf_model_dir(dir.path.string());
  EXPECT_EQ(at(model->token_embedding, 3, 4), hf_at(hf, "model.embed_tokens.weight", 3, 4));
}

// ---- config.json ----------------------------------------------------------------------------

TEST(HfConfig, RoundTrips) {
  for (const ModelConfig& c : {tiny_gpt2(true), tiny_gpt2(false, 20), tiny_llama(true), tiny_llama(false, 1),
                               ModelConfig::gpt2_124m(), ModelConfig::llama32_1b()}) {
    const json hf = models::config_to_hf(c);
    EXPECT_EQ(models::config_from_hf(hf).to_json(), c.to_json()) << hf.dump();
    EXPECT_EQ(hf["torch_dtype"], "float32");
    EXPECT_EQ(hf["model_type"], c.architecture);
    EXPECT_EQ(hf["architectures"][0], c.is_gpt2() ? "GPT2LMHeadModel" : "LlamaForCausalLM");
  }
  const json gpt2 = models::config_to_hf(tiny_gpt2(true));
  EXPECT_TRUE(gpt2["n_inner"].is_null());
  EXPECT_EQ(gpt2["layer_norm_epsilon"].dump(), "1e-05");
  EXPECT_EQ(models::config_to_hf(tiny_gpt2(true), 0, 12)["eos_token_id"], 12);
  EXPECT_FALSE(gpt2.contains("eos_token_id"));
  const json llama = models::config_to_hf(ModelConfig::llama32_1b());
  EXPECT_EQ(llama["rope_theta"].dump(), "500000.0");
  EXPECT_EQ(llama["num_key_value_heads"], 8);
  EXPECT_EQ(llama["head_dim"], 64);
}

TEST(HfConfig, MixtralRoundTripsAndReadsThePublishedConfig) {
  for (const ModelConfig& c : {tiny_mixtral(false), tiny_mixtral(true, 3, 1)}) {
    const json hf = models::config_to_hf(c);
    EXPECT_EQ(models::config_from_hf(hf).to_json(), c.to_json()) << hf.dump();
    EXPECT_EQ(hf["architectures"][0], "MixtralForCausalLM");
    EXPECT_EQ(hf["num_local_experts"], c.num_experts);
    EXPECT_EQ(hf["output_router_logits"], true);
  }
  // mistralai/Mixtral-8x7B-v0.1's config.json (abridged).
  const json mixtral = json::parse(R"({"architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0,
    "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32,
    "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
    "output_router_logits": false, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
    "sliding_window": null, "tie_word_embeddings": false, "vocab_size": 32000})");
  const ModelConfig c = models::config_from_hf(mixtral);
  EXPECT_EQ(c.architecture, "mixtral");
  EXPECT_EQ(c.num_experts, 8);
  EXPECT_EQ(c.num_experts_per_tok, 2);
  EXPECT_EQ(c.ffn_size(), 14336);
  EXPECT_EQ(c.rope_theta, 1e6f);
  EXPECT_EQ(c.router_aux_loss_coef, 0.0f);  // output_router_logits false: no aux loss in transformers
  EXPECT_EQ(c.num_parameters(), 46702792704);  // Mixtral-8x7B's published 46.7B
  json with_aux = mixtral;
  with_aux["output_router_logits"] = true;
  EXPECT_FLOAT_EQ(models::config_from_hf(with_aux).router_aux_loss_coef, 0.04f);  // top_k x transformers' coefficient
  json jitter = mixtral;
  jitter["router_jitter_noise"] = 0.1;
  EXPECT_CONTAINS(error_of([&] { models::config_from_hf(jitter); }), "router_jitter_noise");
  json window = mixtral;
  window["sliding_window"] = 4096;
  EXPECT_CONTAINS(error_of([&] { models::config_from_hf(window); }), "sliding_window");
  ModelConfig sigmoid = tiny_mixtral(false);
  sigmoid.router_score = "sigmoid";
  EXPECT_CONTAINS(error_of([&] { models::config_to_hf(sigmoid); }), "no Hugging Face Mixtral equivalent");
}

TEST(HfConvert, MixtralExpertsLandInTheGroupedWeights) {
  const ModelConfig c = tiny_mixtral(false);
  TransformerLM model(c);
  randomize(model, 3);
  TempDir dir;
  models::save_hf_model(dir.file("hf"), model);
  const io::SafetensorsFile file(dir.file("hf") + "/model.safetensors");
  const std::string b = "model.layers.1.block_sparse_moe.";
  const Tensor w1 = file.get(b + "experts.2.w1.weight"), w3 = file.get(b + "experts.2.w3.weight");
  const Tensor w2 = file.get(b + "experts.3.w2.weight"), gate = file.get(b + "gate.weight");
  const nn::MoELayer& moe = *model.layers[1]->moe;
  const int64_t f = c.ffn_size(), h = c.hidden_size;
  EXPECT_EQ(w1.shape(), (Shape{f, h}));
  EXPECT_EQ(w2.shape(), (Shape{h, f}));
  EXPECT_EQ(gate.shape(), (Shape{c.num_experts, h}));
  EXPECT_EQ(w1.item(5 * h + 7), moe.experts.fc.weight.value.item((2 * 2 * f + 5) * h + 7));
  EXPECT_EQ(w3.item(5 * h + 7), moe.experts.fc.weight.value.item((2 * 2 * f + f + 5) * h + 7));
  EXPECT_EQ(w2.item(9 * f + 4), moe.experts.proj.weight.value.item((3 * h + 9) * f + 4));
  EXPECT_EQ(gate.item(3 * h + 1), moe.router.weight.value.item(3 * h + 1));
  EXPECT_FALSE(file.contains("model.layers.0.mlp.gate_proj.weight"));
}

TEST(HfConfig, ReadsPublishedConfigs) {
  // openai-community/gpt2's config.json (abridged to the keys that matter).
  const json gpt2 = json::parse(R"({"activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"],
    "attn_pdrop": 0.1, "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256, "initializer_range": 0.02,
    "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768, "n_head": 12,
    "n_layer": 12, "n_positions": 1024, "resid_pdrop": 0.1, "vocab_size": 50257})");
  EXPECT_EQ(models::config_from_hf(gpt2).to_json(), ModelConfig::gpt2_124m().to_json());
  // A Llama-3-style config without RoPE scaling; transformers 5 puts the theta in rope_parameters.
  json llama = json::parse(R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 8192, "max_position_embeddings": 131072, "num_attention_heads": 32,
    "num_hidden_layers": 16, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": null, "tie_word_embeddings": true, "vocab_size": 128256, "head_dim": 64})");
  EXPECT_EQ(models::config_from_hf(llama).to_json(), ModelConfig::llama32_1b().to_json());
  llama.erase("rope_theta");
  llama["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 500000.0}};
  EXPECT_EQ(models::config_from_hf(llama).to_json(), ModelConfig::llama32_1b().to_json());
  // Keys left out take transformers' defaults: no key-value heads means one per query head.
  const ModelConfig d = models::config_from_hf({{"model_type", "llama"}, {"hidden_size", 64}, {"num_attention_heads", 4}});
  EXPECT_EQ(d.num_kv_heads, 4);
  EXPECT_FALSE(d.tie_embeddings);
  EXPECT_FLOAT_EQ(d.rope_theta, 10000.0f);
  EXPECT_FLOAT_EQ(d.norm_eps, 1e-6f);
}

TEST(HfConfig, UnsupportedOptionsAreClearErrors) {
  EXPECT_CONTAINS(error_of([] { models::config_from_hf({{"model_type", "bert"}}); }), "model_type \"bert\" is not supported");
  EXPECT_CONTAINS(error_of([] { models::config_from_hf({{"n_embd", 8}}); }), "model_type");
  json llama = models::config_to_hf(tiny_llama(false));
  llama["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 32.0}, {"original_max_position_embeddings", 8192}};
  EXPECT_CONTAINS(error_of([&] { models::config_from_hf(llama); }), "tessera's RoPE has no scaling support");
  llama["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
  EXPECT_CONTAINS(error_of([&] { models::config_from_hf(llama); }), "rope_scaling");
  llama["rope_scaling"] = nullptr;
  llama["rope_parameters"] = {{"rope_type", "yarn"}, {"rope_theta", 10000.0}, {"factor", 4.0}};
  EXPECT_CONTAINS(error_of([&] { models::config_from_hf(llama); }), "no scaling support");
  llama.erase("rope_parameters");
  EXPECT_NO_THROW(models::config_from_hf(llama));
  for (const char* key : {"attention_bias", "mlp_bias"}) {
    json bad = llama;
    bad[key] = true;
    EXPECT_CONTAINS(error_of([&] { models::config_from_hf(bad); }), key);
  }
  json bad = llama;
  bad["hidden_act"] = "gelu";
  EXPECT_CONTAINS(error_of([&] { models::config_from_hf(bad); }), "hidden_act");
  bad = llama;
  bad["head_dim"] = 8;
  EXPECT_CONTAINS(error_of([&] { models::config_from_hf(bad); }), "head_dim");
  bad = llama;
  bad["hidden_size"] = "big";
  EXPECT_CONTAINS(error_of([&] { models::config_from_hf(bad); }), "\"hidden_size\" must be an integer");
  json gpt2 = models::config_to_hf(tiny_gpt2(true));
  gpt2["activation_function"] = "relu";
  EXPECT_CONTAINS(error_of([&] { models::config_from_hf(gpt2); }), "activation_function \"relu\"");
  gpt2["activation_function"] = "gelu_pytorch_tanh";
  EXPECT_NO_THROW(models::config_from_hf(gpt2));
  gpt2["scale_attn_by_inverse_layer_idx"] = true;
  EXPECT_CONTAINS(error_of([&] { models::config_from_hf(gpt2); }), "scale_attn_by_inverse_layer_idx");
  TempDir dir;
  EXPECT_CONTAINS(error_of([&] { models::read_hf_config(dir.path.string()); }), "has no config.json");
  io::write_file_atomically(dir.file("config.json"), "{not json");
  EXPECT_CONTAINS(error_of([&] { models::read_hf_config(dir.path.string()); }), "not valid JSON");
}

// ---- Errors leave everything as it was ---------------------------------------------------

namespace {

// Writes `tensors` as dir/model.safetensors, loads it into a randomized model of config `c`
// and returns the error; the model's parameters must be unchanged.
std::string failed_load(const ModelConfig& c, const io::NamedTensors& tensors) {
  TempDir dir;
  io::save_safetensors(dir.file("model.safetensors"), tensors, {{"format", "pt"}});
  TransformerLM model(c);
  randomize(model, 11);
  const auto before = snapshot(model);
  const std::string message = error_of([&] { models::load_hf_model(dir.path.string(), model); });
  EXPECT_TRUE(snapshot(model) == before) << "a failed load changed the model";
  return message;
}

io::NamedTensors without(io::NamedTensors t, const std::string& name) {
  std::erase_if(t, [&](const auto& entry) { return entry.first == name; });
  return t;
}

}  // namespace

TEST(HfConvert, MissingTensorIsNamed) {
  const ModelConfig c = tiny_llama(false);
  const std::string message = failed_load(c, without(hf_llama_tensors(c), "model.layers.1.mlp.up_proj.weight"));
  EXPECT_CONTAINS(message, "has no tensor 'model.layers.1.mlp.up_proj.weight'");
  EXPECT_CONTAINS(message, "layers.1.mlp.fc.weight");
  const ModelConfig g = tiny_gpt2(false);
  EXPECT_CONTAINS(failed_load(g, without(hf_gpt2_tensors(g, "transformer."), "lm_head.weight")),
                  "has no tensor 'lm_head.weight'");
}

TEST(HfConvert, WrongShapeNamesBothShapes) {
  const ModelConfig c = tiny_gpt2(true);
  io::NamedTensors t = hf_gpt2_tensors(c, "transformer.");
  // Stored [out, in] instead of Conv1D's [in, out].
  for (auto& [name, v] : t)
    if (name == "transformer.h.0.attn.c_attn.weight") v = coded({36, 12}, 7);
  const std::string message = failed_load(c, t);
  EXPECT_CONTAINS(message, "'transformer.h.0.attn.c_attn.weight'");
  EXPECT_CONTAINS(message, "has shape [36, 12], expected [12, 36]");
  // A checkpoint for another model size.
  EXPECT_CONTAINS(failed_load(tiny_gpt2(true, 20), hf_gpt2_tensors(c, "transformer.")), "expected [12, 20]");
}

TEST(HfConvert, UnexpectedTensorsAndDtypesAreErrors) {
  const ModelConfig c = tiny_llama(true);
  ModelConfig three_layers = c;
  three_layers.num_layers = 3;
  // Weights of a deeper model than config.json says.
  EXPECT_CONTAINS(failed_load(c, hf_llama_tensors(three_layers)), "no place for: 'model.layers.2.");
  io::NamedTensors t = hf_llama_tensors(c);
  for (auto& [name, v] : t)
    if (name == "model.norm.weight") v = Tensor::from_ints(std::vector<int64_t>(16, 1), {16});
  EXPECT_CONTAINS(failed_load(c, t), "'model.norm.weight' in");
}

TEST(HfConvert, CorruptFileChangesNothing) {
  TransformerLM source(tiny_gpt2(true));
  randomize(source, 5);
  TempDir dir;
  models::save_hf_model(dir.path.string(), source);
  const std::string path = dir.file("model.safetensors");
  std::filesystem::resize_file(path, std::filesystem::file_size(path) / 2);
  TransformerLM model(tiny_gpt2(true));
  randomize(model, 6);
  const auto before = snapshot(model);
  EXPECT_CONTAINS(error_of([&] { models::load_hf_model(dir.path.string(), model); }), path);
  EXPECT_TRUE(snapshot(model) == before);
  EXPECT_THROW(models::load_hf_model_dir(dir.path.string()), Error);
  EXPECT_CONTAINS(error_of([&] { models::load_hf_model_dir(dir.file("nowhere")); }), "config.json");
}

TEST(HfConvert, FailedSaveKeepsTheOldFiles) {
  TransformerLM model(tiny_llama(false));
  randomize(model, 8);
  TempDir dir;
  models::save_hf_model(dir.path.string(), model);
  const std::string weights = io::read_file(dir.file("model.safetensors")), config = io::read_file(dir.file("config.json"));
  TransformerLM other(tiny_llama(true));
  EXPECT_CONTAINS(error_of([&] { models::save_hf_model(dir.path.string(), other, DType::E4M3); }), "e4m3");
  EXPECT_EQ(io::read_file(dir.file("model.safetensors")), weights);
  EXPECT_EQ(io::read_file(dir.file("config.json")), config);
  EXPECT_EQ(dir.entries(), (std::vector<std::string>{"config.json", "model.safetensors"}));
  EXPECT_CONTAINS(error_of([&] { models::save_hf_model(dir.file("config.json"), model); }), "cannot create directory");
}

// ---- Against transformers, and against an independent numpy forward pass ------------------

namespace {

bool python_can_import(const std::string& modules) {
  return std::system(("python3 -c 'import " + modules + "' >/dev/null 2>&1").c_str()) == 0;
}

std::string script(const char* name) {
  return (std::filesystem::path(__FILE__).parent_path() / "python" / name).string();
}

// Runs `script` on an exported directory and returns its logits ([T, V], as doubles).
std::vector<double> python_logits(const std::string& script_path, const std::string& dir) {
  std::string ids;
  for (int64_t t : kTokens) ids += (ids.empty() ? "" : ",") + std::to_string(t);
  const std::string command = "python3 '" + script_path + "' '" + dir + "' " + ids + " 2>" + dir + "/stderr.txt";
  FILE* pipe = popen(command.c_str(), "r");
  if (!pipe) {
    ADD_FAILURE() << "cannot run " << command;
    return {};
  }
  std::string out;
  char buffer[4096];
  for (size_t n; (n = fread(buffer, 1, sizeof(buffer), pipe)) > 0;) out.append(buffer, n);
  const int status = pclose(pipe);
  if (status != 0) {
    ADD_FAILURE() << command << " failed:\n" << io::read_file(dir + "/stderr.txt");
    return {};
  }
  return json::parse(out)["logits"].get<std::vector<double>>();
}

void expect_python_agrees(const char* script_name, const ModelConfig& config) {
  TransformerLM model(config);
  randomize(model, 21);
  // Llama tokens must fit both vocabularies; kTokens < 13 does.
  TempDir dir;
  const std::string hf = dir.file("hf");
  models::save_hf_model(hf, model);
  const std::vector<double> want = logits_of(model).to_doubles();
  const std::vector<double> got = python_logits(script(script_name), hf);
  ASSERT_EQ(got.size(), want.size());
  EXPECT_LT(relative_error(got, want), 1e-4) << config.to_json().dump();
}

const ModelConfig kPythonConfigs[] = {tiny_gpt2(true), tiny_gpt2(false, 20), tiny_llama(true, 2), tiny_llama(false, 1)};

}  // namespace

TEST(HfConvert, TransformersComputesTheSameLogits) {
  if (!python_can_import("torch, transformers"))
    GTEST_SKIP() << "python3 cannot import torch and transformers; the comparison with transformers is skipped";
  for (const ModelConfig& c : kPythonConfigs) expect_python_agrees("hf_logits.py", c);
}

TEST(HfConvert, TransformersComputesTheSameMixtralLogits) {
  if (!python_can_import("torch, transformers"))
    GTEST_SKIP() << "python3 cannot import torch and transformers; the comparison with transformers is skipped";
  for (const ModelConfig& c : {tiny_mixtral(false), tiny_mixtral(true, 3, 1)}) expect_python_agrees("hf_logits.py", c);
}

TEST(HfConvert, NumpyReferenceComputesTheSameMixtralLogits) {
  if (!python_can_import("numpy"))
    GTEST_SKIP() << "python3 cannot import numpy; the comparison with the numpy reference is skipped";
  for (const ModelConfig& c : {tiny_mixtral(false), tiny_mixtral(true, 3, 1)}) expect_python_agrees("hf_mixtral_numpy.py", c);
}

TEST(HfConvert, NumpyReferenceComputesTheSameLogits) {
  if (!python_can_import("numpy"))
    GTEST_SKIP() << "python3 cannot import numpy; the comparison with the numpy reference is skipped";
  for (const ModelConfig& c : kPythonConfigs) expect_python_agrees("hf_reference_numpy.py", c);
}
