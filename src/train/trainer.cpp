#include "tessera/train/trainer.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <deque>
#include <fstream>
#include <map>
#include <set>
#include <thread>

#include "tessera/core/allocator.h"
#include "tessera/core/numeric.h"
#include "tessera/core/stream.h"
#include "tessera/data/loader.h"
#include "tessera/data/token_file.h"
#include "tessera/infer/generate.h"
#include "tessera/io/atomic_file.h"
#include "tessera/models/fp8_model.h"
#include "tessera/models/hf_convert.h"
#include "tessera/models/transformer_lm.h"
#include "tessera/ops/attention.h"
#include "tessera/ops/gemm.h"
#include "tessera/train/checkpoint.h"
#include "tessera/train/optimizer.h"
#include "train/async_checkpoint.h"
#include "train/cuda_graph_step.h"
#include "train/distributed.h"
#include "train/rewind.h"

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
// Trainer state kept as tensors in a checkpoint's JSON trainer state: the FP8 recipe's
// (delayed scaling's amax history, scales and ring position) and the MoE expert biases.
// Floats as their bit patterns, so that NaN amaxes and every bit survive JSON and a resumed
// run continues exactly as the uninterrupted one would.
nlohmann::json tensors_to_json(const std::map<std::string, Tensor>& tensors) {
  nlohmann::json out = nlohmann::json::object();
  for (const auto& [name, tensor] : tensors) {
    if (tensor.dtype() == DType::I64) {
      out[name] = {{"shape", tensor.shape()}, {"i64", tensor.to_ints()}};
      continue;
    }
    std::vector<uint32_t> bits;
    for (float f : tensor.to_floats()) bits.push_back(float_bits(f));
    out[name] = {{"shape", tensor.shape()}, {"f32_bits", bits}};
  }
  return out;
}

std::map<std::string, Tensor> tensors_from_json(const nlohmann::json& j, const char* what) {
  std::map<std::string, Tensor> out;
  TESSERA_CHECK(j.is_object(), "train: the checkpoint's ", what, " is not an object");
  for (const auto& [name, entry] : j.items()) {
    const Shape shape = entry.at("shape").get<Shape>();
    if (entry.contains("i64")) {
      out[name] = Tensor::from_ints(entry.at("i64").get<std::vector<int64_t>>(), shape, DType::I64);
    } else {
      std::vector<float> values;
      for (uint32_t b : entry.at("f32_bits").get<std::vector<uint32_t>>()) values.push_back(bits_float(b));
      out[name] = Tensor::from_floats(values, shape);
    }
  }
  return out;
}

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

// Keeps the lines of metrics.jsonl for steps <= `step`; drops later ones and any line that
// does not parse (the torn last line of a process that was killed while writing it).
void truncate_metrics_after(const std::string& path, int64_t step) {
  if (!fs::exists(path)) return;
  const std::string text = io::read_file(path);
  std::string kept;
  size_t begin = 0;
  while (begin < text.size()) {
    size_t end = text.find('\n', begin);
    if (end == std::string::npos) break;  // no newline: torn
    const std::string line = text.substr(begin, end - begin);
    begin = end + 1;
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("step") || !j["step"].is_number_integer()) continue;
    if (j["step"].get<int64_t>() <= step) kept += line + "\n";
  }
  if (kept != text) io::write_file_atomically(path, kept);
}

// Fault injection: a NaN in the first element of the first parameter's gradient.
void poison_a_gradient(models::TransformerLM& model) {
  nn::Parameter* p = model.parameters().front();
  TESSERA_CHECK(p->grad.defined() && p->grad.dtype() == DType::F32, "fault injection: '", p->name, "' has no F32 gradient");
  Tensor host = p->grad.device().is_cpu() ? p->grad : p->grad.to(Device::cpu());
  host.data<float>()[0] = NAN;
  if (!p->grad.device().is_cpu()) p->grad.copy_from(host);
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

TrainResult train(const RunConfig& config, const TrainOptions& options) {
  // The ranks of the run (one without a launcher; collective: the ranks' configs are
  // compared) and this rank's device. `c` is the config this rank runs: grad_accum follows
  // from training.global_batch_size when that is set.
  detail::DistributedRun dist_run(config, pick_device(config.training.device), options.world,
                                  {{"resume", options.resume}, {"resume_from", options.resume_from},
                                   {"stop_after", options.stop_after}});
  const RunConfig c = dist_run.resolve(config);
  const TrainingConfig& t = c.training;
  Context ctx = dist_run.device_context();
  const bool main_rank = dist_run.is_main();
  const bool quiet = options.quiet || !main_rank;  // only rank 0 prints
  const int64_t data_size = dist_run.data_size(), data_rank = dist_run.data_rank();
  // On CUDA the run queues everything, ops and Tensor copies alike, on one stream of its own
  // (the legacy default stream cannot be captured into a CUDA graph). With the optimizer
  // overlapped with the backward, at a higher priority than the update's side stream, so the
  // backward's kernels go first (Llama: -0.3% against -0.75% at equal priorities; see
  // bench/RESULTS.md).
  const Stream stream = Stream::create(ctx.device, c.optimizer.overlap_backward ? -1 : 0);
  ctx.stream = stream.get();
  const StreamGuard stream_guard(ctx);
  fs::create_directories(t.out_dir);
  const auto tokenizer = make_tokenizer(c.data);
  TESSERA_CHECK(tokenizer->vocab_size() <= c.model.vocab_size, "config: model.vocab_size (", c.model.vocab_size,
                ") is smaller than the tokenizer's vocabulary (", tokenizer->vocab_size(), ")");
  const data::TokenFile tokens = dist_run.main_first([&] { return open_tokens(c, *tokenizer); });  // one writes the cache

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
  set_attention_deterministic(t.deterministic_attention);
  // false leaves the process default alone, which TESSERA_GEMM_AUTOTUNE may have set.
  if (t.gemm_autotune) set_gemm_autotune(true);
  models::TransformerLM model(c.model, dtype, dist_run.parallel_context());
  model.to(ctx.device);
  model.init(ctx, t.seed);
  // ZeRO-1 (training.parallel.distributed_optimizer) shards the optimizer state over the data
  // ranks; the plain optimizer then holds nothing.
  // Tensor parallelism: each rank holds shards, so the plain optimizer's norm (of this rank's
  // shards) is not the model's; it steps with its clipping off and the trainer clips by the
  // single-device norm (model.clip_grad_norm) after the data-parallel reduction. ZeRO-1 sums
  // the counted squares over data x tensor itself (DistributedOptimizer::set_tensor_parallel).
  const bool tensor_parallel = model.tensor_parallel();
  OptimizerConfig plain_config = c.optimizer;
  if (tensor_parallel) plain_config.grad_clip = 0;
  std::unique_ptr<dist::DistributedOptimizer> zero1 = dist_run.make_zero1(ctx, model, c.optimizer);
  Optimizer optimizer(zero1 ? nn::ParameterList{} : model.parameters(), plain_config);
  OptimizerBase& opt = zero1 ? static_cast<OptimizerBase&>(*zero1) : optimizer;
  TESSERA_CHECK(!c.optimizer.overlap_backward || (dist_run.size() == 1 && !c.fp8),
                "config: optimizer.overlap_backward runs on one device without FP8 (this run has ", dist_run.size(),
                " ranks", c.fp8 ? " and an fp8 section" : "", "); drop it");
  std::shared_ptr<nn::Fp8Scaling> fp8_state;
  if (c.fp8) {
    TESSERA_CHECK(!tensor_parallel, "config: the fp8 section is not built for tensor parallelism (training.parallel.",
                  "tensor = ", dist_run.tensor_size(), "): FP8 binds the single-device layers only; drop fp8 or use tensor 1");
    TESSERA_CHECK(dtype == DType::BF16, "train: the fp8 section needs BF16 compute (training.precision bf16, ",
                  "or auto on CUDA); this run computes in ", dtype_name(dtype));
    // The deferred expert gradients appear after the last micro-batch's backward, where the
    // gradient reduction of data (and pipeline) parallel runs has started already.
    TESSERA_CHECK(!c.fp8->defer_expert_wgrad || dist_run.size() == 1, "config: fp8.defer_expert_wgrad runs on one ",
                  "device only (this run has ", dist_run.size(), " ranks); drop it or run on one GPU");
    fp8_state = models::enable_fp8(ctx, model, *c.fp8);
    // fp8.cast_in_optimizer: the experts' updates write their next casts (after end_step).
    TESSERA_CHECK(!c.fp8->cast_in_optimizer || !zero1, "config: fp8.cast_in_optimizer runs with the plain optimizer; ",
                  "drop it or training.zero1");
    if (c.fp8->cast_in_optimizer) use_cast_in_optimizer(model, optimizer);
  }
  // What a checkpoint's trainer state holds besides the weights and the optimizer: put back on
  // resume and on every rewind (from memory or from a checkpoint).
  auto restore_trainer_tensors = [&](const nlohmann::json& extra) {
    if (!extra.is_object()) return;
    if (fp8_state && extra.contains("fp8"))
      fp8_state->load_state_dict(ctx, tensors_from_json(extra["fp8"], "fp8 state"));
    if (extra.contains("expert_bias")) model.load_expert_biases(ctx, tensors_from_json(extra["expert_bias"], "expert biases"));
  };
  int64_t step = 0;
  bool resumed = false;
  // step -> steps' worth of data skipped when that step starts (configured, or left by rewinds).
  std::map<int64_t, int64_t> skip_data;
  for (int64_t s : t.skip_data_at_steps) skip_data[s] = std::max<int64_t>(skip_data[s], 1);
  if (options.resume) {
    std::vector<std::string> skipped;
    std::optional<std::string> dir;
    if (!options.resume_from.empty()) {
      dir = options.resume_from;  // load_checkpoint verifies it
    } else {
      dir = dist_run.latest_checkpoint(t.out_dir, &skipped);  // rank 0 looks, every rank gets its answer
    }
    if (dir) {
      const CheckpointState state = load_checkpoint(*dir, model, &opt, /*verify=*/main_rank);
      step = state.step;
      train_loader.load_state(state.data_position);
      if (state.extra.is_object() && state.extra.contains("skip_data"))
        for (const auto& e : state.extra["skip_data"]) skip_data[e.at(0).get<int64_t>()] = e.at(1).get<int64_t>();
      restore_trainer_tensors(state.extra);
      resumed = true;
      if (!quiet) std::printf("train: resumed from %s at step %lld\n", dir->c_str(), static_cast<long long>(step));
    } else if (!skipped.empty()) {
      TESSERA_FAIL("train: --resume: none of the ", skipped.size(), " checkpoints under ", t.out_dir,
                   "/checkpoints verifies (newest: ", skipped.front(), "); move them away to start afresh");
    }
  }

  if (!resumed && !t.init_from.empty()) {
    // Fine-tuning: weights from a Hugging Face directory or a tessera checkpoint, fresh
    // optimizer state and data position.
    // A Hugging Face directory has a config.json with "model_type"; a tessera run directory
    // has a config.json too (the run config), but with sections instead.
    const fs::path hf_config = fs::path(t.init_from) / "config.json";
    if (fs::exists(hf_config) && nlohmann::json::parse(io::read_file(hf_config.string()), nullptr, false).contains("model_type")) {
      if (tensor_parallel) {
        // The importer fills a single-device model; every rank cuts its shards out of it.
        models::TransformerLM whole(c.model, dtype);
        models::load_hf_model(t.init_from, whole);
        Context cpu = Context::cpu();
        model.load_full_state(ctx, whole.full_state_dict(cpu));
      } else {
        models::load_hf_model(t.init_from, model);
      }
    } else {
      std::string dir = t.init_from;
      if (!fs::exists(fs::path(dir) / "state.json")) {
        auto latest = latest_checkpoint(dir);
        TESSERA_CHECK(latest.has_value(), "training.init_from: '", dir, "' is neither a Hugging Face model directory ",
                      "(config.json), a checkpoint (state.json) nor a run directory with a verified checkpoint");
        dir = *latest;
      }
      load_checkpoint(dir, model, nullptr);
    }
    if (!quiet) std::printf("train: initialised from %s\n", t.init_from.c_str());
  }

  dist_run.wait_for_all();  // loading (rank 0 verifies the checkpoint) takes long on some ranks
  dist_run.setup_replicas(ctx, model);  // rank 0's weights on every data rank; the gradient buckets

  const std::string metrics_path = (fs::path(t.out_dir) / "metrics.jsonl").string();
  // A resumed run continues the metrics of the steps its checkpoint covers; lines of later
  // steps (written before the run died) would otherwise appear twice. Rank 0 alone writes
  // metrics.jsonl, events.jsonl and config.json (`metrics` stays closed on the others).
  if (step > 0 && main_rank) truncate_metrics_after(metrics_path, step);
  std::ofstream metrics;
  if (main_rank) {
    metrics.open(metrics_path, step > 0 ? std::ios::app : std::ios::trunc);
    TESSERA_CHECK(metrics.good(), "train: cannot write ", metrics_path);
    io::write_file_atomically((fs::path(t.out_dir) / "config.json").string(), config.to_json().dump(2));
  }

  const int64_t tokens_per_step = t.batch_size * t.seq_len * t.grad_accum * data_size;  // over all data ranks
  if (!quiet) {
    std::printf("train: %s model, %lld parameters, on %s in %s, %lld tokens (%s tokenizer), %lld tokens per step\n",
                c.model.architecture.c_str(), static_cast<long long>(model.num_parameters()),
                ctx.device.is_cuda() ? "cuda" : "cpu", dtype == DType::BF16 ? "bf16 (fp32 master weights)" : "fp32",
                static_cast<long long>(tokens.num_tokens()), tokenizer->name().c_str(),
                static_cast<long long>(tokens_per_step));
    if (dist_run.size() > 1)
      std::printf("train: %d ranks (%s): %lld data-parallel x %lld micro-batch(es) of %lld sequences per step, %s\n",
                  dist_run.size(), dist_run.runtime().grid->data->backend(), static_cast<long long>(data_size),
                  static_cast<long long>(t.grad_accum), static_cast<long long>(t.batch_size),
                  zero1                                      ? "ZeRO-1 distributed optimizer"
                  : !c.training.parallel.overlap_grad_reduce ? "gradients all-reduced after backward"
                                                             : "gradients all-reduced during backward");
    if (tensor_parallel)
      std::printf("train: tensor parallel x %d%s%s: this rank holds %lld parameters\n", dist_run.tensor_size(),
                  c.training.parallel.sequence_parallel ? " with sequence parallelism" : "",
                  c.training.parallel.tp_comm_overlap ? " (communication overlapped)" : "",
                  static_cast<long long>(model.num_parameters()));
    if (fp8_state) {
      int64_t moe_layers = 0;
      for (const auto& layer : model.layers) moe_layers += layer->moe ? 1 : 0;
      std::printf("train: FP8 (%s scaling) in %lld linear layers of the blocks", c.fp8->name().c_str(),
                  static_cast<long long>(fp8_state->num_linears()));
      if (moe_layers > 0)
        std::printf(" and the experts of %lld MoE layers%s", static_cast<long long>(moe_layers),
                    fp8_state->expert_state() ? " (per-expert delayed scales)" : " (per-expert current scales)");
      std::printf("\n");
      if (c.fp8->cast_in_optimizer && moe_layers > 0)
        std::printf("train: the experts' FP8 weights cast by the optimizer's update for the next step\n");
      if (t.grad_accum > 1 && c.fp8->cache_weights)
        std::printf("train: FP8 weights cast once per step for its %lld micro-batches%s\n",
                    static_cast<long long>(t.grad_accum),
                    c.fp8->defer_expert_wgrad && moe_layers > 0 ? "; the experts' weight gradients at the step's end" : "");
    }
    if (gemm_autotune() && ctx.device.is_cuda())
      std::printf("train: GEMM autotuning on: each GEMM shape's cuBLASLt algorithm is timed at its second call "
                  "(stderr names the shapes whose choice changed)\n");
    std::printf("train: unigram entropy of the data %.3f nats/token (the loss of a model that ignores context)\n",
                unigram_entropy(tokens, c.model.vocab_size));
  }

  // training.cuda_graph: the step captured into a CUDA graph after a few uncaptured ones.
  std::unique_ptr<CudaGraphStep> graph_step;
  bool graph_news_told = false;
  {
    const CudaGraphChoice choice = choose_cuda_graph(c, ctx.device, dist_run.size() > 1 || zero1 != nullptr);
    if (choice.use) {
      graph_step = std::make_unique<CudaGraphStep>(
          ctx, model, optimizer,
          CudaGraphStep::Options{.batch_size = t.batch_size, .seq_len = t.seq_len, .grad_accum = t.grad_accum});
    } else if (!choice.reason.empty() && (t.cuda_graph == "on" || ctx.device.is_cuda()) && !quiet) {
      std::printf("train: CUDA graph off: %s; the step runs eagerly\n", choice.reason.c_str());
    }
  }

  auto validation_loss = [&] {
    val_loader->reset();
    double total = 0;
    for (int64_t i = 0; i < t.eval_batches; ++i) {
      const data::Batch b = val_loader->next();
      if (i % data_size == data_rank) total += model.forward_loss(ctx, b.inputs, b.targets);  // this rank's share
    }
    return dist_run.sum(total) / t.eval_batches;
  };

  TrainResult result;
  result.step = step;  // a resumed run that has nothing left to do completed its checkpoint's step
  const bool tty = isatty(fileno(stdout));
  const auto start = std::chrono::steady_clock::now();
  int64_t first_step = step;
  const RewindConfig& rw = t.rewind;
  const Retention retention{.keep_last = t.checkpoint_keep_last, .keep_every = t.checkpoint_keep_every};
  std::unique_ptr<AsyncCheckpointer> writer;
  if (t.async_checkpoint) writer = std::make_unique<AsyncCheckpointer>(t.out_dir, retention);
  // Pin the snapshot buffers while the first steps run: allocated inside the first save,
  // they stalled it for seconds. One set per snapshot alive at once: a rewind snapshot kept
  // beside the newest checkpoint's. Under tensor parallelism checkpoints gather the full
  // layout into ordinary host tensors, so only the (per-rank) rewind snapshots are pinned.
  const bool rewind_snapshots = rw.enabled && rw.snapshot_interval > 0;
  const bool pinned_checkpoints = t.checkpoint_interval > 0 && !model.tensor_parallel();
  const int pinned_sets = int{rewind_snapshots} + int{pinned_checkpoints};
  std::jthread pin_snapshot_buffers;
  if (ctx.device.is_cuda() && pinned_sets > 0)
    pin_snapshot_buffers = std::jthread(reserve_pinned_host, snapshot_buffer_bytes(model, &opt), pinned_sets);

  auto current_state = [&] {
    nlohmann::json skips = nlohmann::json::array();
    for (const auto& [s, n] : skip_data) skips.push_back({s, n});
    nlohmann::json extra = {{"skip_data", skips}};
    if (fp8_state) extra["fp8"] = tensors_to_json(fp8_state->state_dict());
    if (auto biases = model.expert_biases(); !biases.empty()) extra["expert_bias"] = tensors_to_json(biases);
    return CheckpointState{.step = step, .data_position = train_loader.state(), .config = config.to_json(),
                           .extra = std::move(extra)};
  };
  // The rewind point: a host snapshot and where metrics.jsonl ended when it was taken.
  std::shared_ptr<const CheckpointSnapshot> last_good;
  uintmax_t last_good_metrics_bytes = 0;
  auto keep_as_last_good = [&](std::shared_ptr<const CheckpointSnapshot> snapshot) {
    metrics.flush();
    last_good = std::move(snapshot);
    last_good_metrics_bytes = main_rank ? fs::file_size(metrics_path) : 0;
  };
  double stall_total_ms = 0;
  int64_t checkpoints = 0;
  auto save = [&] {
    const auto begin = std::chrono::steady_clock::now();
    double waited = 0;
    // The previous save is complete before this one copies the state: its pinned buffer is
    // free again (the copy reuses it instead of pinning new memory), and with several ranks
    // its end has cleaned up leftover .tmp directories everywhere before rank 0 empties the
    // one all ranks write this save into.
    if (writer) waited = writer->wait();
    dist_run.begin_checkpoint(t.out_dir, step);
    auto snapshot = std::make_shared<const CheckpointSnapshot>(
        snapshot_training_state(model, &opt, current_state(), dist_run.writers()));
    if (writer) {
      waited += writer->request(snapshot);
      result.checkpoint = (fs::path(t.out_dir) / "checkpoints" / checkpoint_dir_name(step)).string();
    } else {
      result.checkpoint = write_checkpoint(t.out_dir, *snapshot, retention);
    }
    const double stall_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - begin).count();
    stall_total_ms += stall_ms;
    result.max_checkpoint_stall_ms = std::max(result.max_checkpoint_stall_ms, stall_ms);
    checkpoints += 1;
    // A line of its own (read_metrics joins it to the step): the step's line is written
    // first, so a crash during the save never loses the loss of a checkpointed step.
    metrics << nlohmann::json{{"step", step}, {"checkpoint_stall_ms", stall_ms}, {"checkpoint_wait_ms", waited * 1e3},
                              {"checkpoint_async", writer != nullptr}}.dump()
            << "\n" << std::flush;
    if (rw.enabled && rw.snapshot_interval > 0) keep_as_last_good(std::move(snapshot));
  };
  if (rw.enabled && rw.snapshot_interval > 0)
    keep_as_last_good(std::make_shared<const CheckpointSnapshot>(
        snapshot_training_state(model, &opt, current_state(), {}, SnapshotLayout::Local)));

  AnomalyDetector detector(rw);
  std::deque<int64_t> rewinds;  // steps at which rewinds happened, within max_rewinds_window
  int64_t lr_scaled_from = 0, lr_scaled_until = 0;  // the steps that run at lr * rewind.lr_scale
  std::set<int64_t> faults_fired;  // (step, kind) of one-shot injected faults, kind in the low bit
  auto fault_once = [&](const std::vector<int64_t>& steps, int kind) {
    return std::find(steps.begin(), steps.end(), step) != steps.end() && faults_fired.insert(step * 2 + kind).second;
  };
  std::unique_ptr<std::ofstream> events;
  auto log_event = [&](const nlohmann::json& event) {
    if (!main_rank) return;
    if (!events) events = std::make_unique<std::ofstream>(fs::path(t.out_dir) / "events.jsonl", std::ios::app);
    *events << event.dump() << "\n" << std::flush;
  };

  auto rewind = [&](int64_t bad_step, const std::string& why) {
    rewinds.push_back(bad_step);
    while (!rewinds.empty() && rewinds.front() <= bad_step - rw.max_rewinds_window) rewinds.pop_front();
    const int64_t count = static_cast<int64_t>(rewinds.size());
    if (count > rw.max_rewinds) {
      log_event({{"event", "give_up"}, {"step", bad_step}, {"reason", why}, {"rewinds", count}});
      TESSERA_FAIL("train: giving up at step ", bad_step, ": ", why, ". That is ", count, " faults within ",
                   rw.max_rewinds_window, " steps (training.rewind.max_rewinds allows ", rw.max_rewinds,
                   " rewinds), so the fault persists after rolling back and skipping data: suspect the model or optimizer ",
                   "settings (lower optimizer.lr, raise optimizer.warmup_steps) or a long stretch of bad data ",
                   "(raise training.rewind.skip_steps)");
    }
    std::string from;
    int64_t back_to = 0;
    metrics.close();
    if (fp8_state) fp8_state->weight_cache()->drop_primed();  // casts of the weights being rolled back
    if (last_good) {
      restore_snapshot(*last_good, model, &opt);
      restore_trainer_tensors(last_good->extra);
      train_loader.load_state(last_good->data_position);
      back_to = last_good->step;
      if (main_rank) fs::resize_file(metrics_path, last_good_metrics_bytes);
      from = "memory";
    } else {
      if (writer) writer->wait();
      dist_run.wait_for_all();  // every rank's part of the last checkpoint is on disk
      const auto dir = dist_run.latest_checkpoint(t.out_dir, nullptr);
      TESSERA_CHECK(dir.has_value(), "train: step ", bad_step, ": ", why, "; no state to roll back to (no in-memory ",
                    "snapshot: training.rewind.snapshot_interval is 0, and no verified checkpoint yet)");
      const CheckpointState state = load_checkpoint(*dir, model, &opt, /*verify=*/main_rank);
      restore_trainer_tensors(state.extra);
      train_loader.load_state(state.data_position);
      back_to = state.step;
      if (main_rank) truncate_metrics_after(metrics_path, back_to);
      from = *dir;
    }
    if (main_rank) {
      metrics.open(metrics_path, std::ios::app);
      TESSERA_CHECK(metrics.good(), "train: cannot reopen ", metrics_path);
    }
    if (rw.skip_steps > 0) skip_data[bad_step] = std::max(skip_data[bad_step], rw.skip_steps);
    if (rw.lr_scale_steps > 0 && rw.lr_scale < 1) {
      lr_scaled_from = bad_step;
      lr_scaled_until = bad_step + rw.lr_scale_steps - 1;
    }
    detector.rewind_to(back_to);
    result.rewinds += 1;
    log_event({{"event", "rewind"}, {"step", bad_step}, {"reason", why}, {"back_to_step", back_to}, {"from", from},
               {"skipped_data_steps", rw.skip_steps}, {"lr_scale", rw.lr_scale}, {"lr_scale_until_step", lr_scaled_until},
               {"rewinds_in_window", count}});
    if (main_rank)
      std::fprintf(stderr, "%strain: step %lld: %s; rewound to step %lld (from %s), skipping %lld step(s) of data\n",
                 tty ? "\n" : "", static_cast<long long>(bad_step), why.c_str(), static_cast<long long>(back_to),
                 from.c_str(), static_cast<long long>(rw.skip_steps));
    step = back_to;
  };

  const FaultInjectionConfig& faults = t.fault_injection;
  while (step < t.steps) {
    step += 1;
    dist_run.inject_rank_fault(faults, step);
    if (auto skip = skip_data.find(step); skip != skip_data.end())
      detail::DistributedRun::skip_batches(train_loader, skip->second * t.grad_accum * data_size);
    // A global batch is grad_accum x data_size micro-batches in loader order; this rank
    // computes its grad_accum of them, data rank 0 the first.
    detail::DistributedRun::skip_batches(train_loader, data_rank * t.grad_accum);
    std::vector<data::Batch> batches;
    for (int64_t micro = 0; micro < t.grad_accum; ++micro) batches.push_back(train_loader.next());
    detail::DistributedRun::skip_batches(train_loader, (data_size - 1 - data_rank) * t.grad_accum);
    const bool poison_now =
        (faults.nan_grad_from_step > 0 && step >= faults.nan_grad_from_step) || fault_once(faults.nan_grad_at_step, 0);
    double lr = learning_rate(c.optimizer, step, t.steps);
    if (step >= lr_scaled_from && step <= lr_scaled_until) lr *= rw.lr_scale;
    double loss = 0, grad_norm = NAN;
    // The captured step has no place for the host to poison a gradient between backward and
    // the optimizer: such steps, and batches with ignored targets, run eagerly (same bits).
    if (graph_step && !poison_now && graph_step->accepts(batches)) {
      const CudaGraphStep::Result r = graph_step->step(batches, lr);
      loss = r.loss;
      grad_norm = r.grad_norm;
      if (!graph_news_told && !quiet && (r.replayed || !graph_step->failure().empty())) {
        graph_news_told = true;
        if (r.replayed)
          std::printf("%strain: step %lld captured into a CUDA graph\n", tty ? "\n" : "", static_cast<long long>(step));
        else
          std::printf("%strain: CUDA graph capture failed (%s); the step runs uncaptured\n", tty ? "\n" : "",
                      graph_step->failure().c_str());
      }
      if (!rw.enabled)
        TESSERA_CHECK(std::isfinite(loss), "train: the loss became ", loss, " at step ", step,
                      " (lower optimizer.lr or check the data)");
    } else {
      model.zero_grad();
      // fp8.cache_weights: each FP8 weight cast once for the step's micro-batches (end_step
      // drops the casts, after the optimizer).
      if (fp8_state) fp8_state->begin_step(static_cast<int64_t>(batches.size()));
      for (size_t micro = 0; micro < batches.size(); ++micro) {
        const data::Batch& b = batches[micro];
        // The last micro-batch's backward starts the gradient reduction bucket by bucket (not
        // when a NaN is to be injected between backward and the reduction).
        dist_run.arm_overlap(model, micro + 1 == batches.size() && !poison_now);
        // optimizer.overlap_backward: the last micro-batch's backward updates each bucket of
        // parameters as soon as their gradients are final (one device: checked at start-up).
        if (c.optimizer.overlap_backward && micro + 1 == batches.size() && !poison_now) {
          optimizer.begin_step(ctx, lr);
          model.set_grad_ready_hook([&optimizer](Context& x, nn::Parameter& p) { optimizer.mark_ready(x, p); });
        }
        loss += model.forward_backward(ctx, b.inputs, b.targets, 1.0f / t.grad_accum) / t.grad_accum;
        if (fp8_state) fp8_state->end_micro_batch(ctx);
      }
      // The global batch's loss, the same on every rank (a NaN on one rank is a NaN on all, so
      // they all skip the update below together).
      loss = dist_run.average(loss);
      if (!rw.enabled)
        TESSERA_CHECK(std::isfinite(loss), "train: the loss became ", loss, " at step ", step,
                      " (lower optimizer.lr or check the data)");
      if (poison_now && main_rank) poison_a_gradient(model);  // the reduction spreads rank 0's NaN to all
      // A step that is rolled back may update with NaNs: the restore undoes it.
      // The plain optimizer on several data ranks: average the gradients (finishing what the
      // backward started; also after a NaN loss, so that no reduction is left pending).
      dist_run.reduce_gradients(ctx);
      // Delayed scaling: next step's scales, before the optimizer, whose casts for that step
      // (fp8.cast_in_optimizer) use them (the captured step queues this itself).
      if (fp8_state) fp8_state->end_step(ctx);
      if (optimizer.armed()) {
        // The update ran with the backward; step() finishes it. A NaN loss has updated the
        // weights already: the rewind restores them (and without rewinds the run stops).
        model.set_grad_ready_hook({});
        grad_norm = optimizer.step(ctx, lr);
      } else if (std::isfinite(loss)) {
        if (tensor_parallel && !zero1) {
          grad_norm = model.clip_grad_norm(ctx, c.optimizer.grad_clip);  // the single-device norm
          opt.step(ctx, lr);
        } else {
          grad_norm = opt.step(ctx, lr);
        }
      }
    }
    // MoE: the step's tokens per expert of each layer (logged below), then the
    // auxiliary-loss-free balancing, which moves the biases by them and resets them.
    const std::vector<std::vector<int64_t>> expert_load = c.model.is_moe() ? model.expert_loads()
                                                                           : std::vector<std::vector<int64_t>>{};
    if (c.model.is_moe()) model.update_expert_biases(ctx);
    const double seen_loss = fault_once(faults.loss_spike_at_step, 1) ? loss * 10 + 10 : loss;
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    // Rewinds and stops are decided by all ranks together, so that none goes its own way.
    std::optional<std::string> why = rw.enabled ? detector.check(step, seen_loss, grad_norm) : std::nullopt;
    bool out_of_time = t.max_minutes > 0 && elapsed > t.max_minutes * 60;
    dist_run.agree(why, out_of_time);
    if (why) {
      rewind(step, *why);
      continue;
    }
    if (rw.enabled) detector.accept(step, seen_loss, grad_norm);
    const double rate = std::max<int64_t>(step - first_step, 1) * tokens_per_step / elapsed;
    nlohmann::json line = {{"step", step}, {"loss", loss}, {"lr", lr}, {"grad_norm", grad_norm}, {"tokens_per_s", rate}};
    if (c.model.is_moe()) {
      line["aux_loss"] = model.last_aux_loss();  // router losses, part of `loss`
      line["expert_load"] = expert_load;         // [layer][expert] tokens kept this step
    }
    if (val_loader && (step % t.eval_interval == 0 || step == t.steps)) {
      result.last_val_loss = validation_loss();
      line["val_loss"] = result.last_val_loss;
    }
    metrics << line.dump() << "\n" << std::flush;
    result.step = step;
    result.last_loss = loss;
    result.tokens_per_second = rate;

    if (!quiet && (step % t.log_interval == 0 || step == t.steps || line.contains("val_loss"))) {
      const double eta = elapsed / std::max<int64_t>(step - first_step, 1) * (t.steps - step);
      std::printf("%sstep %lld/%lld  loss %.4f  lr %.2e  |g| %.2f  %.0f tok/s  ETA %s%s", tty ? "\r" : "",
                  static_cast<long long>(step), static_cast<long long>(t.steps), loss, lr, grad_norm, rate,
                  format_duration(eta).c_str(), tty ? "   " : "\n");
      if (line.contains("val_loss")) std::printf("%s  val_loss %.4f\n", tty ? "\n" : "", result.last_val_loss);
      std::fflush(stdout);
    }
    const bool stop_now = options.stop_after > 0 && step - first_step >= options.stop_after;
    const bool checkpoint_now =
        (t.checkpoint_interval > 0 && step % t.checkpoint_interval == 0) || step == t.steps || out_of_time || stop_now;
    if (checkpoint_now) save();
    if (rw.enabled && rw.snapshot_interval > 0 && step % rw.snapshot_interval == 0 && !checkpoint_now)
      keep_as_last_good(std::make_shared<const CheckpointSnapshot>(
          snapshot_training_state(model, &opt, current_state(), {}, SnapshotLayout::Local)));
    if (out_of_time) {
      if (!quiet) std::printf("\ntrain: stopping after %.1f minutes (training.max_minutes)\n", elapsed / 60);
      break;
    }
    if (stop_now) break;
  }
  // The last asynchronous write is waited for before returning; reported apart from the
  // per-checkpoint stalls, which are what training itself lost.
  double final_wait_ms = 0;
  if (writer) final_wait_ms = writer->wait() * 1e3;
  dist_run.wait_for_all();  // on every rank, train() returns once the last checkpoint is complete
  result.checkpoints = checkpoints;
  result.mean_checkpoint_stall_ms = checkpoints > 0 ? stall_total_ms / checkpoints : 0;
  if (!quiet) {
    std::printf("\ntrain: step %lld, loss %.4f, %.0f tokens/s; checkpoint %s\n", static_cast<long long>(result.step),
                result.last_loss, result.tokens_per_second, result.checkpoint.c_str());
    if (checkpoints > 0)
      std::printf("train: %lld checkpoint(s) (%s), training stalled %.1f ms per checkpoint on average, %.1f ms at "
                  "most; %.1f ms waiting for the last write at the end\n",
                  static_cast<long long>(checkpoints), writer ? "asynchronous" : "synchronous",
                  result.mean_checkpoint_stall_ms, result.max_checkpoint_stall_ms, final_wait_ms);
    if (result.rewinds > 0)
      std::printf("train: %lld rewind(s), see %s/events.jsonl\n", static_cast<long long>(result.rewinds), t.out_dir.c_str());
  }
  // The sample: rank 0's; under tensor parallelism every rank of each tensor group takes part
  // (the logits are collective), the same draws everywhere. Not under sequence parallelism,
  // whose forward needs batch x seq rows divisible by the tensor size (a growing prompt is not).
  const bool sequence_parallel = tensor_parallel && c.training.parallel.sequence_parallel;
  if (!quiet && !t.sample_prompt.empty() && sequence_parallel)
    std::printf("\ntrain: no sample under sequence parallelism (sample from the checkpoint with tessera generate)\n");
  if (!options.quiet && !t.sample_prompt.empty() && (main_rank || tensor_parallel) && !sequence_parallel) {
    std::vector<int32_t> prompt = tokenizer->encode(t.sample_prompt);
    infer::SamplingOptions sampling{.temperature = 0.8f, .top_k = 0, .top_p = 0.95f, .seed = t.seed,
                                    .max_new_tokens = t.sample_tokens};
    const std::vector<int32_t> out = infer::generate(ctx, model, prompt, sampling);
    if (main_rank)
      std::printf("\n--- sample ---\n%s%s\n--------------\n", t.sample_prompt.c_str(), tokenizer->decode(out).c_str());
  }
  return result;
}

}  // namespace tessera::train
