// Shared by the GPU tests of the fused activation -> FP8 kernels (test_gpu_gelu_fp8.cpp,
// test_gpu_swiglu_fp8.cpp): FP8 code comparisons, and the check that an MLP / LayerNormMLP in
// FP8 gives the same bits with the fused activation casts on and off.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gpu_testing.h"
#include "tessera/fp8/recipe.h"
#include "tessera/nn/fp8_scaling.h"
#include "tessera/nn/layernorm_mlp.h"
#include "tessera/nn/mlp.h"

namespace tessera::testing {

inline Tensor host(const Tensor& t) { return t.to(Device::cpu()); }

inline bool is_nan_code(uint8_t c, DType t) { return t == DType::E4M3 ? (c & 0x7f) == 0x7f : (c & 0x7f) > 0x7c; }
// Codes in value order (sign-magnitude to a signed integer), so that neighbours differ by 1.
inline int ordered_code(uint8_t c) { return (c & 0x80) ? -int(c & 0x7f) : int(c); }

// Codes equal (max_off_fraction = 0), or one step apart for at most that fraction of the
// elements; NaN codes exactly where the reference has them. Codes whose values (in the
// scaled domain) differ by at most abs_tol_scaled count as equal: for the GELU tail, where the
// CUDA kernels' FP32 form is accurate to ~1e-6 absolute and the CPU's far better.
inline void expect_close_codes(const Tensor& got_any, const Tensor& want_any, double max_off_fraction,
                               const std::string& what, double abs_tol_scaled = 0.0) {
  const Tensor got = host(got_any), want = host(want_any);
  ASSERT_EQ(got.dtype(), want.dtype()) << what;
  ASSERT_EQ(got.shape(), want.shape()) << what;
  const auto* g = static_cast<const uint8_t*>(got.raw_data());
  const auto* w = static_cast<const uint8_t*>(want.raw_data());
  std::vector<double> gv, wv;
  if (abs_tol_scaled > 0) {
    gv = got.to_doubles();
    wv = want.to_doubles();
  }
  int64_t off = 0, bad = 0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const bool gn = is_nan_code(g[i], got.dtype()), wn = is_nan_code(w[i], want.dtype());
    if (gn || wn) {
      if (gn != wn && bad++ < 5) ADD_FAILURE() << what << ": element " << i << " NaN on one side only";
      continue;
    }
    if (g[i] == w[i] || (abs_tol_scaled > 0 && std::abs(gv[i] - wv[i]) <= abs_tol_scaled)) continue;
    ++off;
    if ((max_off_fraction == 0 || std::abs(ordered_code(g[i]) - ordered_code(w[i])) > 1) && bad++ < 5)
      ADD_FAILURE() << what << ": element " << i << " code 0x" << std::hex << int(g[i]) << ", want 0x" << int(w[i]);
  }
  EXPECT_EQ(bad, 0) << what;
  const double allowed = max_off_fraction > 0 ? max_off_fraction * double(got.numel()) + 1 : 0;
  EXPECT_LE(double(off), allowed) << what << ": " << off << " codes one step off";
}

inline void expect_same_bytes(const Tensor& got, const Tensor& want, const std::string& what) {
  EXPECT_EQ(bytes_of(got), bytes_of(want)) << what;
}

inline float item(const Tensor& t) { return host(t).data<float>()[0]; }

// An activation input in [-6, 6] (E4M3 saturates at the scales the tests use), with NaN, +-Inf,
// +-0 and 1000 planted when `specials`.
inline Tensor activation_input(const Shape& shape, DType t, uint64_t seed, bool specials) {
  Tensor x = random_tensor(shape, t, seed, -6.0f, 6.0f);
  if (specials && x.numel() > 0) {
    const float values[] = {NAN, INFINITY, -INFINITY, 0.0f, -0.0f, 1000.0f};
    for (int k = 0; k < 6; ++k) x.set_item((int64_t(k) * 7919) % x.numel(), values[k]);
  }
  return x;
}

// A kernel test's shape: rows x f (f the activation's output width).
struct ActivationCase {
  int64_t rows, f;
};

// Parameters made on the CPU from a seed: norm weights near 1, others small; gradients random
// (they accumulate, so the check covers accumulation too).
inline void randomize(nn::ParameterList& params, uint64_t seed) {
  Context ctx = Context::cpu();
  for (nn::Parameter* p : params) {
    const bool norm = p->name.find("norm") != std::string::npos && p->name.find(".weight") != std::string::npos;
    p->weights().copy_from(random_tensor(p->weights().shape(), p->weights().dtype(), seed++, norm ? 0.5f : -0.4f,
                                         norm ? 1.5f : 0.4f));
    p->refresh_value(ctx);
    p->grad.copy_from(random_tensor(p->grad.shape(), p->grad.dtype(), seed++));
  }
}

inline fp8::Recipe recipe_named(const std::string& name) { return fp8::Recipe::from_json({{"recipe", name}}); }

// Restores nn::MLP's fused-activation switch when a test ends.
struct FusedFp8ActivationSwitch {
  bool before = nn::MLP::fused_fp8_activation();
  ~FusedFp8ActivationSwitch() { nn::MLP::set_fused_fp8_activation(before); }
};

struct FusedMlpCase {
  nn::Activation activation;
  nn::NormKind norm;
  bool bias;
  bool with_norm;  // LayerNormMLP (the norm feeding fc) or the plain MLP
  std::string recipe;
  uint64_t seed;
};

// Two identical FP8 modules on the GPU, one with the fused activation casts and one without:
// two steps of forward and backward give the same outputs, input and parameter gradients and
// scaling state, byte for byte. Without the norm, the plain MLP must also keep no BF16
// gradient of the pre-activation when `expect_no_d_h_pre` (the fused backward writes FP8).
inline void expect_fused_mlp_equals_unfused(const FusedMlpCase& c, bool expect_no_d_h_pre) {
  Context gpu = Context::cuda();
  const Device cuda = Device::cuda(0);
  FusedFp8ActivationSwitch restore;
  const int64_t rows = 128, hidden = 64, ffn = 256;
  nn::Norm norm_a("norm", c.norm, hidden, 1e-5f, DType::BF16);
  nn::Norm norm_b("norm", c.norm, hidden, 1e-5f, DType::BF16);
  nn::MLP mlp_a("m", hidden, ffn, c.activation, c.bias, DType::BF16);
  nn::MLP mlp_b("m", hidden, ffn, c.activation, c.bias, DType::BF16);
  nn::LayerNormMLP ln_a(norm_a, mlp_a), ln_b(norm_b, mlp_b);
  nn::ParameterList pa, pb;
  ln_a.parameters(pa);
  ln_b.parameters(pb);
  randomize(pa, c.seed);
  randomize(pb, c.seed);
  for (nn::Parameter* p : pa) p->to(cuda);
  for (nn::Parameter* p : pb) p->to(cuda);
  auto sa = std::make_shared<nn::Fp8Scaling>(gpu, recipe_named(c.recipe), 2);
  auto sb = std::make_shared<nn::Fp8Scaling>(gpu, recipe_named(c.recipe), 2);
  mlp_a.fc.use_fp8({sa, 0});
  mlp_a.proj.use_fp8({sa, 1});
  mlp_b.fc.use_fp8({sb, 0});
  mlp_b.proj.use_fp8({sb, 1});
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const Tensor x = random_tensor({rows, hidden}, DType::BF16, c.seed + 10 + step, -2, 3).to(cuda);
    const Tensor dy = random_tensor({rows, hidden}, DType::BF16, c.seed + 20 + step).to(cuda);
    Tensor y[2], dx[2];
    nn::LayerNormMLP* modules[2] = {&ln_a, &ln_b};
    nn::MLP* mlps[2] = {&mlp_a, &mlp_b};
    for (int k = 0; k < 2; ++k) {
      nn::MLP::set_fused_fp8_activation(k == 0);
      if (c.with_norm) {
        nn::LayerNormMLP::Saved s;
        y[k] = modules[k]->forward(gpu, x, s);
        dx[k] = modules[k]->backward_input(gpu, dy, s);
        modules[k]->backward_weight(gpu, dy, s);
      } else {
        nn::MLP::Saved s;
        y[k] = mlps[k]->forward(gpu, x, s);
        ASSERT_TRUE(s.fc_in.fp8 && s.proj_in.fp8);
        dx[k] = mlps[k]->backward_input(gpu, dy, s);
        if (expect_no_d_h_pre) EXPECT_FALSE(s.d_h_pre.defined());
        mlps[k]->backward_weight(gpu, dy, s);
      }
    }
    expect_same_bytes(y[0], y[1], "y");
    expect_same_bytes(dx[0], dx[1], "dx");
    for (size_t i = 0; i < pa.size(); ++i) expect_same_bytes(pa[i]->grad, pb[i]->grad, "gradient of " + pa[i]->name);
    for (const auto& s : {sa, sb}) {
      s->end_micro_batch(gpu);
      s->end_step(gpu);
    }
    for (const auto& [name, t] : sa->state_dict()) expect_same_bytes(t, sb->state_dict().at(name), "scaling state " + name);
  }
}

}  // namespace tessera::testing
