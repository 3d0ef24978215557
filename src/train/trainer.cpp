#include "tessera/train/trainer.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "tessera/core/allocator.h"
#include "tessera/data/loader.h"
#include "tessera/data/token_file.h"
#include "tessera/infer/generate.h"
#include "tessera/io/atomic_file.h"
#include "tessera/models/hf_convert.h"
#include "tessera/models/transformer_lm.h"
#include "tessera/ops/attention.h"
#include "tessera/train/checkpoint.h"
#include "tessera/train/optimizer.h"

namespace fs = std::filesystem;

namespace tessera::train {

std::unique_ptr<data::Tokenizer> make_tokenizer(const DataConfig& c) {
  if (c.tokenizer == "byte") return std::make_unique<data::ByteTokenizer>();
  TESSERA_CHECK(!c.vocab.empty() && !c.merges.empty(), "config: data.tokenizer gpt2 needs data.vocab (vocab.json) and ",
                "data.merges (merges.txt)");
  return data::Gpt2BpeTokenizer::from_files(c.vocab, c.merges);
}

int64_t prepare_text(const std::string& text_path, const data::Tokenizer& tokenizer, const std::string& out_path) {
  const std::string text = io::read_file(text_path);
  const std::vector<int32_t> tokens = tokenizer.encode(text);
  TESSERA_CHECK(!tokens.empty(), "prepare: '", text_path, "' holds no text");
  const auto format = tokenizer.vocab_size() <= 65536 ? data::LlmcFormat::Gpt2 : data::LlmcFormat::Llama3;
  if (!fs::path(out_path).parent_path().empty()) fs::create_directories(fs::path(out_path).parent_path());
  data::write_llmc_shard(out_path, tokens, format);
  return static_cast<int64_t>(tokens.size());
}

namespace {

Context pick_device(const std::string& device) {
  if (device == "cpu") return Context::cpu();
  const bool gpu = cuda_available();
  if (device == "cuda") {
    TESSERA_CHECK(gpu, "training.device=cuda: ",
                  TESSERA_WITH_CUDA ? "no CUDA GPU is visible" : "this build has no CUDA backend (configure with -DTESSERA_CUDA=ON)");
    return Context::cuda();
  }
  return gpu ? Context::cuda() : Context::cpu();  // auto
}

// The compute dtype: BF16 with FP32 master weights on a GPU, FP32 on the CPU (where BF16
// saves no time: the reference kernels compute in float either way).
DType pick_dtype(const std::string& precision, const Context& ctx) {
  if (precision == "bf16") return DType::BF16;
  if (precision == "fp32") return DType::F32;
  return ctx.device.is_cuda() ? DType::BF16 : DType::F32;
}

data::TokenFile open_tokens(const RunConfig& c, const data::Tokenizer& tokenizer) {
  if (!c.data.path.empty()) return data::TokenFile::open(c.data.path);
  TESSERA_CHECK(!c.data.text.empty(), "config: set data.path (a token file) or data.text (a text file)");
  // The cache remembers which text it came from (path, size, modification time), so a
  // changed or different text is tokenized again instead of reusing stale tokens.
  const std::string cached = (fs::path(c.training.out_dir) / ("tokens-" + tokenizer.name() + ".bin")).string();
  std::error_code ec;
  const fs::path text = fs::absolute(c.data.text, ec);
  const std::string source = text.string() + "\n" + std::to_string(fs::file_size(text, ec)) + "\n" +
                             std::to_string(fs::last_write_time(text, ec).time_since_epoch().count()) + "\n";
  const std::string source_path = cached + ".source";
  const bool fresh = fs::exists(cached) && fs::exists(source_path) && io::read_file(source_path) == source;
  if (!fresh) {
    prepare_text(c.data.text, tokenizer, cached);
    io::write_file_atomically(source_path, source);
  }
  return data::TokenFile::open(cached);
}

// Entropy of the token frequencies, over at most the first 16M tokens.
double unigram_entropy(const data::TokenFile& tokens, int64_t vocab) {
  const int64_t n = std::min<int64_t>(tokens.num_tokens(), 16 << 20);
  const std::vector<int32_t> ids = tokens.read(0, n);
  std::vector<double> counts(static_cast<size_t>(vocab), 0.0);
  for (int32_t id : ids)
    if (id >= 0 && id < vocab) counts[id] += 1;
  double h = 0;
  for (double c : counts)
    if (c > 0) h -= c / n * std::log(c / n);
  return h;
}

std::string format_duration(double seconds) {
  char out[32];
  const long s = static_cast<long>(seconds + 0.5);
  if (s >= 3600) std::snprintf(out, sizeof(out), "%ldh%02ldm", s / 3600, (s / 60) % 60);
  else if (s >= 60) std::snprintf(out, sizeof(out), "%ldm%02lds", s / 60, s % 60);
  else std::snprintf(out, sizeof(out), "%lds", s);
  return out;
}

}  // namespace

TrainResult train(const RunConfig& c, const TrainOptions& options) {
  const TrainingConfig& t = c.training;
  Context ctx = pick_device(t.device);
  fs::create_directories(t.out_dir);
  const auto tokenizer = make_tokenizer(c.data);
  TESSERA_CHECK(tokenizer->vocab_size() <= c.model.vocab_size, "config: model.vocab_size (", c.model.vocab_size,
                ") is smaller than the tokenizer's vocabulary (", tokenizer->vocab_size(), ")");
  const data::TokenFile tokens = open_tokens(c, *tokenizer);

  data::LoaderOptions train_opts{.batch_size = t.batch_size, .seq_len = t.seq_len, .split = data::Split::Train,
                                 .val_fraction = c.data.validation_fraction, .seed = t.seed, .shuffle = true,
                                 .vocab_size = c.model.vocab_size};
  data::DataLoader train_loader(tokens, train_opts);
  std::unique_ptr<data::DataLoader> val_loader;
  if (c.data.validation_fraction > 0 && t.eval_interval > 0) {
    data::LoaderOptions val_opts = train_opts;
    val_opts.split = data::Split::Validation;
    val_opts.shuffle = false;
    val_loader = std::make_unique<data::DataLoader>(tokens, val_opts);
  }

  const DType dtype = pick_dtype(t.precision, ctx);
  // "auto" leaves the process default alone, which TESSERA_ATTENTION_BACKEND may have set.
  if (t.attention_backend != "auto") set_attention_backend(parse_attention_backend(t.attention_backend));
  models::TransformerLM model(c.model, dtype);
  model.to(ctx.device);
  model.init(ctx, t.seed);
  Optimizer optimizer(model.parameters(), c.optimizer);
  int64_t step = 0;
  bool resumed = false;
  if (options.resume) {
    if (auto dir = latest_checkpoint(t.out_dir)) {
      const CheckpointState state = load_checkpoint(*dir, model, &optimizer);
      step = state.step;
      train_loader.load_state(state.data_position);
      resumed = true;
      if (!options.quiet) std::printf("train: resumed from %s at step %lld\n", dir->c_str(), static_cast<long long>(step));
    }
  }

  if (!resumed && !t.init_from.empty()) {
    // Fine-tuning: weights from a Hugging Face directory or a tessera checkpoint, fresh
    // optimizer state and data position.
    // A Hugging Face directory has a config.json with "model_type"; a tessera run directory
    // has a config.json too (the run config), but with sections instead.
    const fs::path hf_config = fs::path(t.init_from) / "config.json";
    if (fs::exists(hf_config) && nlohmann::json::parse(io::read_file(hf_config.string()), nullptr, false).contains("model_type")) {
      models::load_hf_model(t.init_from, model);
    } else {
      std::string dir = t.init_from;
      if (!fs::exists(fs::path(dir) / "state.json")) {
        auto latest = latest_checkpoint(dir);
        TESSERA_CHECK(latest.has_value(), "training.init_from: '", dir, "' is neither a Hugging Face model directory ",
                      "(config.json), a checkpoint (state.json) nor a run directory");
        dir = *latest;
      }
      load_checkpoint(dir, model, nullptr);
    }
    if (!options.quiet) std::printf("train: initialised from %s\n", t.init_from.c_str());
  }

  std::ofstream metrics(fs::path(t.out_dir) / "metrics.jsonl", step > 0 ? std::ios::app : std::ios::trunc);
  TESSERA_CHECK(metrics.good(), "train: cannot write ", t.out_dir, "/metrics.jsonl");
  io::write_file_atomically((fs::path(t.out_dir) / "config.json").string(), c.to_json().dump(2));

  const int64_t tokens_per_step = t.batch_size * t.seq_len * t.grad_accum;
  if (!options.quiet) {
    std::printf("train: %s model, %lld parameters, on %s in %s, %lld tokens (%s tokenizer), %lld tokens per step\n",
                c.model.architecture.c_str(), static_cast<long long>(model.num_parameters()),
                ctx.device.is_cuda() ? "cuda" : "cpu", dtype == DType::BF16 ? "bf16 (fp32 master weights)" : "fp32",
                static_cast<long long>(tokens.num_tokens()), tokenizer->name().c_str(),
                static_cast<long long>(tokens_per_step));
    std::printf("train: unigram entropy of the data %.3f nats/token (the loss of a model that ignores context)\n",
                unigram_entropy(tokens, c.model.vocab_size));
  }

  auto validation_loss = [&] {
    val_loader->reset();
    double total = 0;
    for (int64_t i = 0; i < t.eval_batches; ++i) {
      const data::Batch b = val_loader->next();
      total += model.forward_loss(ctx, b.inputs, b.targets);
    }
    return total / t.eval_batches;
  };

  TrainResult result;
  const bool tty = isatty(fileno(stdout));
  const auto start = std::chrono::steady_clock::now();
  const int64_t first_step = step;
  auto save = [&] {
    result.checkpoint = save_checkpoint(t.out_dir, model, &optimizer,
                                        {.step = step, .data_position = train_loader.state(), .config = c.to_json()});
  };
  while (step < t.steps) {
    step += 1;
    model.zero_grad();
    double loss = 0;
    for (int64_t micro = 0; micro < t.grad_accum; ++micro) {
      const data::Batch b = train_loader.next();
      loss += model.forward_backward(ctx, b.inputs, b.targets, 1.0f / t.grad_accum) / t.grad_accum;
    }
    TESSERA_CHECK(std::isfinite(loss), "train: the loss became ", loss, " at step ", step,
                  " (lower optimizer.lr or check the data)");
    const double lr = learning_rate(c.optimizer, step, t.steps);
    const double grad_norm = optimizer.step(ctx, lr);
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double rate = (step - first_step) * tokens_per_step / elapsed;
    nlohmann::json line = {{"step", step}, {"loss", loss}, {"lr", lr}, {"grad_norm", grad_norm}, {"tokens_per_s", rate}};
    if (val_loader && (step % t.eval_interval == 0 || step == t.steps)) {
      result.last_val_loss = validation_loss();
      line["val_loss"] = result.last_val_loss;
    }
    metrics << line.dump() << "\n" << std::flush;
    result.step = step;
    result.last_loss = loss;
    result.tokens_per_second = rate;

    if (!options.quiet && (step % t.log_interval == 0 || step == t.steps || line.contains("val_loss"))) {
      const double eta = elapsed / (step - first_step) * (t.steps - step);
      std::printf("%sstep %lld/%lld  loss %.4f  lr %.2e  |g| %.2f  %.0f tok/s  ETA %s%s", tty ? "\r" : "",
                  static_cast<long long>(step), static_cast<long long>(t.steps), loss, lr, grad_norm, rate,
                  format_duration(eta).c_str(), tty ? "   " : "\n");
      if (line.contains("val_loss")) std::printf("%s  val_loss %.4f\n", tty ? "\n" : "", result.last_val_loss);
      std::fflush(stdout);
    }
    const bool out_of_time = t.max_minutes > 0 && elapsed > t.max_minutes * 60;
    const bool stop_now = options.stop_after > 0 && step - first_step >= options.stop_after;
    if ((t.checkpoint_interval > 0 && step % t.checkpoint_interval == 0) || step == t.steps || out_of_time || stop_now) save();
    if (out_of_time) {
      if (!options.quiet) std::printf("\ntrain: stopping after %.1f minutes (training.max_minutes)\n", elapsed / 60);
      break;
    }
    if (stop_now) break;
  }
  if (!options.quiet) {
    std::printf("\ntrain: step %lld, loss %.4f, %.0f tokens/s; checkpoint %s\n", static_cast<long long>(result.step),
                result.last_loss, result.tokens_per_second, result.checkpoint.c_str());
    if (!t.sample_prompt.empty()) {
      std::vector<int32_t> prompt = tokenizer->encode(t.sample_prompt);
      infer::SamplingOptions sampling{.temperature = 0.8f, .top_k = 0, .top_p = 0.95f, .seed = t.seed,
                                      .max_new_tokens = t.sample_tokens};
      const std::vector<int32_t> out = infer::generate(ctx, model, prompt, sampling);
      std::printf("\n--- sample ---\n%s%s\n--------------\n", t.sample_prompt.c_str(), tokenizer->decode(out).c_str());
    }
  }
  return result;
}

}  // namespace tessera::train
