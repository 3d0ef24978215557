// The optional FP8 LM head (fp8.lm_head, TransformerLM::use_fp8_lm_head) on the CPU, where
// the FP8 GEMMs are the dequantized reference: the head's loss and gradients stay close to
// the BF16 head, equal a reference built by hand from the dequantized operands (current
// scaling for h and W, the static dlogits scale fp8_max * valid / |scale|), never overflow
// with a confident wrong prediction, fall back to BF16 for sizes the FP8 GEMMs cannot take,
// parse from the `fp8` block, and a tiny Llama trains with it; and the cross-entropy backward
// with FP8 output (cross_entropy_backward_fp8) it uses.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include "testing.h"
#include "tessera/fp8/quantized_tensor.h"
#include "tessera/models/fp8_model.h"
#include "tessera/models/transformer_lm.h"
#include "tessera/ops/elementwise.h"
#include "tessera/ops/gemm.h"
#include "tessera/ops/loss.h"
#include "tessera/ops/quantize.h"
#include "tessera/train/optimizer.h"

using namespace tessera;
using namespace tessera::testing;
using models::ModelConfig;
using models::TransformerLM;

namespace {

// vocab 96: a multiple of 16 (the CPU runs the FP8 head) but not of 64 (CUDA pads it).
ModelConfig tiny_llama(int64_t vocab = 96) {
  ModelConfig c;
  c.architecture = "llama";
  c.vocab_size = vocab;
  c.hidden_size = 32;
  c.num_layers = 2;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.intermediate_size = 64;
  c.max_seq_len = 32;
  c.tie_embeddings = true;
  return c;
}

// Targets [rows] with every 7th ignored.
Tensor head_targets(int64_t rows, int64_t vocab, uint64_t seed) {
  Tensor t = random_ids({rows}, vocab, seed);
  for (int64_t i = 3; i < rows; i += 7) t.set_item(i, TransformerLM::kIgnoreIndex);
  return t;
}

struct HeadResult {
  double loss;
  Tensor d_h, d_w;  // d_w: the head weight's gradient (F32)
};

HeadResult run_head(TransformerLM& model, Context& ctx, const Tensor& h, const Tensor& targets, float scale) {
  model.zero_grad();
  Tensor d_h = Tensor::empty(h.shape(), h.dtype(), ctx.device);
  poison(d_h);
  const double loss = model.head_forward_backward(ctx, h, targets, &d_h, scale);
  return {loss, d_h, model.token_embedding.grad.to(Device::cpu())};
}

// Current scaling as the head does it: the tensor's own amax, margin 0, E4M3.
fp8::QuantizedTensor cast_current(Context& ctx, const Tensor& x) {
  Tensor a = Tensor::empty({1}, DType::F32), s = Tensor::empty({1}, DType::F32);
  amax(ctx, x, a);
  s.data<float>()[0] = fp8_scale_from_amax(a.data<float>()[0], DType::E4M3);
  return fp8::quantize_with_transpose(ctx, x, s, DType::E4M3);
}

}  // namespace

TEST(Fp8LmHead, StaysCloseToTheBf16Head) {
  Context ctx = Context::cpu();
  for (const fp8::Format format : {fp8::Format::Hybrid, fp8::Format::E4M3}) {
    TransformerLM bf16(tiny_llama(), DType::BF16), fp8h(tiny_llama(), DType::BF16);
    bf16.init(ctx, 3);
    fp8h.init(ctx, 3);
    fp8h.use_fp8_lm_head(format);
    ASSERT_TRUE(fp8h.fp8_lm_head());
    const Tensor h = random_tensor({80, 32}, DType::BF16, 4, -2, 2);
    const Tensor targets = head_targets(80, 96, 5);
    const HeadResult want = run_head(bf16, ctx, h, targets, 0.5f);
    const HeadResult got = run_head(fp8h, ctx, h, targets, 0.5f);
    std::printf("[format %s] loss %.6f vs %.6f, d_h rel err %.4f, d_w rel err %.4f\n",
                format == fp8::Format::Hybrid ? "hybrid" : "e4m3", got.loss, want.loss,
                relative_error(got.d_h, want.d_h), relative_error(got.d_w, want.d_w));
    EXPECT_NE(got.d_w.to_doubles(), want.d_w.to_doubles());  // the FP8 path did run
    // The FP8 linear layer's tolerances (test_fp8_linear.cpp: outputs 0.06, gradients 0.1).
    EXPECT_LT(std::abs(got.loss - want.loss), 0.02 * want.loss);
    EXPECT_LT(relative_error(got.d_h, want.d_h), 0.1);
    EXPECT_LT(relative_error(got.d_w, want.d_w), 0.1);
  }
}

// The FP8 path is exactly: h, W cast with current scaling; logits = BF16(h_q W_q^T); the
// cross-entropy and its BF16 gradient; that gradient cast with the static scale; dh and dW
// from the dequantized operands. Over two chunks (1040 rows), ignored rows included.
TEST(Fp8LmHead, EqualsTheDequantizedReference) {
  Context ctx = Context::cpu();
  const int64_t rows = TransformerLM::kHeadChunkRows + 16, vocab = 96;
  TransformerLM model(tiny_llama(vocab), DType::BF16);
  model.init(ctx, 7);
  model.use_fp8_lm_head(fp8::Format::Hybrid);
  const Tensor h = random_tensor({rows, 32}, DType::BF16, 8, -3, 3);
  Tensor targets = head_targets(rows, vocab, 9);
  for (int64_t i = rows - 16; i < rows - 4; ++i) targets.set_item(i, TransformerLM::kIgnoreIndex);  // unequal chunks
  const float scale = 0.25f;
  const HeadResult got = run_head(model, ctx, h, targets, scale);

  const fp8::QuantizedTensor hq = cast_current(ctx, h), wq = cast_current(ctx, model.token_embedding.value);
  const Tensor hd = fp8::dequantize(ctx, hq), wd = fp8::dequantize(ctx, wq);  // F32
  Tensor logits32 = Tensor::empty({rows, vocab}, DType::F32), logits = Tensor::empty({rows, vocab}, DType::BF16);
  gemm(ctx, hd, wd, logits32, {.transpose_b = true});
  cast(ctx, logits32, logits);
  Tensor loss = Tensor::empty({1}, DType::F32), lse = Tensor::empty({rows}, DType::F32);
  cross_entropy_forward(ctx, logits, targets, loss, lse, {.ignore_index = TransformerLM::kIgnoreIndex});
  EXPECT_NEAR(got.loss, loss.item(0), 1e-5 * loss.item(0));

  Tensor dl = Tensor::empty({rows, vocab}, DType::BF16);
  cross_entropy_backward(ctx, logits, targets, lse, scale, dl, {.ignore_index = TransformerLM::kIgnoreIndex});
  int64_t valid = 0;
  for (int64_t i = 0; i < rows; ++i) valid += targets.item(i) != TransformerLM::kIgnoreIndex;
  Tensor dl_scale = Tensor::from_floats({static_cast<float>(fp8_max(DType::E5M2) * double(valid) / scale)}, {1});
  const Tensor dld = fp8::dequantize(ctx, fp8::quantize_with_transpose(ctx, dl, dl_scale, DType::E5M2));
  Tensor dh = Tensor::empty({rows, 32}, DType::F32), dw = Tensor::zeros({vocab, 32}, DType::F32);
  gemm(ctx, dld, wd, dh);
  gemm(ctx, dld, hd, dw, {.transpose_a = true});
  // dh lands in BF16 (one rounding); dW in F32 (summation order only). The chunked backward
  // scales each chunk's d_loss by its share, so a few BF16 dlogits round differently.
  std::printf("against the dequantized reference: loss %.8f vs %.8f, d_h %.2e, d_w %.2e\n", got.loss, loss.item(0),
              relative_error(got.d_h, dh), relative_error(got.d_w, dw));
  EXPECT_LT(relative_error(got.d_h, dh), 5e-3);  // measured 1.7e-3
  EXPECT_LT(relative_error(got.d_w, dw), 1e-5);  // measured 2.8e-7
}

// A confident wrong prediction: softmax puts ~1 on a wrong class, so dlogits reach the bound
// |scale| / valid in both signs. The static scale maps that to fp8_max: codes saturate at
// most, never Inf or NaN, and the gradients still match the BF16 head.
TEST(Fp8LmHead, StaticScaleNeverOverflows) {
  Context ctx = Context::cpu();
  for (const fp8::Format format : {fp8::Format::Hybrid, fp8::Format::E4M3}) {
    for (const float scale : {1.0f, 1.0f / 64, 1024.0f}) {
      TransformerLM bf16(tiny_llama(), DType::BF16), fp8h(tiny_llama(), DType::BF16);
      for (TransformerLM* m : {&bf16, &fp8h}) {
        m->init(ctx, 11);
        // Row 5 of W aligned with every h row, with a large norm: logit 5 dominates.
        Tensor w = m->token_embedding.weights();
        for (int64_t c = 0; c < 32; ++c) w.set_item(5 * 32 + c, 4.0);
        m->refresh_values(ctx);
      }
      fp8h.use_fp8_lm_head(format);
      Tensor h = Tensor::empty({32, 32}, DType::BF16);
      for (int64_t i = 0; i < h.numel(); ++i) h.set_item(i, 1.0);
      Tensor targets = Tensor::empty({32}, DType::I64);
      for (int64_t i = 0; i < 32; ++i) targets.set_item(i, 7);  // never class 5
      const HeadResult want = run_head(bf16, ctx, h, targets, scale);
      const HeadResult got = run_head(fp8h, ctx, h, targets, scale);
      ASSERT_TRUE(std::isfinite(got.loss)) << scale;
      EXPECT_GT(got.loss, 50.0);  // p(target) ~ e^-128: the prediction is confidently wrong
      for (double v : got.d_h.to_doubles()) ASSERT_TRUE(std::isfinite(v)) << scale;
      for (double v : got.d_w.to_doubles()) ASSERT_TRUE(std::isfinite(v)) << scale;
      EXPECT_LT(relative_error(got.d_h, want.d_h), 0.1) << scale;
      EXPECT_LT(relative_error(got.d_w, want.d_w), 0.1) << scale;
    }
  }
}

// Rows that are not a multiple of 16 (or a vocabulary that is not, on the CPU) run the
// BF16 head: the same bits as without the option.
TEST(Fp8LmHead, SizesTheFp8GemmsCannotTakeRunInBf16) {
  Context ctx = Context::cpu();
  for (const auto& [rows, vocab] : {std::pair<int64_t, int64_t>{40, 96}, std::pair<int64_t, int64_t>{48, 100}}) {
    TransformerLM bf16(tiny_llama(vocab), DType::BF16), fp8h(tiny_llama(vocab), DType::BF16);
    bf16.init(ctx, 3);
    fp8h.init(ctx, 3);
    fp8h.use_fp8_lm_head(fp8::Format::Hybrid);
    const Tensor h = random_tensor({rows, 32}, DType::BF16, 4, -2, 2);
    const Tensor targets = head_targets(rows, vocab, 5);
    const HeadResult want = run_head(bf16, ctx, h, targets, 1.0f);
    const HeadResult got = run_head(fp8h, ctx, h, targets, 1.0f);
    EXPECT_EQ(got.loss, want.loss);
    EXPECT_EQ(got.d_h.to_doubles(), want.d_h.to_doubles());
    EXPECT_EQ(got.d_w.to_doubles(), want.d_w.to_doubles());
  }
}

// The op behind the head's backward: the codes of the BF16 gradient cast with the scale, and
// code 0 in the padding columns [V, W).
TEST(Fp8LmHead, CrossEntropyBackwardFp8) {
  Context ctx = Context::cpu();
  const int64_t rows = 9, vocab = 21, width = 24;
  const Tensor logits = random_tensor({rows, vocab}, DType::BF16, 1, -4, 4);
  Tensor targets = random_ids({rows}, vocab, 2);
  targets.set_item(4, -100);
  Tensor loss = Tensor::empty({1}, DType::F32), lse = Tensor::empty({rows}, DType::F32);
  cross_entropy_forward(ctx, logits, targets, loss, lse);
  const Tensor scale = Tensor::from_floats({300.0f}, {1});
  for (const DType fp8_dtype : {DType::E4M3, DType::E5M2}) {
    Tensor q = Tensor::empty({rows, width}, fp8_dtype);
    poison(q);
    cross_entropy_backward_fp8(ctx, logits, targets, lse, 0.5f, scale, q);
    Tensor dl = Tensor::empty({rows, vocab}, DType::BF16), want = Tensor::empty({rows, vocab}, fp8_dtype);
    cross_entropy_backward(ctx, logits, targets, lse, 0.5f, dl);
    quantize_per_tensor(ctx, dl, scale, want);
    for (int64_t n = 0; n < rows; ++n)
      for (int64_t v = 0; v < width; ++v)
        ASSERT_EQ(q.item(n * width + v), v < vocab ? want.item(n * vocab + v) : 0.0) << n << " " << v;
    Tensor small = Tensor::empty({rows, vocab - 1}, fp8_dtype);
    EXPECT_THROW(cross_entropy_backward_fp8(ctx, logits, targets, lse, 0.5f, scale, small), Error);
    Tensor bf16 = Tensor::empty({rows, width}, DType::BF16);
    EXPECT_THROW(cross_entropy_backward_fp8(ctx, logits, targets, lse, 0.5f, scale, bf16), Error);
  }
}

// NaN never passes: a NaN in h makes the loss NaN (its amax is NaN, the scale falls back to 1
// and the NaN code reaches the GEMM).
TEST(Fp8LmHead, NanPropagates) {
  Context ctx = Context::cpu();
  TransformerLM model(tiny_llama(), DType::BF16);
  model.init(ctx, 3);
  model.use_fp8_lm_head(fp8::Format::Hybrid);
  Tensor h = random_tensor({32, 32}, DType::BF16, 4);
  h.set_item(17, NAN);
  const HeadResult got = run_head(model, ctx, h, head_targets(32, 96, 5), 1.0f);
  EXPECT_TRUE(std::isnan(got.loss));
}

TEST(Fp8LmHead, ConfigKey) {
  EXPECT_FALSE(fp8::Recipe::from_json({{"recipe", "delayed"}}).lm_head);
  EXPECT_FALSE(fp8::Recipe::from_json({{"recipe", "delayed"}}).to_json().contains("lm_head"));
  for (const char* name : {"delayed", "current", "block", "mxfp8"}) {
    const fp8::Recipe r = fp8::Recipe::from_json({{"recipe", name}, {"lm_head", true}});
    EXPECT_TRUE(r.lm_head) << name;
    EXPECT_EQ(r.name(), name);
    const fp8::Recipe back = fp8::Recipe::from_json(r.to_json());
    EXPECT_TRUE(back.lm_head) << name;
    EXPECT_EQ(back.to_json(), r.to_json()) << name;
  }
  EXPECT_THROW(fp8::Recipe::from_json({{"recipe", "current"}, {"lm_head", 1}}), Error);
  EXPECT_THROW(fp8::Recipe::from_json({{"recipe", "current"}, {"lm_head", true}, {"bogus", 1}}), Error);

  Context ctx = Context::cpu();
  TransformerLM model(tiny_llama(), DType::BF16);
  models::enable_fp8(ctx, model, fp8::Recipe::from_json({{"recipe", "current"}}));
  EXPECT_FALSE(model.fp8_lm_head());
  models::enable_fp8(ctx, model, fp8::Recipe::from_json({{"recipe", "current"}, {"lm_head", true}}));
  EXPECT_TRUE(model.fp8_lm_head());
  models::disable_fp8(model);
  EXPECT_FALSE(model.fp8_lm_head());
}

// A tiny Llama trains with the FP8 head (and FP8 blocks) about as well as without it.
TEST(Fp8LmHead, TinyLlamaTrains) {
  Context ctx = Context::cpu();
  const ModelConfig c = tiny_llama(64);
  const int64_t batch = 2, seq = 32;
  Tensor inputs = Tensor::empty({batch, seq}, DType::I32), targets = Tensor::empty({batch, seq}, DType::I32);
  for (int64_t i = 0; i < batch * seq; ++i) {  // next = (3 * current + 1) mod V
    inputs.data<int32_t>()[i] = static_cast<int32_t>((i * 7) % c.vocab_size);
    targets.data<int32_t>()[i] = static_cast<int32_t>((3 * inputs.data<int32_t>()[i] + 1) % c.vocab_size);
  }
  std::vector<double> final_loss;
  for (const bool head : {false, true}) {
    TransformerLM model(c, DType::BF16);
    model.init(ctx, 5);
    auto scaling = models::enable_fp8(ctx, model, fp8::Recipe::from_json({{"recipe", "delayed"}, {"lm_head", head}}));
    ASSERT_EQ(model.fp8_lm_head(), head);
    train::OptimizerConfig oc;
    oc.lr = 1e-2;
    train::Optimizer optimizer(model.parameters(), oc);
    double loss = 0, first = 0;
    std::string curve;
    for (int step = 0; step < 30; ++step) {
      model.zero_grad();
      loss = model.forward_backward(ctx, inputs, targets);
      if (step == 0) first = loss;
      if (step % 5 == 0 || step == 29) curve += " " + std::to_string(step) + ":" + std::to_string(loss);
      scaling->end_micro_batch(ctx);
      optimizer.step(ctx, oc.lr);
      scaling->end_step(ctx);
    }
    std::printf("[fp8 lm_head=%d] loss%s\n", int(head), curve.c_str());
    ASSERT_TRUE(std::isfinite(loss)) << head;
    EXPECT_LT(loss, 0.5 * first) << head;
    final_loss.push_back(loss);
  }
  EXPECT_LT(std::abs(final_loss[1] - final_loss[0]), 0.1 * final_loss[0] + 0.05);
}
