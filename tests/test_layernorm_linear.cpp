// LayerNormLinear and LayerNormMLP (a norm feeding a linear layer / an MLP) on the CPU:
//  - in F32 they are the separate modules call for call: outputs, input gradients, the
//    residual sum and every parameter gradient equal bit for bit, with and without the fused
//    residual add, LayerNorm and RMSNorm, GELU and SwiGLU;
//  - in F64 their gradients match finite differences;
//  - in FP8 (BF16 model, CPU emulation) the norm's FP8 output equals the unfused path (norm
//    in BF16, then the linear layer's own cast) bit for bit, for current and delayed scaling,
//    through two steps, and so does a whole TransformerLayer against the unfused block;
//  - the norm -> FP8 ops: the apply pass equals the forward's cast, the statistics pass
//    writes only the statistics, and bad arguments are named;
//  - a TransformerLayer's parameter names are unchanged.
#include <gtest/gtest.h>

#include <cstring>

#include "testing.h"
#include "tessera/fp8/quantized_tensor.h"
#include "tessera/nn/layernorm_linear.h"
#include "tessera/nn/layernorm_mlp.h"
#include "tessera/nn/transformer_layer.h"
#include "tessera/ops/elementwise.h"
#include "tessera/ops/norm.h"
#include "tessera/ops/quantize.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

constexpr float kEps = 1e-5f;


// Random values for every parameter (norm weights near 1) and random starting gradients, so
// that accumulation (+=) is part of what is compared.
void randomize(nn::ParameterList& params, uint64_t seed) {
  Context ctx = Context::cpu();
  for (nn::Parameter* p : params) {
    const bool norm = p->name.find("norm") != std::string::npos && p->name.find(".weight") != std::string::npos;
    p->weights().copy_from(random_tensor(p->weights().shape(), p->weights().dtype(), seed++, norm ? 0.5f : -0.4f,
                                         norm ? 1.5f : 0.4f));
    p->refresh_value(ctx);
    p->grad.copy_from(random_tensor(p->grad.shape(), p->grad.dtype(), seed++));
  }
}

// The same values and gradients in `to` as in `from` (same structure).
void copy_params(const nn::ParameterList& from, const nn::ParameterList& to) {
  Context ctx = Context::cpu();
  ASSERT_EQ(from.size(), to.size());
  for (size_t i = 0; i < from.size(); ++i) {
    to[i]->weights().copy_from(from[i]->weights());
    to[i]->refresh_value(ctx);
    to[i]->grad.copy_from(from[i]->grad);
  }
}

void expect_same_grads(const nn::ParameterList& a, const nn::ParameterList& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_TRUE(same_bits(a[i]->grad, b[i]->grad)) << what << ": gradient of " << a[i]->name;
}

nn::NormKind kind_of(int k) { return k == 0 ? nn::NormKind::LayerNorm : nn::NormKind::RMSNorm; }
const char* name_of(nn::NormKind k) { return k == nn::NormKind::LayerNorm ? "layernorm" : "rmsnorm"; }

fp8::Recipe recipe_named(const std::string& name) { return fp8::Recipe::from_json({{"recipe", name}}); }

}  // namespace

TEST(LayerNormLinear, F32IsNormThenLinearBitForBit) {
  Context ctx = Context::cpu();
  const int64_t rows = 6, in = 10, out = 7;
  for (int k = 0; k < 2; ++k) {
    for (const bool bias : {true, false}) {
      for (const bool add : {false, true}) {
        const nn::NormKind kind = kind_of(k);
        SCOPED_TRACE(std::string(name_of(kind)) + (bias ? " bias" : " no bias") + (add ? " add" : ""));
        nn::Norm norm_a("norm", kind, in, kEps, DType::F32), norm_b("norm", kind, in, kEps, DType::F32);
        nn::Linear lin_a("l", in, out, bias, DType::F32), lin_b("l", in, out, bias, DType::F32);
        nn::LayerNormLinear fused(norm_a, lin_a);
        nn::ParameterList pa, pb;
        fused.parameters(pa);
        norm_b.parameters(pb);
        lin_b.parameters(pb);
        randomize(pa, 100);
        copy_params(pa, pb);
        EXPECT_FALSE(fused.runs_fp8(random_tensor({rows, in}, DType::F32, 1)));

        const Tensor x = random_tensor({rows, in}, DType::F32, 1, -1, 3), r = random_tensor({rows, in}, DType::F32, 2);
        const Tensor dy = random_tensor({rows, out}, DType::F32, 3), d_res = random_tensor({rows, in}, DType::F32, 4);
        nn::LayerNormLinear::Saved sa;
        const Tensor y_a = add ? fused.forward_add(ctx, x, r, sa) : fused.forward(ctx, x, sa);
        const Tensor dx_a = add ? fused.backward_input_add(ctx, dy, d_res, sa) : fused.backward_input(ctx, dy, sa);
        fused.backward_weight(ctx, dy, sa);

        nn::Norm::Saved ns;
        nn::Linear::Saved ls;
        const Tensor h = add ? norm_b.forward_add(ctx, x, r, ns) : norm_b.forward(ctx, x, ns);
        const Tensor y_b = lin_b.forward(ctx, h, ls);
        const Tensor dh = lin_b.backward_input(ctx, dy, ls);
        const Tensor dx_b = add ? norm_b.backward_input_add(ctx, dh, d_res, ns) : norm_b.backward_input(ctx, dh, ns);
        lin_b.backward_weight(ctx, dy, ls);

        EXPECT_TRUE(same_bits(y_a, y_b)) << "y";
        EXPECT_TRUE(same_bits(dx_a, dx_b)) << "dx";
        EXPECT_TRUE(same_bits(sa.norm.x, ns.x)) << "the norm's input (the residual sum)";
        expect_same_grads(pa, pb, "F32");
      }
    }
  }
}

TEST(LayerNormMLP, F32IsNormThenMlpBitForBit) {
  Context ctx = Context::cpu();
  const int64_t rows = 5, hidden = 12, ffn = 9;
  for (const nn::Activation act : {nn::Activation::GELU, nn::Activation::SwiGLU}) {
    for (const bool add : {false, true}) {
      const bool gelu = act == nn::Activation::GELU;
      const nn::NormKind kind = gelu ? nn::NormKind::LayerNorm : nn::NormKind::RMSNorm;
      SCOPED_TRACE(std::string(gelu ? "gelu" : "swiglu") + (add ? " add" : ""));
      nn::Norm norm_a("norm", kind, hidden, kEps, DType::F32), norm_b("norm", kind, hidden, kEps, DType::F32);
      nn::MLP mlp_a("m", hidden, ffn, act, gelu, DType::F32), mlp_b("m", hidden, ffn, act, gelu, DType::F32);
      nn::LayerNormMLP fused(norm_a, mlp_a);
      nn::ParameterList pa, pb;
      fused.parameters(pa);
      norm_b.parameters(pb);
      mlp_b.parameters(pb);
      randomize(pa, 200);
      copy_params(pa, pb);

      const Tensor x = random_tensor({rows, hidden}, DType::F32, 5, -1, 2);
      const Tensor r = random_tensor({rows, hidden}, DType::F32, 6);
      const Tensor dy = random_tensor({rows, hidden}, DType::F32, 7);
      const Tensor d_res = random_tensor({rows, hidden}, DType::F32, 8);
      nn::LayerNormMLP::Saved sa;
      const Tensor y_a = add ? fused.forward_add(ctx, x, r, sa) : fused.forward(ctx, x, sa);
      const Tensor dx_a = add ? fused.backward_input_add(ctx, dy, d_res, sa) : fused.backward_input(ctx, dy, sa);
      fused.backward_weight(ctx, dy, sa);

      nn::Norm::Saved ns;
      nn::MLP::Saved ms;
      const Tensor h = add ? norm_b.forward_add(ctx, x, r, ns) : norm_b.forward(ctx, x, ns);
      const Tensor y_b = mlp_b.forward(ctx, h, ms);
      const Tensor dh = mlp_b.backward_input(ctx, dy, ms);
      const Tensor dx_b = add ? norm_b.backward_input_add(ctx, dh, d_res, ns) : norm_b.backward_input(ctx, dh, ns);
      mlp_b.backward_weight(ctx, dy, ms);

      EXPECT_TRUE(same_bits(y_a, y_b)) << "y";
      EXPECT_TRUE(same_bits(dx_a, dx_b)) << "dx";
      EXPECT_TRUE(same_bits(sa.norm.x, ns.x)) << "the residual sum";
      expect_same_grads(pa, pb, "F32");
    }
  }
}

namespace {

// Finite differences (F64) of L = sum(y * w) for every input and parameter of a fused module,
// whose forward/backward are given as callables over (x, residual).
template <typename Module>
void check_gradients(Module& module, nn::ParameterList& params, int64_t rows, int64_t in, int64_t out, bool add,
                     uint64_t seed) {
  Context ctx = Context::cpu();
  for (nn::Parameter* p : params) {
    const bool norm_weight = p->name.find("n.weight") != std::string::npos;
    p->value.copy_from(random_tensor(p->value.shape(), DType::F64, seed++, norm_weight ? 0.5f : -0.5f,
                                     norm_weight ? 1.5f : 0.5f));
    p->grad.fill_zero();
  }
  Tensor x = random_tensor({rows, in}, DType::F64, seed++, -1, 2), r = random_tensor({rows, in}, DType::F64, seed++);
  const Tensor w = random_tensor({rows, out}, DType::F64, seed++);
  auto run = [&] {
    typename Module::Saved s;
    return add ? module.forward_add(ctx, x, r, s) : module.forward(ctx, x, s);
  };
  auto loss = [&] { return weighted_sum(run(), w); };
  typename Module::Saved s;
  (void)(add ? module.forward_add(ctx, x, r, s) : module.forward(ctx, x, s));
  Tensor d_res = Tensor::zeros({rows, in}, DType::F64);
  const Tensor dx = add ? module.backward_input_add(ctx, w, d_res, s) : module.backward_input(ctx, w, s);
  module.backward_weight(ctx, w, s);
  expect_gradient(dx, x, loss, "dx", 1e-6);
  if (add) expect_gradient(dx, r, loss, "d residual", 1e-6);  // the sum's gradient reaches both summands
  for (nn::Parameter* p : params) expect_gradient(p->grad, p->value, loss, p->name, 1e-6);
}

}  // namespace

TEST(LayerNormLinear, GradientsMatchFiniteDifferences) {
  for (int k = 0; k < 2; ++k) {
    for (const bool add : {false, true}) {
      SCOPED_TRACE(std::string(name_of(kind_of(k))) + (add ? " add" : ""));
      nn::Norm norm("n", kind_of(k), 6, kEps, DType::F64);
      nn::Linear linear("l", 6, 5, true, DType::F64);
      nn::LayerNormLinear module(norm, linear);
      nn::ParameterList params;
      module.parameters(params);
      check_gradients(module, params, 4, 6, 5, add, 300 + 10 * k);
    }
  }
}

TEST(LayerNormMLP, GradientsMatchFiniteDifferences) {
  for (const nn::Activation act : {nn::Activation::GELU, nn::Activation::SwiGLU}) {
    const bool gelu = act == nn::Activation::GELU;
    SCOPED_TRACE(gelu ? "gelu" : "swiglu");
    nn::Norm norm("n", gelu ? nn::NormKind::LayerNorm : nn::NormKind::RMSNorm, 6, kEps, DType::F64);
    nn::MLP mlp("m", 6, 5, act, gelu, DType::F64);
    nn::LayerNormMLP module(norm, mlp);
    nn::ParameterList params;
    module.parameters(params);
    check_gradients(module, params, 3, 6, 6, true, 400);
  }
}

// The fused FP8 path against the unfused one (norm in BF16, the linear layer's own cast of
// its input): on the CPU both are the same reference operations, so every bit agrees.
TEST(LayerNormLinear, Fp8EqualsNormThenFp8LinearBitForBit) {
  Context ctx = Context::cpu();
  const int64_t rows = 32, in = 48, out = 32;
  for (const char* recipe : {"current", "delayed"}) {
    for (int k = 0; k < 2; ++k) {
      for (const bool add : {false, true}) {
        const nn::NormKind kind = kind_of(k);
        SCOPED_TRACE(std::string(recipe) + " " + name_of(kind) + (add ? " add" : ""));
        nn::Norm norm_a("norm", kind, in, kEps, DType::BF16), norm_b("norm", kind, in, kEps, DType::BF16);
        nn::Linear lin_a("l", in, out, true, DType::BF16), lin_b("l", in, out, true, DType::BF16);
        nn::LayerNormLinear fused(norm_a, lin_a);
        nn::ParameterList pa, pb;
        fused.parameters(pa);
        norm_b.parameters(pb);
        lin_b.parameters(pb);
        randomize(pa, 500);
        copy_params(pa, pb);
        auto sa_scaling = std::make_shared<nn::Fp8Scaling>(ctx, recipe_named(recipe), 1);
        auto sb_scaling = std::make_shared<nn::Fp8Scaling>(ctx, recipe_named(recipe), 1);
        lin_a.use_fp8({sa_scaling, 0});
        lin_b.use_fp8({sb_scaling, 0});
        for (int step = 0; step < 2; ++step) {  // the second step uses delayed scaling's learned scales
          SCOPED_TRACE("step " + std::to_string(step));
          const Tensor x = random_tensor({rows, in}, DType::BF16, 10 + step, -2, 3);
          const Tensor r = random_tensor({rows, in}, DType::BF16, 20 + step);
          const Tensor dy = random_tensor({rows, out}, DType::BF16, 30 + step);
          const Tensor d_res = random_tensor({rows, in}, DType::BF16, 40 + step);
          ASSERT_TRUE(fused.runs_fp8(x));
          nn::LayerNormLinear::Saved sa;
          const Tensor y_a = add ? fused.forward_add(ctx, x, r, sa) : fused.forward(ctx, x, sa);
          const Tensor dx_a = add ? fused.backward_input_add(ctx, dy, d_res, sa) : fused.backward_input(ctx, dy, sa);
          fused.backward_weight(ctx, dy, sa);
          ASSERT_TRUE(sa.linear.fp8);
          EXPECT_FALSE(sa.linear.x.defined());

          nn::Norm::Saved ns;
          nn::Linear::Saved ls;
          const Tensor h = add ? norm_b.forward_add(ctx, x, r, ns) : norm_b.forward(ctx, x, ns);
          const Tensor y_b = lin_b.forward(ctx, h, ls);
          const Tensor dh = lin_b.backward_input(ctx, dy, ls);
          const Tensor dx_b = add ? norm_b.backward_input_add(ctx, dh, d_res, ns) : norm_b.backward_input(ctx, dh, ns);
          lin_b.backward_weight(ctx, dy, ls);

          // Only the transposed copy outlives the forward (what dW reads): the norm's FP8 output.
          EXPECT_FALSE(sa.linear.x_fp8.data.defined() || ls.x_fp8.data.defined()) << "row-wise copy kept";
          ASSERT_TRUE(sa.linear.x_fp8.data_t.defined());
          EXPECT_TRUE(same_bits(sa.linear.x_fp8.data_t, ls.x_fp8.data_t)) << "the norm's FP8 output (transposed)";
          EXPECT_TRUE(same_bits(sa.linear.x_fp8.scale_inv, ls.x_fp8.scale_inv)) << "scale_inv";
          EXPECT_TRUE(same_bits(y_a, y_b)) << "y";
          EXPECT_TRUE(same_bits(dx_a, dx_b)) << "dx";
          EXPECT_TRUE(same_bits(sa.norm.x, ns.x)) << "the residual sum";
          expect_same_grads(pa, pb, "FP8");
          for (const auto& s : {sa_scaling, sb_scaling}) {
            s->end_micro_batch(ctx);
            s->end_step(ctx);
          }
          for (const auto& [name, t] : sa_scaling->state_dict())
            EXPECT_TRUE(same_bits(t, sb_scaling->state_dict().at(name))) << "scaling state " << name;
        }
      }
    }
  }
}

TEST(LayerNormMLP, Fp8EqualsNormThenFp8MlpBitForBit) {
  Context ctx = Context::cpu();
  const int64_t rows = 16, hidden = 32, ffn = 48;
  for (const char* recipe : {"current", "delayed"}) {
    for (const nn::Activation act : {nn::Activation::GELU, nn::Activation::SwiGLU}) {
      const bool gelu = act == nn::Activation::GELU;
      SCOPED_TRACE(std::string(recipe) + (gelu ? " gelu" : " swiglu"));
      const nn::NormKind kind = gelu ? nn::NormKind::LayerNorm : nn::NormKind::RMSNorm;
      nn::Norm norm_a("norm", kind, hidden, kEps, DType::BF16), norm_b("norm", kind, hidden, kEps, DType::BF16);
      nn::MLP mlp_a("m", hidden, ffn, act, gelu, DType::BF16), mlp_b("m", hidden, ffn, act, gelu, DType::BF16);
      nn::LayerNormMLP fused(norm_a, mlp_a);
      nn::ParameterList pa, pb;
      fused.parameters(pa);
      norm_b.parameters(pb);
      mlp_b.parameters(pb);
      randomize(pa, 600);
      copy_params(pa, pb);
      auto sa_scaling = std::make_shared<nn::Fp8Scaling>(ctx, recipe_named(recipe), 2);
      auto sb_scaling = std::make_shared<nn::Fp8Scaling>(ctx, recipe_named(recipe), 2);
      mlp_a.fc.use_fp8({sa_scaling, 0});
      mlp_a.proj.use_fp8({sa_scaling, 1});
      mlp_b.fc.use_fp8({sb_scaling, 0});
      mlp_b.proj.use_fp8({sb_scaling, 1});
      for (int step = 0; step < 2; ++step) {
        SCOPED_TRACE("step " + std::to_string(step));
        const Tensor x = random_tensor({rows, hidden}, DType::BF16, 50 + step, -2, 3);
        const Tensor r = random_tensor({rows, hidden}, DType::BF16, 60 + step);
        const Tensor dy = random_tensor({rows, hidden}, DType::BF16, 70 + step);
        nn::LayerNormMLP::Saved sa;
        const Tensor y_a = fused.forward_add(ctx, x, r, sa);
        const Tensor dx_a = fused.backward_input_add(ctx, dy, dy, sa);
        fused.backward_weight(ctx, dy, sa);
        ASSERT_TRUE(sa.mlp.fc_in.fp8 && sa.mlp.proj_in.fp8);

        nn::Norm::Saved ns;
        nn::MLP::Saved ms;
        const Tensor y_b = mlp_b.forward(ctx, norm_b.forward_add(ctx, x, r, ns), ms);
        const Tensor dx_b = norm_b.backward_input_add(ctx, mlp_b.backward_input(ctx, dy, ms), dy, ns);
        mlp_b.backward_weight(ctx, dy, ms);

        ASSERT_TRUE(sa.mlp.fc_in.x_fp8.data_t.defined());
        EXPECT_TRUE(same_bits(sa.mlp.fc_in.x_fp8.data_t, ms.fc_in.x_fp8.data_t)) << "the norm's FP8 output";
        EXPECT_TRUE(same_bits(y_a, y_b)) << "y";
        EXPECT_TRUE(same_bits(dx_a, dx_b)) << "dx";
        expect_same_grads(pa, pb, "FP8");
        for (const auto& s : {sa_scaling, sb_scaling}) {
          s->end_micro_batch(ctx);
          s->end_step(ctx);
        }
      }
    }
  }
}

// The whole block in FP8: the fused modules against the unfused block (separate adds, norms
// in BF16, each linear layer casting its own input), forward, backward and weight gradients.
TEST(LayerNormLinear, Fp8TransformerLayerEqualsTheUnfusedBlock) {
  Context ctx = Context::cpu();
  const int64_t batch = 2, seq = 8;
  auto sum_of = [&](const Tensor& a, const Tensor& b) {
    Tensor out = Tensor::empty(a.shape(), a.dtype());
    add(ctx, a, b, out);
    return out;
  };
  for (const char* arch : {"gpt2", "llama"}) {
    for (const char* recipe : {"current", "delayed"}) {
      SCOPED_TRACE(std::string(arch) + " " + recipe);
      models::ModelConfig c;
      c.architecture = arch;
      c.hidden_size = 32;
      c.num_heads = 2;
      c.num_kv_heads = c.is_gpt2() ? 2 : 1;
      c.intermediate_size = 48;
      c.max_seq_len = 8;
      c.rope_theta = 100.0f;
      nn::TransformerLayer layer("layers.0", c, DType::BF16);
      nn::ParameterList params;
      layer.parameters(params);
      randomize(params, 700);
      for (nn::Parameter* p : params) p->grad.fill_zero();
      auto scaling = std::make_shared<nn::Fp8Scaling>(ctx, recipe_named(recipe), 4);
      layer.attn.qkv.use_fp8({scaling, 0});
      layer.attn.proj.use_fp8({scaling, 1});
      layer.mlp.fc.use_fp8({scaling, 2});
      layer.mlp.proj.use_fp8({scaling, 3});
      const Tensor x = random_tensor({batch * seq, c.hidden_size}, DType::BF16, 710, -1, 1);
      const Tensor dy = random_tensor({batch * seq, c.hidden_size}, DType::BF16, 711, -1, 1);
      if (std::string(recipe) == "delayed") {  // one step so that the scales are learned ones
        nn::TransformerLayer::Saved warm;
        layer.forward(ctx, x, batch, seq, warm);
        layer.backward_input(ctx, dy, warm);
        layer.backward_weight(ctx, dy, warm);
        scaling->end_step(ctx);
        for (nn::Parameter* p : params) p->grad.fill_zero();
      }

      nn::TransformerLayer::Saved fused;
      const Tensor out = layer.forward(ctx, x, batch, seq, fused);
      ASSERT_TRUE(fused.attn.qkv_in.fp8 && fused.mlp.fc_in.fp8);
      const Tensor dx = layer.backward_input(ctx, dy, fused);
      layer.backward_weight(ctx, dy, fused);
      std::vector<Tensor> grads;
      for (nn::Parameter* p : params) {
        grads.push_back(p->grad.clone());
        p->grad.fill_zero();
      }

      nn::TransformerLayer::Saved u;
      const Tensor x1 = sum_of(x, layer.attn.forward(ctx, layer.norm1.forward(ctx, x, u.norm1), batch, seq, u.attn));
      const Tensor out_ref = sum_of(x1, layer.mlp.forward(ctx, layer.norm2.forward(ctx, x1, u.norm2), u.mlp));
      const Tensor d_x1 =
          sum_of(dy, layer.norm2.backward_input(ctx, layer.mlp.backward_input(ctx, dy, u.mlp), u.norm2));
      const Tensor dx_ref =
          sum_of(d_x1, layer.norm1.backward_input(ctx, layer.attn.backward_input(ctx, d_x1, u.attn), u.norm1));
      layer.mlp.backward_weight(ctx, dy, u.mlp);
      layer.attn.backward_weight(ctx, d_x1, u.attn);

      ASSERT_TRUE(fused.attn.qkv_in.x_fp8.data_t.defined() && fused.mlp.fc_in.x_fp8.data_t.defined());
      EXPECT_TRUE(same_bits(fused.attn.qkv_in.x_fp8.data_t, u.attn.qkv_in.x_fp8.data_t)) << "norm1's FP8 output";
      EXPECT_TRUE(same_bits(fused.mlp.fc_in.x_fp8.data_t, u.mlp.fc_in.x_fp8.data_t)) << "norm2's FP8 output";
      EXPECT_TRUE(same_bits(out, out_ref)) << "output";
      EXPECT_TRUE(same_bits(dx, dx_ref)) << "dx";
      for (size_t i = 0; i < params.size(); ++i)
        EXPECT_TRUE(same_bits(grads[i], params[i]->grad)) << params[i]->name << " gradient";
    }
  }
}

TEST(LayerNormLinear, TransformerLayerKeepsItsParameterNames) {
  models::ModelConfig c;
  c.architecture = "gpt2";
  c.hidden_size = 16;
  c.num_heads = 2;
  c.num_kv_heads = 2;
  c.intermediate_size = 32;
  c.max_seq_len = 8;
  nn::TransformerLayer layer("layers.3", c, DType::F32);
  nn::ParameterList params;
  layer.parameters(params);
  std::vector<std::string> names;
  for (const nn::Parameter* p : params) names.push_back(p->name);
  const std::vector<std::string> want = {
      "layers.3.norm1.weight",    "layers.3.norm1.bias",      "layers.3.attn.qkv.weight", "layers.3.attn.qkv.bias",
      "layers.3.attn.proj.weight", "layers.3.attn.proj.bias", "layers.3.norm2.weight",    "layers.3.norm2.bias",
      "layers.3.mlp.fc.weight",   "layers.3.mlp.fc.bias",     "layers.3.mlp.proj.weight", "layers.3.mlp.proj.bias"};
  EXPECT_EQ(names, want);
}

// ---- The norm -> FP8 ops on the CPU ----------------------------------------------------------

TEST(NormFp8, OpsAreTheNormThenTheCast) {
  Context ctx = Context::cpu();
  for (int k = 0; k < 2; ++k) {
    for (const DType t : {DType::F32, DType::BF16}) {
      const bool layer = k == 0;
      SCOPED_TRACE(std::string(layer ? "layernorm " : "rmsnorm ") + dtype_name(t));
      const Shape shape{7, 33};
      const Tensor x = random_tensor(shape, t, 800, -2, 4), r = random_tensor(shape, t, 801);
      const Tensor gamma = random_tensor({33}, DType::F32, 802, 0.5f, 1.5f), beta = random_tensor({33}, t, 803);
      const Tensor scale = Tensor::from_floats({37.5f}, {1});
      for (const bool add : {false, true}) {
        SCOPED_TRACE(add ? "add" : "plain");
        // Reference: the plain op, then quantize_per_tensor.
        Tensor y = Tensor::empty(shape, t), sum = Tensor::empty(shape, t), mean = Tensor::empty({7}, DType::F32),
               rstd = Tensor::empty({7}, DType::F32), q_ref = Tensor::empty(shape, DType::E4M3),
               amax_ref = Tensor::empty({1}, DType::F32);
        if (layer && add) add_layernorm_forward(ctx, x, r, gamma, beta, kEps, sum, y, mean, rstd);
        else if (layer) layernorm_forward(ctx, x, gamma, beta, kEps, y, mean, rstd);
        else if (add) add_rmsnorm_forward(ctx, x, r, gamma, kEps, sum, y, rstd);
        else rmsnorm_forward(ctx, x, gamma, kEps, y, rstd);
        quantize_per_tensor(ctx, y, scale, q_ref, amax_ref);

        // The fused op, with the copy of y, then the statistics pass and the apply pass.
        NormFp8Output out{Tensor::empty(shape, DType::E4M3), Tensor::empty({1}, DType::F32), Tensor::empty(shape, t)};
        Tensor sum2 = Tensor::empty(shape, t), mean2 = Tensor::empty({7}, DType::F32),
               rstd2 = Tensor::empty({7}, DType::F32);
        auto run = [&](NormFp8Output& o) {
          if (layer && add) add_layernorm_forward_fp8(ctx, x, r, gamma, beta, kEps, scale, sum2, o, mean2, rstd2);
          else if (layer) layernorm_forward_fp8(ctx, x, gamma, beta, kEps, scale, o, mean2, rstd2);
          else if (add) add_rmsnorm_forward_fp8(ctx, x, r, gamma, kEps, scale, sum2, o, rstd2);
          else rmsnorm_forward_fp8(ctx, x, gamma, kEps, scale, o, rstd2);
        };
        run(out);
        EXPECT_TRUE(same_bits(out.q, q_ref)) << "q";
        EXPECT_TRUE(same_bits(out.amax, amax_ref)) << "amax";
        EXPECT_TRUE(same_bits(out.y, y)) << "y";
        EXPECT_TRUE(same_bits(rstd2, rstd)) << "rstd";
        if (layer) EXPECT_TRUE(same_bits(mean2, mean)) << "mean";
        if (add) EXPECT_TRUE(same_bits(sum2, sum)) << "sum";

        NormFp8Output stats{Tensor(), Tensor::empty({1}, DType::F32), Tensor()};
        run(stats);
        EXPECT_TRUE(same_bits(stats.amax, amax_ref)) << "statistics pass amax";
        Tensor q = Tensor::empty(shape, DType::E4M3);
        const Tensor& normalized = add ? sum2 : x;
        if (layer) layernorm_apply_fp8(ctx, normalized, gamma, beta, mean2, rstd2, scale, q);
        else rmsnorm_apply_fp8(ctx, normalized, gamma, rstd2, scale, q);
        EXPECT_TRUE(same_bits(q, q_ref)) << "apply pass";
      }
    }
  }
}

TEST(NormFp8, RejectsBadArguments) {
  Context ctx = Context::cpu();
  const Tensor x = random_tensor({4, 16}, DType::BF16, 900), gamma = random_tensor({16}, DType::BF16, 901);
  const Tensor scale = Tensor::from_floats({1.0f}, {1});
  Tensor rstd = Tensor::empty({4}, DType::F32);
  auto expect_error = [&](NormFp8Output out, const Tensor& s, const std::string& needle) {
    try {
      rmsnorm_forward_fp8(ctx, x, gamma, kEps, s, out, rstd);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error({Tensor::empty({4, 16}, DType::E5M2), Tensor(), Tensor()}, scale, "out.q");
  expect_error({Tensor::empty({4, 8}, DType::E4M3), Tensor(), Tensor()}, scale, "out.q");
  expect_error({Tensor(), Tensor(), Tensor()}, scale, "out.amax must be given");
  expect_error({Tensor::empty({4, 16}, DType::E4M3), Tensor(), Tensor()}, Tensor::from_floats({1, 2}, {2}), "scale");
  Tensor shared = Tensor::from_floats({1.0f}, {1});
  expect_error({Tensor::empty({4, 16}, DType::E4M3), shared, Tensor()}, shared, "out.amax");
  expect_error({Tensor::empty({4, 16}, DType::E4M3), Tensor(), Tensor::empty({4, 16}, DType::F32)}, scale, "out.y");
}
