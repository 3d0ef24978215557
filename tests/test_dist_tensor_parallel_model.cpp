// TransformerLM under tensor (and sequence) parallelism against the single-device model:
// the tensor size is the world size (1 alone, 2 and 4 under mpirun). A GPT-2-like model
// (LayerNorm, GELU, biases, learned positions, tied embeddings) and Llama-like ones (RMSNorm,
// SwiGLU, RoPE, GQA with 2 K/V heads: split at TP 2, replicated at TP 4; tied and untied),
// vocabularies that do not divide by the tensor size. Checked: the same initial weights
// from the same seed, the same loss and (gathered) gradients, a few AdamW steps, and
// checkpoints in the full layout moving between tensor sizes (TP 2 -> TP 1, TP 2 -> TP 4,
// including the optimizer moments).
#include <unistd.h>

#include <cstring>
#include <filesystem>

#include "dist_testing.h"
#include "tessera/dist/parallel_grid.h"
#include "tessera/io/safetensors.h"
#include "tessera/models/transformer_lm.h"
#include "tessera/train/optimizer.h"
#include "testing.h"

using namespace tessera;
using namespace tessera::testing;
using models::ModelConfig;
using models::TransformerLM;

namespace {

// Whole-model relative errors, as tests/test_gpu_models.cpp allows a GPU model against the
// CPU one: the tensor-parallel sums run in another order (F32), and BF16 activations round
// differently after them (BF16 gradients: 5e-2, loss 1e-2).
constexpr double kF32Tolerance = 1e-5;
constexpr double kBf16Tolerance = 1e-2, kBf16GradTolerance = 5e-2;

ModelConfig tiny_gpt2() {
  ModelConfig c;
  c.architecture = "gpt2";
  c.vocab_size = 37;  // 19 per rank at TP 2 (one padding row), 10 at TP 4 (three)
  c.hidden_size = 32;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 4;
  c.max_seq_len = 16;
  c.tie_embeddings = true;
  return c;
}

ModelConfig tiny_llama(bool tied) {
  ModelConfig c;
  c.architecture = "llama";
  c.vocab_size = 41;
  c.hidden_size = 32;
  c.num_layers = 2;
  c.num_heads = 8;
  c.num_kv_heads = 2;
  c.intermediate_size = 48;
  c.max_seq_len = 16;
  c.rope_theta = 100.0f;
  c.tie_embeddings = tied;
  return c;
}

constexpr int64_t kBatch = 2, kSeq = 8;

// A batch of ids in [0, vocab) with a few ignored targets.
std::pair<Tensor, Tensor> batch(int step, int64_t vocab) {
  std::vector<int64_t> in, tg;
  uint64_t s = 987654321ull + static_cast<uint64_t>(step) * 7919ull;
  for (int64_t i = 0; i < kBatch * kSeq; ++i) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    in.push_back(static_cast<int64_t>((s >> 33) % static_cast<uint64_t>(vocab)));
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    tg.push_back(static_cast<int64_t>((s >> 33) % static_cast<uint64_t>(vocab)));
  }
  tg[3] = TransformerLM::kIgnoreIndex;
  tg[static_cast<size_t>(kSeq + 5)] = TransformerLM::kIgnoreIndex;
  tg.back() = vocab - 1;  // the last id: on the last rank holding a real row
  return {Tensor::from_ints(in, {kBatch, kSeq}), Tensor::from_ints(tg, {kBatch, kSeq})};
}

std::string describe(const ModelConfig& c, const nn::ParallelContext& pc, DType dtype) {
  return c.architecture + (c.tie_embeddings ? " tied" : " untied") + " " + dtype_name(dtype) + " tp=" +
         std::to_string(pc.tensor_size) + (pc.sequence_parallel ? " sp" : "") + " rank=" +
         std::to_string(pc.tensor_rank);
}

// Full-layout gradients of a model (gathered over the tensor group).
TransformerLM::NamedTensors full_grads(Context& ctx, TransformerLM& model) {
  TransformerLM::NamedTensors local;
  for (nn::Parameter* p : model.parameters()) local.emplace_back(p->name, p->grad);
  return model.gather_full(ctx, local);
}

void expect_same_tensors(const TransformerLM::NamedTensors& got, TransformerLM& ref, bool grads, double tol,
                         const std::string& what) {
  const nn::ParameterList want = ref.parameters();
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_EQ(got[i].first, want[i]->name) << what;
    const Tensor& w = grads ? want[i]->grad : want[i]->weights();
    EXPECT_LE(relative_error(doubles_of(got[i].second), doubles_of(w)), tol)
        << what << " " << (grads ? "gradient of " : "weights of ") << got[i].first;
  }
}

void check_model(const nn::ParallelContext& base, const ModelConfig& config, bool sp, DType dtype) {
  Context ctx = Context::cpu();
  nn::ParallelContext pc = base;
  pc.sequence_parallel = sp && pc.tensor_size > 1;
  const std::string what = describe(config, pc, dtype);
  TransformerLM ref(config, dtype), model(config, dtype, pc);
  EXPECT_EQ(model.tensor_parallel(), pc.tensor_size > 1);
  ref.init(ctx, 17);
  model.init(ctx, 17);
  // The same seed draws the same full weights.
  expect_same_tensors(model.full_state_dict(ctx), ref, false, 0.0, what + " init");

  const double tol = dtype == DType::BF16 ? kBf16Tolerance : kF32Tolerance;
  const double grad_tol = dtype == DType::BF16 ? kBf16GradTolerance : kF32Tolerance;
  for (int step = 0; step < 2; ++step) {  // the second accumulates onto the first
    const auto [inputs, targets] = batch(step, config.vocab_size);
    const double want = ref.forward_backward(ctx, inputs, targets, 0.5f);
    const double got = model.forward_backward(ctx, inputs, targets, 0.5f);
    EXPECT_NEAR(got, want, tol * std::abs(want)) << what << " step " << step;
    expect_same_tensors(full_grads(ctx, model), ref, true, grad_tol, what + " step " + std::to_string(step));
  }
  const auto [inputs, targets] = batch(5, config.vocab_size);
  EXPECT_NEAR(model.forward_loss(ctx, inputs, targets), ref.forward_loss(ctx, inputs, targets),
              tol * ref.forward_loss(ctx, inputs, targets))
      << what;
  EXPECT_LT(relative_error(doubles_of(model.logits(ctx, inputs)), doubles_of(ref.logits(ctx, inputs))), tol) << what;
  // The norm global-norm clipping needs: the single-device model's.
  EXPECT_NEAR(model.grad_norm(ctx), ref.grad_norm(ctx), grad_tol * ref.grad_norm(ctx)) << what;
}

}  // namespace

TEST(DistTensorParallelModel, LossAndGradientsMatchTheSingleDeviceModel) {
  Context ctx = Context::cpu();
  auto world = test_world();
  dist::ParallelGrid grid(ctx, world, {.data = 1, .tensor = world->size(), .pipeline = 1, .sequence_parallel = true});
  for (bool sp : {false, true}) {
    check_model(grid.context(), tiny_gpt2(), sp, DType::F32);
    check_model(grid.context(), tiny_llama(false), sp, DType::F32);
    check_model(grid.context(), tiny_llama(true), sp, DType::F32);
  }
  check_model(grid.context(), tiny_llama(false), true, DType::BF16);
  check_model(grid.context(), tiny_gpt2(), false, DType::BF16);
}

TEST(DistTensorParallelModel, AdamWStepsKeepMatching) {
  Context ctx = Context::cpu();
  auto world = test_world();
  dist::ParallelGrid grid(ctx, world, {.data = 1, .tensor = world->size(), .pipeline = 1, .sequence_parallel = true});
  train::OptimizerConfig oc;
  oc.lr = 1e-2;
  oc.warmup_steps = 0;
  oc.grad_clip = 0;  // train::Optimizer clips by the local norm; TransformerLM::clip_grad_norm does it
  // Adam's first steps move every weight by about lr * sign(gradient), also where the
  // gradient is only rounding noise (GPT-2's key biases have a zero gradient in exact
  // arithmetic), and the noise of a tensor-parallel sum is another: an eps above that noise
  // keeps those weights still in both models, and changes nothing else measurably.
  oc.eps = 1e-5;
  // Without clipping, and clipping at a norm every step exceeds (by the model's global norm).
  for (const double clip : {0.0, 0.05})
  for (const ModelConfig& config : {tiny_gpt2(), tiny_llama(false)}) {
    const std::string what = describe(config, grid.context(), DType::F32) + " clip " + std::to_string(clip);
    TransformerLM ref(config), model(config, DType::F32, grid.context());
    ref.init(ctx, 3);
    model.init(ctx, 3);
    train::Optimizer ref_opt(ref.parameters(), oc), opt(model.parameters(), oc);
    for (int step = 0; step < 3; ++step) {
      const auto [inputs, targets] = batch(10 + step, config.vocab_size);
      ref.zero_grad();
      model.zero_grad();
      const double want = ref.forward_backward(ctx, inputs, targets);
      EXPECT_NEAR(model.forward_backward(ctx, inputs, targets), want, kF32Tolerance * want) << what << " step " << step;
      const double ref_norm = ref.clip_grad_norm(ctx, clip), norm = model.clip_grad_norm(ctx, clip);
      EXPECT_NEAR(norm, ref_norm, kF32Tolerance * ref_norm) << what << " step " << step;
      if (clip > 0) EXPECT_GT(norm, clip) << what << ": the test means to clip";
      ref_opt.step(ctx, oc.lr);
      opt.step(ctx, oc.lr);
    }
    // Adam divides each gradient by its own running size, so elements with tiny gradients
    // carry their relative rounding differences into the weights: 1e-4 after 3 steps (the
    // whole-model F32 gradient tolerance of tests/test_gpu_models.cpp).
    expect_same_tensors(model.full_state_dict(ctx), ref, false, 1e-4, what + " after 3 steps");
  }
}

namespace {

// Bit for bit: every element's bits, NaN included.
void expect_bitwise(const Tensor& got, const Tensor& want, const std::string& what) {
  const Tensor a = got.to(Device::cpu()).contiguous(), b = want.to(Device::cpu()).contiguous();
  ASSERT_EQ(a.shape(), b.shape()) << what;
  ASSERT_EQ(a.dtype(), b.dtype()) << what;
  EXPECT_EQ(std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()), 0) << what << ": not bitwise equal";
}

}  // namespace

// parallel.tp_comm_overlap changes only the order of independent work (the column-parallel
// weight gradients beside dx's reduction, the LM head's last weight-gradient GEMM beside
// d_h's): the losses and every gradient (this rank's shards) bit for bit against it off.
// TP = the world size (1, 2, 4: K/V heads split at 2, replicated at 4), with and without
// sequence parallelism, F32 and BF16, two accumulating steps and a third after zero_grad.
TEST(DistTensorParallelModel, CommunicationOverlapIsBitIdentical) {
  Context ctx = Context::cpu();
  auto world = test_world();
  for (bool sp : {false, true})
  for (DType dtype : {DType::F32, DType::BF16})
  for (const ModelConfig& config : {tiny_gpt2(), tiny_llama(false), tiny_llama(true)}) {
    dist::ParallelGrid grid(ctx, world, {.data = 1, .tensor = world->size(), .pipeline = 1, .sequence_parallel = sp});
    nn::ParallelContext off = grid.context();
    // The config key reaches the layers through the grid's context (as in `tessera train`);
    // a tensor size of 1 has nothing to overlap and leaves it off.
    dist::ParallelGrid overlapped(ctx, world, {.data = 1, .tensor = world->size(), .pipeline = 1,
                                               .sequence_parallel = sp, .tp_comm_overlap = true});
    const nn::ParallelContext on = overlapped.context();
    EXPECT_EQ(on.tp_comm_overlap, world->size() > 1);
    EXPECT_FALSE(off.tp_comm_overlap);
    const std::string what = describe(config, on, dtype) + " overlap";
    TransformerLM a(config, dtype, off), b(config, dtype, on);
    a.init(ctx, 29);
    b.init(ctx, 29);
    for (int step = 0; step < 3; ++step) {
      if (step == 2) {
        a.zero_grad();
        b.zero_grad();
      }
      const auto [inputs, targets] = batch(40 + step, config.vocab_size);
      const double want = a.forward_backward(ctx, inputs, targets, 0.5f);
      const double got = b.forward_backward(ctx, inputs, targets, 0.5f);
      EXPECT_EQ(got, want) << what << " step " << step;
      const nn::ParameterList pa = a.parameters(), pb = b.parameters();
      ASSERT_EQ(pa.size(), pb.size());
      for (size_t i = 0; i < pa.size(); ++i)
        expect_bitwise(pb[i]->grad, pa[i]->grad, what + " step " + std::to_string(step) + " gradient of " + pa[i]->name);
    }
  }
}

namespace {

// A path every rank of the world agrees on (rank 0's pid).
std::string shared_path(Context& ctx, dist::ProcessGroup& world, const std::string& name) {
  Tensor id = Tensor::from_ints({static_cast<int64_t>(::getpid())}, {1}, DType::I64);
  world.broadcast(ctx, id, 0);
  return (std::filesystem::temp_directory_path() / ("tessera_tp_" + std::to_string(id.item(0)) + "_" + name)).string();
}

TransformerLM::NamedTensors read_named(const std::string& path) {
  const auto tensors = io::load_safetensors(path);
  return TransformerLM::NamedTensors(tensors.begin(), tensors.end());
}

}  // namespace

// Checkpoints in the full layout: written at TP 2 (data x tensor 2 x 2 at 4 ranks), read at
// TP 1 and, with 4 ranks, TP 4; weights and AdamW moments, and the next step agrees.
TEST(DistTensorParallelModel, FullLayoutCheckpointsMoveBetweenTensorSizes) {
  Context ctx = Context::cpu();
  auto world = test_world();
  if (world->size() % 2 != 0) GTEST_SKIP() << "needs an even number of ranks (TP 2)";
  const ModelConfig config = tiny_llama(false);
  train::OptimizerConfig oc;
  oc.lr = 1e-2;
  oc.warmup_steps = 0;
  oc.grad_clip = 0;
  const std::string weights_path = shared_path(ctx, *world, "model.safetensors");
  const std::string moments_path = shared_path(ctx, *world, "optimizer.safetensors");

  // Train 2 steps at TP 2 and save in the full layout.
  dist::ParallelGrid tp2(ctx, world, {.data = world->size() / 2, .tensor = 2, .pipeline = 1, .sequence_parallel = true});
  TransformerLM a(config, DType::F32, tp2.context());
  a.init(ctx, 23);
  train::Optimizer a_opt(a.parameters(), oc);
  for (int step = 0; step < 2; ++step) {
    const auto [inputs, targets] = batch(20 + step, config.vocab_size);
    a.zero_grad();
    a.forward_backward(ctx, inputs, targets);
    a_opt.step(ctx, oc.lr);
  }
  const TransformerLM::NamedTensors weights = a.full_state_dict(ctx);
  const TransformerLM::NamedTensors moments = a.gather_full(ctx, a_opt.state());
  if (world->rank() == 0) {
    io::save_safetensors(weights_path, weights);
    io::save_safetensors(moments_path, moments);
  }
  world->barrier();
  const auto [inputs, targets] = batch(30, config.vocab_size);
  a.zero_grad();
  const double a_loss = a.forward_backward(ctx, inputs, targets);
  a_opt.step(ctx, oc.lr);
  const TransformerLM::NamedTensors a_after = a.full_state_dict(ctx);

  auto resume = [&](const nn::ParallelContext& pc, const std::string& what) {
    TransformerLM b(config, DType::F32, pc);
    b.load_full_state(ctx, read_named(weights_path));
    train::Optimizer b_opt(b.parameters(), oc);
    b_opt.load_state(b.shard_full(read_named(moments_path)), 2);
    b.zero_grad();
    EXPECT_NEAR(b.forward_backward(ctx, inputs, targets), a_loss, kF32Tolerance * a_loss) << what;
    b_opt.step(ctx, oc.lr);
    const TransformerLM::NamedTensors b_after = b.full_state_dict(ctx);
    ASSERT_EQ(b_after.size(), a_after.size());
    for (size_t i = 0; i < a_after.size(); ++i)
      EXPECT_LT(relative_error(doubles_of(b_after[i].second), doubles_of(a_after[i].second)), kF32Tolerance)
          << what << " " << a_after[i].first;
  };
  resume({}, "TP 2 -> TP 1");
  if (world->size() == 4) {
    dist::ParallelGrid tp4(ctx, world, {.data = 1, .tensor = 4, .pipeline = 1});
    resume(tp4.context(), "TP 2 -> TP 4");
  }
  world->barrier();
  if (world->rank() == 0) {
    std::filesystem::remove(weights_path);
    std::filesystem::remove(moments_path);
  }
}

TEST(DistTensorParallelModel, ConfigsThatDoNotFitAreRefusedByName) {
  auto world = test_world();
  if (world->size() == 1) GTEST_SKIP() << "needs a tensor size above 1";
  Context ctx = Context::cpu();
  dist::ParallelGrid grid(ctx, world, {.data = 1, .tensor = world->size(), .pipeline = 1});
  auto message = [&](const ModelConfig& c) {
    try {
      TransformerLM model(c, DType::F32, grid.context());
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  ModelConfig heads = tiny_llama(false);
  heads.num_heads = world->size() == 2 ? 3 : 6;  // does not divide by the tensor size
  heads.num_kv_heads = 1;
  heads.hidden_size = 48;
  EXPECT_NE(message(heads).find("model.num_heads"), std::string::npos) << message(heads);
  ModelConfig kv = tiny_llama(false);
  kv.num_heads = 12;
  kv.num_kv_heads = 3;
  kv.hidden_size = 48;
  EXPECT_NE(message(kv).find("model.num_kv_heads"), std::string::npos) << message(kv);
  ModelConfig ffn = tiny_llama(false);
  ffn.intermediate_size = 4 * world->size() + 1;
  EXPECT_NE(message(ffn).find("model.intermediate_size"), std::string::npos) << message(ffn);
  ModelConfig moe = tiny_llama(false);
  moe.architecture = "mixtral";
  EXPECT_NE(message(moe).find("mixture-of-experts"), std::string::npos) << message(moe);
  // A vocabulary that does not divide is padded, not refused.
  ModelConfig vocab = tiny_gpt2();
  vocab.vocab_size = 4 * world->size() + 3;
  EXPECT_EQ(message(vocab), "no error");
}
