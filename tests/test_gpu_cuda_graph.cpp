// The training step captured into a CUDA graph (train/cuda_graph_step.h) against the eager
// loop: the same losses, gradient norms, weights and optimizer moments, bit for bit, with a
// learning rate that changes every step (warm-up) and clipping active; the private memory
// pool of a graph; a capture that fails and leaves everything working; streams; and the
// device-resident ops against their CPU forms. Attention runs on tessera's kernels, which
// are deterministic (cuDNN's backward accumulates dQ with atomics). Skipped, saying so,
// where no GPU is present.
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "gpu_testing.h"
#include "tessera/core/stream.h"
#include "tessera/io/atomic_file.h"
#include "tessera/models/fp8_model.h"
#include "tessera/models/transformer_lm.h"
#include "tessera/ops/attention.h"
#include "tessera/ops/elementwise.h"
#include "tessera/ops/loss.h"
#include "tessera/ops/optimizer.h"
#include "tessera/train/trainer.h"
#include "train/cuda_graph_step.h"
#if TESSERA_WITH_CUDA
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/graph.h"
#endif

using namespace tessera;
using namespace tessera::testing;
using models::ModelConfig;
using models::TransformerLM;
namespace fs = std::filesystem;

namespace {

// Head dim 64, an odd vocabulary (the padded LM head), GQA for Llama.
ModelConfig small(const char* arch, int64_t intermediate = 344) {
  ModelConfig c;
  c.architecture = arch;
  c.vocab_size = 301;
  c.hidden_size = 128;
  c.num_layers = 2;
  c.num_heads = 2;
  c.num_kv_heads = c.is_gpt2() ? 2 : 1;
  c.intermediate_size = intermediate;
  c.max_seq_len = 64;
  c.rope_theta = 10000.0f;
  c.tie_embeddings = c.is_gpt2();
  return c;
}

// Sets the attention backend for a scope.
struct AttentionBackendScope {
  AttentionBackend previous = attention_backend();
  explicit AttentionBackendScope(AttentionBackend b) { set_attention_backend(b); }
  ~AttentionBackendScope() { set_attention_backend(previous); }
};

// Everything a step leaves behind, as bytes: full-precision weights, compute values,
// optimizer moments.
std::vector<std::vector<uint8_t>> state_bytes(TransformerLM& model, const train::Optimizer& optimizer) {
  std::vector<std::vector<uint8_t>> out;
  for (nn::Parameter* p : model.parameters()) {
    out.push_back(bytes_of(p->weights()));
    out.push_back(bytes_of(p->value));
  }
  for (const auto& [name, t] : optimizer.state()) out.push_back(bytes_of(t));
  return out;
}

struct Curve {
  std::vector<double> losses, norms;
};

// Eager (the trainer's loop) and captured training of the same model from the same seed on
// the same batches, compared bit for bit.
void check_captured_matches_eager(const char* arch, DType dtype, int64_t grad_accum, const char* fp8_recipe = nullptr,
                                  int64_t intermediate = 344, int history_len = 0) {
  const AttentionBackendScope tessera_attention(AttentionBackend::Tessera);
  const ModelConfig config = small(arch, intermediate);
  const std::string what = std::string(arch) + " " + dtype_name(dtype) + " accum " + std::to_string(grad_accum) +
                           (fp8_recipe ? std::string(" fp8 ") + fp8_recipe : "");
  const int64_t batch = 4, seq = 32, steps = 8;
  train::OptimizerConfig oc;
  oc.lr = 3e-3;
  oc.warmup_steps = 5;  // a new learning rate every step, also after the capture
  oc.grad_clip = 0.05;  // active (checked below)
  // Two sets of batches, alternating: the inputs change at every replay, and a model that
  // memorises them shows that training works (fresh uniform-random tokens every step leave
  // nothing to learn, and the loss of a small model may rise by chance).
  std::vector<std::vector<data::Batch>> batches(steps);
  for (int64_t s = 0; s < steps; ++s)
    for (int64_t m = 0; m < grad_accum; ++m)
      batches[s].push_back({random_ids({batch, seq}, config.vocab_size, 100 * (s % 2) + 2 * m),
                            random_ids({batch, seq}, config.vocab_size, 100 * (s % 2) + 2 * m + 1)});
  nlohmann::json recipe_json = {{"recipe", fp8_recipe ? fp8_recipe : "current"}};
  if (history_len > 0) recipe_json["history_len"] = history_len;  // delayed scaling's ring
  const fp8::Recipe recipe = fp8::Recipe::from_json(recipe_json);

  // The eager loop, on the default stream (no guard: the behaviour before streams).
  Curve eager;
  Context ectx = Context::cuda();
  TransformerLM a(config, dtype);
  a.to(kCuda);
  a.init(ectx, 17);
  std::shared_ptr<nn::Fp8Scaling> fp8_a;
  if (fp8_recipe) fp8_a = models::enable_fp8(ectx, a, recipe);
  train::Optimizer oa(a.parameters(), oc);
  for (int64_t s = 1; s <= steps; ++s) {
    a.zero_grad();
    double loss = 0;
    for (const data::Batch& b : batches[s - 1]) {
      loss += a.forward_backward(ectx, b.inputs, b.targets, 1.0f / grad_accum) / grad_accum;
      if (fp8_a) fp8_a->end_micro_batch(ectx);
    }
    eager.losses.push_back(loss);
    eager.norms.push_back(oa.step(ectx, train::learning_rate(oc, s, steps)));
    if (fp8_a) fp8_a->end_step(ectx);  // the captured step queues this itself
  }

  // The captured step, on a stream of its own.
  const Stream stream = Stream::create(kCuda);
  Context gctx = stream.context();
  const StreamGuard guard(gctx);
  TransformerLM b(config, dtype);
  b.to(kCuda);
  b.init(gctx, 17);
  std::shared_ptr<nn::Fp8Scaling> fp8_b;
  if (fp8_recipe) fp8_b = models::enable_fp8(gctx, b, recipe);
  train::Optimizer ob(b.parameters(), oc);
  const int64_t warmup = 2;
  train::CudaGraphStep graph(gctx, b, ob,
                             {.batch_size = batch, .seq_len = seq, .grad_accum = grad_accum, .warmup_steps = warmup});
  int clipped = 0;
  for (int64_t s = 1; s <= steps; ++s) {
    ASSERT_TRUE(graph.accepts(batches[s - 1]));
    const train::CudaGraphStep::Result r = graph.step(batches[s - 1], train::learning_rate(oc, s, steps));
    EXPECT_EQ(r.replayed, s > warmup) << what << " step " << s << ": " << graph.failure();
    ASSERT_TRUE(std::isfinite(r.loss)) << what << " step " << s;
    EXPECT_EQ(r.loss, eager.losses[s - 1]) << what << " step " << s;
    EXPECT_EQ(r.grad_norm, eager.norms[s - 1]) << what << " step " << s;
    clipped += r.grad_norm > oc.grad_clip;
  }
  EXPECT_TRUE(graph.captured()) << what << ": " << graph.failure();
  EXPECT_TRUE(graph.failure().empty()) << what << ": " << graph.failure();
  EXPECT_EQ(ob.steps_taken(), steps);
  EXPECT_GT(clipped, 0) << what << ": clipping must be active for this test to mean anything";
  // The last step saw the same batches as the second (steps is even).
  EXPECT_LT(eager.losses.back(), eager.losses[1]) << what << ": the run must learn";
  const auto sa = state_bytes(a, oa), sb = state_bytes(b, ob);
  ASSERT_EQ(sa.size(), sb.size());
  size_t differing = 0;
  for (size_t i = 0; i < sa.size(); ++i) differing += sa[i] != sb[i];
  EXPECT_EQ(differing, 0u) << what << ": weights, values or moments differ after " << steps << " steps";
  // Delayed scaling's state (history, scales, ring position) after the same steps.
  if (fp8_a) {
    const auto da = fp8_a->state_dict(), db = fp8_b->state_dict();
    ASSERT_EQ(da.size(), db.size()) << what;
    for (const auto& [name, t] : da) EXPECT_EQ(bytes_of(t), bytes_of(db.at(name))) << what << ": " << name;
  }
}

}  // namespace

TEST(GpuCudaGraph, Gpt2Bf16CapturedMatchesEager) {
  REQUIRE_GPU();
  check_captured_matches_eager("gpt2", DType::BF16, 1);
}

TEST(GpuCudaGraph, LlamaBf16WithGradAccumCapturedMatchesEager) {
  REQUIRE_GPU();
  check_captured_matches_eager("llama", DType::BF16, 2);
}

TEST(GpuCudaGraph, Gpt2F32WithGradAccumCapturedMatchesEager) {
  REQUIRE_GPU();
  check_captured_matches_eager("gpt2", DType::F32, 3);
}

TEST(GpuCudaGraph, LlamaFp8CurrentScalingCapturedMatchesEager) {
  REQUIRE_GPU();
  check_captured_matches_eager("llama", DType::BF16, 1, "current", 256);
}

// Delayed scaling: the amax history's ring position lives on the device, so replays fold
// into and advance from the right slot. Short histories (3 and 5) wrap within the 8 steps;
// with grad accumulation the per-micro-batch record is captured too.
TEST(GpuCudaGraph, LlamaFp8DelayedScalingCapturedMatchesEager) {
  REQUIRE_GPU();
  check_captured_matches_eager("llama", DType::BF16, 1, "delayed", 256, 3);
}

TEST(GpuCudaGraph, LlamaFp8DelayedScalingWithGradAccumCapturedMatchesEager) {
  REQUIRE_GPU();
  check_captured_matches_eager("llama", DType::BF16, 2, "delayed", 256, 5);
}

// Block scaling and MXFP8 have no state and no host reads (block casts, GEMM-ready scales,
// cuBLASLt's block-scaled GEMMs; MXFP8's casts, dequantization and BF16 GEMM): captured.
// intermediate 256: fc 128 -> 512 and proj 256 -> 128, all multiples of 128.
TEST(GpuCudaGraph, LlamaFp8BlockScalingCapturedMatchesEager) {
  REQUIRE_GPU();
  check_captured_matches_eager("llama", DType::BF16, 2, "block", 256);
}

TEST(GpuCudaGraph, LlamaFp8Mxfp8CapturedMatchesEager) {
  REQUIRE_GPU();
  check_captured_matches_eager("llama", DType::BF16, 1, "mxfp8", 256);
}

// What the captured step refuses, and why (the trainer then runs the eager step).
TEST(GpuCudaGraph, RefusalsSayWhy) {
  REQUIRE_GPU();
  train::RunConfig c;
  c.model = small("llama");
  EXPECT_TRUE(train::choose_cuda_graph(c, kCuda).use);
  train::RunConfig moe = c;
  moe.model.architecture = "mixtral";
  moe.model.num_experts = 4;
  moe.model.num_experts_per_tok = 2;
  const train::CudaGraphChoice m = train::choose_cuda_graph(moe, kCuda);
  EXPECT_FALSE(m.use);
  EXPECT_NE(m.reason.find("mixture-of-experts"), std::string::npos) << m.reason;
  train::RunConfig delayed = c;
  delayed.fp8 = fp8::Recipe::from_json({{"recipe", "delayed"}});
  EXPECT_TRUE(train::choose_cuda_graph(delayed, kCuda).use) << "delayed scaling keeps its position on the device";
  // The step itself refuses batches it cannot take: ignored targets, other shapes.
  const Stream stream = Stream::create(kCuda);
  Context ctx = stream.context();
  const StreamGuard guard(ctx);
  TransformerLM model(c.model, DType::BF16);
  model.to(kCuda);
  model.init(ctx, 1);
  train::Optimizer optimizer(model.parameters(), {});
  train::CudaGraphStep graph(ctx, model, optimizer, {.batch_size = 2, .seq_len = 8});
  Tensor targets = random_ids({2, 8}, 301, 2);
  EXPECT_TRUE(graph.accepts({{random_ids({2, 8}, 301, 1), targets}}));
  targets.set_item(3, TransformerLM::kIgnoreIndex);
  EXPECT_FALSE(graph.accepts({{random_ids({2, 8}, 301, 1), targets}}));
  EXPECT_FALSE(graph.accepts({{random_ids({2, 9}, 301, 1), random_ids({2, 9}, 301, 2)}}));
  EXPECT_THROW(graph.step({{random_ids({2, 8}, 301, 1), targets}}, 1e-3), Error);
  TransformerLM mixtral(moe.model, DType::BF16);
  train::Optimizer mo(mixtral.parameters(), {});
  EXPECT_THROW(train::CudaGraphStep(ctx, mixtral, mo, {.batch_size = 2, .seq_len = 8}), Error);
  EXPECT_THROW(train::CudaGraphStep(Context::cuda(), model, optimizer, {.batch_size = 2, .seq_len = 8}), Error)
      << "the default stream cannot be captured";
}

// `tessera train` with training.cuda_graph on and off (GPT-2, Llama, Llama with FP8 delayed
// scaling): the same metrics, bit for bit, also across an injected NaN gradient (that step
// runs eagerly, the run rewinds to a snapshot and replays the graph on the restored weights)
// and validation between replays.
TEST(GpuCudaGraph, TrainerOnAndOffWriteTheSameMetrics) {
  REQUIRE_GPU();
  const std::string root = (fs::temp_directory_path() / ("tessera_gpu_graph_" + std::to_string(::getpid()))).string();
  fs::remove_all(root);
  fs::create_directories(root);
  std::string text;
  for (int i = 0; i < 400; ++i) text += "sphinx of black quartz, judge my vow " + std::to_string(i % 9) + ". ";
  io::write_file_atomically(root + "/corpus.txt", text);
  // "llama-fp8": Llama with FP8 delayed scaling (a short history that wraps): the captured
  // step queues the scaling's bookkeeping itself, the eager steps (the NaN one) the trainer.
  for (const char* name : {"gpt2", "llama", "llama-fp8"}) {
    const bool fp8 = std::string(name) == "llama-fp8";
    const char* arch = fp8 ? "llama" : name;
    std::vector<std::vector<nlohmann::json>> lines(2);
    for (int on = 0; on < 2; ++on) {
      const std::string dir = root + "/" + name + (on ? "_on" : "_off");
      nlohmann::json j = nlohmann::json::parse(R"({
        "model": {"vocab_size": 257, "hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
                  "intermediate_size": 128, "max_seq_len": 32, "rope_theta": 10000},
        "data": {"tokenizer": "byte", "validation_fraction": 0.1},
        "optimizer": {"lr": 0.01, "warmup_steps": 3, "grad_clip": 0.5},
        "training": {"steps": 10, "batch_size": 4, "seq_len": 16, "eval_interval": 4, "eval_batches": 2,
                     "grad_accum": 2, "device": "cuda", "precision": "bf16", "attention_backend": "tessera",
                     "rewind": {"snapshot_interval": 2},
                     "fault_injection": {"nan_grad_at_step": [7]}}
      })");
      j["model"]["architecture"] = arch;
      if (std::string(arch) == "gpt2") j["model"]["num_kv_heads"] = 2;
      if (fp8) j["fp8"] = {{"recipe", "delayed"}, {"history_len", 4}};
      j["data"]["text"] = root + "/corpus.txt";
      j["training"]["out_dir"] = dir;
      j["training"]["cuda_graph"] = on ? "on" : "off";
      const train::TrainResult r = train::train(train::RunConfig::from_json(j), {.quiet = true});
      EXPECT_EQ(r.rewinds, 1) << name << (on ? " on" : " off");
      std::ifstream in(dir + "/metrics.jsonl");
      std::string line;
      while (std::getline(in, line)) {
        nlohmann::json m = nlohmann::json::parse(line);
        if (!m.contains("loss")) continue;
        m.erase("tokens_per_s");
        lines[on].push_back(m);
      }
    }
    ASSERT_EQ(lines[0].size(), lines[1].size()) << name;
    EXPECT_GE(lines[0].size(), 10u) << name;
    for (size_t i = 0; i < lines[0].size(); ++i) EXPECT_EQ(lines[0][i], lines[1][i]) << name << " line " << i;
  }
  fs::remove_all(root);
}

#if TESSERA_WITH_CUDA

// Tensor-level copies and fills queue on the thread's current stream and a copy to the host
// waits for it: a large H2D copy, a kernel, a strided copy and a D2H read in a row.
TEST(GpuCudaGraph, TensorCopiesFollowTheCurrentStream) {
  REQUIRE_GPU();
  const Stream stream = Stream::create(kCuda);
  Context ctx = stream.context();
  const StreamGuard guard(ctx);
  EXPECT_EQ(current_stream(kCuda), stream.get());
  const Tensor host = random_tensor({2048, 1024}, DType::F32, 3);
  for (int rep = 0; rep < 3; ++rep) {
    Tensor x = host.to(kCuda);
    Tensor y = Tensor::empty(x.shape(), DType::F32, kCuda);
    scale(ctx, x, 2.0f, y);
    Tensor half = y.slice(1, 0, 512).contiguous();  // copy kernel on the stream
    Tensor z = Tensor::zeros({2048, 512}, DType::F32, kCuda);
    z.copy_from(half);
    Tensor want = Tensor::empty({2048, 512}, DType::F32);
    Context cpu = Context::cpu();
    scale(cpu, host.slice(1, 0, 512).contiguous(), 2.0f, want);
    EXPECT_EQ(bytes_of(z), bytes_of(want)) << "rep " << rep;
    y.fill_zero();
    EXPECT_EQ(y.to(Device::cpu()).to_doubles()[12345], 0.0);
  }
}

// A graph's temporaries stay its own: tensors made after the capture never share them, a
// replay sees the inputs' new values, and releasing the pool returns its blocks.
TEST(GpuCudaGraph, PrivatePoolKeepsTheGraphsMemory) {
  REQUIRE_GPU();
  const Stream stream = Stream::create(kCuda);
  Context ctx = stream.context();
  const StreamGuard guard(ctx);
  const int64_t n = 1 << 18;
  Tensor x = Tensor::zeros({n}, DType::F32, kCuda), out = Tensor::zeros({n}, DType::F32, kCuda);
  // Warm the general free lists with blocks of the temporaries' size: the capture may take
  // them over (they are idle), but then nobody else may get them.
  { Tensor w1 = Tensor::empty({n}, DType::F32, kCuda), w2 = Tensor::empty({n}, DType::F32, kCuda); }
  void* temp_address = nullptr;
  auto graph = std::make_unique<cuda::CapturedGraph>();
  graph->begin(0, ctx.stream);
  {
    Tensor t1 = Tensor::empty({n}, DType::F32, kCuda);
    scale(ctx, x, 2.0f, t1);
    Tensor t2 = Tensor::empty({n}, DType::F32, kCuda);
    add(ctx, t1, x, t2);  // 3x
    temp_address = t2.raw_data();
    out.copy_from(t2);
  }  // the temporaries go back to the pool during the capture
  graph->end();
  ASSERT_TRUE(graph->ready());
  for (int k = 1; k <= 3; ++k) {
    const Tensor host = random_tensor({n}, DType::F32, 10 + k);
    x.copy_from(host);
    // Same-sized tensors made between replays must not land on the graph's temporaries.
    Tensor others[4];
    for (Tensor& o : others) {
      o = Tensor::empty({n}, DType::F32, kCuda);
      EXPECT_NE(o.raw_data(), temp_address);
      scale(ctx, x, 0.0f, o);
    }
    graph->replay();
    Tensor want = Tensor::empty({n}, DType::F32);
    Context cpu = Context::cpu();
    scale(cpu, host, 3.0f, want);
    EXPECT_LT(relative_error(out.to(Device::cpu()), want), 1e-6) << "replay " << k;
    for (const Tensor& o : others) EXPECT_EQ(o.to(Device::cpu()).to_doubles()[7], 0.0) << "replay " << k;
  }
  graph.reset();  // releases the pool: its blocks serve ordinary allocations again
  bool reused = false;
  std::vector<Tensor> held;
  for (int i = 0; i < 8 && !reused; ++i) {
    held.push_back(Tensor::empty({n}, DType::F32, kCuda));
    reused = held.back().raw_data() == temp_address;
  }
  EXPECT_TRUE(reused) << "a released pool's free blocks return to the general cache";
}

// A capture that breaks (here: reading a result on the host, which synchronises) throws a
// clear error, and the stream, the allocator and later work are fine.
TEST(GpuCudaGraph, AFailedCaptureIsAnErrorAndLeavesEverythingWorking) {
  REQUIRE_GPU();
  const Stream stream = Stream::create(kCuda);
  Context ctx = stream.context();
  const StreamGuard guard(ctx);
  const Tensor host = random_tensor({4099}, DType::F32, 5);
  const Tensor x = host.to(kCuda);
  cuda::CapturedGraph graph;
  graph.begin(0, ctx.stream);
  EXPECT_TRUE(cuda::stream_capturing(ctx.stream));
  Tensor y = Tensor::empty({4099}, DType::F32, kCuda);
  scale(ctx, x, 2.0f, y);
  EXPECT_THROW(y.to(Device::cpu()), Error);
  graph.abandon();
  EXPECT_FALSE(graph.ready());
  EXPECT_FALSE(cuda::stream_capturing(ctx.stream));
  EXPECT_EQ(cuda::selected_allocation_pool(0), 0u);
  scale(ctx, x, 3.0f, y);
  Tensor want = Tensor::empty({4099}, DType::F32);
  Context cpu = Context::cpu();
  scale(cpu, host, 3.0f, want);
  EXPECT_EQ(bytes_of(y), bytes_of(want));
  EXPECT_THROW(graph.replay(), Error);
  cuda::CapturedGraph default_stream;
  EXPECT_THROW(default_stream.begin(0, nullptr), Error);
}

// The device-resident ops against their CPU forms, bit for bit.
TEST(GpuCudaGraph, AccumulateWeightedLossMatchesTheCpu) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  for (DType t : {DType::F32, DType::F64}) {
    for (int n : {0, 1, 63, 64, 65, 200}) {  // one launch per 64 weights
      const Tensor x = random_tensor({n}, t, 40 + n, 0.1f, 12.0f);
      std::vector<double> w;
      for (int i = 0; i < n; ++i) w.push_back(double(1024 - (i % 5)) / double(1024 * n + 7));
      Tensor want = Tensor::from_doubles({1.5}, {1}), got = want.to(kCuda);
      accumulate_weighted_loss(cpu, x, w, 3.0, want);
      accumulate_weighted_loss(gpu, x.to(kCuda), w, 3.0, got);
      accumulate_weighted_loss(cpu, x, w, 3.0, want);  // accumulates
      accumulate_weighted_loss(gpu, x.to(kCuda), w, 3.0, got);
      EXPECT_EQ(bytes_of(got), bytes_of(want)) << dtype_name(t) << " n=" << n;
    }
  }
}

TEST(GpuCudaGraph, AdamWFromDeviceScalarsMatchesHostScalars) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  const AdamWOptions o{.lr = 7e-4f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.0f, .step = 13};
  const auto s = adamw_step_scalars(o);
  const Tensor scalars = Tensor::from_doubles({s[0], s[1], s[2], s[3]}, {kAdamWStepScalars}).to(kCuda);
  std::vector<std::vector<uint8_t>> results[2];
  for (int from_device = 0; from_device < 2; ++from_device) {
    std::vector<Tensor> p, g, m, v, values;
    for (int64_t size : {4097, 64, 1}) {
      p.push_back(random_tensor({size}, DType::F32, size).to(kCuda));
      g.push_back(random_tensor({size}, DType::BF16, size + 1).to(kCuda));
      m.push_back(random_tensor({size}, DType::F32, size + 2, 0, 0.1f).to(kCuda));
      v.push_back(random_tensor({size}, DType::F32, size + 3, 0, 0.1f).to(kCuda));
      values.push_back(Tensor::empty({size}, DType::BF16, kCuda));
    }
    const Tensor norm = Tensor::from_doubles({3.0}, {1}).to(kCuda);
    AdamWOptions opt = o;
    if (from_device) opt.lr = 1.0f;  // ignored: the scalars say 7e-4
    adamw_step_multi(gpu, p, g, m, v, values, opt, {0.1f, 0.0f, 0.1f}, norm, 1.0, nullptr,
                     from_device ? scalars : Tensor());
    for (auto* list : {&p, &m, &v, &values})
      for (const Tensor& t : *list) results[from_device].push_back(bytes_of(t));
  }
  EXPECT_EQ(results[0], results[1]);
}

#endif  // TESSERA_WITH_CUDA
