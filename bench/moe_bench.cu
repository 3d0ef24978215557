// The expert MLP of a Mixtral-shaped MoE layer alone, forward + backward, on the GPU:
// tessera's GroupedMLP (GroupedLinear [gate|up] -> SwiGLU scaled by the routing probability
// -> GroupedLinear down) at the issue's shape: 8192 tokens routed top-2 over 8 experts
// (16384 expert rows), hidden 4096, ffn 14336, BF16. bench/moe_torch.py times PyTorch's
// per-expert loop and torch._grouped_mm on the same shape and splits.
//
// Splits: "balanced" gives every expert 2048 rows (what a uniform router gives on average);
// "skewed" gives 4096, 3072, 2048, 2048, 1536, 1536, 1024, 1024 (sum 16384), the load of an
// unbalanced early router. Timed: forward, backward_input and backward_weight of every
// GroupedLinear plus the SwiGLU kernels: CUDA events, 3 warm-up calls, median of `runs`.
// FLOPs = 3 GEMMs forward (2 M H F for gate+up counted as 2, 1 for down) x 3 for
// forward + backward = 18 * M * H * F; TFLOP/s over that.
//
// Each case runs twice: the experts' GEMMs all on one stream, then spread over GroupedLinear's
// four side streams (set_grouped_gemm_streams), which gives the same bits.
//
// Correctness in the same run: the forward output against a per-expert loop of plain
// tessera GEMMs and the SwiGLU op on the same data (relative Frobenius error).
//
// FP8 rows ("... fp8"): the same layer with use_fp8 (current scaling, hybrid format: E4M3
// x, W and h, E5M2 gradients; the SwiGLU writes h straight to FP8). FP8 is not exact: their
// error is the larger of the forward output's and dx's relative error against the BF16
// layer on the same data ("ok" below 0.1). "keepWt": with MoEFp8Options::keep_weight_transpose
// (each expert's W^T codes kept from forward to backward instead of re-cast there).
//
// "delayed" rows: FP8 with delayed scaling (Transformer Engine's default recipe; MoEFp8Options::
// delayed): every cast takes its scale from the state and records its amax in the same pass,
// so the amax passes go and the SwiGLU backward cast is one pass. The timed call includes the
// state's update (one launch a step); the scales come from the warm-up calls' amaxes.
//
// "step" rows: each timed call starts as a training step's first micro-batch does after
// zero_grad, with both weights' gradients lazily zeroed (nn::Parameter::grad_unwritten), so
// the weight-gradient GEMMs overwrite (beta 0) instead of reading and adding to dW. The other
// rows accumulate into dW (beta 1), as later micro-batches do.
//
// "4-micro step" rows: each timed call is a whole training step of four micro-batches (the
// first overwriting dW, the others adding; the delayed state updated once at the end), and
// the figure is the time per micro-batch. "cached": fp8.cache_weights (fp8/weight_cache.h,
// Transformer Engine's is_first_microbatch), every expert weight cast once in the step's
// first micro-batch and its codes reused by the other three; "uncached" casts in each.
// bench/moe_torch.py's "4-micro step" forms time the same step in PyTorch.
//
// "deferred": also fp8.defer_expert_wgrad, the experts' weight gradients computed once per step
// over the four micro-batches' rows side by side (one GEMM per expert, K = 4 x the rows; no
// FP32 gradient read back), instead of a GEMM per micro-batch that adds into it.
//
// "castopt" rows: fp8.cast_in_optimizer (Transformer Engine's FP8 primary weights): the expert
// weights' codes come from the optimizer's update, so the timed forward + backward casts no
// weight. The codes are made once by that update (lr 0, untimed) and primed again before each
// timed call. After the row, one line times the optimizer's part for the two weights: the
// plain AdamW (with the BF16 copy), the fused AdamW + cast that replaces it, and the
// separate cast (both orientations, every expert) that the forward makes without it.
//
// "autotuned" rows: the same with GEMM autotuning on for that row (training.gemm_autotune: the
// widened candidate search of docs/ops/gemm.md), its shapes tuned in the row's warm-up calls.
// They run last: a tuned shape keeps its choice for the rest of the process.
//
// Usage: bench_moe [runs] [filter]   (needs a GPU; filter: only rows whose name contains it)
//        bench_moe profile    one balanced BF16, one FP8 and one delayed-FP8 forward+backward between
//                             cudaProfilerStart/Stop, for `ncu --profile-from-start off`
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

#include <memory>

#include "gpu_timing.h"
#include "tessera/core/random.h"
#include "tessera/fp8/device_scaling.h"
#include "tessera/fp8/weight_cache.h"
#include "tessera/nn/moe.h"
#include "tessera/ops/elementwise.h"
#include "tessera/ops/gemm.h"
#include "tessera/ops/moe.h"
#include "tessera/ops/optimizer.h"

using namespace tessera;

namespace {

constexpr int64_t kTokens = 8192, kTopK = 2, kExperts = 8, kHidden = 4096, kFfn = 14336;

double relative_error(const Tensor& got, const Tensor& want) {
  const std::vector<double> g = got.to(Device::cpu()).to_doubles(), w = want.to(Device::cpu()).to_doubles();
  double d = 0, r = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    d += (g[i] - w[i]) * (g[i] - w[i]);
    r += w[i] * w[i];
  }
  return std::sqrt(d / std::max(r, 1e-30));
}

// The same forward as GroupedMLP, one expert at a time with the plain gemm op.
Tensor loop_forward(Context& ctx, const nn::GroupedMLP& mlp, const Tensor& x, const Tensor& scale,
                    const std::vector<int64_t>& splits) {
  const Tensor fc = mlp.fc.weight3d(), proj = mlp.proj.weight3d();
  Tensor h_pre = Tensor::empty({x.size(0), 2 * kFfn}, x.dtype(), ctx.device);
  Tensor y = Tensor::empty({x.size(0), kHidden}, x.dtype(), ctx.device);
  int64_t row = 0;
  for (size_t e = 0; e < splits.size(); ++e) {
    Tensor he = h_pre.slice(0, row, row + splits[e]);
    gemm(ctx, x.slice(0, row, row + splits[e]), fc.select(0, static_cast<int64_t>(e)), he, {.transpose_b = true});
    row += splits[e];
  }
  Tensor h = Tensor::empty({x.size(0), kFfn}, x.dtype(), ctx.device);
  moe_swiglu_scaled_forward(ctx, h_pre, scale, h);
  row = 0;
  for (size_t e = 0; e < splits.size(); ++e) {
    Tensor ye = y.slice(0, row, row + splits[e]);
    gemm(ctx, h.slice(0, row, row + splits[e]), proj.select(0, static_cast<int64_t>(e)), ye, {.transpose_b = true});
    row += splits[e];
  }
  return y;
}

// One optimizer step's tensors for a GroupedLinear's weight (zero moments, its gradient),
// learning rate 0: the update leaves the weights as they are, so every row sees the same ones.
AdamWTensorStep optimizer_step_of(Context& ctx, nn::Parameter& p) {
  p.materialize_grad(ctx);
  cast(ctx, p.value, p.master);  // the FP32 master of the filled BF16 weights (the update rewrites value from it)
  AdamWTensorStep s;
  s.param = p.weights();
  s.grad = p.grad;
  s.exp_avg = Tensor::zeros(p.weights().shape(), DType::F32, ctx.device);
  s.exp_avg_sq = Tensor::zeros(p.weights().shape(), DType::F32, ctx.device);
  s.value = p.value;
  s.options.lr = 0.0f;
  return s;
}

// fp8.cast_in_optimizer: the two weights' updates, which prime the weight cache.
void prime_from_optimizer(Context& ctx, nn::GroupedMLP& mlp) {
  for (nn::GroupedLinear* l : {&mlp.fc, &mlp.proj}) {
    AdamWTensorStep s = optimizer_step_of(ctx, l->weight);
    l->optimizer_update(ctx, s);
  }
}

// The optimizer's part of a castopt row (see the note at the top).
void time_optimizer(Context& ctx, nn::GroupedMLP& mlp, int runs) {
  AdamWTensorStep fc = optimizer_step_of(ctx, mlp.fc.weight), proj = optimizer_step_of(ctx, mlp.proj.weight);
  const double plain_ms = median_ms([&] { adamw_step_one(ctx, fc); adamw_step_one(ctx, proj); }, runs, 2);
  const double fused_ms = median_ms([&] { mlp.fc.optimizer_update(ctx, fc); mlp.proj.optimizer_update(ctx, proj); }, runs, 2);
  // The forward's cast of every expert, both orientations, under the same delayed state.
  MoEFp8Options o = *mlp.fc.fp8_options();
  o.keep_weight_transpose = true;
  MoEFp8Options op = *mlp.proj.fp8_options();
  op.keep_weight_transpose = true;
  const std::vector<int64_t> all(kExperts, 1);
  const Tensor w_fc = mlp.fc.weight.value.reshape({kExperts, 2 * kFfn, kHidden});
  const Tensor w_proj = mlp.proj.weight.value.reshape({kExperts, kHidden, kFfn});
  const double cast_ms = median_ms(
      [&] {
        (void)moe_fp8_quantize_weights(ctx, w_fc, all, o);
        (void)moe_fp8_quantize_weights(ctx, w_proj, all, op);
      },
      runs, 2);
  std::printf("|   optimizer, fc + proj weights | AdamW %.2f ms + the forward's cast %.2f ms = %.2f | fused AdamW + cast "
              "%.2f ms | saved %.2f ms |\n",
              plain_ms, cast_ms, plain_ms + cast_ms, fused_ms, plain_ms + cast_ms - fused_ms);
}

// What a row runs: the layer's precision and FP8 options, and how each timed call starts.
struct Case {
  bool fp8 = false, keep_weight_transpose = false, delayed = false;
  bool step_start = false;   // the call starts a step: lazily zeroed gradients
  int micro_batches = 1;     // > 1: the call is a whole step of this many micro-batches
  bool cache_weights = false;  // with micro_batches > 1: fp8.cache_weights
  bool defer_weight_grad = false;  // with cache_weights: fp8.defer_expert_wgrad
  bool profile = false;
  bool autotune = false;  // tessera::set_gemm_autotune(true) for this row (ops/gemm.h)
  bool cast_in_optimizer = false;  // with delayed: fp8.cast_in_optimizer (see "castopt" above)
};

const char* g_filter = "";  // run only the rows whose name contains it

void run_case(const char* name, const std::vector<int64_t>& splits, int runs, int streams, const Case& c = {}) {
  if (std::strstr(name, g_filter) == nullptr) return;
  const bool fp8 = c.fp8, profile = c.profile, step_start = c.step_start, delayed = c.delayed;
  set_grouped_gemm_streams(streams);
  // GEMM autotuning for this row only: its shapes are tuned in the warm-up calls.
  const bool autotune_before = gemm_autotune();
  set_gemm_autotune(c.autotune || autotune_before);
  struct RestoreAutotune {
    bool on;
    ~RestoreAutotune() { set_gemm_autotune(on); }
  } restore_autotune{autotune_before};
  Context ctx = Context::cuda(0);
  const int64_t rows = kTokens * kTopK;
  nn::GroupedMLP mlp("experts", kExperts, kHidden, kFfn, DType::BF16);
  mlp.fc.weight.to(ctx.device);
  mlp.proj.weight.to(ctx.device);
  fill_uniform(ctx, mlp.fc.weight.value, -0.02, 0.02, 1);
  fill_uniform(ctx, mlp.proj.weight.value, -0.01, 0.01, 2);
  Tensor x = Tensor::empty({rows, kHidden}, DType::BF16, ctx.device);
  Tensor scale = Tensor::empty({rows}, DType::BF16, ctx.device);
  Tensor dy = Tensor::empty({rows, kHidden}, DType::BF16, ctx.device);
  fill_uniform(ctx, x, -1, 1, 3);
  fill_uniform(ctx, scale, 0.1, 0.9, 4);
  fill_uniform(ctx, dy, -1, 1, 5);

  nn::GroupedMLP::Saved saved;
  const Tensor y = mlp.forward(ctx, x, scale, splits, saved);
  double err = relative_error(y, loop_forward(ctx, mlp, x, scale, splits));
  std::shared_ptr<fp8::DeviceDelayedScaling> state;
  std::shared_ptr<fp8::WeightCache> cache;
  std::vector<std::pair<const nn::Parameter*, MoEFp8Weights>> primed_casts;  // castopt rows
  if (fp8) {
    const Tensor dx16 = mlp.backward_input(ctx, dy, saved);
    MoEFp8Options options;
    options.keep_weight_transpose = c.keep_weight_transpose;
    if (c.cache_weights || c.cast_in_optimizer) options.weight_cache = std::make_shared<fp8::WeightCache>();
    options.defer_weight_grad = c.defer_weight_grad;
    cache = options.weight_cache;
    if (delayed) {
      state = std::make_shared<fp8::DeviceDelayedScaling>(ctx, fp8::DelayedScalingConfig{}, mlp.delayed_roles());
      options.delayed = state;
    }
    mlp.use_fp8(options);
    if (state) {  // one step to fill the history, so that the checked step has real scales
      nn::GroupedMLP::Saved warm;
      (void)mlp.forward(ctx, x, scale, splits, warm);
      (void)mlp.backward_input(ctx, dy, warm);
      state->update(ctx);
    }
    if (c.cast_in_optimizer) {
      if (!state || !cache) throw std::runtime_error("castopt rows need delayed scaling and a weight cache");
      prime_from_optimizer(ctx, mlp);
    }
    nn::GroupedMLP::Saved saved8;
    if (c.cast_in_optimizer) cache->open(/*keep_new=*/false);
    const Tensor y8 = mlp.forward(ctx, x, scale, splits, saved8);
    if (!saved8.fp8) throw std::runtime_error("the FP8 path did not run");
    const Tensor dx8 = mlp.backward_input(ctx, dy, saved8);
    err = std::max(relative_error(y8, y), relative_error(dx8, dx16));
    if (c.cast_in_optimizer) {
      if (cache->hits() != 2) throw std::runtime_error("the optimizer's casts did not serve the forward");
      // The codes the timed calls start from (handles; the weights do not change).
      nn::GroupedLinear* layers[2] = {&mlp.fc, &mlp.proj};
      for (nn::GroupedLinear* l : layers)
        primed_casts.emplace_back(&l->weight, cache->get_or_make<MoEFp8Weights>(&l->weight, []() -> MoEFp8Weights {
          throw std::runtime_error("no primed cast");
        }));
      cache->close();
    }
  }

  if (profile) {
    // Warm (plans, FP8 scales), then one step under the profiler: its kernels, one by one.
    for (int i = 0; i < 2; ++i) {
      (void)mlp.forward(ctx, x, scale, splits, saved);
      (void)mlp.backward_input(ctx, dy, saved);
      mlp.backward_weight(ctx, dy, saved);
      if (state) state->update(ctx);
    }
    CHECK_CUDA(cudaDeviceSynchronize());
    CHECK_CUDA(cudaProfilerStart());
    (void)mlp.forward(ctx, x, scale, splits, saved);
    (void)mlp.backward_input(ctx, dy, saved);
    mlp.backward_weight(ctx, dy, saved);
    CHECK_CUDA(cudaDeviceSynchronize());
    CHECK_CUDA(cudaProfilerStop());
    std::printf("profiled %s (error %.1e)\n", name, err);
    return;
  }
  const double fwd_ms = median_ms([&] { (void)mlp.forward(ctx, x, scale, splits, saved); }, runs, 3);
  const int micro = std::max(1, c.micro_batches);
  const double all_ms = median_ms(
                            [&] {
                              if (step_start || micro > 1)  // as zero_grad
                                mlp.fc.weight.grad_unwritten = mlp.proj.weight.grad_unwritten = true;
                              if (!primed_casts.empty()) {
                                for (const auto& [key, w] : primed_casts) cache->prime(key, w);
                                cache->open(/*keep_new=*/false);
                              } else if (cache) {
                                cache->open();
                              }
                              for (int m = 0; m < micro; ++m) {
                                (void)mlp.forward(ctx, x, scale, splits, saved);
                                (void)mlp.backward_input(ctx, dy, saved);
                                mlp.backward_weight(ctx, dy, saved);
                                if (state && m + 1 < micro) state->record(ctx);
                              }
                              if (cache) {
                                cache->flush(ctx);  // deferred weight gradients
                                cache->close();
                              }
                              if (state) state->update(ctx);  // the step's scale update
                            },
                            runs, 3) /
                        micro;
  const double flop_fwd = 6.0 * rows * kHidden * kFfn;
  std::printf("| %-8s | %7d | %8.2f | %6.1f | %8.2f | %6.1f | %.1e %s |\n", name, streams, fwd_ms,
              flop_fwd / fwd_ms * 1e-9, all_ms, 3 * flop_fwd / all_ms * 1e-9, err, err < (fp8 ? 0.1 : 2e-2) ? "ok" : "WRONG");
  if (c.cast_in_optimizer) time_optimizer(ctx, mlp, runs);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc > 1 && std::string(argv[1]) == "profile") {
      const std::vector<int64_t> balanced(kExperts, kTokens * kTopK / kExperts);
      Case bf16, fp8_current, fp8_delayed;
      bf16.profile = fp8_current.profile = fp8_delayed.profile = true;
      fp8_current.fp8 = fp8_delayed.fp8 = true;
      fp8_delayed.keep_weight_transpose = fp8_delayed.delayed = true;
      run_case("balanced", balanced, 0, 1, bf16);
      run_case("bal fp8", balanced, 0, 1, fp8_current);
      run_case("bal fp8 delayed", balanced, 0, 1, fp8_delayed);
      return 0;
    }
    const int runs = argc > 1 ? std::max(5, std::atoi(argv[1])) : 20;
    if (argc > 2) g_filter = argv[2];
    cudaDeviceProp prop{};
    CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
    std::printf("tessera GroupedMLP on %s: %lld tokens top-%lld over %lld experts, hidden %lld, ffn %lld, BF16,\n"
                "median of %d runs after 3 warm-ups; error: forward against a per-expert GEMM loop (fp8 rows:\n"
                "max of forward and dx against the BF16 layer)\n\n",
                prop.name, static_cast<long long>(kTokens), static_cast<long long>(kTopK),
                static_cast<long long>(kExperts), static_cast<long long>(kHidden), static_cast<long long>(kFfn), runs);
    // Each case with the experts' GEMMs on one stream and spread over four (GroupedLinear's
    // side streams): the same bits, side by side.
    std::printf("| splits   | streams |  fwd ms | TFLOP/s | fwd+bwd ms | TFLOP/s | error |\n"
                "|---|---|---|---|---|---|---|\n");
    for (int streams : {1, 4}) {
      run_case("balanced", std::vector<int64_t>(kExperts, kTokens * kTopK / kExperts), runs, streams);
      run_case("skewed", {4096, 3072, 2048, 2048, 1536, 1536, 1024, 1024}, runs, streams);
    }
    // FP8 on one stream (four measured no faster), and with each expert's W^T codes kept from
    // the forward (fp8.keep_weight_transpose: no re-cast in the backward, 1.3 GB more a layer).
    const std::vector<int64_t> balanced(kExperts, kTokens * kTopK / kExperts);
    const std::vector<int64_t> skewed = {4096, 3072, 2048, 2048, 1536, 1536, 1024, 1024};
    Case fp8;
    fp8.fp8 = true;
    Case keep = fp8;
    keep.keep_weight_transpose = true;
    run_case("bal fp8", balanced, runs, 1, fp8);
    run_case("skew fp8", skewed, runs, 1, fp8);
    run_case("bal fp8 keepWt", balanced, runs, 1, keep);
    // A step's first micro-batch: dW overwritten (beta 0) after a lazy zero_grad.
    Case step, fp8_step = fp8;
    step.step_start = fp8_step.step_start = true;
    run_case("bal step", balanced, runs, 1, step);
    run_case("bal fp8 step", balanced, runs, 1, fp8_step);
    // Delayed scaling: plain, with W^T kept, skewed, and as a step's first micro-batch.
    Case delayed = fp8;
    delayed.delayed = true;
    Case delayed_keep = delayed;
    delayed_keep.keep_weight_transpose = true;
    Case delayed_keep_step = delayed_keep;
    delayed_keep_step.step_start = true;
    run_case("bal fp8 delayed", balanced, runs, 1, delayed);
    run_case("bal fp8 delayed keepWt", balanced, runs, 1, delayed_keep);
    run_case("skew fp8 delayed", skewed, runs, 1, delayed);
    run_case("bal fp8 delayed keepWt step", balanced, runs, 1, delayed_keep_step);
    // ... with the weights' casts made by the optimizer (fp8.cast_in_optimizer).
    Case castopt_step = delayed_keep_step;
    castopt_step.cast_in_optimizer = true;
    run_case("bal fp8 delayed castopt step", balanced, runs, 1, castopt_step);
    // Whole steps of four micro-batches, per micro-batch: BF16, and delayed FP8 with the
    // expert weights cast in every micro-batch (W^T kept) or once a step (cache_weights).
    Case bf16_4;
    bf16_4.micro_batches = 4;
    Case uncached_4 = delayed_keep;
    uncached_4.micro_batches = 4;
    Case cached_4 = delayed;
    cached_4.micro_batches = 4;
    cached_4.cache_weights = true;
    run_case("bal 4-micro step", balanced, runs, 1, bf16_4);
    run_case("bal fp8 delayed keepWt 4-micro step", balanced, runs, 1, uncached_4);
    run_case("bal fp8 delayed cached 4-micro step", balanced, runs, 1, cached_4);
    // ... and the weight gradients deferred to the step's end (fp8.defer_expert_wgrad).
    Case deferred_4 = cached_4;
    deferred_4.defer_weight_grad = true;
    run_case("bal fp8 delayed cached deferred 4-micro step", balanced, runs, 1, deferred_4);
    // Last, because a tuned plan keeps its choice for the rest of the process: the BF16 layer
    // and the delayed FP8 step with GEMM autotuning (training.gemm_autotune), side by side
    // with the untuned rows above.
    Case tuned;
    tuned.autotune = true;
    run_case("balanced autotuned", balanced, runs, 4, tuned);
    Case step_tuned = step;
    step_tuned.autotune = true;
    run_case("bal step autotuned", balanced, runs, 1, step_tuned);
    Case delayed_keep_step_tuned = delayed_keep_step;
    delayed_keep_step_tuned.autotune = true;
    run_case("bal fp8 delayed keepWt step autotuned", balanced, runs, 1, delayed_keep_step_tuned);
    Case castopt_step_tuned = castopt_step;
    castopt_step_tuned.autotune = true;
    run_case("bal fp8 delayed castopt step autotuned", balanced, runs, 1, castopt_step_tuned);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_moe: %s\n", e.what());
    return 1;
  }
}
