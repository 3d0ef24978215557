// Times tessera's training step (forward, backward, AdamW) of a model on random tokens.
//
//   bench_train_step --model '{"architecture":"gpt2",...}' --batch 8 --seq 256 --steps 10
//   bench_train_step --model gpt2-124m --device cuda --precision bf16 --batch 16 --seq 1024
//
// Prints one JSON line: median/min step time over `steps` timed steps after `warmup`
// untimed ones, tokens per second and MFU from the median, and on CUDA the peak memory
// the caching allocator held. Every step ends with the loss and gradient norm on the host,
// so wall-clock time per step is the GPU time of the step. On CUDA everything runs on one
// non-blocking stream, as `tessera train` does.
//
// --cuda-graph: after the eager steps, the same model trains on with its step captured into
// a CUDA graph (train::CudaGraphStep: `warmup` uncaptured steps, the capture, then `steps`
// timed replays); the line then reports the captured step's times, with the eager median
// beside them (eager_median_step_s) and, when the capture was refused or failed, why. The side-by-side comparisons
// with PyTorch are bench/cpu_train_step.py and bench/gpu_train_step.py; where the GPU time
// of a step goes, kernel by kernel, is bench/profile_step.py (uses --profile).
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "bench_models.h"
#include "tessera/core/allocator.h"
#include "tessera/core/philox.h"
#include "tessera/core/stream.h"
#include "tessera/models/fp8_model.h"
#include "tessera/nn/mlp.h"
#include "tessera/ops/gemm.h"
#include "tessera/models/transformer_lm.h"
#include "tessera/train/optimizer.h"
#include "train/cuda_graph_step.h"

#if TESSERA_WITH_CUDA
#include <cuda_profiler_api.h>

#include "backend/cuda/cuda_backend.h"
#endif

using namespace tessera;
using tessera::bench::flops_per_token;
using tessera::bench::named_or_json;

int main(int argc, char** argv) {
  CLI::App app{"Time tessera's training step on random tokens"};
  std::string model_json;
  int64_t batch = 8, seq = 256, steps = 10, warmup = 2;
  std::string device = "cpu", precision = "fp32";
  app.add_option("--model", model_json, "gpt2-124m, llama3.2-1b, or a model config as JSON (keys of the model section)")
      ->required();
  int64_t vocab = 0;
  app.add_option("--vocab", vocab, "Override the model's vocabulary size (e.g. 50304, GPT-2's padded to 64)");
  app.add_option("--device", device, "cpu or cuda")->capture_default_str()->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--precision", precision, "fp32 or bf16 (BF16 compute, FP32 master weights)")
      ->capture_default_str()
      ->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_option("--batch", batch)->capture_default_str();
  app.add_option("--seq", seq)->capture_default_str();
  app.add_option("--steps", steps)->capture_default_str();
  app.add_option("--warmup", warmup)->capture_default_str();
  std::string fp8_recipe;
  app.add_option("--fp8", fp8_recipe,
                 "Run the blocks' linear layers in FP8 with this recipe: current, delayed, block or mxfp8 "
                 "(emulated) (needs --precision bf16)")
      ->check(CLI::IsMember({"current", "delayed", "block", "mxfp8"}));
  bool fp8_lm_head = false;
  app.add_flag("--fp8-lm-head", fp8_lm_head, "With --fp8: the LM head's GEMMs in FP8 too (fp8.lm_head)");
  bool fp8_keep_weight_transpose = false;
  app.add_flag("--fp8-keep-weight-transpose", fp8_keep_weight_transpose,
               "With --fp8: keep each FP8 layer's transposed weight codes from forward to backward (the old "
               "behaviour, fp8.keep_weight_transpose) instead of re-casting them in backward");
  bool fp8_cast_in_optimizer = false;
  app.add_flag("--fp8-cast-in-optimizer", fp8_cast_in_optimizer,
               "With --fp8 delayed: the MoE experts' weights cast to FP8 by the optimizer's update for the next "
               "step (fp8.cast_in_optimizer) instead of by the forward");
  bool unfused_fp8_activation = false;
  app.add_flag("--unfused-fp8-activation", unfused_fp8_activation,
               "With --fp8: the MLP writes its activation in BF16 and casts it in a separate pass (the path "
               "before the fused SwiGLU -> FP8 kernels, for comparison)");
  bool profile = false;
  app.add_flag("--profile", profile,
               "Mark the last step for a profiler started with profiling off (ncu --profile-from-start off; "
               "bench/profile_step.py does this)");
  bool cuda_graph = false;
  app.add_flag("--cuda-graph", cuda_graph,
               "Also time the step captured into a CUDA graph (after the eager steps; reports both medians)");
  bool keep_activation = false;
  app.add_flag("--keep-activation", keep_activation,
               "llama: keep the SwiGLU output from forward to backward instead of recomputing it "
               "(model.recompute_activation: false)");
  int64_t keep_activation_layers = 0;
  app.add_option("--keep-activation-layers", keep_activation_layers,
                 "llama: the last N layers keep the SwiGLU output, the others recompute it "
                 "(model.keep_activation_layers)")
      ->capture_default_str();
  double grad_clip = train::OptimizerConfig().grad_clip;
  app.add_option("--grad-clip", grad_clip,
                 "Global-norm gradient clipping of the AdamW step (0: none, as bench/gpu_train_step.py's PyTorch "
                 "step, which it passes unless --clip)")
      ->capture_default_str();
  bool eager_zero_grad = false;
  app.add_flag("--eager-zero-grad", eager_zero_grad,
               "Clear every gradient at zero_grad (a memset, then the first GEMMs add to zeros) instead of "
               "letting each weight's first gradient GEMM overwrite it (the default; for timing both)");
  bool eager_bias_grad = false;
  app.add_flag("--eager-bias-grad", eager_bias_grad,
               "Clear the Linear biases' gradients at zero_grad (the bias-gradient epilogue then sums into a "
               "scratch vector that is added) instead of letting it write them (the default; for timing both)");
  bool optimizer_overlap = false;
  app.add_flag("--optimizer-overlap", optimizer_overlap,
               "Update each bucket of parameters during the backward, as soon as their gradients are final "
               "(optimizer.overlap_backward; needs --grad-clip 0, no --fp8)");
  int stream_priority = 0;
  app.add_option("--stream-priority", stream_priority,
                 "CUDA priority of the step's stream (0: the default and lowest; -1 and below: higher, so its "
                 "kernels go ahead of the --optimizer-overlap update's)")
      ->capture_default_str();
  bool gemm_autotune_flag = false;
  app.add_flag("--gemm-autotune", gemm_autotune_flag,
               "Time cuBLASLt's candidate algorithms for each GEMM shape and keep the fastest "
               "(training.gemm_autotune; the warm-up steps absorb the timing)");
  CLI11_PARSE(app, argc, argv);
  try {
    if (gemm_autotune_flag) set_gemm_autotune(true);
    models::ModelConfig config = named_or_json(model_json);
    if (vocab > 0) config.vocab_size = vocab;
    if (keep_activation) config.recompute_activation = false;
    config.keep_activation_layers = keep_activation_layers;
    config.validate();
    if (device == "cuda" && !cuda_available()) throw std::runtime_error("--device cuda: no GPU present");
    Context ctx = device == "cuda" ? Context::cuda() : Context::cpu();
    const Stream stream = Stream::create(ctx.device, stream_priority);
    ctx.stream = stream.get();
    const StreamGuard stream_guard(ctx);
    models::TransformerLM model(config, precision == "bf16" ? DType::BF16 : DType::F32);
    model.to(ctx.device);
    model.init(ctx, 1);
    train::OptimizerConfig optimizer_config;
    optimizer_config.grad_clip = grad_clip;
    optimizer_config.overlap_backward = optimizer_overlap;
    if (optimizer_overlap && (grad_clip != 0 || !fp8_recipe.empty()))
      throw std::runtime_error("--optimizer-overlap needs --grad-clip 0 and no --fp8");
    train::Optimizer optimizer(model.parameters(), optimizer_config);
    if (optimizer_overlap)
      model.set_grad_ready_hook([&optimizer](Context& c, nn::Parameter& p) { optimizer.mark_ready(c, p); });
    std::shared_ptr<nn::Fp8Scaling> fp8_state;
    if (!fp8_recipe.empty()) {
      if (precision != "bf16") throw std::runtime_error("--fp8 needs --precision bf16");
    } else if (fp8_lm_head || fp8_keep_weight_transpose || fp8_cast_in_optimizer) {
      throw std::runtime_error(std::string(fp8_lm_head                 ? "--fp8-lm-head"
                                           : fp8_keep_weight_transpose ? "--fp8-keep-weight-transpose"
                                                                       : "--fp8-cast-in-optimizer") +
                               " needs --fp8");
    }
    nlohmann::json fp8_json = {
        {"recipe", fp8_recipe}, {"lm_head", fp8_lm_head}, {"keep_weight_transpose", fp8_keep_weight_transpose}};
    if (fp8_cast_in_optimizer) fp8_json["cast_in_optimizer"] = true;  // Recipe refuses it without delayed
    nn::MLP::set_fused_fp8_activation(!unfused_fp8_activation);
    if (!fp8_recipe.empty()) {
      fp8_state = models::enable_fp8(ctx, model, fp8::Recipe::from_json(fp8_json));
      if (fp8_cast_in_optimizer) train::use_cast_in_optimizer(model, optimizer);
    }
    Tensor inputs = Tensor::empty({batch, seq}, DType::I32), targets = Tensor::empty({batch, seq}, DType::I32);
    for (int64_t i = 0; i < batch * seq; ++i) {
      inputs.data<int32_t>()[i] = static_cast<int32_t>(philox_word(7, 0, 2 * i) % config.vocab_size);
      targets.data<int32_t>()[i] = static_cast<int32_t>(philox_word(7, 0, 2 * i + 1) % config.vocab_size);
    }
    std::vector<double> times;
    double loss = 0;
    for (int64_t s = 0; s < warmup + steps; ++s) {
      const bool profiled = profile && s == warmup + steps - 1;
#if TESSERA_WITH_CUDA
      if (profiled) cudaProfilerStart();
#endif
      const auto start = std::chrono::steady_clock::now();
      model.zero_grad();
      if (eager_zero_grad) model.materialize_grads(ctx);  // what zero_grad did before it was lazy
      if (eager_bias_grad)
        for (nn::Parameter* p : model.parameters())
          if (p->name.size() > 5 && p->name.compare(p->name.size() - 5, 5, ".bias") == 0) p->materialize_grad(ctx);
      if (optimizer_overlap) optimizer.begin_step(ctx, 1e-4);
      if (fp8_state) fp8_state->begin_step(1);
      loss = model.forward_backward(ctx, inputs, targets);
      if (fp8_state) fp8_state->end_micro_batch(ctx);
      // As the trainer: the next step's scales before the optimizer, whose casts use them.
      if (fp8_state) fp8_state->end_step(ctx);
      optimizer.step(ctx, 1e-4);
      synchronize(ctx);
#if TESSERA_WITH_CUDA
      if (profiled) cudaProfilerStop();
#endif
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (s >= warmup) times.push_back(seconds);
    }
    std::sort(times.begin(), times.end());
    double median = times[times.size() / 2];
    nlohmann::json graph_info;
    if (cuda_graph) {
      train::RunConfig run;
      run.model = config;
      if (fp8_state) run.fp8 = fp8::Recipe::from_json(fp8_json);
      const double eager_median = median;
      graph_info = {{"cuda_graph", false}, {"eager_median_step_s", eager_median}};
      if (auto why = train::cuda_graph_blocker(run, ctx.device)) {
        graph_info["cuda_graph_refused"] = *why;
      } else {
        train::CudaGraphStep graph(ctx, model, optimizer,
                                   {.batch_size = batch, .seq_len = seq, .grad_accum = 1,
                                    .warmup_steps = std::max<int64_t>(warmup, 1)});
        const std::vector<data::Batch> batches = {{inputs, targets}};
        std::vector<double> graph_times;
        for (int64_t s = 0; s < std::max<int64_t>(warmup, 1) + steps; ++s) {
          const auto start = std::chrono::steady_clock::now();
          loss = graph.step(batches, 1e-4).loss;
          const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
          if (s >= std::max<int64_t>(warmup, 1)) graph_times.push_back(seconds);
        }
        std::sort(graph_times.begin(), graph_times.end());
        times = graph_times;
        median = times[times.size() / 2];
        graph_info["cuda_graph"] = graph.captured();
        if (!graph.failure().empty()) graph_info["cuda_graph_failure"] = graph.failure();
        graph_info["speedup"] = eager_median / median;
      }
    }
    const double tokens_per_s = batch * seq / median;
    nlohmann::json out = {{"impl", "tessera"},
                          {"device", device},
                          {"precision", fp8_recipe.empty() ? precision : "fp8-" + fp8_recipe + (fp8_lm_head ? "+head" : "") +
                                                                 (fp8_keep_weight_transpose ? "+keep-wt" : "") +
                                                                 (unfused_fp8_activation ? "+unfused-act" : "")},
                          {"params", model.num_parameters()},
                          {"median_step_s", median},
                          {"min_step_s", times.front()},
                          {"tokens_per_s", tokens_per_s},
                          {"mfu", tokens_per_s * flops_per_token(config, model.num_parameters(), seq) / 989e12},
                          {"loss", loss}};
    if (cuda_graph) out.update(graph_info);
    if (eager_zero_grad) out["eager_zero_grad"] = true;
    if (eager_bias_grad) out["eager_bias_grad"] = true;
    if (gemm_autotune()) out["gemm_autotune"] = true;
    out["grad_clip"] = grad_clip;
    if (optimizer_overlap) out["optimizer_overlap"] = true;
    if (stream_priority != 0) out["stream_priority"] = stream_priority;
    if (const char* rows = std::getenv("TESSERA_HEAD_CHUNK_ROWS")) out["head_chunk_rows"] = rows;
#if TESSERA_WITH_CUDA
    if (ctx.device.is_cuda()) {
      const cuda::AllocatorStats stats = cuda::allocator_stats(0);
      out["peak_memory_gib"] = double(stats.peak_bytes_reserved) / (1ull << 30);  // in use + cached
      out["peak_in_use_gib"] = double(stats.peak_bytes_in_use) / (1ull << 30);
    }
#endif
    std::printf("%s\n", out.dump().c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_train_step: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
