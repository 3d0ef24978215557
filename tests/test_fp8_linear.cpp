// FP8 linear layers (nn::Linear bound to an Fp8Scaling) on the CPU, where the FP8 GEMM is the
// dequantized reference: the forward equals the FP8 GEMM of the recipe's casts bit for bit,
// the three GEMMs stay close to the BF16 layer, sizes the FP8 GEMMs cannot take fall back to
// BF16, delayed scaling moves its scales after a step, and a small GPT-2 and Llama train in
// FP8 about as well as in BF16.
#include <gtest/gtest.h>

#include <cmath>

#include "model_testing.h"
#include "testing.h"
#include "tessera/fp8/quantized_tensor.h"
#include "tessera/models/fp8_model.h"
#include "tessera/models/transformer_lm.h"
#include "tessera/nn/linear.h"
#include "tessera/nn/mlp.h"
#include "tessera/ops/gemm.h"
#include "tessera/ops/quantize.h"
#include "tessera/train/optimizer.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

fp8::Recipe recipe_named(const std::string& name) {
  return fp8::Recipe::from_json({{"recipe", name}});
}

// The bytes of a CPU tensor, for bit-exact comparisons.
std::vector<uint8_t> bytes_of(const Tensor& t) {
  const Tensor c = t.contiguous();
  const auto* p = static_cast<const uint8_t*>(c.raw_data());
  return std::vector<uint8_t>(p, p + c.nbytes());
}

nn::Linear bf16_linear(int64_t in, int64_t out, bool bias, uint64_t seed) {
  nn::Linear layer("l", in, out, bias, DType::BF16);
  layer.weight.value.copy_from(random_tensor({out, in}, DType::BF16, seed, -0.3f, 0.3f));
  if (bias) layer.bias.value.copy_from(random_tensor({out}, DType::BF16, seed + 1));
  return layer;
}

}  // namespace

TEST(Fp8Linear, ForwardIsTheFp8GemmOfTheRecipesCasts) {
  Context ctx = Context::cpu();
  nn::Linear layer = bf16_linear(32, 48, true, 1);
  auto scaling = std::make_shared<nn::Fp8Scaling>(ctx, recipe_named("current"), 1);
  layer.use_fp8({scaling, 0});
  const Tensor x = random_tensor({64, 32}, DType::BF16, 3, -2, 2);
  nn::Linear::Saved saved;
  const Tensor y = layer.forward(ctx, x, saved);
  ASSERT_TRUE(saved.fp8);
  EXPECT_FALSE(saved.x.defined());  // the FP8 copy is what is kept for the backward

  // By hand: current scaling from each tensor's amax, then the TN FP8 GEMM with the bias.
  const auto cast = [&](const Tensor& t, DType fp8_dtype) {
    Tensor a = Tensor::empty({1}, DType::F32), scale = Tensor::empty({1}, DType::F32);
    amax(ctx, t, a);
    scale.data<float>()[0] = fp8_scale_from_amax(a.data<float>()[0], fp8_dtype);
    return fp8::quantize_with_transpose(ctx, t, scale, fp8_dtype);
  };
  const fp8::QuantizedTensor xq = cast(x, DType::E4M3), wq = cast(layer.weight.value, DType::E4M3);
  Tensor want = Tensor::empty({64, 48}, DType::BF16);
  fp8::Fp8GemmOptions options;
  options.bias = layer.bias.value;
  fp8::fp8_gemm(ctx, xq, false, wq, true, want, options);
  EXPECT_EQ(y.to_doubles(), want.to_doubles());
}

// What the FP8 path keeps between forward and backward: the transposed copies of x and W
// (what dx = dy W and dW = dy^T x read), not the row-wise ones; dy's row-wise copy goes
// after the dx GEMM. The results are those of the full copies (ForwardIs... above, and the
// LayerNormLinear / model tests, compare bits).
TEST(Fp8Linear, KeepsOnlyTheCopiesTheBackwardReads) {
  Context ctx = Context::cpu();
  for (const char* recipe : {"current", "delayed"}) {
    nn::Linear layer = bf16_linear(32, 48, true, 1);
    auto scaling = std::make_shared<nn::Fp8Scaling>(ctx, recipe_named(recipe), 1);
    EXPECT_FALSE(scaling->keep_weight_transpose()) << "the default drops W^T after the forward";
    scaling->set_keep_weight_transpose(true);
    layer.use_fp8({scaling, 0});
    const Tensor x = random_tensor({64, 32}, DType::BF16, 3, -2, 2);
    const Tensor dy = random_tensor({64, 48}, DType::BF16, 4);
    nn::Linear::Saved saved;
    layer.forward(ctx, x, saved);
    ASSERT_TRUE(saved.fp8);
    EXPECT_FALSE(saved.x_fp8.data.defined()) << recipe;
    EXPECT_FALSE(saved.w_fp8.data.defined()) << recipe;
    ASSERT_TRUE(saved.x_fp8.data_t.defined() && saved.w_fp8.data_t.defined()) << recipe;
    EXPECT_EQ(saved.x_fp8.data_t.shape(), (Shape{32, 64}));
    EXPECT_EQ(saved.w_fp8.data_t.shape(), (Shape{32, 48}));
    EXPECT_FALSE(saved.w_scale.defined()) << recipe;
    // Without keep_weight_transpose only W's scale stays.
    scaling->set_keep_weight_transpose(false);
    nn::Linear::Saved lean;
    layer.forward(ctx, x, lean);
    EXPECT_FALSE(lean.w_fp8.data.defined() || lean.w_fp8.data_t.defined() || lean.w_fp8.scale_inv.defined()) << recipe;
    ASSERT_TRUE(lean.w_scale.defined() && lean.x_fp8.data_t.defined()) << recipe;
    EXPECT_EQ(lean.w_scale.shape(), (Shape{1}));
    scaling->set_keep_weight_transpose(true);
    // x^T is the transpose of what quantizing x gives now (same scale: current scaling's own
    // amax; delayed scaling's scale does not move before end_step).
    const fp8::QuantizedTensor again = scaling->quantize(ctx, x, 0, nn::Fp8Scaling::kInput);
    EXPECT_EQ(saved.x_fp8.data_t.to_doubles(), again.data_t.to_doubles()) << recipe;
    layer.backward_input(ctx, dy, saved);
    EXPECT_FALSE(saved.dy_fp8.data.defined()) << recipe;
    ASSERT_TRUE(saved.dy_fp8.data_t.defined()) << recipe;
    layer.backward_weight(ctx, dy, saved);
    EXPECT_FALSE(saved.dy_fp8.data_t.defined()) << recipe;
  }
}

TEST(Fp8Linear, GradientsStayCloseToBf16) {
  Context ctx = Context::cpu();
  for (const char* recipe : {"current", "delayed"}) {
    nn::Linear ref = bf16_linear(64, 80, true, 10), fp8_layer = bf16_linear(64, 80, true, 10);
    auto scaling = std::make_shared<nn::Fp8Scaling>(ctx, recipe_named(recipe), 1);
    fp8_layer.use_fp8({scaling, 0});
    const Tensor x = random_tensor({96, 64}, DType::BF16, 11, -2, 2), dy = random_tensor({96, 80}, DType::BF16, 12);
    // Delayed scaling starts at scale 1; one step of statistics sets real scales.
    for (int step = 0; step < 2; ++step) {
      ref.weight.grad.fill_zero();
      fp8_layer.weight.grad.fill_zero();
      ref.bias.grad.fill_zero();
      fp8_layer.bias.grad.fill_zero();
      nn::Linear::Saved sr, sf;
      const Tensor yr = ref.forward(ctx, x, sr), yf = fp8_layer.forward(ctx, x, sf);
      const Tensor dxr = ref.backward_input(ctx, dy, sr), dxf = fp8_layer.backward_input(ctx, dy, sf);
      ref.backward_weight(ctx, dy, sr);
      fp8_layer.backward_weight(ctx, dy, sf);
      scaling->end_step(ctx);
      if (step == 0) continue;
      SCOPED_TRACE(recipe);
      // E4M3 keeps 3 mantissa bits, E5M2 2: a few percent per element, less after the sums.
      EXPECT_LT(relative_error(yf, yr), 0.06);
      EXPECT_LT(relative_error(dxf, dxr), 0.1);
      EXPECT_LT(relative_error(fp8_layer.weight.grad, ref.weight.grad), 0.1);
      EXPECT_EQ(fp8_layer.bias.grad.to_doubles(), ref.bias.grad.to_doubles());  // the bias gradient stays BF16
    }
  }
}

// A biased per-tensor FP8 layer takes its bias gradient from dy's cast
// (fp8::quantize_with_transpose_and_bias_grad, one read of dy on CUDA): accumulated into
// bias.grad by backward_input, exactly bias_grad's sums, and not added again by
// backward_weight. The fused function equals the cast and bias_grad, bit for bit.
TEST(Fp8Linear, BiasGradientComesFromTheOutputGradientsCast) {
  Context ctx = Context::cpu();
  {
    const Tensor x = random_tensor({48, 80}, DType::BF16, 30, -3, 3);
    const Tensor scale = Tensor::from_floats({7.5f}, {1});
    const Tensor start = random_tensor({80}, DType::F32, 31, -5, 5);
    Tensor amax_want = Tensor::empty({1}, DType::F32), amax_got = Tensor::empty({1}, DType::F32);
    Tensor db_want = start.clone(), db_got = start.clone();
    const fp8::QuantizedTensor want = fp8::quantize_with_transpose(ctx, x, scale, DType::E5M2, &amax_want);
    bias_grad(ctx, x, db_want);
    const fp8::QuantizedTensor got =
        fp8::quantize_with_transpose_and_bias_grad(ctx, x, scale, DType::E5M2, db_got, &amax_got);
    EXPECT_EQ(bytes_of(got.data), bytes_of(want.data));
    EXPECT_EQ(bytes_of(got.data_t), bytes_of(want.data_t));
    EXPECT_EQ(bytes_of(got.scale_inv), bytes_of(want.scale_inv));
    EXPECT_EQ(bytes_of(amax_got), bytes_of(amax_want));
    EXPECT_EQ(bytes_of(db_got), bytes_of(db_want));
    Tensor wrong = Tensor::zeros({79}, DType::F32);
    EXPECT_THROW(fp8::quantize_with_transpose_and_bias_grad(ctx, x, scale, DType::E5M2, wrong), Error);
  }
  for (const char* recipe : {"current", "delayed"}) {
    SCOPED_TRACE(recipe);
    nn::Linear layer = bf16_linear(32, 48, true, 40);
    auto scaling = std::make_shared<nn::Fp8Scaling>(ctx, recipe_named(recipe), 1);
    layer.use_fp8({scaling, 0});
    const Tensor start = random_tensor({48}, DType::F32, 41, -1, 1);
    for (int step = 0; step < 2; ++step) {
      const Tensor x = random_tensor({64, 32}, DType::BF16, 42 + step, -2, 2);
      const Tensor dy = random_tensor({64, 48}, DType::BF16, 44 + step);
      layer.bias.grad.copy_from(start);
      Tensor want = start.clone();
      bias_grad(ctx, dy, want);
      nn::Linear::Saved saved;
      layer.forward(ctx, x, saved);
      EXPECT_FALSE(saved.bias_grad_done);
      layer.backward_input(ctx, dy, saved);
      EXPECT_TRUE(saved.bias_grad_done);
      EXPECT_EQ(bytes_of(layer.bias.grad), bytes_of(want)) << "step " << step << ": summed by dy's cast";
      layer.backward_weight(ctx, dy, saved);
      EXPECT_FALSE(saved.bias_grad_done);
      EXPECT_EQ(bytes_of(layer.bias.grad), bytes_of(want)) << "step " << step << ": not added twice";
      scaling->end_step(ctx);
    }
  }
}

TEST(Fp8Linear, SizesTheFp8GemmsCannotTakeRunInBf16) {
  Context ctx = Context::cpu();
  nn::Linear layer = bf16_linear(24, 40, false, 20);  // 24 is no multiple of 16
  auto scaling = std::make_shared<nn::Fp8Scaling>(ctx, recipe_named("current"), 1);
  layer.use_fp8({scaling, 0});
  nn::Linear::Saved saved;
  layer.forward(ctx, random_tensor({32, 24}, DType::BF16, 21), saved);
  EXPECT_FALSE(saved.fp8);
  nn::Linear other = bf16_linear(32, 48, false, 22);
  other.use_fp8({scaling, 0});
  other.forward(ctx, random_tensor({17, 32}, DType::BF16, 23), saved);  // 17 rows
  EXPECT_FALSE(saved.fp8);
  // Block scaling and MXFP8 are wired in too (tests/test_fp8_block_linear.cpp).
  EXPECT_NO_THROW(nn::Fp8Scaling(ctx, recipe_named("block"), 1));
  EXPECT_NO_THROW(nn::Fp8Scaling(ctx, recipe_named("mxfp8"), 1));
}

TEST(Fp8Linear, DelayedScalingLearnsItsScalesFromTheStep) {
  Context ctx = Context::cpu();
  nn::Linear layer = bf16_linear(32, 32, false, 30);
  auto scaling = std::make_shared<nn::Fp8Scaling>(ctx, recipe_named("delayed"), 1);
  layer.use_fp8({scaling, 0});
  const Tensor x = random_tensor({16, 32}, DType::BF16, 31, -4, 4);
  nn::Linear::Saved saved;
  layer.forward(ctx, x, saved);
  layer.backward_input(ctx, random_tensor({16, 32}, DType::BF16, 32), saved);
  scaling->end_step(ctx);
  Tensor x_amax = Tensor::empty({1}, DType::F32);
  amax(ctx, x, x_amax);
  const std::map<std::string, Tensor> state = scaling->state_dict();
  const std::vector<float> scales = state.at("fp8.scale").to_floats();
  EXPECT_EQ(scales[0], fp8_scale_from_amax(x_amax.data<float>()[0], DType::E4M3));  // the input's
  EXPECT_NE(scales[2], 1.0f);  // the gradient's, in E5M2
}

// A small model trains in FP8 about as well as in BF16 from the same start (CPU emulation).
TEST(Fp8Model, SmallModelsTrainLikeBf16) {
  Context ctx = Context::cpu();
  // Each architecture with one recipe, to keep the test short (the layer tests cover both).
  for (const auto& [arch, recipe] : {std::pair{"gpt2", "delayed"}, std::pair{"llama", "current"}}) {
    {
      const models::ModelConfig c = tiny_model_config(arch, 32, 64, 16);
      const int64_t batch = 2, seq = 16;
      const auto [inputs, targets] = cyclic_tokens(batch, seq, c.vocab_size);  // next = (3 * current + 1) mod V
      std::vector<double> final_loss;
      for (const bool use_fp8 : {false, true}) {
        models::TransformerLM model(c, DType::BF16);
        model.init(ctx, 5);
        std::shared_ptr<nn::Fp8Scaling> scaling;
        if (use_fp8) scaling = models::enable_fp8(ctx, model, recipe_named(recipe));
        train::OptimizerConfig oc;
        oc.lr = 1e-2;
        train::Optimizer optimizer(model.parameters(), oc);
        double loss = 0, first = 0;
        for (int step = 0; step < 15; ++step) {
          model.zero_grad();
          loss = model.forward_backward(ctx, inputs, targets);
          if (step == 0) first = loss;
          if (scaling) scaling->end_micro_batch(ctx);
          optimizer.step(ctx, oc.lr);
          if (scaling) scaling->end_step(ctx);
        }
        ASSERT_TRUE(std::isfinite(loss)) << arch << " " << recipe << " fp8=" << use_fp8;
        EXPECT_LT(loss, 0.7 * first) << arch << " " << recipe << " fp8=" << use_fp8;
        final_loss.push_back(loss);
      }
      EXPECT_LT(std::abs(final_loss[1] - final_loss[0]), 0.1 * final_loss[0] + 0.05) << arch << " " << recipe;
    }
  }
}

// A tiny GPT-2 (every linear with a bias, GELU MLPs) in FP8 with MLP's fused activation casts
// on and off: the same losses and weights over three steps, bit for bit (the fused ops and
// the bias gradients from the casts are the unfused path's bytes on the CPU).
TEST(Fp8Model, Gpt2FusedActivationCastsMatchTheUnfusedPath) {
  Context ctx = Context::cpu();
  const auto [inputs, targets] = cyclic_tokens(2, 16, 64);
  for (const char* recipe : {"current", "delayed"}) {
    SCOPED_TRACE(recipe);
    expect_fused_fp8_activation_training_identical(ctx, tiny_model_config("gpt2", 32, 64, 16), recipe, inputs, targets);
  }
}
