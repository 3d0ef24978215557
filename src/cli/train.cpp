// `tessera train`, `tessera prepare`, `tessera eval` and `tessera generate`.
#include <CLI/CLI.hpp>

#include <cmath>
#include <cstdio>
#include <filesystem>

#include "cli/commands.h"
#include "tessera/data/loader.h"
#include "tessera/data/token_file.h"
#include "tessera/infer/generate.h"
#include "tessera/io/atomic_file.h"
#include "tessera/io/safetensors.h"
#include "tessera/train/checkpoint.h"
#include "tessera/train/trainer.h"

namespace tessera::cli {

namespace {

// A checkpoint path may name a run directory (its latest checkpoint) or a checkpoint.
std::string resolve_checkpoint(const std::string& path) {
  if (std::filesystem::exists(std::filesystem::path(path) / "state.json")) return path;
  if (auto latest = train::latest_checkpoint(path)) return *latest;
  TESSERA_FAIL("'", path, "' is neither a checkpoint directory (with state.json) nor a run directory with checkpoints/latest");
}

struct LoadedModel {
  std::unique_ptr<models::TransformerLM> model;
  std::unique_ptr<data::Tokenizer> tokenizer;
};

LoadedModel load_model(const std::string& checkpoint, const std::string& tokenizer, const std::string& vocab,
                       const std::string& merges) {
  const std::string dir = resolve_checkpoint(checkpoint);
  LoadedModel out;
  out.model = std::make_unique<models::TransformerLM>(train::checkpoint_model_config(dir));
  train::load_checkpoint(dir, *out.model, nullptr);
  train::DataConfig data{.tokenizer = tokenizer, .vocab = vocab, .merges = merges};
  // Training runs record their tokenizer in state.json's config; use it unless told otherwise.
  const auto state = nlohmann::json::parse(io::read_file((std::filesystem::path(dir) / "state.json").string()));
  if (tokenizer.empty() && state.contains("config") && state["config"].contains("data")) {
    const auto& d = state["config"]["data"];
    data.tokenizer = d.value("tokenizer", "byte");
    data.vocab = d.value("vocab", "");
    data.merges = d.value("merges", "");
  }
  if (data.tokenizer.empty()) data.tokenizer = "byte";
  out.tokenizer = train::make_tokenizer(data);
  return out;
}

}  // namespace

void add_train_commands(CLI::App& app) {
  // ---- train ----
  static std::string config_path;
  static std::vector<std::string> overrides;
  static std::vector<std::string> resume;
  static std::string device, precision, attention_backend, deterministic_attention, gemm_autotune, cuda_graph,
      optimizer_overlap;
  CLI::App* train_cmd = app.add_subcommand("train", "Train a model from a YAML/JSON config (see docs/training.md)");
  train_cmd->footer(
      "Several ranks (data and tensor parallelism, docs/distributed.md): `mpirun -np N tessera train CONFIG` (one or many hosts) "
      "or `tessera launch --nproc N train CONFIG` (one host, no MPI needed); every rank gets the same config and "
      "arguments. training.parallel sets the layout (data, tensor, sequence_parallel, distributed_optimizer for "
      "ZeRO-1, timeout_s, bucket_mb, overlap_grad_reduce, tp_comm_overlap); "
      "training.batch_size is per rank and micro-batch, training.global_batch_size (optional) the sequences per "
      "step over all ranks. Rank 0 prints and writes metrics.jsonl; every rank writes its part of each checkpoint, "
      "and --resume continues at any number of ranks.");
  train_cmd->add_option("config", config_path, "Config file (YAML or JSON)")->required()->check(CLI::ExistingFile);
  train_cmd->add_option("--set", overrides, "Override a config key, e.g. --set training.steps=200 (repeatable)");
  static CLI::Option* resume_opt = train_cmd->add_option(
      "--resume", resume,
      "Continue a run: `--resume` or `--resume auto` from the newest checkpoint in training.out_dir that verifies "
      "(skipping damaged or partial ones with a warning; none at all starts afresh), `--resume DIR` from that "
      "checkpoint directory");
  resume_opt->expected(0, 1);
  train_cmd->add_option("--device", device, "auto, cpu or cuda (same as --set training.device=...)")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  train_cmd->add_option("--precision", precision, "auto, fp32 or bf16 (same as --set training.precision=...)")
      ->check(CLI::IsMember({"auto", "fp32", "bf16"}));
  train_cmd->add_option("--attention-backend", attention_backend,
                        "CUDA attention: auto (the faster per shape, timed once), tessera or cudnn "
                        "(same as --set training.attention_backend=...)")
      ->check(CLI::IsMember({"auto", "tessera", "cudnn"}));
  train_cmd->add_option("--deterministic-attention", deterministic_attention,
                        "true (the default): tessera's CUDA attention backward is bitwise repeatable; false: dQ is "
                        "summed with FP32 atomics, faster, last bits vary between runs "
                        "(same as --set training.deterministic_attention=...)")
      ->check(CLI::IsMember({"true", "false"}));
  train_cmd->add_option("--gemm-autotune", gemm_autotune,
                        "true: on CUDA, time cuBLASLt's candidate algorithms for each GEMM shape once and keep the "
                        "fastest (the last bits may then vary between runs); false (the default): the heuristic's "
                        "first choice, as PyTorch (same as --set training.gemm_autotune=...)")
      ->check(CLI::IsMember({"true", "false"}));
  train_cmd->add_option("--cuda-graph", cuda_graph,
                        "Capture the training step into a CUDA graph: auto (when the run can be), on or off "
                        "(same as --set training.cuda_graph=...)")
      ->check(CLI::IsMember({"auto", "on", "off"}));
  train_cmd->add_option("--optimizer-overlap", optimizer_overlap,
                        "true: update each bucket of parameters during the backward, as soon as their gradients "
                        "are final (needs optimizer.grad_clip 0, one device, no fp8); false (the default): after it "
                        "(same as --set optimizer.overlap_backward=...)")
      ->check(CLI::IsMember({"true", "false"}));
  train_cmd->callback([] {
    nlohmann::json j = train::load_config_file(config_path);
    for (const std::string& o : overrides) train::apply_override(j, o);
    if (!device.empty()) train::apply_override(j, "training.device=" + device);
    if (!precision.empty()) train::apply_override(j, "training.precision=" + precision);
    if (!attention_backend.empty()) train::apply_override(j, "training.attention_backend=" + attention_backend);
    if (!deterministic_attention.empty())
      train::apply_override(j, "training.deterministic_attention=" + deterministic_attention);
    if (!gemm_autotune.empty()) train::apply_override(j, "training.gemm_autotune=" + gemm_autotune);
    if (!cuda_graph.empty()) train::apply_override(j, "training.cuda_graph=" + cuda_graph);
    if (!optimizer_overlap.empty()) train::apply_override(j, "optimizer.overlap_backward=" + optimizer_overlap);
    train::TrainOptions options;
    if (resume_opt->count() > 0) {
      const std::string what = resume.empty() || resume.front().empty() ? "auto" : resume.front();
      options.resume = true;
      if (what != "auto") {
        TESSERA_CHECK(std::filesystem::is_directory(what), "--resume takes `auto` or a checkpoint directory, got '",
                      what, "'");
        options.resume_from = what;
      }
    }
    train::train(train::RunConfig::from_json(j), options);
  });

  // ---- prepare ----
  static std::string text_path, out_path, tokenizer_name = "byte", vocab, merges;
  CLI::App* prepare = app.add_subcommand("prepare", "Tokenize a text file into a token file (llm.c shard format)");
  prepare->add_option("text", text_path, "Text file")->required()->check(CLI::ExistingFile);
  prepare->add_option("--out", out_path, "Token file to write (.bin)")->required();
  prepare->add_option("--tokenizer", tokenizer_name, "byte or gpt2")->capture_default_str();
  prepare->add_option("--vocab", vocab, "GPT-2 vocab.json (for --tokenizer gpt2)");
  prepare->add_option("--merges", merges, "GPT-2 merges.txt (for --tokenizer gpt2)");
  prepare->callback([] {
    const auto tok = train::make_tokenizer({.tokenizer = tokenizer_name, .vocab = vocab, .merges = merges});
    const int64_t n = train::prepare_text(text_path, *tok, out_path);
    std::printf("prepare: wrote %lld tokens (%s tokenizer) to %s\n", static_cast<long long>(n), tok->name().c_str(),
                out_path.c_str());
  });

  // ---- eval ----
  static std::string eval_ckpt, eval_data, dump_logits;
  static int64_t eval_batch = 4, eval_seq = 0, eval_batches = 0;
  CLI::App* eval = app.add_subcommand("eval", "Loss and perplexity of a checkpoint on a token file");
  eval->add_option("checkpoint", eval_ckpt, "Checkpoint directory or run directory")->required();
  eval->add_option("--data", eval_data, "Token file (.bin llm.c shard or Megatron .idx/.bin prefix)")->required();
  eval->add_option("--batch", eval_batch, "Sequences per batch")->capture_default_str()->check(CLI::PositiveNumber);
  eval->add_option("--seq-len", eval_seq, "Tokens per sequence (default: model.max_seq_len)");
  eval->add_option("--batches", eval_batches, "Batches to evaluate (default: the whole file)");
  eval->add_option("--dump-logits", dump_logits, "Write the logits of the first batch to this safetensors file");
  eval->callback([] {
    LoadedModel m = load_model(eval_ckpt, "", "", "");
    Context ctx = Context::cpu();
    const int64_t seq = eval_seq > 0 ? eval_seq : m.model->config().max_seq_len;
    data::DataLoader loader(data::TokenFile::open(eval_data),
                            {.batch_size = eval_batch, .seq_len = seq, .split = data::Split::Train, .val_fraction = 0,
                             .seed = 0, .shuffle = false, .vocab_size = m.model->config().vocab_size});
    const int64_t n = eval_batches > 0 ? std::min(eval_batches, loader.batches_per_epoch()) : loader.batches_per_epoch();
    double total = 0;
    for (int64_t i = 0; i < n; ++i) {
      const data::Batch b = loader.next();
      if (i == 0 && !dump_logits.empty()) {
        io::save_safetensors(dump_logits, {{"logits", m.model->logits(ctx, b.inputs)}, {"input_ids", b.inputs}});
      }
      total += m.model->forward_loss(ctx, b.inputs, b.targets);
    }
    const double loss = total / n;
    std::printf("eval: %lld batches of %lldx%lld tokens: loss %.4f, perplexity %.3f\n", static_cast<long long>(n),
                static_cast<long long>(eval_batch), static_cast<long long>(seq), loss, std::exp(loss));
  });

  // ---- generate ----
  static std::string gen_ckpt, prompt = "\n", gen_tokenizer, gen_vocab, gen_merges;
  static infer::SamplingOptions sampling{.temperature = 0.8f, .top_k = 0, .top_p = 0.95f, .seed = 0, .max_new_tokens = 200};
  CLI::App* gen = app.add_subcommand("generate", "Sample text from a checkpoint");
  gen->add_option("checkpoint", gen_ckpt, "Checkpoint directory or run directory")->required();
  gen->add_option("--prompt", prompt, "Text to continue")->capture_default_str();
  gen->add_option("--tokens", sampling.max_new_tokens, "Tokens to generate")->capture_default_str();
  gen->add_option("--temperature", sampling.temperature, "Softmax temperature; 0 is greedy")->capture_default_str();
  gen->add_option("--top-k", sampling.top_k, "Keep the k most likely tokens; 0 keeps all")->capture_default_str();
  gen->add_option("--top-p", sampling.top_p, "Keep the smallest set with this much probability")->capture_default_str();
  gen->add_option("--seed", sampling.seed, "Random seed")->capture_default_str();
  gen->add_option("--tokenizer", gen_tokenizer, "byte or gpt2 (default: the one the run trained with)");
  gen->add_option("--vocab", gen_vocab, "GPT-2 vocab.json");
  gen->add_option("--merges", gen_merges, "GPT-2 merges.txt");
  gen->callback([] {
    LoadedModel m = load_model(gen_ckpt, gen_tokenizer, gen_vocab, gen_merges);
    Context ctx = Context::cpu();
    std::vector<int32_t> tokens = m.tokenizer->encode(prompt);
    TESSERA_CHECK(!tokens.empty(), "generate: the prompt is empty");
    if (auto eot = m.tokenizer->eot_id()) sampling.stop_token = *eot;
    std::printf("%s", prompt.c_str());
    infer::generate(ctx, *m.model, tokens, sampling, [&](int32_t t) {
      const int32_t one[1] = {t};
      std::printf("%s", m.tokenizer->decode(one).c_str());
      std::fflush(stdout);
    });
    std::printf("\n");
  });
}

}  // namespace tessera::cli
