// `tessera convert`: Hugging Face model directory <-> tessera checkpoint directory.
//
//   tessera convert --from-hf HF_DIR --to CHECKPOINT_DIR
//   tessera convert --to-hf HF_DIR --from CHECKPOINT_DIR [--dtype f32|bf16|f16]
//
// A tessera checkpoint directory holds model.safetensors (tessera parameter names, F32,
// metadata {"format": "tessera", "model_config": ...}) and state.json ({"step": 0,
// "model_config": {...}}), the files `tessera eval` and `tessera generate` read.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <filesystem>

#include "cli/commands.h"
#include "tessera/io/atomic_file.h"
#include "tessera/io/safetensors.h"
#include "tessera/models/hf_convert.h"
#include "tessera/train/checkpoint.h"

namespace tessera::cli {

namespace {

namespace fs = std::filesystem;

void write_tessera_checkpoint(const std::string& dir, models::TransformerLM& model) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  TESSERA_CHECK(!ec && fs::is_directory(dir), "convert: cannot create directory ", dir, ": ",
                ec ? ec.message() : "a file of that name exists");
  io::NamedTensors params;
  for (nn::Parameter* p : model.parameters()) params.emplace_back(p->name, p->value);
  const nlohmann::json model_config = model.config().to_json();
  io::save_safetensors((fs::path(dir) / "model.safetensors").string(), params,
                       {{"format", "tessera"}, {"model_config", model_config.dump()}});
  const nlohmann::json state = {{"step", 0}, {"model_config", model_config}};
  io::write_file_atomically((fs::path(dir) / "state.json").string(), state.dump(2) + "\n");
  // Moments of an earlier model in this directory would not fit the new weights.
  fs::remove(fs::path(dir) / "optimizer.safetensors", ec);
}

// A checkpoint directory (with state.json), or a run directory whose newest checkpoint is used.
std::string resolve_checkpoint(const std::string& path) {
  if (fs::exists(fs::path(path) / "state.json")) return path;
  if (auto latest = train::latest_checkpoint(path)) return *latest;
  TESSERA_FAIL("convert: '", path,
               "' is neither a checkpoint directory (with state.json) nor a run directory with checkpoints/latest");
}

DType output_dtype(const std::string& name) {
  if (name == "f32") return DType::F32;
  if (name == "bf16") return DType::BF16;
  if (name == "f16") return DType::F16;
  TESSERA_FAIL("convert: --dtype must be f32, bf16 or f16, got '", name, "'");
}

}  // namespace

void add_convert_command(CLI::App& app) {
  static std::string from_hf, to, to_hf, from, dtype = "f32";
  CLI::App* cmd = app.add_subcommand("convert", "Convert between Hugging Face models and tessera checkpoints");
  cmd->footer(
      "Examples:\n"
      "  tessera convert --from-hf gpt2-hf --to gpt2-ckpt\n"
      "  tessera convert --to-hf llama-hf --from runs/llama --dtype bf16");
  CLI::Option* from_hf_opt = cmd->add_option("--from-hf", from_hf, "Hugging Face model directory to read (config.json + safetensors)");
  CLI::Option* to_opt = cmd->add_option("--to", to, "tessera checkpoint directory to write (with --from-hf)");
  CLI::Option* to_hf_opt = cmd->add_option("--to-hf", to_hf, "Hugging Face model directory to write");
  CLI::Option* from_opt = cmd->add_option("--from", from, "tessera checkpoint or run directory to read (with --to-hf)");
  CLI::Option* dtype_opt = cmd->add_option("--dtype", dtype, "Stored dtype of the Hugging Face weights (with --to-hf)")
                               ->check(CLI::IsMember({"f32", "bf16", "f16"}))
                               ->capture_default_str();
  from_hf_opt->needs(to_opt)->excludes(to_hf_opt)->excludes(from_opt)->excludes(dtype_opt);
  to_hf_opt->needs(from_opt);
  to_opt->needs(from_hf_opt);
  from_opt->needs(to_hf_opt);
  cmd->callback([] {
    TESSERA_CHECK(!from_hf.empty() || !to_hf.empty(),
                  "convert: give --from-hf HF_DIR --to CHECKPOINT_DIR, or --to-hf HF_DIR --from CHECKPOINT_DIR");
    if (!from_hf.empty()) {
      const auto model = models::load_hf_model_dir(from_hf);
      write_tessera_checkpoint(to, *model);
      std::printf("convert: %s model with %lld parameters from %s -> tessera checkpoint %s\n",
                  model->config().architecture.c_str(), static_cast<long long>(model->num_parameters()),
                  from_hf.c_str(), to.c_str());
    } else {
      const DType out_dtype = output_dtype(dtype);
      const std::string dir = resolve_checkpoint(from);
      models::TransformerLM model(train::checkpoint_model_config(dir));
      train::load_checkpoint(dir, model, nullptr);
      models::save_hf_model(to_hf, model, out_dtype);
      std::printf("convert: %s model with %lld parameters from %s -> Hugging Face model %s (%s)\n",
                  model.config().architecture.c_str(), static_cast<long long>(model.num_parameters()), dir.c_str(),
                  to_hf.c_str(), dtype.c_str());
    }
  });
}

}  // namespace tessera::cli
