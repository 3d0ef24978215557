// The FP8 cast + transpose with the bias gradient on CUDA (fp8::quantize_with_transpose_and_bias_grad,
// backend/cuda/cast_transpose.cu with dbias) against the CPU reference (quantize_with_transpose
// then bias_grad): codes, transposed codes, scale_inv and amax byte for byte; dbias (F32,
// accumulated onto a non-zero start) within test_gpu_reduce's bias_grad tolerance (both sum
// in double and round once: only the order differs), run-to-run identical. F32 and BF16 in,
// E4M3 and E5M2 out, the vector kernel's shapes, ragged row tiles, odd and misaligned shapes
// (the scalar kernel), zero rows or columns, a BF16 dbias (bias_grad after the cast), NaN in
// one column, amax that is the scale itself; and a biased FP8 Linear whose bias gradient now
// comes from dy's cast, against the CPU layer. Skipped (saying so) where no GPU is present.
#include <cmath>
#include <string>

#include "gpu_testing.h"
#include "tessera/fp8/quantized_tensor.h"
#include "tessera/nn/linear.h"
#include "tessera/ops/gemm.h"
#include "tessera/ops/quantize.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

Tensor host(const Tensor& t) { return t.to(Device::cpu()); }

}  // namespace

TEST(GpuCastTransposeBiasGrad, MatchesTheCastThenBiasGrad) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  uint64_t seed = 1200;
  const std::vector<Shape> shapes = {{256, 512}, {64, 2048}, {1000, 768}, {136, 80}, {48, 80}, {8, 8},
                                     {100, 24},  {7, 9},     {5000, 13},  {0, 16},   {16, 0}};
  for (const Shape& shape : shapes) {
    for (const DType in : {DType::F32, DType::BF16}) {
      for (const DType out : {DType::E4M3, DType::E5M2}) {
        for (const bool misaligned : {false, true}) {
          SCOPED_TRACE(shape_to_string(shape) + " " + dtype_name(in) + " -> " + dtype_name(out) +
                       (misaligned ? " misaligned" : ""));
          const Tensor x = random_tensor(shape, in, seed++, -3.0f, 3.0f);
          const Tensor scale = Tensor::from_floats({fp8_max(out) / 3.5f}, {1});
          const Tensor start = random_tensor({shape[1]}, DType::F32, seed++, -5.0f, 5.0f);
          Tensor amax_cpu = Tensor::empty({1}, DType::F32), db_cpu = start.clone();
          const fp8::QuantizedTensor want = fp8::quantize_with_transpose(cpu, x, scale, out, &amax_cpu);
          bias_grad(cpu, x, db_cpu);
          const Tensor xd = to_device(x, misaligned), sd = scale.to(kCuda);
          Tensor amax_gpu = poisoned_device({1}, DType::F32), db_gpu = start.to(kCuda);
          const fp8::QuantizedTensor got =
              fp8::quantize_with_transpose_and_bias_grad(gpu, xd, sd, out, db_gpu, &amax_gpu);
          EXPECT_EQ(bytes_of(got.data), bytes_of(want.data));
          EXPECT_EQ(bytes_of(got.data_t), bytes_of(want.data_t));
          EXPECT_EQ(bytes_of(got.scale_inv), bytes_of(want.scale_inv));
          if (x.numel() > 0) EXPECT_EQ(bytes_of(amax_gpu), bytes_of(amax_cpu));
          EXPECT_LT(relative_error(host(db_gpu), db_cpu), 1e-6);
          if (shape[0] == 0) EXPECT_EQ(bytes_of(db_gpu), bytes_of(start)) << "no rows: dbias untouched";
          // Deterministic: the same bits again, also without an amax.
          Tensor db_again = start.to(kCuda);
          const fp8::QuantizedTensor again = fp8::quantize_with_transpose_and_bias_grad(gpu, xd, sd, out, db_again);
          EXPECT_EQ(bytes_of(db_again), bytes_of(db_gpu));
          EXPECT_EQ(bytes_of(again.data_t), bytes_of(want.data_t));
          // A BF16 dbias takes bias_grad after the cast: the same codes, bias_grad's tolerance.
          const Tensor start16 = random_tensor({shape[1]}, DType::BF16, seed++, -5.0f, 5.0f);
          Tensor db16_cpu = start16.clone(), db16_gpu = start16.to(kCuda);
          bias_grad(cpu, x, db16_cpu);
          const fp8::QuantizedTensor q16 = fp8::quantize_with_transpose_and_bias_grad(gpu, xd, sd, out, db16_gpu);
          EXPECT_EQ(bytes_of(q16.data), bytes_of(want.data));
          EXPECT_LT(relative_error(host(db16_gpu), db16_cpu), 1e-2);
        }
      }
    }
  }
}

// A NaN in one column: that column's sum is NaN, no other (on the vector and the scalar
// kernel); its code is NaN as on the CPU.
TEST(GpuCastTransposeBiasGrad, NanStaysInItsColumn) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  for (const Shape& shape : std::vector<Shape>{{320, 64}, {300, 17}}) {
    SCOPED_TRACE(shape_to_string(shape));
    const int64_t cols = shape[1];
    Tensor x = random_tensor(shape, DType::BF16, 1300);
    x.set_item((shape[0] - 1) * cols + 3, NAN);  // the last row (a ragged tile for 300)
    const Tensor scale = Tensor::from_floats({16.0f}, {1});
    Tensor db = Tensor::zeros({cols}, DType::F32, kCuda);
    const fp8::QuantizedTensor got = fp8::quantize_with_transpose_and_bias_grad(gpu, x.to(kCuda), scale.to(kCuda),
                                                                                DType::E4M3, db);
    const fp8::QuantizedTensor want = fp8::quantize_with_transpose(cpu, x, scale, DType::E4M3);
    EXPECT_EQ(bytes_of(got.data), bytes_of(want.data));
    EXPECT_EQ(bytes_of(got.data_t), bytes_of(want.data_t));
    const std::vector<float> sums = db.to_floats();
    for (int64_t c = 0; c < cols; ++c) EXPECT_EQ(std::isnan(sums[c]), c == 3) << c;
  }
}

// amax_out may be the scale tensor (its amax pass runs after the cast): the codes use the old
// scale, and the column sums are unaffected.
TEST(GpuCastTransposeBiasGrad, AmaxMayBeTheScaleItself) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  const Tensor x = random_tensor({128, 256}, DType::BF16, 1400, -2, 2);
  const Tensor scale = Tensor::from_floats({40.0f}, {1});
  Tensor amax_cpu = Tensor::empty({1}, DType::F32), db_cpu = Tensor::zeros({256}, DType::F32);
  const fp8::QuantizedTensor want = fp8::quantize_with_transpose(cpu, x, scale, DType::E4M3, &amax_cpu);
  bias_grad(cpu, x, db_cpu);
  Tensor scale_gpu = scale.to(kCuda), db_gpu = Tensor::zeros({256}, DType::F32, kCuda);
  const fp8::QuantizedTensor got =
      fp8::quantize_with_transpose_and_bias_grad(gpu, x.to(kCuda), scale_gpu, DType::E4M3, db_gpu, &scale_gpu);
  EXPECT_EQ(bytes_of(got.data), bytes_of(want.data));
  EXPECT_EQ(bytes_of(got.data_t), bytes_of(want.data_t));
  EXPECT_EQ(bytes_of(scale_gpu), bytes_of(amax_cpu));
  EXPECT_LT(relative_error(host(db_gpu), db_cpu), 1e-6);
}

// A biased FP8 Linear on CUDA: the bias gradient (now summed by dy's cast in backward_input,
// not by bias_grad in backward_weight) against the CPU layer, accumulated over two steps
// without zeroing, and dy's transposed codes still bit-identical.
TEST(GpuCastTransposeBiasGrad, LinearBiasGradientMatchesTheCpu) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  for (const char* recipe_name : {"current", "delayed"}) {
    SCOPED_TRACE(recipe_name);
    const fp8::Recipe recipe = fp8::Recipe::from_json({{"recipe", recipe_name}});
    nn::Linear hl("l", 256, 384, true, DType::BF16), dl("l", 256, 384, true, DType::BF16);
    hl.weight.value.copy_from(random_tensor({384, 256}, DType::BF16, 1500, -0.2f, 0.2f));
    hl.bias.value.copy_from(random_tensor({384}, DType::BF16, 1501));
    hl.bias.grad.copy_from(random_tensor({384}, DType::F32, 1502, -3, 3));
    dl.weight.to(kCuda);
    dl.bias.to(kCuda);
    dl.weight.value.copy_from(hl.weight.value);
    dl.bias.value.copy_from(hl.bias.value);
    dl.bias.grad.copy_from(hl.bias.grad);
    auto hs_scaling = std::make_shared<nn::Fp8Scaling>(cpu, recipe, 1);
    auto ds_scaling = std::make_shared<nn::Fp8Scaling>(gpu, recipe, 1);
    hl.use_fp8({hs_scaling, 0});
    dl.use_fp8({ds_scaling, 0});
    for (int step = 0; step < 2; ++step) {
      const Tensor x = random_tensor({512, 256}, DType::BF16, 1510 + step, -3, 3);
      const Tensor dy = random_tensor({512, 384}, DType::BF16, 1520 + step);
      nn::Linear::Saved hs, ds;
      hl.forward(cpu, x, hs);
      dl.forward(gpu, x.to(kCuda), ds);
      hl.backward_input(cpu, dy, hs);
      dl.backward_input(gpu, dy.to(kCuda), ds);
      EXPECT_TRUE(ds.bias_grad_done);
      EXPECT_EQ(bytes_of(ds.dy_fp8.data_t), bytes_of(hs.dy_fp8.data_t)) << "step " << step;
      hl.backward_weight(cpu, dy, hs);
      dl.backward_weight(gpu, Tensor(), ds);  // dy is not read again: its cast summed the bias
      EXPECT_LT(relative_error(host(dl.bias.grad), hl.bias.grad), 1e-6) << "step " << step;
      EXPECT_LT(relative_error(host(dl.weight.grad), hl.weight.grad), 1e-3) << "step " << step;
      hs_scaling->end_step(cpu);
      ds_scaling->end_step(gpu);
    }
  }
}
