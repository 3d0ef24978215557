// SwiGLU fused with the FP8 cast of its output (ops/activation.h's swiglu_*_fp8 and
// swiglu_*_amax) on the CPU, and the FP8 MLP that uses them:
//  - each fused op equals the unfused path byte for byte (the activation in x's dtype, then
//    quantize_with_transpose / amax): codes, transposed codes, scale_inv and amax, E4M3 and
//    E5M2, BF16 and F32, odd and empty shapes, zero inputs, NaN inputs (NaN amax and NaN
//    codes where the unfused cast puts them); bad arguments are named;
//  - an MLP / LayerNormMLP in FP8 (current and delayed scaling, two steps, SwiGLU with and
//    without a bias, GELU) gives the same outputs, input gradients, weight gradients and
//    scaling state with MLP::set_fused_fp8_activation on as off, bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "testing.h"
#include "tessera/fp8/quantized_tensor.h"
#include "tessera/nn/layernorm_mlp.h"
#include "tessera/nn/mlp.h"
#include "tessera/ops/activation.h"
#include "tessera/ops/gemm.h"
#include "tessera/ops/quantize.h"

using namespace tessera;
using namespace tessera::testing;

namespace {


Tensor scalar(float v) { return Tensor::from_floats({v}, {1}); }

void expect_same_quantized(const fp8::QuantizedTensor& got, const fp8::QuantizedTensor& want, const std::string& what) {
  EXPECT_EQ(got.dtype, want.dtype) << what;
  EXPECT_TRUE(same_bits(got.data, want.data)) << what << ": data";
  EXPECT_TRUE(same_bits(got.data_t, want.data_t)) << what << ": data_t";
  EXPECT_TRUE(same_bits(got.scale_inv, want.scale_inv)) << what << ": scale_inv";
}

// x [rows, 2F] with a spread wide enough to saturate E4M3 at scale 64.
Tensor swiglu_input(int64_t rows, int64_t f, DType t, uint64_t seed) { return random_tensor({rows, 2 * f}, t, seed, -6, 6); }

struct Case {
  int64_t rows, f;
};

const std::vector<Case> kCases{{16, 8}, {5, 3}, {1, 1}, {33, 24}, {0, 4}, {7, 0}};

}  // namespace

TEST(SwigluFp8, ForwardEqualsSwigluThenCast) {
  Context ctx = Context::cpu();
  uint64_t seed = 1;
  for (const Case& c : kCases) {
    for (DType t : {DType::BF16, DType::F32}) {
      for (DType fp8 : {DType::E4M3, DType::E5M2}) {
        for (float s : {1.0f, 64.0f}) {
          const std::string what = std::to_string(c.rows) + "x" + std::to_string(c.f) + " " + dtype_name(t) + " " +
                                   dtype_name(fp8) + " scale " + std::to_string(s);
          const Tensor x = swiglu_input(c.rows, c.f, t, ++seed);
          Tensor h = Tensor::empty({c.rows, c.f}, t);
          swiglu_forward(ctx, x, h);
          Tensor want_amax = scalar(-1), got_amax = scalar(-2);
          const fp8::QuantizedTensor want = fp8::quantize_with_transpose(ctx, h, scalar(s), fp8, &want_amax);
          const fp8::QuantizedTensor got = swiglu_forward_fp8(ctx, x, scalar(s), fp8, &got_amax);
          expect_same_quantized(got, want, what);
          EXPECT_TRUE(same_bits(got_amax, want_amax)) << what << ": amax";
          expect_same_quantized(swiglu_forward_fp8(ctx, x, scalar(s), fp8), want, what + " (no amax)");

          Tensor only = scalar(-3), ref = scalar(-4);
          swiglu_forward_amax(ctx, x, only);
          amax(ctx, h, ref);
          EXPECT_TRUE(same_bits(only, ref)) << what << ": swiglu_forward_amax";
        }
      }
    }
  }
}

TEST(SwigluFp8, BackwardEqualsSwigluBackwardThenCast) {
  Context ctx = Context::cpu();
  uint64_t seed = 100;
  for (const Case& c : kCases) {
    for (DType t : {DType::BF16, DType::F32}) {
      for (DType fp8 : {DType::E5M2, DType::E4M3}) {
        const std::string what =
            std::to_string(c.rows) + "x" + std::to_string(c.f) + " " + dtype_name(t) + " " + dtype_name(fp8);
        const Tensor x = swiglu_input(c.rows, c.f, t, ++seed);
        const Tensor dy = random_tensor({c.rows, c.f}, t, ++seed, -3, 3);
        Tensor dx = Tensor::empty({c.rows, 2 * c.f}, t);
        swiglu_backward(ctx, x, dy, dx);
        Tensor want_amax = scalar(-1), got_amax = scalar(-2);
        const fp8::QuantizedTensor want = fp8::quantize_with_transpose(ctx, dx, scalar(16), fp8, &want_amax);
        const fp8::QuantizedTensor got = swiglu_backward_fp8(ctx, x, dy, scalar(16), fp8, &got_amax);
        expect_same_quantized(got, want, what);
        EXPECT_TRUE(same_bits(got_amax, want_amax)) << what << ": amax";

        Tensor only = scalar(-3), ref = scalar(-4);
        swiglu_backward_amax(ctx, x, dy, only);
        amax(ctx, dx, ref);
        EXPECT_TRUE(same_bits(only, ref)) << what << ": swiglu_backward_amax";
      }
    }
  }
}

TEST(SwigluFp8, ZeroInputGivesZeroCodesAndAmax) {
  Context ctx = Context::cpu();
  const Tensor x = Tensor::zeros({8, 16}, DType::BF16), dy = Tensor::zeros({8, 8}, DType::BF16);
  Tensor a = scalar(-1), b = scalar(-1), c = scalar(-1);
  const fp8::QuantizedTensor q = swiglu_forward_fp8(ctx, x, scalar(2), DType::E4M3, &a);
  const fp8::QuantizedTensor g = swiglu_backward_fp8(ctx, x, dy, scalar(2), DType::E5M2, &b);
  swiglu_forward_amax(ctx, x, c);
  EXPECT_EQ(a.item(0), 0.0);
  EXPECT_EQ(b.item(0), 0.0);
  EXPECT_EQ(c.item(0), 0.0);
  for (const Tensor* t : {&q.data, &q.data_t, &g.data, &g.data_t}) {
    const auto* p = static_cast<const uint8_t*>(t->raw_data());
    for (int64_t i = 0; i < t->numel(); ++i) ASSERT_EQ(p[i] & 0x7f, 0) << i;
  }
}

TEST(SwigluFp8, NanPropagatesAsInTheUnfusedCast) {
  Context ctx = Context::cpu();
  for (int64_t at : {int64_t(3), int64_t(8 + 2)}) {  // a gate element, then an up element
    SCOPED_TRACE(at);
    std::vector<double> v = swiglu_input(4, 8, DType::F32, 7).to_doubles();
    v[static_cast<size_t>(16 + at)] = std::numeric_limits<double>::quiet_NaN();  // row 1
    const Tensor x = Tensor::from_doubles(v, {4, 16}, DType::BF16);
    const Tensor dy = random_tensor({4, 8}, DType::BF16, 8);
    Tensor h = Tensor::empty({4, 8}, DType::BF16), dx = Tensor::empty({4, 16}, DType::BF16);
    swiglu_forward(ctx, x, h);
    swiglu_backward(ctx, x, dy, dx);
    Tensor fa = scalar(0), fb = scalar(0), ba = scalar(0), bb = scalar(0), only = scalar(0), only_b = scalar(0);
    expect_same_quantized(swiglu_forward_fp8(ctx, x, scalar(4), DType::E4M3, &fa),
                          fp8::quantize_with_transpose(ctx, h, scalar(4), DType::E4M3, &fb), "forward");
    expect_same_quantized(swiglu_backward_fp8(ctx, x, dy, scalar(4), DType::E5M2, &ba),
                          fp8::quantize_with_transpose(ctx, dx, scalar(4), DType::E5M2, &bb), "backward");
    swiglu_forward_amax(ctx, x, only);
    swiglu_backward_amax(ctx, x, dy, only_b);
    for (const Tensor* t : {&fa, &fb, &ba, &bb, &only, &only_b}) EXPECT_TRUE(std::isnan(t->item(0)));
  }
}

TEST(SwigluFp8, BadArgumentsAreNamed) {
  Context ctx = Context::cpu();
  const Tensor odd = Tensor::zeros({4, 7}, DType::BF16), x = Tensor::zeros({4, 8}, DType::BF16);
  const Tensor three_d = Tensor::zeros({2, 2, 8}, DType::BF16);
  EXPECT_THROW(swiglu_forward_fp8(ctx, odd, scalar(1), DType::E4M3), Error);
  EXPECT_THROW(swiglu_forward_fp8(ctx, three_d, scalar(1), DType::E4M3), Error);
  EXPECT_THROW(swiglu_forward_fp8(ctx, x, scalar(1), DType::BF16), Error);
  EXPECT_THROW(swiglu_forward_fp8(ctx, x, Tensor::zeros({2}, DType::F32), DType::E4M3), Error);
  Tensor s = scalar(1);
  EXPECT_THROW(swiglu_forward_fp8(ctx, x, s, DType::E4M3, &s), Error);  // amax_out aliasing the scale
  EXPECT_THROW(swiglu_backward_fp8(ctx, x, Tensor::zeros({4, 8}, DType::BF16), s, DType::E5M2), Error);  // dy shape
  EXPECT_THROW(swiglu_backward_fp8(ctx, x, Tensor::zeros({4, 4}, DType::F32), s, DType::E5M2), Error);   // dy dtype
  Tensor wrong = Tensor::zeros({2}, DType::F32);
  EXPECT_THROW(swiglu_forward_amax(ctx, x, wrong), Error);
}

// GELU's fused forms: the unfused path's bytes (gelu_forward / gelu_backward in x's dtype,
// then the cast, and for the backward with dbias the cast with the bias gradient).
TEST(GeluFp8, ForwardAndBackwardEqualTheUnfusedPath) {
  Context ctx = Context::cpu();
  uint64_t seed = 300;
  const std::vector<Case> cases{{16, 16}, {5, 3}, {1, 1}, {33, 24}, {0, 4}, {7, 0}};
  for (const Case& c : cases) {
    for (DType t : {DType::BF16, DType::F32}) {
      for (DType fp8 : {DType::E4M3, DType::E5M2}) {
        const std::string what =
            std::to_string(c.rows) + "x" + std::to_string(c.f) + " " + dtype_name(t) + " " + dtype_name(fp8);
        Tensor x = random_tensor({c.rows, c.f}, t, ++seed, -6, 6);
        if (x.numel() > 2) x.set_item(x.numel() - 1, NAN);  // a NaN row end: NaN amax and codes
        const Tensor dy = random_tensor({c.rows, c.f}, t, ++seed, -3, 3);
        Tensor h = Tensor::empty({c.rows, c.f}, t), dx = Tensor::empty({c.rows, c.f}, t);
        gelu_forward(ctx, x, h);
        gelu_backward(ctx, x, dy, dx);
        Tensor want_amax = scalar(-1), got_amax = scalar(-2);
        expect_same_quantized(gelu_forward_fp8(ctx, x, scalar(32), fp8, &got_amax),
                              fp8::quantize_with_transpose(ctx, h, scalar(32), fp8, &want_amax), what + " forward");
        EXPECT_TRUE(same_bits(got_amax, want_amax)) << what << ": forward amax";
        expect_same_quantized(gelu_backward_fp8(ctx, x, dy, scalar(16), fp8, &got_amax),
                              fp8::quantize_with_transpose(ctx, dx, scalar(16), fp8, &want_amax), what + " backward");
        EXPECT_TRUE(same_bits(got_amax, want_amax)) << what << ": backward amax";
        const Tensor start = random_tensor({c.f}, DType::F32, ++seed, -2, 2);
        Tensor db_got = start.clone(), db_want = start.clone();
        expect_same_quantized(gelu_backward_fp8(ctx, x, dy, scalar(16), fp8, nullptr, &db_got),
                              fp8::quantize_with_transpose(ctx, dx, scalar(16), fp8), what + " backward + dbias");
        bias_grad(ctx, dx, db_want);
        EXPECT_TRUE(same_bits(db_got, db_want)) << what << ": dbias";
        Tensor only = scalar(-3), ref = scalar(-4);
        gelu_forward_amax(ctx, x, only);
        amax(ctx, h, ref);
        EXPECT_TRUE(same_bits(only, ref)) << what << ": gelu_forward_amax";
        gelu_backward_amax(ctx, x, dy, only);
        amax(ctx, dx, ref);
        EXPECT_TRUE(same_bits(only, ref)) << what << ": gelu_backward_amax";
      }
    }
  }
}

TEST(GeluFp8, BadArgumentsAreNamed) {
  Context ctx = Context::cpu();
  const Tensor x = Tensor::zeros({4, 8}, DType::BF16), three_d = Tensor::zeros({2, 2, 8}, DType::BF16);
  Tensor s = scalar(1);
  EXPECT_THROW(gelu_forward_fp8(ctx, three_d, s, DType::E4M3), Error);
  EXPECT_THROW(gelu_forward_fp8(ctx, x, s, DType::BF16), Error);
  EXPECT_THROW(gelu_forward_fp8(ctx, x, s, DType::E4M3, &s), Error);  // amax_out aliasing the scale
  EXPECT_THROW(gelu_backward_fp8(ctx, x, Tensor::zeros({4, 4}, DType::BF16), s, DType::E5M2), Error);  // dy shape
  EXPECT_THROW(gelu_backward_fp8(ctx, x, Tensor::zeros({4, 8}, DType::F32), s, DType::E5M2), Error);   // dy dtype
  Tensor bad_bias = Tensor::zeros({7}, DType::F32);
  EXPECT_THROW(gelu_backward_fp8(ctx, x, x, s, DType::E5M2, nullptr, &bad_bias), Error);
  Tensor wrong = Tensor::zeros({2}, DType::F32);
  EXPECT_THROW(gelu_forward_amax(ctx, x, wrong), Error);
}

namespace {

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

void copy_params(const nn::ParameterList& from, const nn::ParameterList& to) {
  Context ctx = Context::cpu();
  ASSERT_EQ(from.size(), to.size());
  for (size_t i = 0; i < from.size(); ++i) {
    to[i]->weights().copy_from(from[i]->weights());
    to[i]->refresh_value(ctx);
    to[i]->grad.copy_from(from[i]->grad);
  }
}

fp8::Recipe recipe_named(const std::string& name) { return fp8::Recipe::from_json({{"recipe", name}}); }

// Restores the process-wide switch however the test ends.
struct FusedSwitch {
  bool before = nn::MLP::fused_fp8_activation();
  ~FusedSwitch() { nn::MLP::set_fused_fp8_activation(before); }
};

}  // namespace

// Two identical MLPs (and LayerNormMLPs over them), one run with the fused activation casts
// and one without, over two steps: every output, gradient and scaling statistic agrees.
TEST(SwigluFp8, MlpFusedEqualsUnfusedBitForBit) {
  Context ctx = Context::cpu();
  FusedSwitch restore;
  const int64_t rows = 32, hidden = 32, ffn = 48;
  for (const char* recipe : {"current", "delayed"}) {
    for (const nn::Activation act : {nn::Activation::SwiGLU, nn::Activation::GELU}) {
      for (const bool bias : {false, true}) {
        for (const bool with_norm : {false, true}) {
          const bool gelu = act == nn::Activation::GELU;
          SCOPED_TRACE(std::string(recipe) + (gelu ? " gelu" : " swiglu") + (bias ? " bias" : "") +
                       (with_norm ? " LayerNormMLP" : " MLP"));
          nn::Norm norm_a("norm", nn::NormKind::RMSNorm, hidden, 1e-5f, DType::BF16);
          nn::Norm norm_b("norm", nn::NormKind::RMSNorm, hidden, 1e-5f, DType::BF16);
          nn::MLP mlp_a("m", hidden, ffn, act, bias, DType::BF16), mlp_b("m", hidden, ffn, act, bias, DType::BF16);
          nn::LayerNormMLP ln_a(norm_a, mlp_a), ln_b(norm_b, mlp_b);
          nn::ParameterList pa, pb;
          ln_a.parameters(pa);
          ln_b.parameters(pb);
          randomize(pa, 900);
          copy_params(pa, pb);
          auto sa = std::make_shared<nn::Fp8Scaling>(ctx, recipe_named(recipe), 2);
          auto sb = std::make_shared<nn::Fp8Scaling>(ctx, recipe_named(recipe), 2);
          mlp_a.fc.use_fp8({sa, 0});
          mlp_a.proj.use_fp8({sa, 1});
          mlp_b.fc.use_fp8({sb, 0});
          mlp_b.proj.use_fp8({sb, 1});
          for (int step = 0; step < 2; ++step) {
            SCOPED_TRACE("step " + std::to_string(step));
            const Tensor x = random_tensor({rows, hidden}, DType::BF16, 910 + step, -2, 3);
            const Tensor dy = random_tensor({rows, hidden}, DType::BF16, 920 + step);
            Tensor y[2], dx[2];
            nn::LayerNormMLP* modules[2] = {&ln_a, &ln_b};
            nn::MLP* mlps[2] = {&mlp_a, &mlp_b};
            for (int k = 0; k < 2; ++k) {
              nn::MLP::set_fused_fp8_activation(k == 0);
              if (with_norm) {
                nn::LayerNormMLP::Saved s;
                y[k] = modules[k]->forward(ctx, x, s);
                dx[k] = modules[k]->backward_input(ctx, dy, s);
                modules[k]->backward_weight(ctx, dy, s);
              } else {
                nn::MLP::Saved s;
                y[k] = mlps[k]->forward(ctx, x, s);
                ASSERT_TRUE(s.fc_in.fp8 && s.proj_in.fp8);
                dx[k] = mlps[k]->backward_input(ctx, dy, s);
                EXPECT_FALSE(s.h_pre.defined());
                // Fused (k == 0) or not, nothing reads d_h_pre after fc's backward_input in
                // per-tensor FP8: fc's bias gradient came out of its cast.
                EXPECT_FALSE(s.d_h_pre.defined()) << "d_h_pre kept in BF16";
                if (bias) EXPECT_TRUE(s.fc_in.bias_grad_done);
                mlps[k]->backward_weight(ctx, dy, s);
              }
            }
            EXPECT_TRUE(same_bits(y[0], y[1])) << "y";
            EXPECT_TRUE(same_bits(dx[0], dx[1])) << "dx";
            for (size_t i = 0; i < pa.size(); ++i)
              EXPECT_TRUE(same_bits(pa[i]->grad, pb[i]->grad)) << "gradient of " << pa[i]->name;
            for (const auto& s : {sa, sb}) {
              s->end_micro_batch(ctx);
              s->end_step(ctx);
            }
            for (const auto& [name, t] : sa->state_dict())
              EXPECT_TRUE(same_bits(t, sb->state_dict().at(name))) << "scaling state " << name;
          }
        }
      }
    }
  }
}
