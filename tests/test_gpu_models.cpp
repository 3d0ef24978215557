// Whole models on the GPU against the CPU reference: a GPT-2 and a Llama (GQA, untied
// head) with identical weights give the same loss and gradients on both backends, and a
// short training run follows the same loss curve; in F32 (tight) and in BF16 mixed
// precision (BF16 compute, FP32 master weights and gradients; looser). Skipped, saying
// so, where no GPU is present.
#include <cmath>

#include "tessera/core/allocator.h"
#include "tessera/models/transformer_lm.h"
#include "tessera/train/optimizer.h"
#include "gpu_testing.h"

using namespace tessera;
using namespace tessera::testing;
using models::ModelConfig;
using models::TransformerLM;

namespace {

// Head dim 64 (the fast attention path), an odd vocabulary and sequence length.
ModelConfig small(const char* arch) {
  ModelConfig c;
  c.architecture = arch;
  c.vocab_size = 301;
  c.hidden_size = 128;
  c.num_layers = 2;
  c.num_heads = 2;
  c.num_kv_heads = c.is_gpt2() ? 2 : 1;
  c.intermediate_size = 344;
  c.max_seq_len = 64;
  c.rope_theta = 10000.0f;
  c.tie_embeddings = c.is_gpt2();
  return c;
}

// Copies every parameter's full-precision weights from `src` to `dst` (any devices).
void copy_weights(TransformerLM& src, TransformerLM& dst, Context& dst_ctx) {
  auto a = src.parameters(), b = dst.parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    b[i]->weights().copy_from(a[i]->weights().to(b[i]->weights().device()));
    b[i]->refresh_value(dst_ctx);
  }
}

struct Tolerance {
  double loss, grad;
};

void check_loss_and_gradients(const char* arch, DType gpu_dtype, Tolerance tol) {
  const ModelConfig config = small(arch);
  Context cpu = Context::cpu(), gpu = Context::cuda();
  TransformerLM reference(config, DType::F32), model(config, gpu_dtype);
  reference.init(cpu, 11);
  model.to(Device::cuda());
  copy_weights(reference, model, gpu);
  // A few randomly ignored targets exercise the masked mean.
  const Tensor inputs = random_ids({3, 37}, config.vocab_size, 1);
  Tensor targets = random_ids({3, 37}, config.vocab_size, 2);
  targets.set_item(5, TransformerLM::kIgnoreIndex);
  targets.set_item(60, TransformerLM::kIgnoreIndex);
  reference.zero_grad();
  model.zero_grad();
  const double want = reference.forward_backward(cpu, inputs, targets);
  const double got = model.forward_backward(gpu, inputs, targets);
  const std::string what = std::string(arch) + " " + dtype_name(gpu_dtype);
  ASSERT_TRUE(std::isfinite(got)) << what;
  EXPECT_LT(std::abs(got - want) / std::abs(want), tol.loss) << what << ": loss " << got << " vs " << want;
  auto a = reference.parameters(), b = model.parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(b[i]->grad.dtype(), DType::F32) << b[i]->name;
    EXPECT_LT(relative_error(b[i]->grad.to(Device::cpu()), a[i]->grad), tol.grad) << what << " gradient of " << a[i]->name;
  }
}

std::vector<double> train_curve(TransformerLM& model, Context& ctx, int steps) {
  train::OptimizerConfig oc;
  oc.lr = 3e-3;
  oc.warmup_steps = 0;
  oc.grad_clip = 1.0;
  train::Optimizer optimizer(model.parameters(), oc);
  std::vector<double> losses;
  for (int step = 1; step <= steps; ++step) {
    const Tensor inputs = random_ids({4, 32}, model.config().vocab_size, 100 + step % 3);
    const Tensor targets = random_ids({4, 32}, model.config().vocab_size, 200 + step % 3);
    model.zero_grad();
    losses.push_back(model.forward_backward(ctx, inputs, targets));
    optimizer.step(ctx, train::learning_rate(oc, step, steps));
  }
  return losses;
}

void check_training_curve(const char* arch, DType gpu_dtype, double tol) {
  const ModelConfig config = small(arch);
  Context cpu = Context::cpu(), gpu = Context::cuda();
  TransformerLM reference(config, DType::F32), model(config, gpu_dtype);
  reference.init(cpu, 3);
  model.to(Device::cuda());
  copy_weights(reference, model, gpu);
  const int steps = 25;
  const std::vector<double> want = train_curve(reference, cpu, steps), got = train_curve(model, gpu, steps);
  EXPECT_LT(want.back(), want.front() - 0.5) << "the reference run must learn for this test to mean anything";
  for (int i = 0; i < steps; ++i)
    EXPECT_LT(std::abs(got[i] - want[i]) / want[i], tol) << arch << " " << dtype_name(gpu_dtype) << " step " << i + 1
                                                         << ": " << got[i] << " vs " << want[i];
}

}  // namespace

TEST(GpuModels, Gpt2F32MatchesTheCpu) {
  REQUIRE_GPU();
  check_loss_and_gradients("gpt2", DType::F32, {1e-5, 1e-4});
}
TEST(GpuModels, LlamaF32MatchesTheCpu) {
  REQUIRE_GPU();
  check_loss_and_gradients("llama", DType::F32, {1e-5, 1e-4});
}
TEST(GpuModels, Gpt2Bf16MatchesTheCpu) {
  REQUIRE_GPU();
  check_loss_and_gradients("gpt2", DType::BF16, {1e-2, 5e-2});
}
TEST(GpuModels, LlamaBf16MatchesTheCpu) {
  REQUIRE_GPU();
  check_loss_and_gradients("llama", DType::BF16, {1e-2, 5e-2});
}
TEST(GpuModels, TrainingCurvesAgree) {
  REQUIRE_GPU();
  check_training_curve("gpt2", DType::F32, 1e-3);
  check_training_curve("llama", DType::F32, 1e-3);
  check_training_curve("gpt2", DType::BF16, 3e-2);
  check_training_curve("llama", DType::BF16, 3e-2);
}
