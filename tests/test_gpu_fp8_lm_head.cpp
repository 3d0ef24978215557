// The FP8 LM head (TransformerLM::use_fp8_lm_head) on CUDA against its CPU emulation: the
// same casts (bit-matching CPU references), cuBLASLt's FP8 GEMMs against the dequantized
// reference GEMMs. A vocabulary that is a multiple of 64 and one that CUDA pads (96 -> 128:
// the padding rows must stay out of the result), two chunks with ignored targets, gradient
// scaling, the static dlogits scale at its bound, NaN propagation, and the fused
// cross-entropy backward with FP8 output against the unfused path. Skipped, saying so,
// where no GPU is present.
#include <cmath>

#include "tessera/core/stream.h"
#include "tessera/models/fp8_model.h"
#include "tessera/models/transformer_lm.h"
#include "tessera/train/optimizer.h"
#include "train/cuda_graph_step.h"
#include "tessera/ops/loss.h"
#include "tessera/ops/quantize.h"
#include "gpu_testing.h"

using namespace tessera;
using namespace tessera::testing;
using models::ModelConfig;
using models::TransformerLM;

namespace {

ModelConfig head_config(int64_t vocab) {
  ModelConfig c;
  c.architecture = "llama";
  c.vocab_size = vocab;
  c.hidden_size = 64;
  c.num_layers = 1;
  c.num_heads = 1;
  c.num_kv_heads = 1;
  c.intermediate_size = 64;
  c.max_seq_len = 32;
  c.tie_embeddings = true;
  return c;
}

struct HeadRun {
  double loss;
  Tensor d_h, d_w;  // host copies
};

HeadRun run(TransformerLM& model, Context& ctx, const Tensor& h, const Tensor& targets, float scale) {
  model.zero_grad();
  Tensor d_h = Tensor::empty(h.shape(), h.dtype());
  poison(d_h);
  d_h = d_h.to(ctx.device);
  const double loss = model.head_forward_backward(ctx, h.to(ctx.device), targets, &d_h, scale);
  return {loss, d_h.to(Device::cpu()), model.token_embedding.grad.to(Device::cpu())};
}

void check(int64_t vocab, int64_t rows, float scale, bool confident_wrong) {
  Context cpu = Context::cpu(), gpu = Context::cuda();
  const ModelConfig c = head_config(vocab);
  TransformerLM ref(c, DType::BF16), model(c, DType::BF16);
  ref.init(cpu, 3);
  model.init(cpu, 3);
  Tensor h = random_tensor({rows, 64}, DType::BF16, 4, -2, 2);
  Tensor targets = random_ids({rows}, vocab, 5);
  for (int64_t i = 2; i < rows; i += 9) targets.set_item(i, TransformerLM::kIgnoreIndex);
  if (confident_wrong) {
    for (TransformerLM* m : {&ref, &model}) {
      for (int64_t k = 0; k < 64; ++k) m->token_embedding.weights().set_item(5 * 64 + k, 4.0);
      m->refresh_values(cpu);
    }
    for (int64_t i = 0; i < h.numel(); ++i) h.set_item(i, 1.0);
    for (int64_t i = 0; i < rows; ++i) targets.set_item(i, 7);
  }
  model.to(Device::cuda());
  ref.use_fp8_lm_head(fp8::Format::Hybrid);
  model.use_fp8_lm_head(fp8::Format::Hybrid);
  const HeadRun want = run(ref, cpu, h, targets, scale);
  const HeadRun got = run(model, gpu, h, targets, scale);
  const std::string what = "vocab " + std::to_string(vocab) + " rows " + std::to_string(rows) + " scale " +
                           std::to_string(scale) + (confident_wrong ? " confident-wrong" : "");
  ASSERT_TRUE(std::isfinite(got.loss)) << what;
  // The same FP8 operands; the GPU's forward GEMM uses fast accumulation and its BF16 logits
  // can round one ulp apart, which moves a few FP8 gradient codes by one step.
  EXPECT_LT(std::abs(got.loss - want.loss), 2e-3 * std::abs(want.loss) + 1e-4) << what;
  EXPECT_LT(relative_error(got.d_h, want.d_h), 2e-2) << what;
  EXPECT_LT(relative_error(got.d_w, want.d_w), 2e-2) << what;
}

}  // namespace

TEST(GpuFp8LmHead, MatchesTheCpuEmulation) {
  REQUIRE_GPU();
  for (const int64_t vocab : {128, 96}) {
    check(vocab, 64, 1.0f, false);
    check(vocab, TransformerLM::kHeadChunkRows + 48, 0.25f, false);  // two chunks
    check(vocab, 32, 1.0f, true);
    check(vocab, 32, 1024.0f, true);
  }
}

TEST(GpuFp8LmHead, NanPropagates) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  TransformerLM model(head_config(128), DType::BF16);
  model.init(cpu, 3);
  model.to(Device::cuda());
  model.use_fp8_lm_head(fp8::Format::Hybrid);
  Tensor h = random_tensor({32, 64}, DType::BF16, 4);
  h.set_item(17, NAN);
  const HeadRun got = run(model, gpu, h, random_ids({32}, 128, 5), 1.0f);
  EXPECT_TRUE(std::isnan(got.loss));
}

// The fused cross-entropy backward with FP8 output against the unfused CUDA path (the BF16
// backward, then quantize_per_tensor): the same codes, byte for byte, padding columns 0.
// Odd vocabularies (a scalar tail), ignored rows, I32 and I64 targets, both FP8 formats.
TEST(GpuFp8LmHead, FusedBackwardMatchesTheUnfusedPath) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  uint64_t seed = 40;
  for (const int64_t vocab : {96, 100, 1000, 4103}) {
    for (const int64_t rows : {1, 37, 256}) {
      for (const DType tdt : {DType::I32, DType::I64}) {
        for (const DType fp8_dtype : {DType::E4M3, DType::E5M2}) {
          const int64_t width = (vocab + 7) / 8 * 8;
          Tensor buffer = Tensor::empty({rows, width}, DType::BF16);
          buffer.copy_from(random_tensor({rows, width}, DType::BF16, ++seed, -6, 6));
          const Tensor logits = buffer.to(kCuda).slice(1, 0, vocab);  // row stride `width`
          Tensor ids = random_ids({rows}, vocab, ++seed);
          for (int64_t i = 1; i < rows; i += 5) ids.set_item(i, TransformerLM::kIgnoreIndex);
          Tensor targets = Tensor::empty({rows}, tdt);
          for (int64_t i = 0; i < rows; ++i) targets.set_item(i, ids.item(i));
          targets = targets.to(kCuda);
          Tensor loss = Tensor::empty({1}, DType::F32, kCuda), lse = Tensor::empty({rows}, DType::F32, kCuda);
          cross_entropy_forward(gpu, logits, targets, loss, lse, {.ignore_index = TransformerLM::kIgnoreIndex});
          const float d_loss = 0.37f;
          const Tensor scale = Tensor::from_floats({fp8_max(fp8_dtype) * float(rows) / d_loss * 0.5f}, {1}).to(kCuda);

          Tensor scratch = Tensor::zeros({rows, width}, DType::BF16, kCuda);
          Tensor d_logits = scratch.slice(1, 0, vocab);
          cross_entropy_backward(gpu, logits, targets, lse, d_loss, d_logits,
                                 {.ignore_index = TransformerLM::kIgnoreIndex});
          Tensor want = poisoned_device({rows, width}, fp8_dtype), got = poisoned_device({rows, width}, fp8_dtype);
          quantize_per_tensor(gpu, scratch, scale, want);
          cross_entropy_backward_fp8(gpu, logits, targets, lse, d_loss, scale, got,
                                     {.ignore_index = TransformerLM::kIgnoreIndex});
          const auto a = bytes_of(got), b = bytes_of(want);
          int64_t differ = 0;
          for (size_t i = 0; i < a.size(); ++i) differ += a[i] != b[i];
          EXPECT_EQ(differ, 0) << "vocab " << vocab << " rows " << rows << " " << dtype_name(tdt) << " "
                               << dtype_name(fp8_dtype);
        }
      }
    }
  }
}

// The FP8 head inside a captured step (what `bench_train_step --cuda-graph --fp8-lm-head`
// times): the same losses and weights, bit for bit, as the eager loop. The static dlogits
// scale travels as a kernel argument and W / h use current scaling on the device, so the
// replay needs nothing from the host. Vocabulary 301 (padded to 320 on the GPU).
TEST(GpuFp8LmHead, CapturedStepMatchesEager) {
  REQUIRE_GPU();
  ModelConfig c = head_config(301);
  c.hidden_size = 128;
  c.num_heads = 2;
  c.intermediate_size = 256;
  const int64_t batch = 4, seq = 32, steps = 6;
  const fp8::Recipe recipe = fp8::Recipe::from_json({{"recipe", "delayed"}, {"lm_head", true}});
  std::vector<std::vector<data::Batch>> batches(steps);
  for (int64_t s = 0; s < steps; ++s)
    batches[s].push_back({random_ids({batch, seq}, c.vocab_size, 2 * (s % 2)),
                          random_ids({batch, seq}, c.vocab_size, 2 * (s % 2) + 1)});
  train::OptimizerConfig oc;
  oc.lr = 3e-3;

  Context ectx = Context::cuda();
  TransformerLM a(c, DType::BF16);
  a.to(kCuda);
  a.init(ectx, 17);
  auto fp8_a = models::enable_fp8(ectx, a, recipe);
  ASSERT_TRUE(a.fp8_lm_head());
  train::Optimizer oa(a.parameters(), oc);
  std::vector<double> eager;
  for (int64_t s = 0; s < steps; ++s) {
    a.zero_grad();
    eager.push_back(a.forward_backward(ectx, batches[s][0].inputs, batches[s][0].targets));
    fp8_a->end_micro_batch(ectx);
    oa.step(ectx, oc.lr);
    fp8_a->end_step(ectx);
  }

  const Stream stream = Stream::create(kCuda);
  Context gctx = stream.context();
  const StreamGuard guard(gctx);
  TransformerLM b(c, DType::BF16);
  b.to(kCuda);
  b.init(gctx, 17);
  auto fp8_b = models::enable_fp8(gctx, b, recipe);
  train::Optimizer ob(b.parameters(), oc);
  train::CudaGraphStep graph(gctx, b, ob, {.batch_size = batch, .seq_len = seq, .grad_accum = 1, .warmup_steps = 2});
  for (int64_t s = 0; s < steps; ++s) {
    const train::CudaGraphStep::Result r = graph.step(batches[s], oc.lr);
    ASSERT_TRUE(std::isfinite(r.loss)) << "step " << s;
    EXPECT_EQ(r.loss, eager[s]) << "step " << s;
  }
  EXPECT_TRUE(graph.captured()) << graph.failure();
  auto pa = a.parameters(), pb = b.parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i)
    EXPECT_EQ(bytes_of(pa[i]->weights()), bytes_of(pb[i]->weights())) << pa[i]->name;
}
