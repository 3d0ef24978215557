#include "tessera/train/checkpoint.h"

#include <cstdio>
#include <filesystem>

#include "tessera/io/atomic_file.h"
#include "tessera/io/safetensors.h"
#include "tessera/ops/elementwise.h"

namespace fs = std::filesystem;

namespace tessera::train {

namespace {
std::string step_name(int64_t step) {
  char name[32];
  std::snprintf(name, sizeof(name), "step-%06lld", static_cast<long long>(step));
  return name;
}
}  // namespace

std::string save_checkpoint(const std::string& out_dir, models::TransformerLM& model, const Optimizer* optimizer,
                            const CheckpointState& state) {
  const fs::path root = fs::path(out_dir) / "checkpoints";
  const fs::path final_dir = root / step_name(state.step);
  const fs::path tmp_dir = root / (step_name(state.step) + ".tmp");
  std::error_code ec;
  fs::remove_all(tmp_dir, ec);
  fs::create_directories(tmp_dir);

  io::NamedTensors params;
  // The full-precision weights (FP32 masters of a BF16 model), on the host.
  for (nn::Parameter* p : model.parameters()) params.emplace_back(p->name, p->weights().to(Device::cpu()));
  io::save_safetensors((tmp_dir / "model.safetensors").string(), params,
                       {{"format", "tessera"}, {"model_config", model.config().to_json().dump()}});
  if (optimizer) io::save_safetensors((tmp_dir / "optimizer.safetensors").string(), optimizer->state());
  const nlohmann::json json_state = {{"step", state.step},
                                     {"optimizer_step", optimizer ? optimizer->steps_taken() : 0},
                                     {"data_position", state.data_position},
                                     {"config", state.config},
                                     {"model_config", model.config().to_json()}};
  io::write_file_atomically((tmp_dir / "state.json").string(), json_state.dump(2));

  // Replacing an older save of the same step (a rerun after a rewind) keeps `latest` valid
  // throughout: it still names the old directory until the new one is in place.
  if (fs::exists(final_dir)) {
    const fs::path old = root / (step_name(state.step) + ".old");
    fs::remove_all(old, ec);
    fs::rename(final_dir, old);
    fs::rename(tmp_dir, final_dir);
    fs::remove_all(old, ec);
  } else {
    fs::rename(tmp_dir, final_dir);
  }
  io::write_file_atomically((root / "latest").string(), step_name(state.step) + "\n");
  return final_dir.string();
}

std::optional<std::string> latest_checkpoint(const std::string& out_dir) {
  const fs::path latest = fs::path(out_dir) / "checkpoints" / "latest";
  if (!fs::exists(latest)) return std::nullopt;
  std::string name = io::read_file(latest.string());
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
  const fs::path dir = fs::path(out_dir) / "checkpoints" / name;
  TESSERA_CHECK(!name.empty() && fs::is_directory(dir), "checkpoint: '", latest.string(), "' names '", name,
                "', which is not a checkpoint directory");
  return dir.string();
}

static nlohmann::json read_state(const std::string& dir) {
  const std::string path = (fs::path(dir) / "state.json").string();
  try {
    return nlohmann::json::parse(io::read_file(path));
  } catch (const nlohmann::json::exception& e) {
    TESSERA_FAIL("checkpoint: '", path, "' is not valid JSON: ", e.what());
  }
}

models::ModelConfig checkpoint_model_config(const std::string& dir) {
  const nlohmann::json state = read_state(dir);
  TESSERA_CHECK(state.contains("model_config"), "checkpoint: ", dir, "/state.json has no model_config");
  return models::ModelConfig::from_json(state.at("model_config"));
}

CheckpointState load_checkpoint(const std::string& dir, models::TransformerLM& model, Optimizer* optimizer) {
  const nlohmann::json state = read_state(dir);
  const models::ModelConfig saved = checkpoint_model_config(dir);
  TESSERA_CHECK(saved.to_json() == model.config().to_json(), "checkpoint: ", dir, " holds a different model (",
                saved.to_json().dump(), ") than the one configured (", model.config().to_json().dump(), ")");
  const io::SafetensorsFile file((fs::path(dir) / "model.safetensors").string());
  for (nn::Parameter* p : model.parameters()) {
    TESSERA_CHECK(file.contains(p->name), "checkpoint: ", file.path(), " has no tensor '", p->name, "'");
    const io::TensorInfo& info = file.info(p->name);
    Tensor& weights = p->weights();
    TESSERA_CHECK(info.shape == weights.shape(), "checkpoint: '", p->name, "' has shape ", shape_to_string(info.shape),
                  ", the model needs ", weights.shape_string());
    Tensor loaded = file.get(p->name);
    if (loaded.dtype() != weights.dtype()) {
      Tensor converted = Tensor::empty(loaded.shape(), weights.dtype());
      Context cpu = Context::cpu();
      cast(cpu, loaded, converted);
      loaded = converted;
    }
    weights.copy_from(loaded.to(weights.device()));
    Context ctx{weights.device()};
    p->refresh_value(ctx);
  }
  CheckpointState out;
  out.step = state.value("step", int64_t(0));
  out.data_position = state.value("data_position", nlohmann::json());
  out.config = state.value("config", nlohmann::json());
  if (optimizer) {
    const std::string opt_path = (fs::path(dir) / "optimizer.safetensors").string();
    TESSERA_CHECK(fs::exists(opt_path), "checkpoint: ", dir, " has no optimizer state (optimizer.safetensors)");
    const io::SafetensorsFile opt(opt_path);
    std::vector<std::pair<std::string, Tensor>> tensors;
    for (const std::string& name : opt.names()) tensors.emplace_back(name, opt.get(name));
    optimizer->load_state(tensors, state.value("optimizer_step", int64_t(0)));
  }
  return out;
}

}  // namespace tessera::train
