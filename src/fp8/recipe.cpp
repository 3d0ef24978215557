#include "tessera/fp8/recipe.h"

#include <cmath>
#include <initializer_list>

#include "tessera/core/error.h"

namespace tessera::fp8 {

DType fp8_dtype(Format format, Role role) {
  return format == Format::Hybrid && role == Role::Gradient ? DType::E5M2 : DType::E4M3;
}

// ---- JSON -------------------------------------------------------------------------------

namespace {

void check_keys(const nlohmann::json& j, const std::string& where, std::initializer_list<const char*> keys) {
  for (auto it = j.begin(); it != j.end(); ++it) {
    bool known = false;
    for (const char* k : keys) known = known || it.key() == k;
    TESSERA_CHECK(known, "config: unknown key \"", where, ".", it.key(), "\" for fp8 recipe \"",
                  j.at("recipe").get<std::string>(), "\"");
  }
}

const nlohmann::json* find(const nlohmann::json& j, const char* key) {
  return j.contains(key) ? &j.at(key) : nullptr;
}

void read_float(const nlohmann::json& j, const std::string& where, const char* key, float& out) {
  if (const auto* v = find(j, key)) {
    TESSERA_CHECK(v->is_number() && std::isfinite(v->get<double>()), "config: ", where, ".", key,
                  " must be a finite number, got ", v->dump());
    out = v->get<float>();
  }
}

void read_bool(const nlohmann::json& j, const std::string& where, const char* key, bool& out) {
  if (const auto* v = find(j, key)) {
    TESSERA_CHECK(v->is_boolean(), "config: ", where, ".", key, " must be true or false, got ", v->dump());
    out = v->get<bool>();
  }
}

std::string read_choice(const nlohmann::json& j, const std::string& where, const char* key,
                        std::initializer_list<const char*> choices) {
  const auto* v = find(j, key);
  if (!v) return "";
  std::string list;
  for (const char* c : choices) {
    if (v->is_string() && v->get<std::string>() == c) return c;
    list += list.empty() ? c : std::string(", ") + c;
  }
  TESSERA_FAIL("config: ", where, ".", key, " must be one of ", list, ", got ", v->dump());
}

void read_format(const nlohmann::json& j, const std::string& where, Format& out) {
  const std::string s = read_choice(j, where, "format", {"e4m3", "hybrid"});
  if (!s.empty()) out = s == "e4m3" ? Format::E4M3 : Format::Hybrid;
}

const char* format_name(Format f) { return f == Format::E4M3 ? "e4m3" : "hybrid"; }

}  // namespace

std::string Recipe::name() const {
  static const char* names[] = {"delayed", "current", "block", "mxfp8"};
  return names[config.index()];
}

Recipe Recipe::from_json(const nlohmann::json& j, const std::string& where) {
  TESSERA_CHECK(j.is_object(), "config: ", where, " must be a mapping, got ", j.dump());
  TESSERA_CHECK(j.contains("recipe"), "config: ", where, ".recipe is missing (delayed, current, block or mxfp8)");
  if (j.contains("lm_head") || j.contains("keep_weight_transpose") || j.contains("cache_weights") ||
      j.contains("defer_expert_wgrad") || j.contains("cast_in_optimizer")) {
    // keys of every recipe: read them, then the rest as before
    nlohmann::json rest = j;
    for (const char* key : {"lm_head", "keep_weight_transpose", "cache_weights", "defer_expert_wgrad", "cast_in_optimizer"})
      rest.erase(key);
    Recipe r = from_json(rest, where);
    read_bool(j, where, "lm_head", r.lm_head);
    read_bool(j, where, "keep_weight_transpose", r.keep_weight_transpose);
    read_bool(j, where, "cache_weights", r.cache_weights);
    read_bool(j, where, "defer_expert_wgrad", r.defer_expert_wgrad);
    read_bool(j, where, "cast_in_optimizer", r.cast_in_optimizer);
    // The deferred GEMM runs every micro-batch's codes with one scale: delayed scaling's,
    // which only end_step moves; and it is flushed where the weight cache closes.
    TESSERA_CHECK(!r.defer_expert_wgrad || (r.name() == "delayed" && r.cache_weights), "config: ", where,
                  ".defer_expert_wgrad needs ", where, ".recipe: delayed and ", where, ".cache_weights: true");
    // The update casts with the scale of the next step, which only delayed scaling knows then.
    TESSERA_CHECK(!r.cast_in_optimizer || r.name() == "delayed", "config: ", where, ".cast_in_optimizer needs ", where,
                  ".recipe: delayed (the other recipes' scales come from the weight being cast)");
    return r;
  }
  const std::string name = read_choice(j, where, "recipe", {"delayed", "current", "block", "mxfp8"});
  Recipe r;
  if (name == "delayed") {
    check_keys(j, where, {"recipe", "history_len", "amax_compute", "margin", "format"});
    DelayedScalingConfig c;
    if (const auto* v = find(j, "history_len")) {
      TESSERA_CHECK(v->is_number_integer() && v->get<int64_t>() >= 1 && v->get<int64_t>() <= (1 << 20),
                    "config: ", where, ".history_len must be an integer in [1, 1048576], got ", v->dump());
      c.history_len = v->get<int>();
    }
    const std::string algo = read_choice(j, where, "amax_compute", {"max", "most_recent"});
    if (!algo.empty())
      c.amax_compute = algo == "max" ? DelayedScalingConfig::AmaxCompute::Max : DelayedScalingConfig::AmaxCompute::MostRecent;
    read_float(j, where, "margin", c.margin);
    read_format(j, where, c.format);
    r.config = c;
  } else if (name == "current") {
    check_keys(j, where, {"recipe", "margin", "format", "power_of_two_scales"});
    CurrentScalingConfig c;
    read_float(j, where, "margin", c.margin);
    read_format(j, where, c.format);
    read_bool(j, where, "power_of_two_scales", c.power_of_two_scales);
    r.config = c;
  } else if (name == "block") {
    check_keys(j, where, {"recipe", "format", "power_of_two_scales"});
    BlockScalingConfig c;
    read_format(j, where, c.format);
    read_bool(j, where, "power_of_two_scales", c.power_of_two_scales);
    r.config = c;
  } else {
    check_keys(j, where, {"recipe", "format"});
    Mxfp8Config c;
    read_format(j, where, c.format);
    r.config = c;
  }
  return r;
}

nlohmann::json Recipe::to_json() const {
  nlohmann::json j = {{"recipe", name()}};
  if (lm_head) j["lm_head"] = true;  // only when set: the default's JSON is unchanged
  if (keep_weight_transpose) j["keep_weight_transpose"] = true;
  if (!cache_weights) j["cache_weights"] = false;
  if (defer_expert_wgrad) j["defer_expert_wgrad"] = true;
  if (cast_in_optimizer) j["cast_in_optimizer"] = true;
  if (const auto* c = std::get_if<DelayedScalingConfig>(&config)) {
    j["history_len"] = c->history_len;
    j["amax_compute"] = c->amax_compute == DelayedScalingConfig::AmaxCompute::Max ? "max" : "most_recent";
    j["margin"] = c->margin;
    j["format"] = format_name(c->format);
  } else if (const auto* c = std::get_if<CurrentScalingConfig>(&config)) {
    j["margin"] = c->margin;
    j["format"] = format_name(c->format);
    j["power_of_two_scales"] = c->power_of_two_scales;
  } else if (const auto* c = std::get_if<BlockScalingConfig>(&config)) {
    j["format"] = format_name(c->format);
    j["power_of_two_scales"] = c->power_of_two_scales;
  } else {
    j["format"] = format_name(std::get<Mxfp8Config>(config).format);
  }
  return j;
}

// ---- Delayed scaling state ----------------------------------------------------------------

DelayedScalingState::DelayedScalingState(const DelayedScalingConfig& config, std::vector<Role> roles)
    : config_(config), roles_(std::move(roles)) {
  TESSERA_CHECK(config_.history_len >= 1, "DelayedScalingState: history_len must be >= 1, got ", config_.history_len);
  history_.assign(roles_.size() * static_cast<size_t>(config_.history_len), 0.0f);
  scale_.assign(roles_.size(), 1.0f);
  scale_inv_.assign(roles_.size(), 1.0f);
}

void DelayedScalingState::check_index(int64_t i) const {
  TESSERA_CHECK(i >= 0 && i < size(), "DelayedScalingState: tensor index ", i, " out of range [0, ", size(), ")");
}

void DelayedScalingState::record(int64_t i, float amax) {
  check_index(i);
  float& s = slot(i, position_);
  if (std::isnan(amax) || std::isnan(s)) s = NAN;  // an overflowed step stays visible as such
  else if (amax > s) s = amax;
}

void DelayedScalingState::update() {
  const int64_t len = config_.history_len;
  for (int64_t i = 0; i < size(); ++i) {
    float amax = slot(i, position_);
    if (config_.amax_compute == DelayedScalingConfig::AmaxCompute::Max) {
      amax = 0.0f;
      for (int64_t s = 0; s < len; ++s) amax = std::fmax(amax, slot(i, s));  // fmax skips NaN
    }
    if (amax > 0.0f && std::isfinite(amax)) {
      scale_[i] = fp8_scale_from_amax(amax, dtype(i), config_.margin);
      scale_inv_[i] = 1.0f / scale_[i];
    }
  }
  position_ = (position_ + 1) % len;
  for (int64_t i = 0; i < size(); ++i) slot(i, position_) = 0.0f;
}

float DelayedScalingState::scale(int64_t i) const {
  check_index(i);
  return scale_[static_cast<size_t>(i)];
}

float DelayedScalingState::scale_inv(int64_t i) const {
  check_index(i);
  return scale_inv_[static_cast<size_t>(i)];
}

float DelayedScalingState::history(int64_t i, int steps_ago) const {
  check_index(i);
  const int64_t len = config_.history_len;
  TESSERA_CHECK(steps_ago >= 0 && steps_ago < len, "DelayedScalingState: steps_ago ", steps_ago,
                " out of range [0, ", len, ")");
  return slot(i, ((position_ - steps_ago) % len + len) % len);
}

std::map<std::string, Tensor> DelayedScalingState::state_dict(const std::string& prefix) const {
  const int64_t n = size();
  return {{prefix + "amax_history", Tensor::from_floats(history_, {n, config_.history_len})},
          {prefix + "scale", Tensor::from_floats(scale_, {n})},
          {prefix + "scale_inv", Tensor::from_floats(scale_inv_, {n})},
          {prefix + "position", Tensor::from_ints({position_}, {1}, DType::I64)}};
}

void DelayedScalingState::load_state_dict(const std::map<std::string, Tensor>& tensors, const std::string& prefix) {
  auto get = [&](const char* name, DType dtype, const Shape& shape) {
    const auto it = tensors.find(prefix + name);
    TESSERA_CHECK(it != tensors.end(), "DelayedScalingState: checkpoint lacks tensor '", prefix, name, "'");
    const Tensor& t = it->second;
    TESSERA_CHECK(t.dtype() == dtype && t.shape() == shape, "DelayedScalingState: tensor '", prefix, name,
                  "' is ", t.describe(), ", expected ", dtype_name(dtype), shape_to_string(shape),
                  " (different tensor count or history_len?)");
    return t;
  };
  const int64_t n = size();
  std::vector<float> history = get("amax_history", DType::F32, {n, config_.history_len}).to_floats();
  std::vector<float> scale = get("scale", DType::F32, {n}).to_floats();
  std::vector<float> scale_inv = get("scale_inv", DType::F32, {n}).to_floats();
  const int64_t position = get("position", DType::I64, {1}).to_ints()[0];
  TESSERA_CHECK(position >= 0 && position < config_.history_len, "DelayedScalingState: tensor '", prefix,
                "position' holds ", position, ", outside [0, ", config_.history_len, ")");
  // Assign only after every check passed, so a failed load leaves the state untouched.
  history_ = std::move(history);
  scale_ = std::move(scale);
  scale_inv_ = std::move(scale_inv);
  position_ = position;
}

}  // namespace tessera::fp8
