// GELU fused with the FP8 cast of its output on CUDA (backend/cuda/gelu_fp8.cu):
//  - the fused kernels against the unfused CUDA path (gelu_forward / gelu_backward in BF16,
//    then quantize_with_transpose = cast_transpose, or amax), byte for byte: codes,
//    transposed codes, scale_inv, amax; E4M3 and E5M2, tile-aligned and ragged shapes, NaN /
//    Inf inputs, outputs poisoned first; shapes the kernels do not take (odd F, rows % 8 != 0,
//    F32, misaligned) go through the op's unfused composition, same bytes; zero rows/columns;
//  - the backward with fc's bias gradient (accumulated onto a non-zero F32 dbias) against the
//    unfused cast with its bias gradient (cast_transpose's sums, the same tiles and order:
//    bit for bit) and against the CPU's bias_grad (1e-6 relative), NaN in one column only;
//  - against the CPU reference: codes agree or sit one step apart for at most 1%;
//  - a GELU MLP (with and without bias) and a LayerNormMLP in FP8 (current and delayed, two
//    steps) with MLP::set_fused_fp8_activation on and off: outputs, gradients and scaling
//    state bit for bit; a tiny GPT-2 in FP8 trained three steps either way: the same losses
//    and weights, bit for bit.
// Skipped (saying so) where no GPU is present.
#include <cmath>
#include <string>

#include "fp8_activation_testing.h"
#include "model_testing.h"
#include "gpu_testing.h"
#include "tessera/fp8/quantized_tensor.h"
#include "tessera/models/fp8_model.h"
#include "tessera/models/transformer_lm.h"
#include "tessera/nn/layernorm_mlp.h"
#include "tessera/nn/mlp.h"
#include "tessera/ops/activation.h"
#include "tessera/ops/gemm.h"
#include "tessera/ops/quantize.h"
#include "tessera/train/optimizer.h"
#if TESSERA_WITH_CUDA
#include "backend/cuda/gelu_fp8.h"
#endif

using namespace tessera;
using namespace tessera::testing;

namespace {

Tensor gelu_input(int64_t rows, int64_t f, uint64_t seed, bool specials) {
  return activation_input({rows, f}, DType::BF16, seed, specials);
}

using Case = ActivationCase;

const std::vector<Case> kCases{{64, 128}, {128, 256}, {72, 200}, {8, 8}, {136, 1032}, {512, 3072},
                               {5, 3},    {12, 16},   {16, 12},  {0, 16}, {16, 0}};

}  // namespace

TEST(GpuGeluFp8, KernelsEqualUnfusedCudaAndCpu) {
  REQUIRE_GPU();
#if TESSERA_WITH_CUDA
  Context cpu = Context::cpu(), gpu = Context::cuda();
  uint64_t seed = 1;
  for (const Case& c : kCases) {
    for (const bool backward : {false, true}) {
      for (const DType fp8 : {DType::E4M3, DType::E5M2}) {
        for (const bool with_amax : {true, false}) {
          const bool specials = seed % 3 == 0;
          const std::string what = std::to_string(c.rows) + "x" + std::to_string(c.f) +
                                   (backward ? " backward " : " forward ") + dtype_name(fp8) +
                                   (with_amax ? " amax" : "") + (specials ? " NaN/Inf" : "");
          SCOPED_TRACE(what);
          const Tensor x = gelu_input(c.rows, c.f, seed++, specials);
          const Tensor dy = random_tensor({c.rows, c.f}, DType::BF16, seed++, -4.0f, 4.0f);
          const Tensor scale = Tensor::from_floats({fp8 == DType::E4M3 ? 40.0f : 3000.0f}, {1});
          const Tensor xg = x.to(kCuda), dyg = dy.to(kCuda), sg = scale.to(kCuda);

          // Unfused on CUDA: the BF16 activation, then the cast the layer makes.
          Tensor act = Tensor::empty({c.rows, c.f}, DType::BF16, kCuda);
          if (backward) gelu_backward(gpu, xg, dyg, act);
          else gelu_forward(gpu, xg, act);
          Tensor amax_unfused = Tensor::empty({1}, DType::F32, kCuda);
          const fp8::QuantizedTensor want = fp8::quantize_with_transpose(gpu, act, sg, fp8, &amax_unfused);

          // The kernel itself, into poisoned outputs, where it applies.
          Tensor q = poisoned_device({c.rows, c.f}, fp8), qt = poisoned_device({c.f, c.rows}, fp8);
          Tensor kernel_amax = with_amax ? poisoned_device({1}, DType::F32) : Tensor();
          if (cuda::gelu_cast_transpose_supported(xg, backward ? &dyg : nullptr, q, qt)) {
            if (backward) cuda::gelu_backward_cast_transpose(gpu.stream, xg, dyg, sg, q, qt, kernel_amax, nullptr);
            else cuda::gelu_forward_cast_transpose(gpu.stream, xg, sg, q, qt, kernel_amax);
            expect_same_bytes(q, want.data, "kernel q");
            expect_same_bytes(qt, want.data_t, "kernel q_t");
            if (with_amax && c.rows * c.f > 0) expect_same_bytes(kernel_amax, amax_unfused, "kernel amax");
          } else {
            EXPECT_TRUE(c.f % 8 != 0 || c.rows % 8 != 0) << "a vector shape refused";
          }

          // The op (kernel or composition).
          Tensor op_amax = poisoned_device({1}, DType::F32);
          Tensor* amax_ptr = with_amax ? &op_amax : nullptr;
          const fp8::QuantizedTensor got = backward ? gelu_backward_fp8(gpu, xg, dyg, sg, fp8, amax_ptr)
                                                    : gelu_forward_fp8(gpu, xg, sg, fp8, amax_ptr);
          expect_same_bytes(got.data, want.data, "op data");
          expect_same_bytes(got.data_t, want.data_t, "op data_t");
          expect_same_bytes(got.scale_inv, want.scale_inv, "op scale_inv");
          if (with_amax) expect_same_bytes(op_amax, amax_unfused, "op amax");

          Tensor only = poisoned_device({1}, DType::F32), ref = Tensor::empty({1}, DType::F32, kCuda);
          if (backward) gelu_backward_amax(gpu, xg, dyg, only);
          else gelu_forward_amax(gpu, xg, only);
          amax(gpu, act, ref);
          const float a = item(only), b = item(ref);
          EXPECT_TRUE(std::isnan(a) ? std::isnan(b) : a == b) << "gelu amax " << a << " vs " << b;

          // The CPU reference (tanh, exact exponential): one step at most, rarely.
          const fp8::QuantizedTensor ref_cpu =
              backward ? gelu_backward_fp8(cpu, x, dy, scale, fp8) : gelu_forward_fp8(cpu, x, scale, fp8);
          // 1e-5 absolute in the unscaled value (|dy| <= 4): far below BF16's resolution of
          // any GELU output that is not near zero.
          const double tail_tol = 1e-5 * double(scale.data<float>()[0]);
          expect_close_codes(got.data, ref_cpu.data, 0.01, "data vs CPU", tail_tol);
          expect_close_codes(got.data_t, ref_cpu.data_t, 0.01, "data_t vs CPU", tail_tol);
        }
      }
    }
  }
#endif
}

// The backward with fc's bias gradient: the codes as without it, dbias accumulated exactly as
// the unfused cast with its bias gradient accumulates it, and close to the CPU's bias_grad.
TEST(GpuGeluFp8, BackwardBiasGradientEqualsTheUnfusedCast) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  uint64_t seed = 700;
  for (const Case& c : kCases) {
    for (const bool misaligned : {false, true}) {
      const std::string what = std::to_string(c.rows) + "x" + std::to_string(c.f) + (misaligned ? " misaligned" : "");
      SCOPED_TRACE(what);
      const Tensor x = gelu_input(c.rows, c.f, seed++, false), dy = random_tensor({c.rows, c.f}, DType::BF16, seed++);
      const Tensor scale = Tensor::from_floats({200.0f}, {1});
      const Tensor start = random_tensor({c.f}, DType::F32, seed++, -5.0f, 5.0f);
      const Tensor xg = to_device(x, misaligned), dyg = to_device(dy, misaligned), sg = scale.to(kCuda);
      Tensor act = Tensor::empty({c.rows, c.f}, DType::BF16, kCuda);
      gelu_backward(gpu, xg, dyg, act);
      Tensor db_unfused = start.to(kCuda), db_fused = start.to(kCuda);
      const fp8::QuantizedTensor want =
          fp8::quantize_with_transpose_and_bias_grad(gpu, act, sg, DType::E5M2, db_unfused);
      const fp8::QuantizedTensor got = gelu_backward_fp8(gpu, xg, dyg, sg, DType::E5M2, nullptr, &db_fused);
      expect_same_bytes(got.data, want.data, "data");
      expect_same_bytes(got.data_t, want.data_t, "data_t");
      expect_same_bytes(db_fused, db_unfused, "dbias against the unfused cast's");
      Tensor db_cpu = start.clone();
      bias_grad(cpu, host(act), db_cpu);
      EXPECT_LT(relative_error(host(db_fused), db_cpu), 1e-6) << "dbias against bias_grad";
      if (c.rows == 0) expect_same_bytes(db_fused, start, "no rows: dbias untouched");
    }
  }
  // NaN in one column stays there.
  Tensor x = gelu_input(136, 64, 800, false);
  x.set_item(135 * 64 + 5, NAN);
  const Tensor dy = random_tensor({136, 64}, DType::BF16, 801);
  Tensor db = Tensor::zeros({64}, DType::F32, kCuda);
  gelu_backward_fp8(gpu, x.to(kCuda), dy.to(kCuda), Tensor::from_floats({1.0f}, {1}).to(kCuda), DType::E5M2, nullptr,
                    &db);
  const std::vector<float> sums = db.to_floats();
  for (int c = 0; c < 64; ++c) EXPECT_EQ(std::isnan(sums[c]), c == 5) << c;
}

TEST(GpuGeluFp8, MlpFusedEqualsUnfusedBitForBit) {
  REQUIRE_GPU();
  for (const char* recipe : {"current", "delayed"})
    for (const bool bias : {false, true})
      for (const bool with_norm : {false, true}) {
        SCOPED_TRACE(std::string(recipe) + (bias ? " bias" : "") + (with_norm ? " LayerNormMLP" : " MLP"));
        expect_fused_mlp_equals_unfused({nn::Activation::GELU, nn::NormKind::LayerNorm, bias, with_norm, recipe, 1100},
                                        /*expect_no_d_h_pre=*/true);
      }
}

// A tiny GPT-2 (biases, GELU) in FP8 on CUDA, with the fused activation casts on and off:
// the same losses and weights after three optimizer steps, bit for bit.
TEST(GpuGeluFp8, Gpt2FusedEqualsUnfusedBitForBit) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  const auto [inputs, targets] = cyclic_tokens(2, 32, 64);
  const Tensor in_gpu = inputs.to(kCuda), tg_gpu = targets.to(kCuda);
  for (const char* recipe : {"current", "delayed"}) {
    SCOPED_TRACE(recipe);
    expect_fused_fp8_activation_training_identical(gpu, tiny_model_config("gpt2", 64, 256, 32), recipe, in_gpu, tg_gpu);
  }
}
