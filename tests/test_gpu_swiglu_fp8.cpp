// SwiGLU fused with the FP8 cast of its output on CUDA (backend/cuda/swiglu_fp8.cu):
//  - the fused kernels against the unfused CUDA path (swiglu_forward / swiglu_backward in
//    BF16, then quantize_with_transpose = cast_transpose, or amax), byte for byte: codes,
//    transposed codes, scale_inv, amax; E4M3 and E5M2, tile-aligned and ragged shapes,
//    saturating scales, NaN / Inf inputs, outputs poisoned first; shapes the kernels do not
//    take (odd F, rows % 8 != 0, F32) go through the op's unfused composition, same bytes;
//  - against the CPU reference: the BF16 SwiGLU kernels use the hardware exponential, so an
//    activation may round to the neighbouring BF16 value: codes agree or sit one step apart
//    for at most 1% of the elements, amax within 1%;
//  - an MLP and a LayerNormMLP in FP8 (current and delayed scaling, two steps) on CUDA with
//    MLP::set_fused_fp8_activation on and off: outputs, input and weight gradients and the
//    scaling state bit for bit.
// Skipped (saying so) where no GPU is present.
#include <cmath>
#include <cstring>
#include <string>

#include "gpu_testing.h"
#include "tessera/fp8/quantized_tensor.h"
#include "tessera/nn/layernorm_mlp.h"
#include "tessera/nn/mlp.h"
#include "tessera/ops/activation.h"
#include "tessera/ops/quantize.h"
#if TESSERA_WITH_CUDA
#include "backend/cuda/swiglu_fp8.h"
#endif

using namespace tessera;
using namespace tessera::testing;

namespace {

Tensor host(const Tensor& t) { return t.to(Device::cpu()); }

bool is_nan_code(uint8_t c, DType t) { return t == DType::E4M3 ? (c & 0x7f) == 0x7f : (c & 0x7f) > 0x7c; }
int ordered(uint8_t c) { return (c & 0x80) ? -int(c & 0x7f) : int(c); }

// Codes equal (max_off_fraction = 0), or one step apart for at most that fraction; NaN codes
// exactly where the reference has them.
void expect_codes(const Tensor& got_any, const Tensor& want_any, double max_off_fraction, const std::string& what) {
  const Tensor got = host(got_any), want = host(want_any);
  ASSERT_EQ(got.dtype(), want.dtype()) << what;
  ASSERT_EQ(got.shape(), want.shape()) << what;
  const auto* g = static_cast<const uint8_t*>(got.raw_data());
  const auto* w = static_cast<const uint8_t*>(want.raw_data());
  int64_t off = 0, bad = 0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const bool gn = is_nan_code(g[i], got.dtype()), wn = is_nan_code(w[i], want.dtype());
    if (gn || wn) {
      if (gn != wn && bad++ < 5) ADD_FAILURE() << what << ": element " << i << " NaN on one side only";
      continue;
    }
    if (g[i] == w[i]) continue;
    ++off;
    if ((max_off_fraction == 0 || std::abs(ordered(g[i]) - ordered(w[i])) > 1) && bad++ < 5)
      ADD_FAILURE() << what << ": element " << i << " code 0x" << std::hex << int(g[i]) << ", want 0x" << int(w[i]);
  }
  EXPECT_EQ(bad, 0) << what;
  const double allowed = max_off_fraction > 0 ? max_off_fraction * double(got.numel()) + 1 : 0;
  EXPECT_LE(double(off), allowed) << what << ": " << off << " codes one step off";
}

void expect_same_bytes(const Tensor& got, const Tensor& want, const std::string& what) {
  EXPECT_EQ(bytes_of(got), bytes_of(want)) << what;
}

float item(const Tensor& t) { return host(t).data<float>()[0]; }

// x [rows, 2F] BF16 in [-6, 6] (E4M3 saturates at the scales used), NaN / Inf planted when
// `specials`.
Tensor swiglu_input(int64_t rows, int64_t f, DType t, uint64_t seed, bool specials) {
  Tensor x = random_tensor({rows, 2 * f}, t, seed, -6.0f, 6.0f);
  if (specials && x.numel() > 0) {
    const float values[] = {NAN, INFINITY, -INFINITY, 0.0f, -0.0f, 1000.0f};
    for (int k = 0; k < 6; ++k) x.set_item((int64_t(k) * 7919) % x.numel(), values[k]);
  }
  return x;
}

struct Case {
  int64_t rows, f;
};

// Tile-aligned, ragged tiles (rows % 64, F % 128), the smallest vector shape, and shapes the
// kernels refuse (the op composes the unfused ops there).
const std::vector<Case> kCases{{64, 128}, {128, 256}, {72, 200}, {8, 8}, {136, 1032}, {512, 1024},
                               {5, 3},    {12, 16},   {16, 12},  {0, 16}, {16, 0}};

}  // namespace

TEST(GpuSwigluFp8, ForwardKernelEqualsUnfusedCudaAndCpu) {
  REQUIRE_GPU();
#if TESSERA_WITH_CUDA
  Context cpu = Context::cpu(), gpu = Context::cuda();
  uint64_t seed = 1;
  for (const Case& c : kCases) {
    for (const DType fp8 : {DType::E4M3, DType::E5M2}) {
      for (const bool with_amax : {true, false}) {
        const bool specials = seed % 3 == 0;
        const std::string what = std::to_string(c.rows) + "x" + std::to_string(c.f) + " " + dtype_name(fp8) +
                                 (with_amax ? " amax" : "") + (specials ? " NaN/Inf" : "");
        SCOPED_TRACE(what);
        const Tensor x = swiglu_input(c.rows, c.f, DType::BF16, seed++, specials);
        const Tensor scale = Tensor::from_floats({fp8 == DType::E4M3 ? 40.0f : 3000.0f}, {1});
        const Tensor xg = x.to(kCuda), sg = scale.to(kCuda);

        // Unfused on CUDA: swiglu_forward then the cast the layer makes.
        Tensor h = Tensor::empty({c.rows, c.f}, DType::BF16, kCuda);
        swiglu_forward(gpu, xg, h);
        Tensor amax_unfused = Tensor::empty({1}, DType::F32, kCuda);
        const fp8::QuantizedTensor want = fp8::quantize_with_transpose(gpu, h, sg, fp8, &amax_unfused);

        // The kernel itself, into poisoned outputs, where it applies.
        Tensor q = poisoned_device({c.rows, c.f}, fp8), qt = poisoned_device({c.f, c.rows}, fp8);
        Tensor kernel_amax = with_amax ? poisoned_device({1}, DType::F32) : Tensor();
        if (cuda::swiglu_cast_transpose_supported(xg, nullptr, q, qt)) {
          cuda::swiglu_forward_cast_transpose(gpu.stream, xg, sg, q, qt, kernel_amax);
          expect_codes(q, want.data, 0, "kernel q");
          expect_codes(qt, want.data_t, 0, "kernel q_t");
          expect_same_bytes(q, want.data, "kernel q bytes");
          expect_same_bytes(qt, want.data_t, "kernel q_t bytes");
          if (with_amax) expect_same_bytes(kernel_amax, amax_unfused, "kernel amax");
        } else {
          EXPECT_TRUE(c.f % 8 != 0 || c.rows % 8 != 0) << "a vector shape refused";
        }

        // The op (kernel or composition).
        Tensor op_amax = poisoned_device({1}, DType::F32);
        const fp8::QuantizedTensor got = swiglu_forward_fp8(gpu, xg, sg, fp8, with_amax ? &op_amax : nullptr);
        expect_same_bytes(got.data, want.data, "op data");
        expect_same_bytes(got.data_t, want.data_t, "op data_t");
        expect_same_bytes(got.scale_inv, want.scale_inv, "op scale_inv");
        if (with_amax) expect_same_bytes(op_amax, amax_unfused, "op amax");

        Tensor only = poisoned_device({1}, DType::F32), ref = Tensor::empty({1}, DType::F32, kCuda);
        swiglu_forward_amax(gpu, xg, only);
        amax(gpu, h, ref);
        const float a = item(only), b = item(ref);
        EXPECT_TRUE(std::isnan(a) ? std::isnan(b) : a == b) << "swiglu_forward_amax " << a << " vs " << b;

        // The CPU reference (exact exponential): one step at most, rarely.
        Tensor amax_cpu = Tensor::empty({1}, DType::F32);
        const fp8::QuantizedTensor ref_cpu = swiglu_forward_fp8(cpu, x, scale, fp8, &amax_cpu);
        expect_codes(got.data, ref_cpu.data, 0.01, "data vs CPU");
        expect_codes(got.data_t, ref_cpu.data_t, 0.01, "data_t vs CPU");
        const float ac = item(amax_cpu);
        if (std::isnan(ac) || std::isinf(ac)) EXPECT_EQ(std::isnan(ac), std::isnan(a)) << "amax vs CPU";
        else EXPECT_NEAR(a, ac, 0.01 * ac + 1e-30) << "amax vs CPU";
      }
    }
  }
#endif
}

TEST(GpuSwigluFp8, BackwardKernelEqualsUnfusedCudaAndCpu) {
  REQUIRE_GPU();
#if TESSERA_WITH_CUDA
  Context cpu = Context::cpu(), gpu = Context::cuda();
  uint64_t seed = 500;
  for (const Case& c : kCases) {
    for (const DType fp8 : {DType::E5M2, DType::E4M3}) {
      for (const bool with_amax : {true, false}) {
        const bool specials = seed % 3 == 0;
        const std::string what = std::to_string(c.rows) + "x" + std::to_string(c.f) + " " + dtype_name(fp8) +
                                 (with_amax ? " amax" : "") + (specials ? " NaN/Inf" : "");
        SCOPED_TRACE(what);
        const Tensor x = swiglu_input(c.rows, c.f, DType::BF16, seed++, specials);
        const Tensor dy = random_tensor({c.rows, c.f}, DType::BF16, seed++, -4.0f, 4.0f);
        const Tensor scale = Tensor::from_floats({fp8 == DType::E4M3 ? 20.0f : 2000.0f}, {1});
        const Tensor xg = x.to(kCuda), dyg = dy.to(kCuda), sg = scale.to(kCuda);

        Tensor dx = Tensor::empty({c.rows, 2 * c.f}, DType::BF16, kCuda);
        swiglu_backward(gpu, xg, dyg, dx);
        Tensor amax_unfused = Tensor::empty({1}, DType::F32, kCuda);
        const fp8::QuantizedTensor want = fp8::quantize_with_transpose(gpu, dx, sg, fp8, &amax_unfused);

        Tensor q = poisoned_device({c.rows, 2 * c.f}, fp8), qt = poisoned_device({2 * c.f, c.rows}, fp8);
        Tensor kernel_amax = with_amax ? poisoned_device({1}, DType::F32) : Tensor();
        if (cuda::swiglu_cast_transpose_supported(xg, &dyg, q, qt)) {
          cuda::swiglu_backward_cast_transpose(gpu.stream, xg, dyg, sg, q, qt, kernel_amax);
          expect_codes(q, want.data, 0, "kernel q");
          expect_codes(qt, want.data_t, 0, "kernel q_t");
          expect_same_bytes(q, want.data, "kernel q bytes");
          expect_same_bytes(qt, want.data_t, "kernel q_t bytes");
          if (with_amax) expect_same_bytes(kernel_amax, amax_unfused, "kernel amax");
        } else {
          EXPECT_TRUE(c.f % 8 != 0 || c.rows % 8 != 0) << "a vector shape refused";
        }

        Tensor op_amax = poisoned_device({1}, DType::F32);
        const fp8::QuantizedTensor got = swiglu_backward_fp8(gpu, xg, dyg, sg, fp8, with_amax ? &op_amax : nullptr);
        expect_same_bytes(got.data, want.data, "op data");
        expect_same_bytes(got.data_t, want.data_t, "op data_t");
        expect_same_bytes(got.scale_inv, want.scale_inv, "op scale_inv");
        if (with_amax) expect_same_bytes(op_amax, amax_unfused, "op amax");

        Tensor only = poisoned_device({1}, DType::F32), ref = Tensor::empty({1}, DType::F32, kCuda);
        swiglu_backward_amax(gpu, xg, dyg, only);
        amax(gpu, dx, ref);
        const float a = item(only), b = item(ref);
        EXPECT_TRUE(std::isnan(a) ? std::isnan(b) : a == b) << "swiglu_backward_amax " << a << " vs " << b;

        Tensor amax_cpu = Tensor::empty({1}, DType::F32);
        const fp8::QuantizedTensor ref_cpu = swiglu_backward_fp8(cpu, x, dy, scale, fp8, &amax_cpu);
        expect_codes(got.data, ref_cpu.data, 0.01, "data vs CPU");
        expect_codes(got.data_t, ref_cpu.data_t, 0.01, "data_t vs CPU");
        const float ac = item(amax_cpu);
        if (std::isnan(ac) || std::isinf(ac)) EXPECT_EQ(std::isnan(ac), std::isnan(a)) << "amax vs CPU";
        else EXPECT_NEAR(a, ac, 0.01 * ac + 1e-30) << "amax vs CPU";
      }
    }
  }
#endif
}

TEST(GpuSwigluFp8, F32AndMisalignedInputsTakeTheUnfusedComposition) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  for (const bool misaligned : {false, true}) {
    for (const DType t : {DType::F32, DType::BF16}) {
      if (!misaligned && t == DType::BF16) continue;  // the kernel's case, tested above
      SCOPED_TRACE(std::string(dtype_name(t)) + (misaligned ? " misaligned" : ""));
      const Tensor x = to_device(swiglu_input(32, 64, t, 77, false), misaligned);
      const Tensor dy = to_device(random_tensor({32, 64}, t, 78), misaligned);
      const Tensor scale = Tensor::from_floats({10.0f}, {1}, DType::F32).to(kCuda);
      Tensor h = Tensor::empty({32, 64}, t, kCuda), dx = Tensor::empty({32, 128}, t, kCuda);
      swiglu_forward(gpu, x, h);
      swiglu_backward(gpu, x, dy, dx);
      const fp8::QuantizedTensor f = swiglu_forward_fp8(gpu, x, scale, DType::E4M3);
      const fp8::QuantizedTensor b = swiglu_backward_fp8(gpu, x, dy, scale, DType::E5M2);
      expect_same_bytes(f.data_t, fp8::quantize_with_transpose(gpu, h, scale, DType::E4M3).data_t, "forward");
      expect_same_bytes(b.data_t, fp8::quantize_with_transpose(gpu, dx, scale, DType::E5M2).data_t, "backward");
    }
  }
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

fp8::Recipe recipe_named(const std::string& name) { return fp8::Recipe::from_json({{"recipe", name}}); }

struct FusedSwitch {
  bool before = nn::MLP::fused_fp8_activation();
  ~FusedSwitch() { nn::MLP::set_fused_fp8_activation(before); }
};

}  // namespace

TEST(GpuSwigluFp8, MlpFusedEqualsUnfusedBitForBit) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  FusedSwitch restore;
  const int64_t rows = 128, hidden = 64, ffn = 256;
  for (const char* recipe : {"current", "delayed"}) {
    for (const bool with_norm : {false, true}) {
      SCOPED_TRACE(std::string(recipe) + (with_norm ? " LayerNormMLP" : " MLP"));
      // Two identical modules on the GPU (parameters made on the CPU, then moved).
      nn::Norm norm_a("norm", nn::NormKind::RMSNorm, hidden, 1e-5f, DType::BF16);
      nn::Norm norm_b("norm", nn::NormKind::RMSNorm, hidden, 1e-5f, DType::BF16);
      nn::MLP mlp_a("m", hidden, ffn, nn::Activation::SwiGLU, false, DType::BF16);
      nn::MLP mlp_b("m", hidden, ffn, nn::Activation::SwiGLU, false, DType::BF16);
      nn::LayerNormMLP ln_a(norm_a, mlp_a), ln_b(norm_b, mlp_b);
      nn::ParameterList pa, pb;
      ln_a.parameters(pa);
      ln_b.parameters(pb);
      randomize(pa, 1000);
      randomize(pb, 1000);
      for (nn::Parameter* p : pa) p->to(kCuda);
      for (nn::Parameter* p : pb) p->to(kCuda);
      auto sa = std::make_shared<nn::Fp8Scaling>(gpu, recipe_named(recipe), 2);
      auto sb = std::make_shared<nn::Fp8Scaling>(gpu, recipe_named(recipe), 2);
      mlp_a.fc.use_fp8({sa, 0});
      mlp_a.proj.use_fp8({sa, 1});
      mlp_b.fc.use_fp8({sb, 0});
      mlp_b.proj.use_fp8({sb, 1});
      for (int step = 0; step < 2; ++step) {
        SCOPED_TRACE("step " + std::to_string(step));
        const Tensor x = random_tensor({rows, hidden}, DType::BF16, 1010 + step, -2, 3).to(kCuda);
        const Tensor dy = random_tensor({rows, hidden}, DType::BF16, 1020 + step).to(kCuda);
        Tensor y[2], dx[2];
        nn::LayerNormMLP* modules[2] = {&ln_a, &ln_b};
        nn::MLP* mlps[2] = {&mlp_a, &mlp_b};
        for (int k = 0; k < 2; ++k) {
          nn::MLP::set_fused_fp8_activation(k == 0);
          if (with_norm) {
            nn::LayerNormMLP::Saved s;
            y[k] = modules[k]->forward(gpu, x, s);
            dx[k] = modules[k]->backward_input(gpu, dy, s);
            modules[k]->backward_weight(gpu, dy, s);
          } else {
            nn::MLP::Saved s;
            y[k] = mlps[k]->forward(gpu, x, s);
            ASSERT_TRUE(s.fc_in.fp8 && s.proj_in.fp8);
            dx[k] = mlps[k]->backward_input(gpu, dy, s);
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
        for (const auto& [name, t] : sa->state_dict())
          expect_same_bytes(t, sb->state_dict().at(name), "scaling state " + name);
      }
    }
  }
}
