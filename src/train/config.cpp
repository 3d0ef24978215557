#include "tessera/train/config.h"

#include <yaml-cpp/yaml.h>

#include <fstream>
#include <sstream>

#include "tessera/core/error.h"

namespace tessera::train {

namespace {

nlohmann::json yaml_to_json(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Null:
    case YAML::NodeType::Undefined:
      return nullptr;
    case YAML::NodeType::Sequence: {
      nlohmann::json out = nlohmann::json::array();
      for (const auto& item : node) out.push_back(yaml_to_json(item));
      return out;
    }
    case YAML::NodeType::Map: {
      nlohmann::json out = nlohmann::json::object();
      for (const auto& kv : node) out[kv.first.as<std::string>()] = yaml_to_json(kv.second);
      return out;
    }
    case YAML::NodeType::Scalar: {
      const std::string s = node.Scalar();
      if (node.Tag() == "!") return s;  // quoted: always a string
      if (s == "true" || s == "True") return true;
      if (s == "false" || s == "False") return false;
      if (s == "null" || s == "~") return nullptr;
      // Integers stay integers so that keys like num_layers type-check as integers.
      try {
        size_t used = 0;
        const long long i = std::stoll(s, &used);
        if (used == s.size()) return i;
      } catch (...) {
      }
      try {
        size_t used = 0;
        const double d = std::stod(s, &used);
        if (used == s.size()) return d;
      } catch (...) {
      }
      return s;
    }
  }
  return nullptr;
}

// Reads `section.key` into `out` when present; wrong types name the key.
template <typename T>
void read(const nlohmann::json& section, const std::string& prefix, const char* key, T& out) {
  if (!section.contains(key)) return;
  const nlohmann::json& v = section.at(key);
  if constexpr (std::is_same_v<T, std::string>) {
    if (v.is_null()) {  // `key:` with no value, or `--set key=`
      out.clear();
      return;
    }
  }
  bool ok = true;
  if constexpr (std::is_same_v<T, std::string>) ok = v.is_string();
  else if constexpr (std::is_same_v<T, bool>) ok = v.is_boolean();
  else if constexpr (std::is_integral_v<T>) ok = v.is_number_integer() && (std::is_signed_v<T> || v.get<int64_t>() >= 0);
  else if constexpr (std::is_floating_point_v<T>) ok = v.is_number();
  TESSERA_CHECK(ok, "config: ", prefix, key, " has the wrong type or value: ", v.dump());
  out = v.get<T>();
}

void check_keys(const nlohmann::json& section, const std::string& name, std::initializer_list<const char*> keys) {
  TESSERA_CHECK(section.is_object(), "config: ", name, " must be a mapping, got ", section.dump());
  for (auto it = section.begin(); it != section.end(); ++it) {
    bool known = false;
    for (const char* k : keys) known = known || it.key() == k;
    TESSERA_CHECK(known, "config: unknown key \"", name, name.empty() ? "" : ".", it.key(), "\"");
  }
}

}  // namespace

nlohmann::json yaml_text_to_json(const std::string& text, const std::string& source) {
  try {
    return yaml_to_json(YAML::Load(text));
  } catch (const YAML::Exception& e) {
    TESSERA_FAIL("config: cannot parse ", source, ": ", e.what());
  }
}

nlohmann::json load_config_file(const std::string& path) {
  std::ifstream in(path);
  TESSERA_CHECK(in.good(), "config: cannot open '", path, "'");
  std::stringstream text;
  text << in.rdbuf();
  nlohmann::json j = yaml_text_to_json(text.str(), "'" + path + "'");
  TESSERA_CHECK(j.is_object(), "config: '", path, "' must hold a mapping of sections (model, data, optimizer, training)");
  return j;
}

void apply_override(nlohmann::json& config, const std::string& assignment) {
  const size_t eq = assignment.find('=');
  TESSERA_CHECK(eq != std::string::npos && eq > 0, "--set expects key=value, got '", assignment, "'");
  const std::string path = assignment.substr(0, eq), value = assignment.substr(eq + 1);
  nlohmann::json* node = &config;
  size_t start = 0;
  while (true) {
    const size_t dot = path.find('.', start);
    const std::string key = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    TESSERA_CHECK(!key.empty(), "--set: empty key in '", path, "'");
    if (dot == std::string::npos) {
      (*node)[key] = yaml_text_to_json(value, "--set " + path);
      return;
    }
    if (!node->contains(key)) (*node)[key] = nlohmann::json::object();
    node = &(*node)[key];
    TESSERA_CHECK(node->is_object(), "--set: '", key, "' in '", path, "' is not a section");
    start = dot + 1;
  }
}

RunConfig RunConfig::from_json(const nlohmann::json& j) {
  check_keys(j, "", {"model", "data", "optimizer", "training"});
  RunConfig c;
  if (j.contains("model")) c.model = models::ModelConfig::from_json(j.at("model"));
  if (j.contains("data")) {
    const auto& d = j.at("data");
    check_keys(d, "data", {"path", "text", "tokenizer", "vocab", "merges", "validation_fraction"});
    read(d, "data.", "path", c.data.path);
    read(d, "data.", "text", c.data.text);
    read(d, "data.", "tokenizer", c.data.tokenizer);
    read(d, "data.", "vocab", c.data.vocab);
    read(d, "data.", "merges", c.data.merges);
    read(d, "data.", "validation_fraction", c.data.validation_fraction);
  }
  if (j.contains("optimizer")) {
    const auto& o = j.at("optimizer");
    check_keys(o, "optimizer", {"lr", "min_lr_ratio", "warmup_steps", "beta1", "beta2", "eps", "weight_decay", "grad_clip"});
    read(o, "optimizer.", "lr", c.optimizer.lr);
    read(o, "optimizer.", "min_lr_ratio", c.optimizer.min_lr_ratio);
    read(o, "optimizer.", "warmup_steps", c.optimizer.warmup_steps);
    read(o, "optimizer.", "beta1", c.optimizer.beta1);
    read(o, "optimizer.", "beta2", c.optimizer.beta2);
    read(o, "optimizer.", "eps", c.optimizer.eps);
    read(o, "optimizer.", "weight_decay", c.optimizer.weight_decay);
    read(o, "optimizer.", "grad_clip", c.optimizer.grad_clip);
  }
  if (j.contains("training")) {
    const auto& t = j.at("training");
    check_keys(t, "training", {"steps", "batch_size", "seq_len", "grad_accum", "eval_interval", "eval_batches",
                               "checkpoint_interval", "log_interval", "seed", "out_dir", "device", "precision", "attention_backend", "max_minutes",
                               "sample_prompt", "sample_tokens", "init_from"});
    read(t, "training.", "steps", c.training.steps);
    read(t, "training.", "batch_size", c.training.batch_size);
    read(t, "training.", "seq_len", c.training.seq_len);
    read(t, "training.", "grad_accum", c.training.grad_accum);
    read(t, "training.", "eval_interval", c.training.eval_interval);
    read(t, "training.", "eval_batches", c.training.eval_batches);
    read(t, "training.", "checkpoint_interval", c.training.checkpoint_interval);
    read(t, "training.", "log_interval", c.training.log_interval);
    read(t, "training.", "seed", c.training.seed);
    read(t, "training.", "out_dir", c.training.out_dir);
    read(t, "training.", "device", c.training.device);
    read(t, "training.", "precision", c.training.precision);
    read(t, "training.", "attention_backend", c.training.attention_backend);
    read(t, "training.", "max_minutes", c.training.max_minutes);
    read(t, "training.", "sample_prompt", c.training.sample_prompt);
    read(t, "training.", "init_from", c.training.init_from);
    read(t, "training.", "sample_tokens", c.training.sample_tokens);
  }
  // Values that parse but make no sense.
  const auto& t = c.training;
  TESSERA_CHECK(t.steps > 0, "config: training.steps must be positive, got ", t.steps);
  TESSERA_CHECK(t.batch_size > 0, "config: training.batch_size must be positive, got ", t.batch_size);
  TESSERA_CHECK(t.seq_len > 0 && t.seq_len <= c.model.max_seq_len, "config: training.seq_len must be in [1, model.max_seq_len = ",
                c.model.max_seq_len, "], got ", t.seq_len);
  TESSERA_CHECK(t.grad_accum > 0, "config: training.grad_accum must be positive, got ", t.grad_accum);
  TESSERA_CHECK(t.eval_interval >= 0 && t.eval_batches > 0, "config: training.eval_interval must be >= 0 and training.eval_batches > 0");
  TESSERA_CHECK(t.device == "auto" || t.device == "cpu" || t.device == "cuda", "config: training.device must be auto, cpu or cuda, got \"",
                t.device, "\"");
  TESSERA_CHECK(t.precision == "auto" || t.precision == "fp32" || t.precision == "bf16",
                "config: training.precision must be auto, fp32 or bf16, got \"", t.precision, "\"");
  TESSERA_CHECK(t.attention_backend == "auto" || t.attention_backend == "tessera" || t.attention_backend == "cudnn",
                "config: training.attention_backend must be auto, tessera or cudnn, got \"", t.attention_backend, "\"");
  TESSERA_CHECK(c.optimizer.lr > 0, "config: optimizer.lr must be positive, got ", c.optimizer.lr);
  TESSERA_CHECK(c.optimizer.grad_clip >= 0, "config: optimizer.grad_clip must be >= 0, got ", c.optimizer.grad_clip);
  TESSERA_CHECK(c.optimizer.beta1 >= 0 && c.optimizer.beta1 < 1 && c.optimizer.beta2 >= 0 && c.optimizer.beta2 < 1,
                "config: optimizer.beta1 and optimizer.beta2 must be in [0, 1)");
  TESSERA_CHECK(c.data.validation_fraction >= 0 && c.data.validation_fraction < 1,
                "config: data.validation_fraction must be in [0, 1), got ", c.data.validation_fraction);
  TESSERA_CHECK(c.data.tokenizer == "byte" || c.data.tokenizer == "gpt2", "config: data.tokenizer must be byte or gpt2, got \"",
                c.data.tokenizer, "\"");
  return c;
}

nlohmann::json RunConfig::to_json() const {
  return {{"model", model.to_json()},
          {"data", {{"path", data.path}, {"text", data.text}, {"tokenizer", data.tokenizer}, {"vocab", data.vocab},
                    {"merges", data.merges}, {"validation_fraction", data.validation_fraction}}},
          {"optimizer", {{"lr", optimizer.lr}, {"min_lr_ratio", optimizer.min_lr_ratio}, {"warmup_steps", optimizer.warmup_steps},
                         {"beta1", optimizer.beta1}, {"beta2", optimizer.beta2}, {"eps", optimizer.eps},
                         {"weight_decay", optimizer.weight_decay}, {"grad_clip", optimizer.grad_clip}}},
          {"training", {{"steps", training.steps}, {"batch_size", training.batch_size}, {"seq_len", training.seq_len},
                        {"grad_accum", training.grad_accum}, {"eval_interval", training.eval_interval},
                        {"eval_batches", training.eval_batches}, {"checkpoint_interval", training.checkpoint_interval},
                        {"log_interval", training.log_interval}, {"seed", training.seed}, {"out_dir", training.out_dir},
                        {"device", training.device}, {"precision", training.precision},
                        {"attention_backend", training.attention_backend}, {"max_minutes", training.max_minutes},
                        {"init_from", training.init_from}, {"sample_prompt", training.sample_prompt}, {"sample_tokens", training.sample_tokens}}}};
}

}  // namespace tessera::train
