#include "tessera/train/config.h"

#include <yaml-cpp/yaml.h>

#include <fstream>
#include <sstream>

#include "tessera/core/error.h"

namespace tessera::train {

namespace {

// Whether `s` is well-formed UTF-8 (no overlong forms, surrogates or code points above
// U+10FFFF). JSON strings must be: nlohmann::json refuses to print anything else, even in
// an error message.
bool valid_utf8(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    int n = 0;
    uint32_t cp = 0;
    if (c < 0x80) {
      i += 1;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      n = 1, cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      n = 2, cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      n = 3, cp = c & 0x07;
    } else {
      return false;
    }
    for (int k = 1; k <= n; ++k) {
      if (i + k >= s.size()) return false;
      const auto d = static_cast<unsigned char>(s[i + k]);
      if ((d & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (d & 0x3F);
    }
    static constexpr uint32_t kMin[4] = {0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += n + 1;
  }
  return true;
}

std::string checked_utf8(const std::string& s) {
  TESSERA_CHECK(valid_utf8(s), "config: text that is not valid UTF-8 (", s.size(), " bytes)");
  return s;
}

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
      for (const auto& kv : node) out[checked_utf8(kv.first.as<std::string>())] = yaml_to_json(kv.second);
      return out;
    }
    case YAML::NodeType::Scalar: {
      const std::string s = checked_utf8(node.Scalar());
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
  TESSERA_CHECK(ok, "config: ", prefix, key, " has the wrong type or value: ",
                v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
  out = v.get<T>();
}

// A list of non-negative integers; a single integer is a list of one.
void read_steps(const nlohmann::json& section, const std::string& prefix, const char* key, std::vector<int64_t>& out) {
  if (!section.contains(key)) return;
  const nlohmann::json& v = section.at(key);
  out.clear();
  if (v.is_null()) return;
  const nlohmann::json list = v.is_array() ? v : nlohmann::json::array({v});
  for (const auto& item : list) {
    TESSERA_CHECK(item.is_number_integer() && item.get<int64_t>() >= 0, "config: ", prefix, key,
                  " must be a list of non-negative step numbers, got ",
                  v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
    out.push_back(item.get<int64_t>());
  }
}

void check_keys(const nlohmann::json& section, const std::string& name, std::initializer_list<const char*> keys) {
  TESSERA_CHECK(section.is_object(), "config: ", name, " must be a mapping, got ",
                section.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
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
  check_keys(j, "", {"model", "data", "optimizer", "training", "fp8"});
  RunConfig c;
  if (j.contains("fp8") && !j.at("fp8").is_null()) c.fp8 = fp8::Recipe::from_json(j.at("fp8"), "fp8");
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
    check_keys(o, "optimizer", {"lr", "min_lr_ratio", "warmup_steps", "beta1", "beta2", "eps", "weight_decay", "grad_clip",
                                         "overlap_backward"});
    read(o, "optimizer.", "lr", c.optimizer.lr);
    read(o, "optimizer.", "min_lr_ratio", c.optimizer.min_lr_ratio);
    read(o, "optimizer.", "warmup_steps", c.optimizer.warmup_steps);
    read(o, "optimizer.", "beta1", c.optimizer.beta1);
    read(o, "optimizer.", "beta2", c.optimizer.beta2);
    read(o, "optimizer.", "eps", c.optimizer.eps);
    read(o, "optimizer.", "weight_decay", c.optimizer.weight_decay);
    read(o, "optimizer.", "grad_clip", c.optimizer.grad_clip);
    read(o, "optimizer.", "overlap_backward", c.optimizer.overlap_backward);
  }
  if (j.contains("training")) {
    const auto& t = j.at("training");
    check_keys(t, "training", {"steps", "batch_size", "seq_len", "grad_accum", "eval_interval", "eval_batches",
                               "checkpoint_interval", "log_interval", "seed", "out_dir", "device", "precision", "attention_backend", "deterministic_attention", "gemm_autotune", "cuda_graph", "max_minutes",
                               "sample_prompt", "sample_tokens", "init_from", "checkpoint_keep_last", "checkpoint_keep_every",
                               "async_checkpoint", "skip_data_at_steps", "rewind", "fault_injection", "global_batch_size",
                               "parallel"});
    read(t, "training.", "steps", c.training.steps);
    read(t, "training.", "batch_size", c.training.batch_size);
    read(t, "training.", "seq_len", c.training.seq_len);
    read(t, "training.", "grad_accum", c.training.grad_accum);
    read(t, "training.", "global_batch_size", c.training.global_batch_size);
    if (t.contains("parallel") && !t.at("parallel").is_null()) {
      try {
        c.training.parallel = dist::ParallelConfig::from_json(t.at("parallel"));
      } catch (const Error& e) {
        const std::string what = e.what();  // without its " [file:line]", which this error adds again
        TESSERA_FAIL("config: training.", what.substr(0, what.rfind(" [")));
      }
    }
    read(t, "training.", "eval_interval", c.training.eval_interval);
    read(t, "training.", "eval_batches", c.training.eval_batches);
    read(t, "training.", "checkpoint_interval", c.training.checkpoint_interval);
    read(t, "training.", "log_interval", c.training.log_interval);
    read(t, "training.", "seed", c.training.seed);
    read(t, "training.", "out_dir", c.training.out_dir);
    read(t, "training.", "device", c.training.device);
    read(t, "training.", "precision", c.training.precision);
    read(t, "training.", "attention_backend", c.training.attention_backend);
    read(t, "training.", "deterministic_attention", c.training.deterministic_attention);
    read(t, "training.", "gemm_autotune", c.training.gemm_autotune);
    if (t.contains("cuda_graph") && t.at("cuda_graph").is_boolean())  // `cuda_graph: true` reads as on
      c.training.cuda_graph = t.at("cuda_graph").get<bool>() ? "on" : "off";
    else
      read(t, "training.", "cuda_graph", c.training.cuda_graph);
    read(t, "training.", "max_minutes", c.training.max_minutes);
    read(t, "training.", "sample_prompt", c.training.sample_prompt);
    read(t, "training.", "init_from", c.training.init_from);
    read(t, "training.", "sample_tokens", c.training.sample_tokens);
    read(t, "training.", "checkpoint_keep_last", c.training.checkpoint_keep_last);
    read(t, "training.", "checkpoint_keep_every", c.training.checkpoint_keep_every);
    read(t, "training.", "async_checkpoint", c.training.async_checkpoint);
    read_steps(t, "training.", "skip_data_at_steps", c.training.skip_data_at_steps);
    if (t.contains("rewind") && !t.at("rewind").is_null()) {
      const auto& r = t.at("rewind");
      check_keys(r, "training.rewind", {"enabled", "snapshot_interval", "window", "min_history", "loss_z", "grad_norm_z",
                                        "skip_steps", "lr_scale", "lr_scale_steps", "max_rewinds", "max_rewinds_window"});
      RewindConfig& w = c.training.rewind;
      read(r, "training.rewind.", "enabled", w.enabled);
      read(r, "training.rewind.", "snapshot_interval", w.snapshot_interval);
      read(r, "training.rewind.", "window", w.window);
      read(r, "training.rewind.", "min_history", w.min_history);
      read(r, "training.rewind.", "loss_z", w.loss_z);
      read(r, "training.rewind.", "grad_norm_z", w.grad_norm_z);
      read(r, "training.rewind.", "skip_steps", w.skip_steps);
      read(r, "training.rewind.", "lr_scale", w.lr_scale);
      read(r, "training.rewind.", "lr_scale_steps", w.lr_scale_steps);
      read(r, "training.rewind.", "max_rewinds", w.max_rewinds);
      read(r, "training.rewind.", "max_rewinds_window", w.max_rewinds_window);
    }
    if (t.contains("fault_injection") && !t.at("fault_injection").is_null()) {
      const auto& f = t.at("fault_injection");
      check_keys(f, "training.fault_injection", {"nan_grad_at_step", "loss_spike_at_step", "nan_grad_from_step", "rank_fault"});
      read_steps(f, "training.fault_injection.", "nan_grad_at_step", c.training.fault_injection.nan_grad_at_step);
      read_steps(f, "training.fault_injection.", "loss_spike_at_step", c.training.fault_injection.loss_spike_at_step);
      read(f, "training.fault_injection.", "nan_grad_from_step", c.training.fault_injection.nan_grad_from_step);
      if (f.contains("rank_fault") && !f.at("rank_fault").is_null()) {
        const auto& r = f.at("rank_fault");
        check_keys(r, "training.fault_injection.rank_fault", {"rank", "step", "kind"});
        FaultInjectionConfig& fi = c.training.fault_injection;
        read(r, "training.fault_injection.rank_fault.", "rank", fi.fault_rank);
        read(r, "training.fault_injection.rank_fault.", "step", fi.fault_step);
        read(r, "training.fault_injection.rank_fault.", "kind", fi.fault_kind);
        TESSERA_CHECK(fi.fault_rank >= 0 && fi.fault_step > 0 &&
                          (fi.fault_kind == "exit" || fi.fault_kind == "kill" || fi.fault_kind == "hang"),
                      "config: training.fault_injection.rank_fault needs rank >= 0, step > 0 and kind exit, kill or hang");
      }
    }
  }
  // Values that parse but make no sense.
  const auto& t = c.training;
  TESSERA_CHECK(t.steps > 0, "config: training.steps must be positive, got ", t.steps);
  TESSERA_CHECK(t.batch_size > 0, "config: training.batch_size must be positive, got ", t.batch_size);
  TESSERA_CHECK(t.seq_len > 0 && t.seq_len <= c.model.max_seq_len, "config: training.seq_len must be in [1, model.max_seq_len = ",
                c.model.max_seq_len, "], got ", t.seq_len);
  TESSERA_CHECK(t.grad_accum > 0, "config: training.grad_accum must be positive, got ", t.grad_accum);
  TESSERA_CHECK(t.global_batch_size >= 0, "config: training.global_batch_size must be >= 0 (0: batch_size x grad_accum x ",
                "data ranks), got ", t.global_batch_size);
  TESSERA_CHECK(t.eval_interval >= 0 && t.eval_batches > 0, "config: training.eval_interval must be >= 0 and training.eval_batches > 0");
  TESSERA_CHECK(t.device == "auto" || t.device == "cpu" || t.device == "cuda", "config: training.device must be auto, cpu or cuda, got \"",
                t.device, "\"");
  TESSERA_CHECK(t.precision == "auto" || t.precision == "fp32" || t.precision == "bf16",
                "config: training.precision must be auto, fp32 or bf16, got \"", t.precision, "\"");
  TESSERA_CHECK(t.attention_backend == "auto" || t.attention_backend == "tessera" || t.attention_backend == "cudnn",
                "config: training.attention_backend must be auto, tessera or cudnn, got \"", t.attention_backend, "\"");
  TESSERA_CHECK(t.cuda_graph == "auto" || t.cuda_graph == "on" || t.cuda_graph == "off",
                "config: training.cuda_graph must be auto, on or off, got \"", t.cuda_graph, "\"");
  TESSERA_CHECK(t.checkpoint_interval >= 0 && t.checkpoint_keep_last >= 0 && t.checkpoint_keep_every >= 0,
                "config: training.checkpoint_interval, checkpoint_keep_last and checkpoint_keep_every must be >= 0");
  const RewindConfig& rw = t.rewind;
  TESSERA_CHECK(rw.snapshot_interval >= 0 && rw.window >= 3 && rw.min_history >= 3 && rw.min_history <= rw.window,
                "config: training.rewind needs snapshot_interval >= 0 and 3 <= min_history <= window");
  TESSERA_CHECK(rw.loss_z >= 0 && rw.grad_norm_z >= 0, "config: training.rewind.loss_z and grad_norm_z must be >= 0 (0 disables)");
  TESSERA_CHECK(rw.skip_steps >= 0 && rw.lr_scale > 0 && rw.lr_scale <= 1 && rw.lr_scale_steps >= 0,
                "config: training.rewind needs skip_steps >= 0, 0 < lr_scale <= 1, lr_scale_steps >= 0");
  TESSERA_CHECK(rw.max_rewinds >= 0 && rw.max_rewinds_window > 0,
                "config: training.rewind needs max_rewinds >= 0 and max_rewinds_window > 0");
  TESSERA_CHECK(c.optimizer.lr > 0, "config: optimizer.lr must be positive, got ", c.optimizer.lr);
  TESSERA_CHECK(c.optimizer.grad_clip >= 0, "config: optimizer.grad_clip must be >= 0, got ", c.optimizer.grad_clip);
  TESSERA_CHECK(!c.optimizer.overlap_backward || c.optimizer.grad_clip == 0,
                "config: optimizer.overlap_backward needs optimizer.grad_clip = 0 (clipping scales every gradient by ",
                "the norm of all of them, known only when the whole backward is done); got grad_clip ",
                c.optimizer.grad_clip);
  TESSERA_CHECK(c.optimizer.beta1 >= 0 && c.optimizer.beta1 < 1 && c.optimizer.beta2 >= 0 && c.optimizer.beta2 < 1,
                "config: optimizer.beta1 and optimizer.beta2 must be in [0, 1)");
  TESSERA_CHECK(c.data.validation_fraction >= 0 && c.data.validation_fraction < 1,
                "config: data.validation_fraction must be in [0, 1), got ", c.data.validation_fraction);
  TESSERA_CHECK(c.data.tokenizer == "byte" || c.data.tokenizer == "gpt2", "config: data.tokenizer must be byte or gpt2, got \"",
                c.data.tokenizer, "\"");
  return c;
}

nlohmann::json RunConfig::to_json() const {
  nlohmann::json out = {{"model", model.to_json()},
          {"data", {{"path", data.path}, {"text", data.text}, {"tokenizer", data.tokenizer}, {"vocab", data.vocab},
                    {"merges", data.merges}, {"validation_fraction", data.validation_fraction}}},
          {"optimizer", {{"lr", optimizer.lr}, {"min_lr_ratio", optimizer.min_lr_ratio}, {"warmup_steps", optimizer.warmup_steps},
                         {"beta1", optimizer.beta1}, {"beta2", optimizer.beta2}, {"eps", optimizer.eps},
                         {"weight_decay", optimizer.weight_decay}, {"grad_clip", optimizer.grad_clip},
                         {"overlap_backward", optimizer.overlap_backward}}},
          {"training", {{"steps", training.steps}, {"batch_size", training.batch_size}, {"seq_len", training.seq_len},
                        {"grad_accum", training.grad_accum}, {"global_batch_size", training.global_batch_size},
                        {"parallel", training.parallel.to_json()}, {"eval_interval", training.eval_interval},
                        {"eval_batches", training.eval_batches}, {"checkpoint_interval", training.checkpoint_interval},
                        {"log_interval", training.log_interval}, {"seed", training.seed}, {"out_dir", training.out_dir},
                        {"device", training.device}, {"precision", training.precision},
                        {"attention_backend", training.attention_backend},
                        {"deterministic_attention", training.deterministic_attention},
                        {"gemm_autotune", training.gemm_autotune}, {"cuda_graph", training.cuda_graph},
                        {"max_minutes", training.max_minutes},
                        {"init_from", training.init_from}, {"sample_prompt", training.sample_prompt}, {"sample_tokens", training.sample_tokens},
                        {"checkpoint_keep_last", training.checkpoint_keep_last},
                        {"checkpoint_keep_every", training.checkpoint_keep_every},
                        {"async_checkpoint", training.async_checkpoint},
                        {"skip_data_at_steps", training.skip_data_at_steps},
                        {"rewind", {{"enabled", training.rewind.enabled}, {"snapshot_interval", training.rewind.snapshot_interval},
                                    {"window", training.rewind.window}, {"min_history", training.rewind.min_history},
                                    {"loss_z", training.rewind.loss_z}, {"grad_norm_z", training.rewind.grad_norm_z},
                                    {"skip_steps", training.rewind.skip_steps}, {"lr_scale", training.rewind.lr_scale},
                                    {"lr_scale_steps", training.rewind.lr_scale_steps}, {"max_rewinds", training.rewind.max_rewinds},
                                    {"max_rewinds_window", training.rewind.max_rewinds_window}}},
                        {"fault_injection", {{"nan_grad_at_step", training.fault_injection.nan_grad_at_step},
                                             {"loss_spike_at_step", training.fault_injection.loss_spike_at_step},
                                             {"nan_grad_from_step", training.fault_injection.nan_grad_from_step},
                                             {"rank_fault", training.fault_injection.fault_rank < 0
                                                                ? nlohmann::json(nullptr)
                                                                : nlohmann::json{{"rank", training.fault_injection.fault_rank},
                                                                                 {"step", training.fault_injection.fault_step},
                                                                                 {"kind", training.fault_injection.fault_kind}}}}}}}};
  if (fp8) out["fp8"] = fp8->to_json();
  return out;
}

}  // namespace tessera::train
