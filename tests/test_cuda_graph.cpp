// The CPU side of the captured training step (train/cuda_graph_step.h): the
// training.cuda_graph key, the reasons a run is not captured, the per-thread current
// stream, and the device-resident step pieces (forward_backward_into, the optimizer's
// step scalars, accumulate_weighted_loss), which must give the eager path's bits. The
// capture itself is tests/test_gpu_cuda_graph.cpp.
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <thread>

#include "tessera/core/stream.h"
#include "tessera/io/atomic_file.h"
#include "tessera/models/transformer_lm.h"
#include "tessera/ops/loss.h"
#include "tessera/ops/optimizer.h"
#include "tessera/train/trainer.h"
#include "testing.h"
#include "train/cuda_graph_step.h"

using namespace tessera;
using namespace tessera::testing;
using models::ModelConfig;
using models::TransformerLM;
namespace fs = std::filesystem;

namespace {

ModelConfig small(const char* arch) {
  ModelConfig c;
  c.architecture = arch;
  c.vocab_size = 97;
  c.hidden_size = 32;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = c.is_gpt2() ? 4 : 2;
  c.intermediate_size = 48;
  c.max_seq_len = 16;
  c.rope_theta = 10000.0f;
  c.tie_embeddings = c.is_gpt2();
  return c;
}

std::vector<double> bits_of(const Tensor& t) { return t.to_doubles(); }

nlohmann::json tiny_run(const std::string& dir, const std::string& text) {
  nlohmann::json j = nlohmann::json::parse(R"({
    "model": {"architecture": "llama", "vocab_size": 257, "hidden_size": 32, "num_layers": 2, "num_heads": 4,
              "num_kv_heads": 2, "intermediate_size": 48, "max_seq_len": 32, "rope_theta": 10000},
    "data": {"tokenizer": "byte", "validation_fraction": 0.1},
    "optimizer": {"lr": 0.01, "warmup_steps": 2},
    "training": {"steps": 6, "batch_size": 4, "seq_len": 16, "eval_interval": 0, "grad_accum": 2, "device": "cpu"}
  })");
  j["data"]["text"] = text;
  j["training"]["out_dir"] = dir;
  return j;
}

std::string temp_dir(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("tessera_cuda_graph_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

}  // namespace

// ---- training.cuda_graph ---------------------------------------------------------------

TEST(CudaGraphConfig, KeyParsesValidatesAndRoundTrips) {
  nlohmann::json j = tiny_run("/tmp/unused", "/tmp/unused.txt");
  EXPECT_EQ(train::RunConfig::from_json(j).training.cuda_graph, "auto");
  for (const char* mode : {"auto", "on", "off"}) {
    j["training"]["cuda_graph"] = mode;
    const train::RunConfig c = train::RunConfig::from_json(j);
    EXPECT_EQ(c.training.cuda_graph, mode);
    EXPECT_EQ(train::RunConfig::from_json(c.to_json()).training.cuda_graph, mode);
  }
  j["training"]["cuda_graph"] = true;
  EXPECT_EQ(train::RunConfig::from_json(j).training.cuda_graph, "on");
  j["training"]["cuda_graph"] = false;
  EXPECT_EQ(train::RunConfig::from_json(j).training.cuda_graph, "off");
  j["training"]["cuda_graph"] = "sometimes";
  try {
    train::RunConfig::from_json(j);
    FAIL() << "an unknown mode must be refused";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("training.cuda_graph must be auto, on or off"), std::string::npos) << e.what();
  }
  j["training"]["cuda_graph"] = 3;
  EXPECT_THROW(train::RunConfig::from_json(j), Error);
  // --set parses values as YAML scalars: "off" stays a string.
  nlohmann::json k = tiny_run("/tmp/unused", "/tmp/unused.txt");
  train::apply_override(k, "training.cuda_graph=off");
  EXPECT_EQ(train::RunConfig::from_json(k).training.cuda_graph, "off");
}

TEST(CudaGraphConfig, BlockersSayWhy) {
  train::RunConfig c = train::RunConfig::from_json(tiny_run("/tmp/unused", "/tmp/unused.txt"));
  auto contains = [](const std::optional<std::string>& s, const char* what) {
    return s.has_value() && s->find(what) != std::string::npos;
  };
  EXPECT_TRUE(contains(train::cuda_graph_blocker(c, Device::cpu()), "CPU"));
  const train::CudaGraphChoice cpu = train::choose_cuda_graph(c, Device::cpu());
  EXPECT_FALSE(cpu.use);
  EXPECT_NE(cpu.reason.find("CPU"), std::string::npos);
  c.training.cuda_graph = "off";
  EXPECT_FALSE(train::choose_cuda_graph(c, Device::cuda()).use);
  EXPECT_TRUE(train::choose_cuda_graph(c, Device::cuda()).reason.empty()) << "off is asked for: nothing to report";
  c.training.cuda_graph = "auto";
  if (!TESSERA_WITH_CUDA) {
    EXPECT_TRUE(contains(train::cuda_graph_blocker(c, Device::cuda()), "no CUDA backend"));
    return;
  }
  // The decisions below need no GPU: they read the configuration only.
  EXPECT_FALSE(train::cuda_graph_blocker(c, Device::cuda()).has_value());
  EXPECT_TRUE(train::choose_cuda_graph(c, Device::cuda()).use);
  EXPECT_TRUE(contains(train::cuda_graph_blocker(c, Device::cuda(), /*distributed=*/true), "across ranks"));
  train::RunConfig moe = c;
  moe.model.architecture = "mixtral";
  moe.model.num_experts = 4;
  moe.model.num_experts_per_tok = 2;
  EXPECT_TRUE(contains(train::cuda_graph_blocker(moe, Device::cuda()), "mixture-of-experts"));
  train::RunConfig delayed = c;
  delayed.fp8 = fp8::Recipe::from_json({{"recipe", "delayed"}});
  // Delayed scaling keeps its ring position on the device: captured like current scaling.
  EXPECT_FALSE(train::cuda_graph_blocker(delayed, Device::cuda()).has_value());
  train::RunConfig current = c;
  current.fp8 = fp8::Recipe::from_json({{"recipe", "current"}});
  EXPECT_FALSE(train::cuda_graph_blocker(current, Device::cuda()).has_value());
  // Block scaling and MXFP8 keep no state and read nothing on the host: captured too.
  for (const char* name : {"block", "mxfp8"}) {
    train::RunConfig blocks = c;
    blocks.fp8 = fp8::Recipe::from_json({{"recipe", name}});
    EXPECT_FALSE(train::cuda_graph_blocker(blocks, Device::cuda()).has_value()) << name;
  }
}

// On the CPU, `on` falls back to the eager step (saying so unless quiet) and changes nothing.
TEST(CudaGraphConfig, OnOnTheCpuTrainsExactlyAsOff) {
  const std::string off = temp_dir("off"), on = temp_dir("on");
  std::string text;
  for (int i = 0; i < 300; ++i) text += "pack my box with five dozen liquor jugs " + std::to_string(i % 5) + ". ";
  io::write_file_atomically(off + "/corpus.txt", text);
  nlohmann::json a = tiny_run(off, off + "/corpus.txt"), b = tiny_run(on, off + "/corpus.txt");
  a["training"]["cuda_graph"] = "off";
  b["training"]["cuda_graph"] = "on";
  const train::TrainResult ra = train::train(train::RunConfig::from_json(a), {.quiet = true});
  const train::TrainResult rb = train::train(train::RunConfig::from_json(b), {.quiet = true});
  EXPECT_EQ(ra.last_loss, rb.last_loss);
  std::ifstream fa(off + "/metrics.jsonl"), fb(on + "/metrics.jsonl");
  std::string la, lb;
  int lines = 0;
  while (std::getline(fa, la) && std::getline(fb, lb)) {
    const nlohmann::json ja = nlohmann::json::parse(la), jb = nlohmann::json::parse(lb);
    if (!ja.contains("loss")) continue;
    EXPECT_EQ(ja.at("loss").get<double>(), jb.at("loss").get<double>()) << la;
    EXPECT_EQ(ja.at("grad_norm").get<double>(), jb.at("grad_norm").get<double>()) << la;
    lines += 1;
  }
  EXPECT_EQ(lines, 6);
}

// ---- Streams ---------------------------------------------------------------------------

TEST(Streams, CurrentStreamIsPerThreadAndNests) {
  EXPECT_EQ(current_stream(Device::cpu()), nullptr);
  EXPECT_EQ(current_stream(Device::cuda(0)), nullptr) << "the default stream unless a guard says otherwise";
  // The bookkeeping is host-side only, so fake stream handles exercise it without a GPU.
  void* a = reinterpret_cast<void*>(0x1000);
  void* b = reinterpret_cast<void*>(0x2000);
  {
    StreamGuard outer(Device::cuda(0), a);
    EXPECT_EQ(current_stream(Device::cuda(0)), a);
    EXPECT_EQ(current_stream(Device::cuda(1)), nullptr);
    {
      StreamGuard inner(Context{Device::cuda(0), b});
      EXPECT_EQ(current_stream(Device::cuda(0)), b);
      EXPECT_EQ(context_on(Device::cuda(0)).stream, b);
    }
    EXPECT_EQ(current_stream(Device::cuda(0)), a);
    void* seen_elsewhere = a;
    std::thread([&] { seen_elsewhere = current_stream(Device::cuda(0)); }).join();
    EXPECT_EQ(seen_elsewhere, nullptr) << "another thread keeps its own current stream";
    StreamGuard cpu(Device::cpu(), b);  // a no-op
    EXPECT_EQ(current_stream(Device::cpu()), nullptr);
  }
  EXPECT_EQ(current_stream(Device::cuda(0)), nullptr);
  const Stream none = Stream::create(Device::cpu());
  EXPECT_EQ(none.get(), nullptr);
  EXPECT_TRUE(none.context().device.is_cpu());
}

// ---- The device-resident step's pieces, on the CPU -----------------------------------------

TEST(DeviceResidentStep, AccumulateWeightedLossIsTheHostArithmetic) {
  Context cpu = Context::cpu();
  for (DType t : {DType::F32, DType::F64}) {
    for (int n : {0, 1, 5, 130}) {
      Tensor x = random_tensor({n}, t, 7 + n, 0.5f, 9.0f);
      std::vector<double> w;
      for (int i = 0; i < n; ++i) w.push_back(double(1 + i % 3) / double(2 * n + 1));
      Tensor acc = Tensor::from_doubles({0.25}, {1});
      accumulate_weighted_loss(cpu, x, w, 3.0, acc);
      double total = 0;
      for (int i = 0; i < n; ++i) total += x.item(i) * w[i];
      EXPECT_EQ(acc.item(0), 0.25 + total / 3.0) << dtype_name(t) << " n=" << n;
    }
  }
  Tensor acc = Tensor::from_doubles({0.0}, {1});
  Tensor x = Tensor::from_floats({1, 2}, {2});
  EXPECT_THROW(accumulate_weighted_loss(cpu, x, {0.5}, 1.0, acc), Error);        // one weight per chunk
  EXPECT_THROW(accumulate_weighted_loss(cpu, x, {0.5, 0.5}, 0.0, acc), Error);   // divisor > 0
  Tensor f32_acc = Tensor::zeros({1}, DType::F32);
  EXPECT_THROW(accumulate_weighted_loss(cpu, x, {0.5, 0.5}, 1.0, f32_acc), Error);  // acc is F64
}

TEST(DeviceResidentStep, AdamWStepScalarsGiveTheSameUpdate) {
  Context cpu = Context::cpu();
  const AdamWOptions base{.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.0f, .step = 7};
  const auto s = adamw_step_scalars(base);
  EXPECT_EQ(s[0], double(base.lr));
  EXPECT_EQ(s[1], 7.0);
  EXPECT_EQ(s[2], double(float(double(base.lr) / (1.0 - std::pow(0.9f, 7.0)))));
  auto run = [&](bool from_scalars) {
    std::vector<Tensor> params = {random_tensor({33}, DType::F32, 1), random_tensor({8, 5}, DType::F32, 2)};
    std::vector<Tensor> grads = {random_tensor({33}, DType::F32, 3), random_tensor({8, 5}, DType::F32, 4)};
    std::vector<Tensor> m = {random_tensor({33}, DType::F32, 5, 0, 0.1f),
                             random_tensor({8, 5}, DType::F32, 6, 0, 0.1f)};
    std::vector<Tensor> v = {random_tensor({33}, DType::F32, 7, 0, 0.1f),
                             random_tensor({8, 5}, DType::F32, 8, 0, 0.1f)};
    std::vector<Tensor> values;
    Tensor norm = Tensor::from_doubles({4.5}, {1});
    AdamWOptions o = base;
    Tensor scalars;
    if (from_scalars) {
      scalars = Tensor::from_doubles({s[0], s[1], s[2], s[3]}, {kAdamWStepScalars});
      o.lr = 99.0f;  // ignored
      o.step = 0;    // ignored (would be invalid)
    }
    adamw_step_multi(cpu, params, grads, m, v, values, o, {0.1f, 0.0f}, norm, 1.0, nullptr, scalars);
    std::vector<double> out;
    for (auto* list : {&params, &m, &v})
      for (const Tensor& t : *list) {
        const auto d = t.to_doubles();
        out.insert(out.end(), d.begin(), d.end());
      }
    return out;
  };
  EXPECT_EQ(run(true), run(false));
  // The scalars tensor is checked like every operand.
  std::vector<Tensor> p = {Tensor::zeros({2}, DType::F32)}, g = {Tensor::zeros({2}, DType::F32)},
                      m = {Tensor::zeros({2}, DType::F32)}, v = {Tensor::zeros({2}, DType::F32)}, values;
  const Tensor wrong = Tensor::zeros({3}, DType::F64);
  EXPECT_THROW(adamw_step_multi(cpu, p, g, m, v, values, base, {0.0f}, Tensor(), 0.0, nullptr, wrong), Error);
}

TEST(DeviceResidentStep, OptimizerQueueStepMatchesStep) {
  Context cpu = Context::cpu();
  const ModelConfig config = small("llama");
  TransformerLM a(config, DType::F32), b(config, DType::F32);
  a.init(cpu, 5);
  b.init(cpu, 5);
  train::OptimizerConfig oc;
  oc.grad_clip = 0.01;  // active
  train::Optimizer oa(a.parameters(), oc), ob(b.parameters(), oc);
  for (int step = 1; step <= 3; ++step) {
    const Tensor inputs = random_ids({2, 8}, config.vocab_size, step);
    const Tensor targets = random_ids({2, 8}, config.vocab_size, 10 + step);
    a.zero_grad();
    b.zero_grad();
    a.forward_backward(cpu, inputs, targets);
    b.forward_backward(cpu, inputs, targets);
    const double lr = 1e-3 * step;
    const double norm_a = oa.step(cpu, lr);
    const auto s = ob.step_scalars_for(lr);
    Tensor scalars = Tensor::from_doubles({s[0], s[1], s[2], s[3]}, {kAdamWStepScalars});
    ob.queue_step(cpu, scalars);
    EXPECT_EQ(ob.steps_taken(), step - 1) << "queue_step leaves the count to count_step()";
    ob.count_step();
    EXPECT_EQ(ob.grad_norm().item(0), norm_a);
    EXPECT_GT(norm_a, oc.grad_clip) << "clipping must be active for this test to mean anything";
  }
  auto pa = a.parameters(), pb = b.parameters();
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_EQ(bits_of(pa[i]->weights()), bits_of(pb[i]->weights())) << pa[i]->name;
  const auto sa = oa.state(), sb = ob.state();
  for (size_t i = 0; i < sa.size(); ++i) EXPECT_EQ(bits_of(sa[i].second), bits_of(sb[i].second)) << sa[i].first;
}

TEST(DeviceResidentStep, ForwardBackwardIntoMatchesForwardBackward) {
  Context cpu = Context::cpu();
  for (const char* arch : {"gpt2", "llama"}) {
    const ModelConfig config = small(arch);
    TransformerLM a(config, DType::F32), b(config, DType::F32);
    a.init(cpu, 9);
    b.init(cpu, 9);
    a.zero_grad();
    b.zero_grad();
    Tensor acc = Tensor::zeros({1}, DType::F64);
    double host = 0;
    for (int micro = 0; micro < 2; ++micro) {
      const Tensor inputs = random_ids({3, 11}, config.vocab_size, 20 + micro);
      const Tensor targets = random_ids({3, 11}, config.vocab_size, 30 + micro);
      host += a.forward_backward(cpu, inputs, targets, 1.0f / 2) / 2;
      b.forward_backward_into(cpu, inputs, targets, 1.0f / 2, acc, 2.0);
    }
    EXPECT_EQ(acc.item(0), host) << arch;
    auto pa = a.parameters(), pb = b.parameters();
    for (size_t i = 0; i < pa.size(); ++i)
      EXPECT_EQ(bits_of(pa[i]->grad), bits_of(pb[i]->grad)) << arch << " " << pa[i]->name;
  }
  // Wrong placement and mixtures of experts are refused with a reason.
  TransformerLM model(small("llama"), DType::F32);
  Tensor acc = Tensor::zeros({1}, DType::F64);
  const Tensor ids = random_ids({1, 4}, 97, 1);
  EXPECT_THROW(model.forward_backward_into(cpu, ids, random_ids({1, 5}, 97, 2), 1.0f, acc), Error);
}
