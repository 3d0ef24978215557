// Times tessera's training step (forward, backward, AdamW) of a model on random tokens.
//
//   bench_train_step --model '{"architecture":"gpt2",...}' --batch 8 --seq 256 --steps 10
//
// Prints one JSON line: median/min step time over `steps` timed steps after `warmup`
// untimed ones, and tokens per second from the median. The side-by-side comparison with
// PyTorch is bench/cpu_train_step.py, which runs this program.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "tessera/core/philox.h"
#include "tessera/models/transformer_lm.h"
#include "tessera/train/optimizer.h"

using namespace tessera;

int main(int argc, char** argv) {
  CLI::App app{"Time tessera's training step on random tokens"};
  std::string model_json;
  int64_t batch = 8, seq = 256, steps = 10, warmup = 2;
  app.add_option("--model", model_json, "Model config as JSON (keys of the model section)")->required();
  app.add_option("--batch", batch)->capture_default_str();
  app.add_option("--seq", seq)->capture_default_str();
  app.add_option("--steps", steps)->capture_default_str();
  app.add_option("--warmup", warmup)->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    const models::ModelConfig config = models::ModelConfig::from_json(nlohmann::json::parse(model_json));
    Context ctx = Context::cpu();
    models::TransformerLM model(config);
    model.init(ctx, 1);
    train::Optimizer optimizer(model.parameters(), {});
    Tensor inputs = Tensor::empty({batch, seq}, DType::I32), targets = Tensor::empty({batch, seq}, DType::I32);
    for (int64_t i = 0; i < batch * seq; ++i) {
      inputs.data<int32_t>()[i] = static_cast<int32_t>(philox_word(7, 0, 2 * i) % config.vocab_size);
      targets.data<int32_t>()[i] = static_cast<int32_t>(philox_word(7, 0, 2 * i + 1) % config.vocab_size);
    }
    std::vector<double> times;
    double loss = 0;
    for (int64_t s = 0; s < warmup + steps; ++s) {
      const auto start = std::chrono::steady_clock::now();
      model.zero_grad();
      loss = model.forward_backward(ctx, inputs, targets);
      optimizer.step(ctx, 1e-4);
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (s >= warmup) times.push_back(seconds);
    }
    std::sort(times.begin(), times.end());
    const double median = times[times.size() / 2];
    nlohmann::json out = {{"impl", "tessera"},           {"params", model.num_parameters()},
                          {"median_step_s", median},      {"min_step_s", times.front()},
                          {"tokens_per_s", batch * seq / median}, {"loss", loss}};
    std::printf("%s\n", out.dump().c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_train_step: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
