// The FP8 path of the MoE experts on the CPU (tessera/ops/moe.h "FP8", nn::GroupedLinear /
// GroupedMLP with use_fp8): the padded cast, the fused SwiGLU -> FP8 cast, the grouped FP8
// GEMMs against a reference built from the dequantized operands (tight) and against the
// BF16 layers (FP8 tolerance), split sizes that are not multiples of 16, experts without
// tokens and every token on one expert; the recompute option and a tiny Mixtral in FP8.
#include <cmath>

#include "tessera/fp8/recipe.h"
#include "tessera/models/fp8_model.h"
#include "tessera/models/transformer_lm.h"
#include "tessera/nn/moe.h"
#include "tessera/ops/gemm.h"
#include "tessera/ops/moe.h"
#include "tessera/ops/quantize.h"
#include "model_testing.h"
#include "moe_testing.h"
#include "testing.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

// Host reference of current scaling: the codes of x * scale and 1 / scale.
struct Ref {
  Tensor codes;  // FP8 [rows, cols]
  float scale = 1, scale_inv = 1;
};
Ref quantize_ref(const Tensor& x, DType fp8) {
  Context ctx = Context::cpu();
  Tensor a = Tensor::empty({1}, DType::F32);
  amax(ctx, x, a);
  Ref r;
  r.scale = fp8_scale_from_amax(static_cast<float>(a.item(0)), fp8);
  r.scale_inv = 1.0f / r.scale;
  r.codes = Tensor::empty(x.shape(), fp8);
  quantize_per_tensor(ctx, x, Tensor::from_floats({r.scale}, {1}), r.codes);
  return r;
}
// float(code) * scale_inv as F64.
Tensor dequant(const Ref& r) {
  Tensor out = Tensor::empty(r.codes.shape(), DType::F64);
  for (int64_t i = 0; i < out.numel(); ++i) out.set_item(i, r.codes.item(i) * double(r.scale_inv));
  return out;
}

// Checks data_t against data under the padding rule: column padded[e] + i holds row off_e + i.
void expect_padded_transpose(const MoEFp8Rows& q) {
  ASSERT_TRUE(q.data.defined() && q.data_t.defined());
  const int64_t k = q.data.size(1), width = q.data_t.size(1);
  ASSERT_EQ(width, q.padded_offsets.back());
  ASSERT_EQ(width % 16, 0);
  ASSERT_EQ(q.data_t.size(0), k);
  const uint8_t* d = q.data.data<uint8_t>();
  const uint8_t* t = q.data_t.data<uint8_t>();
  int64_t row = 0;
  for (size_t e = 0; e < q.splits.size(); ++e) {
    ASSERT_EQ(q.padded_offsets[e] % 16, 0);
    for (int64_t col = q.padded_offsets[e]; col < q.padded_offsets[e + 1]; ++col) {
      const int64_t i = col - q.padded_offsets[e];
      for (int64_t c = 0; c < k; ++c) {
        if (i < q.splits[e]) ASSERT_EQ(t[c * width + col], d[(row + i) * k + c]) << "expert " << e;
        else ASSERT_EQ(t[c * width + col], 0) << "padding of expert " << e;
      }
    }
    row += q.splits[e];
  }
}

MoEFp8Options hybrid() { return MoEFp8Options{}; }

}  // namespace

TEST(MoeFp8, PaddedOffsetsRoundEachExpertUpTo16) {
  EXPECT_EQ(moe_fp8_padded_offsets({3, 0, 16, 17}), (std::vector<int64_t>{0, 16, 16, 32, 64}));
  EXPECT_EQ(moe_fp8_padded_offsets({0, 0}), (std::vector<int64_t>{0, 0, 0}));
}

TEST(MoeFp8, CastRowsIsQuantizePerTensorWithAPaddedTranspose) {
  Context ctx = Context::cpu();
  const std::vector<int64_t> splits = {5, 0, 20, 9};
  const Tensor x = rows_input(37, 32, splits, 7, 3.0f);
  for (DType fp8 : {DType::E4M3, DType::E5M2}) {
    const MoEFp8Rows q = moe_fp8_quantize_rows(ctx, x, splits, fp8, hybrid());
    const Ref ref = quantize_ref(x, fp8);
    EXPECT_EQ(q.dtype, fp8);
    EXPECT_EQ(q.data.to_doubles(), ref.codes.to_doubles());
    EXPECT_EQ(static_cast<float>(q.scale_inv.item(0)), ref.scale_inv);
    EXPECT_EQ(q.data_t.shape(), (Shape{32, 16 + 0 + 32 + 16}));
    expect_padded_transpose(q);
  }
  // Every row on one expert, and no rows at all.
  const MoEFp8Rows one = moe_fp8_quantize_rows(ctx, x, {0, 37, 0, 0}, DType::E4M3, hybrid());
  expect_padded_transpose(one);
  const MoEFp8Rows none = moe_fp8_quantize_rows(ctx, x, {0, 0, 0, 0}, DType::E4M3, hybrid());
  EXPECT_EQ(none.data_t.size(1), 0);
}

TEST(MoeFp8, SwigluCastMatchesItsDefinition) {
  Context ctx = Context::cpu();
  const int64_t rows = 29, f = 48;
  const std::vector<int64_t> splits = {11, 0, 17};
  const Tensor x = rows_input(rows, 2 * f, splits, 11, 2.0f);
  const Tensor prob = random_tensor({rows}, DType::BF16, 12, 0.1f, 1.0f);
  // h in float, the scaled SwiGLU's definition, then current scaling of it.
  Tensor h = Tensor::empty({rows, f}, DType::F32);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < f; ++c) {
      const float g = static_cast<float>(x.item(r * 2 * f + c)), u = static_cast<float>(x.item(r * 2 * f + f + c));
      h.set_item(r * f + c, g * (1.0f / (1.0f + std::exp(-g))) * u * static_cast<float>(prob.item(r)));
    }
  Tensor a = Tensor::empty({1}, DType::F32);
  moe_swiglu_scaled_amax(ctx, x, prob, a);
  Tensor want_amax = Tensor::empty({1}, DType::F32);
  amax(ctx, h, want_amax);
  EXPECT_EQ(a.item(0), want_amax.item(0));
  const MoEFp8Rows q = moe_swiglu_scaled_quantize(ctx, x, prob, splits, DType::E4M3, hybrid());
  const Ref ref = quantize_ref(h, DType::E4M3);
  EXPECT_EQ(q.data.to_doubles(), ref.codes.to_doubles());
  EXPECT_EQ(static_cast<float>(q.scale_inv.item(0)), ref.scale_inv);
  expect_padded_transpose(q);
  // And the dequantized codes are h within E4M3's rounding.
  Tensor back = Tensor::empty({rows, f}, DType::F32);
  dequantize_per_tensor(ctx, q.data, q.scale_inv, back);
  EXPECT_LT(relative_error(back, h), 0.05);
}

TEST(MoeFp8, SwigluBackwardReducesTheAmaxOfItsOutput) {
  Context ctx = Context::cpu();
  const Tensor x = random_tensor({9, 32}, DType::BF16, 41, -3, 3), sc = random_tensor({9}, DType::BF16, 42, 0, 1);
  const Tensor dy = random_tensor({9, 16}, DType::BF16, 43);
  Tensor dx = Tensor::empty({9, 32}, DType::BF16), ds = Tensor::empty({9}, DType::BF16), a = Tensor::empty({1}, DType::F32);
  Tensor dx2 = Tensor::empty({9, 32}, DType::BF16), ds2 = Tensor::empty({9}, DType::BF16), want = Tensor::empty({1}, DType::F32);
  moe_swiglu_scaled_backward(ctx, x, sc, dy, dx, ds, &a);
  moe_swiglu_scaled_backward(ctx, x, sc, dy, dx2, ds2);
  EXPECT_EQ(dx.to_doubles(), dx2.to_doubles());
  amax(ctx, dx, want);
  EXPECT_EQ(a.item(0), want.item(0));
}

TEST(MoeFp8, SwigluBackwardQuantizeIsTheBackwardThenTheCast) {
  Context ctx = Context::cpu();
  const int64_t rows = 29, f = 24;
  for (const std::vector<int64_t>& splits : {std::vector<int64_t>{11, 0, 17}, std::vector<int64_t>{0, 0, 0}}) {
    const Tensor x = random_tensor({rows, 2 * f}, DType::BF16, 51, -4, 4), sc = random_tensor({rows}, DType::F32, 52, 0, 1);
    const Tensor dy = random_tensor({rows, f}, DType::BF16, 53, -2, 2);
    for (DType fp8 : {DType::E5M2, DType::E4M3}) {
      Tensor ds = Tensor::empty({rows}, DType::F32);
      const MoEFp8Rows q = moe_swiglu_scaled_backward_quantize(ctx, x, sc, dy, splits, fp8, hybrid(), ds);
      // The composition: dx in BF16 with its amax, then current scaling of dx.
      Tensor dx = Tensor::empty({rows, 2 * f}, DType::BF16), ds2 = Tensor::empty({rows}, DType::F32);
      Tensor a = Tensor::empty({1}, DType::F32);
      moe_swiglu_scaled_backward(ctx, x, sc, dy, dx, ds2, &a);
      const MoEFp8Rows want = moe_fp8_quantize_rows(ctx, dx, a, splits, fp8, hybrid());
      EXPECT_EQ(q.dtype, fp8);
      EXPECT_EQ(q.data.to_doubles(), want.data.to_doubles());
      EXPECT_EQ(q.data_t.shape(), want.data_t.shape());
      EXPECT_EQ(q.data_t.to_doubles(), want.data_t.to_doubles());
      EXPECT_EQ(q.scale_inv.item(0), want.scale_inv.item(0));
      EXPECT_EQ(ds.to_doubles(), ds2.to_doubles());
      expect_padded_transpose(q);
      // And the codes are dx's within the format's rounding (a wrong scale or half fails).
      if (splits[0] > 0) {
        Tensor back = Tensor::empty({rows, 2 * f}, DType::F32);
        dequantize_per_tensor(ctx, q.data, q.scale_inv, back);
        const int64_t kept = splits[0] + splits[1] + splits[2];
        EXPECT_LT(relative_error(back.slice(0, 0, kept), dx.slice(0, 0, kept)), fp8 == DType::E4M3 ? 0.05 : 0.1);
      }
    }
  }
}

TEST(MoeFp8, GroupedMlpFp8BackwardIsTheSameUnderTheLegacySwitch) {
  Context ctx = Context::cpu();
  const int64_t e = 3, hidden = 32, ffn = 48, rows = 40;
  const std::vector<int64_t> splits = {13, 0, 20};
  const Tensor x = rows_input(rows, hidden, splits, 61), dy = rows_input(rows, hidden, splits, 62);
  const Tensor prob = random_tensor({rows}, DType::BF16, 63, 0.1f, 1.0f);
  const bool before = moe_swiglu_legacy();
  std::vector<Tensor> results[2];
  for (int legacy = 0; legacy < 2; ++legacy) {
    set_moe_swiglu_legacy(legacy == 1);
    nn::GroupedMLP m("m", e, hidden, ffn, DType::BF16);
    m.fc.weight.value.copy_from(random_tensor(m.fc.weight.value.shape(), DType::BF16, 64, -0.3f, 0.3f));
    m.proj.weight.value.copy_from(random_tensor(m.proj.weight.value.shape(), DType::BF16, 65, -0.3f, 0.3f));
    m.use_fp8(hybrid());
    nn::GroupedMLP::Saved saved;
    m.forward(ctx, x, prob, splits, saved);
    ASSERT_TRUE(saved.fp8);
    const Tensor dx = m.backward_input(ctx, dy, saved);
    m.backward_weight(ctx, dy, saved);
    results[legacy] = {dx, saved.d_scale, m.fc.weight.grad, m.proj.weight.grad};
  }
  set_moe_swiglu_legacy(before);
  for (size_t i = 0; i < results[0].size(); ++i) {
    EXPECT_EQ(results[0][i].to_doubles(), results[1][i].to_doubles()) << i;
    EXPECT_GT(relative_error(results[0][i], Tensor::zeros(results[0][i].shape(), DType::F64)), 0) << i;  // not all zero
  }
}

namespace {

struct GroupedCase {
  int64_t experts, in, out, rows;
  std::vector<int64_t> splits;
};

// y, dx and dW of one FP8 GroupedLinear against the products of the dequantized operands.
void check_grouped_linear(const GroupedCase& g, uint64_t seed) {
  Context ctx = Context::cpu();
  nn::GroupedLinear fp8_layer("g", g.experts, g.in, g.out, DType::BF16);
  nn::GroupedLinear bf16_layer("g", g.experts, g.in, g.out, DType::BF16);
  Tensor w = random_tensor({g.experts * g.out, g.in}, DType::BF16, seed, -0.5f, 0.5f);
  // A skewed expert: expert 0's weights 64 times larger (its own scale keeps the others' resolution).
  for (int64_t i = 0; i < g.out * g.in; ++i) w.set_item(i, w.item(i) * 64.0);
  fp8_layer.weight.value.copy_from(w);
  bf16_layer.weight.value.copy_from(w);
  fp8_layer.use_fp8(MoEFp8Options{});
  ASSERT_TRUE(fp8_layer.runs_fp8(DType::BF16));
  const Tensor x = rows_input(g.rows, g.in, g.splits, seed + 1);
  const Tensor dy = rows_input(g.rows, g.out, g.splits, seed + 2);

  nn::GroupedLinear::Fp8Saved saved;
  const Tensor y = fp8_layer.forward_fp8(ctx, moe_fp8_quantize_rows(ctx, x, g.splits, DType::E4M3, hybrid()), saved);
  EXPECT_FALSE(saved.x.data.defined());  // only the transposed codes are kept
  for (int64_t i = 0; i < fp8_layer.weight.grad.numel(); ++i) fp8_layer.weight.grad.set_item(i, 1.0);
  const Tensor dx = fp8_layer.backward_input_fp8(ctx, dy, saved);
  fp8_layer.backward_weight_fp8(ctx, saved);

  // Reference from the dequantized operands, in F64.
  const Ref xq = quantize_ref(x, DType::E4M3), dyq = quantize_ref(dy, DType::E5M2);
  const Tensor xd = dequant(xq), dyd = dequant(dyq);
  Tensor y_ref = Tensor::zeros({g.rows, g.out}, DType::F64), dx_ref = Tensor::zeros({g.rows, g.in}, DType::F64);
  Tensor dw_ref = Tensor::empty({g.experts, g.out, g.in}, DType::F64);
  for (int64_t i = 0; i < dw_ref.numel(); ++i) dw_ref.set_item(i, 1.0);
  int64_t row = 0;
  for (int64_t e = 0; e < g.experts; ++e) {
    const int64_t n = g.splits[static_cast<size_t>(e)];
    if (n == 0) continue;
    const Ref wq = quantize_ref(w.slice(0, e * g.out, (e + 1) * g.out), DType::E4M3);
    const Tensor wd = dequant(wq);
    Tensor ye = y_ref.slice(0, row, row + n), dxe = dx_ref.slice(0, row, row + n);
    Tensor dwe = dw_ref.select(0, e);
    gemm(ctx, xd.slice(0, row, row + n), wd, ye, {.transpose_b = true});
    gemm(ctx, dyd.slice(0, row, row + n), wd, dxe);
    gemm(ctx, dyd.slice(0, row, row + n), xd.slice(0, row, row + n), dwe, {.transpose_a = true, .beta = 1});
    row += n;
  }
  // BF16 outputs: one BF16 rounding; dW is F32.
  EXPECT_LT(relative_error(y, y_ref), 4e-3);
  EXPECT_LT(relative_error(dx, dx_ref), 4e-3);
  EXPECT_LT(relative_error(fp8_layer.weight.grad, dw_ref.reshape(fp8_layer.weight.grad.shape())), 1e-5);
  for (int64_t i = row * g.out; i < g.rows * g.out; ++i) ASSERT_EQ(y.item(i), 0.0);
  for (int64_t i = row * g.in; i < g.rows * g.in; ++i) ASSERT_EQ(dx.item(i), 0.0);
  // Experts without tokens keep their gradient untouched.
  for (int64_t e = 0; e < g.experts; ++e)
    if (g.splits[static_cast<size_t>(e)] == 0)
      for (int64_t i = e * g.out * g.in; i < (e + 1) * g.out * g.in; ++i) ASSERT_EQ(fp8_layer.weight.grad.item(i), 1.0);

  // Against the BF16 layer: FP8's error (E4M3 keeps 3 mantissa bits, E5M2 2).
  const Tensor y16 = bf16_layer.forward(ctx, x, g.splits);
  const Tensor dx16 = bf16_layer.backward_input(ctx, dy, g.splits);
  bf16_layer.backward_weight(ctx, dy, x, g.splits);
  EXPECT_LT(relative_error(y, y16), 0.08);
  EXPECT_LT(relative_error(dx, dx16), 0.15);
  Tensor dw8 = fp8_layer.weight.grad.clone();
  for (int64_t i = 0; i < dw8.numel(); ++i) dw8.set_item(i, dw8.item(i) - 1.0);
  EXPECT_LT(relative_error(dw8, bf16_layer.weight.grad), 0.15);
}

}  // namespace

TEST(MoeFp8, GroupedLinearMatchesTheDequantizedReference) {
  // Splits that are not multiples of 16, an expert without tokens, padding rows.
  check_grouped_linear({4, 32, 48, 40, {7, 0, 21, 3}}, 100);
  // Every token on one expert.
  check_grouped_linear({3, 16, 32, 24, {0, 24, 0}}, 200);
  // Multiples of 16 (no padding).
  check_grouped_linear({2, 48, 16, 32, {16, 16}}, 300);
}

TEST(MoeFp8, GroupedLinearRefusesSizesTheFp8GemmsCannotTake) {
  nn::GroupedLinear odd("g", 2, 24, 32, DType::BF16);
  odd.use_fp8(MoEFp8Options{});
  EXPECT_FALSE(odd.runs_fp8(DType::BF16));  // in = 24
  nn::GroupedLinear f32("g", 2, 32, 32, DType::F32);
  f32.use_fp8(MoEFp8Options{});
  EXPECT_FALSE(f32.runs_fp8(DType::F32));
  nn::GroupedLinear off("g", 2, 32, 32, DType::BF16);
  EXPECT_FALSE(off.runs_fp8(DType::BF16));
}

TEST(MoeFp8, GroupedMlpInFp8StaysCloseToBf16) {
  Context ctx = Context::cpu();
  const int64_t e = 4, hidden = 32, ffn = 48;
  for (const std::vector<int64_t>& splits :
       {std::vector<int64_t>{9, 0, 14, 13}, std::vector<int64_t>{0, 0, 40, 0}, std::vector<int64_t>{0, 0, 0, 0}}) {
    nn::GroupedMLP fp8("m", e, hidden, ffn, DType::BF16), bf16("m", e, hidden, ffn, DType::BF16);
    const Tensor wfc = random_tensor(fp8.fc.weight.value.shape(), DType::BF16, 21, -0.3f, 0.3f);
    const Tensor wproj = random_tensor(fp8.proj.weight.value.shape(), DType::BF16, 22, -0.3f, 0.3f);
    for (nn::GroupedMLP* m : {&fp8, &bf16}) {
      m->fc.weight.value.copy_from(wfc);
      m->proj.weight.value.copy_from(wproj);
    }
    fp8.use_fp8(MoEFp8Options{});
    const int64_t rows = 40;
    const Tensor x = rows_input(rows, hidden, splits, 23);
    ASSERT_TRUE(fp8.runs_fp8(x));
    const Tensor prob = random_tensor({rows}, DType::BF16, 24, 0.2f, 1.0f);
    const Tensor dy = rows_input(rows, hidden, splits, 25);
    const MlpRun a = run_mlp(fp8, ctx, x, prob, dy, splits), b = run_mlp(bf16, ctx, x, prob, dy, splits);
    int64_t used = 0;
    for (int64_t s : splits) used += s;
    if (used == 0) {
      for (int64_t i = 0; i < a.y.numel(); ++i) ASSERT_EQ(a.y.item(i), 0.0);
      for (int64_t i = 0; i < a.dfc.numel(); ++i) ASSERT_EQ(a.dfc.item(i), 0.0);
      continue;
    }
    EXPECT_LT(relative_error(a.y, b.y), 0.1);
    EXPECT_LT(relative_error(a.dx, b.dx), 0.2);
    EXPECT_LT(relative_error(a.d_scale, b.d_scale), 0.2);
    EXPECT_LT(relative_error(a.dfc, b.dfc), 0.2);
    EXPECT_LT(relative_error(a.dproj, b.dproj), 0.2);
  }
}

TEST(MoeFp8, RecomputingTheActivationIsBitIdentical) {
  const int64_t e = 3, hidden = 6, ffn = 5, rows = 14;
  const std::vector<int64_t> splits = {5, 0, 7};
  for (DType dt : {DType::F32, DType::BF16}) {
    nn::GroupedMLP keep("m", e, hidden, ffn, dt), recompute("m", e, hidden, ffn, dt);
    recompute.recompute_activation = true;
    const Tensor wfc = random_tensor(keep.fc.weight.value.shape(), dt, 31);
    const Tensor wproj = random_tensor(keep.proj.weight.value.shape(), dt, 32);
    for (nn::GroupedMLP* m : {&keep, &recompute}) {
      m->fc.weight.value.copy_from(wfc);
      m->proj.weight.value.copy_from(wproj);
    }
    Tensor x = random_tensor({rows, hidden}, dt, 33);
    const Tensor prob = random_tensor({rows}, dt, 34, 0.1f, 1.0f);
    const Tensor dy = random_tensor({rows, hidden}, dt, 35);
    // The forward does not keep h with the option.
    nn::GroupedMLP::Saved s;
    Context ctx = Context::cpu();
    recompute.forward(ctx, x, prob, splits, s);
    EXPECT_FALSE(s.h.defined());
    const MlpRun a = run_mlp(keep, ctx, x, prob, dy, splits), b = run_mlp(recompute, ctx, x, prob, dy, splits);
    EXPECT_EQ(a.y.to_doubles(), b.y.to_doubles());
    EXPECT_EQ(a.dx.to_doubles(), b.dx.to_doubles());
    EXPECT_EQ(a.d_scale.to_doubles(), b.d_scale.to_doubles());
    EXPECT_EQ(a.dfc.to_doubles(), b.dfc.to_doubles());
    EXPECT_EQ(a.dproj.to_doubles(), b.dproj.to_doubles());
  }
}

TEST(MoeFp8, TinyMixtralTrainsInFp8) {
  Context ctx = Context::cpu();
  const models::ModelConfig c = tiny_mixtral_config();
  models::TransformerLM model(c, DType::BF16);
  model.init(ctx, 3);
  fp8::Recipe recipe;
  recipe.config = fp8::CurrentScalingConfig{};
  const auto scaling = models::enable_fp8(ctx, model, recipe);
  for (auto& layer : model.layers) {
    ASSERT_TRUE(layer->moe);
    ASSERT_TRUE(layer->moe->experts.fc.fp8_options().has_value());
  }
  const Tensor inputs = random_ids({2, 16}, c.vocab_size, 5);
  const Tensor targets = random_ids({2, 16}, c.vocab_size, 6);
  double first = 0, last = 0;
  for (int step = 0; step < 30; ++step) {
    model.zero_grad();
    const double loss = model.forward_backward(ctx, inputs, targets);
    ASSERT_TRUE(std::isfinite(loss));
    if (step == 0) first = loss;
    last = loss;
    sgd_step(ctx, model, 0.5);
  }
  EXPECT_LT(last, first - 0.5);
  models::disable_fp8(model);
  for (auto& layer : model.layers) EXPECT_FALSE(layer->moe->experts.fc.fp8_options().has_value());
}

TEST(MoeFp8, RecomputeConfigKeyKeepsMixtralBitIdentical) {
  models::ModelConfig c;
  c.architecture = "mixtral";
  c.vocab_size = 13;
  c.hidden_size = 8;
  c.num_layers = 2;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.intermediate_size = 6;
  c.max_seq_len = 8;
  c.tie_embeddings = false;
  c.num_experts = 4;
  c.num_experts_per_tok = 2;
  models::ModelConfig r = c;
  r.moe_recompute_activation = true;
  // The key round-trips, and is written only when set.
  EXPECT_FALSE(c.to_json().contains("moe_recompute_activation"));
  EXPECT_TRUE(models::ModelConfig::from_json(r.to_json()).moe_recompute_activation);
  nlohmann::json dense = c.to_json();
  dense["architecture"] = "llama";
  for (const char* k : {"num_experts", "num_experts_per_tok", "router_score", "router_normalize", "router_num_groups",
                        "router_topk_groups", "router_scaling", "router_aux_loss_coef", "router_z_loss_coef",
                        "capacity_factor", "expert_bias_rate"})
    dense.erase(k);
  dense["moe_recompute_activation"] = true;
  EXPECT_THROW(models::ModelConfig::from_json(dense), Error);

  Context ctx = Context::cpu();
  for (DType dt : {DType::F32, DType::BF16}) {
    models::TransformerLM a(c, dt), b(r, dt);
    ASSERT_TRUE(b.layers[0]->moe->experts.recompute_activation);
    ASSERT_FALSE(a.layers[0]->moe->experts.recompute_activation);
    a.init(ctx, 9);
    b.init(ctx, 9);
    const Tensor inputs = random_ids({2, 8}, c.vocab_size, 1), targets = random_ids({2, 8}, c.vocab_size, 2);
    a.zero_grad();
    b.zero_grad();
    EXPECT_EQ(a.forward_backward(ctx, inputs, targets), b.forward_backward(ctx, inputs, targets));
    const auto pa = a.parameters(), pb = b.parameters();
    for (size_t i = 0; i < pa.size(); ++i) EXPECT_EQ(pa[i]->grad.to_doubles(), pb[i]->grad.to_doubles()) << pa[i]->name;
  }
}
