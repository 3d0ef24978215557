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

#include "fp8_activation_testing.h"
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

// x [rows, 2F] (gate and up halves).
Tensor swiglu_input(int64_t rows, int64_t f, DType t, uint64_t seed, bool specials) {
  return activation_input({rows, 2 * f}, t, seed, specials);
}

using Case = ActivationCase;

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
          expect_close_codes(q, want.data, 0, "kernel q");
          expect_close_codes(qt, want.data_t, 0, "kernel q_t");
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
        expect_close_codes(got.data, ref_cpu.data, 0.01, "data vs CPU");
        expect_close_codes(got.data_t, ref_cpu.data_t, 0.01, "data_t vs CPU");
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
          expect_close_codes(q, want.data, 0, "kernel q");
          expect_close_codes(qt, want.data_t, 0, "kernel q_t");
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
        expect_close_codes(got.data, ref_cpu.data, 0.01, "data vs CPU");
        expect_close_codes(got.data_t, ref_cpu.data_t, 0.01, "data_t vs CPU");
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

TEST(GpuSwigluFp8, MlpFusedEqualsUnfusedBitForBit) {
  REQUIRE_GPU();
  for (const char* recipe : {"current", "delayed"})
    for (const bool with_norm : {false, true}) {
      SCOPED_TRACE(std::string(recipe) + (with_norm ? " LayerNormMLP" : " MLP"));
      expect_fused_mlp_equals_unfused({nn::Activation::SwiGLU, nn::NormKind::RMSNorm, false, with_norm, recipe, 1000},
                                      /*expect_no_d_h_pre=*/false);
    }
}
