// The norm apply pass with the transposed FP8 copy on CUDA (backend/cuda/norm_fp8.cu,
// norm_apply_fp8_transpose, through ops/norm.h's *_apply_fp8_with_transpose): given the same
// statistics the cast is exact, so the QuantizedTensor equals the unfused CUDA path
// (norm_apply_fp8, then the byte transpose) byte for byte and the CPU's (apply, then
// quantized_from_codes) up to the sign of NaN codes (CUDA's canonical NaN): LayerNorm with
// and without beta, RMSNorm, BF16 and F32 gamma, tile-aligned, ragged and refused shapes (the
// op composes the unfused ops there), F32 x, saturating values, a NaN row; the kernel's
// outputs poisoned first.
#include <cmath>
#include <string>

#include "gpu_testing.h"
#include "tessera/fp8/quantized_tensor.h"
#include "tessera/ops/norm.h"
#if TESSERA_WITH_CUDA
#include "backend/cuda/norm_fp8.h"
#endif

using namespace tessera;
using namespace tessera::testing;

namespace {

// E4M3 codes equal, except that NaN codes may differ in sign (CUDA's canonical NaN against
// the CPU's propagated payload: the NaN row's y).
void expect_codes(const Tensor& got, const Tensor& want, const std::string& what) {
  const std::vector<uint8_t> g = bytes_of(got), w = bytes_of(want);
  ASSERT_EQ(g.size(), w.size()) << what;
  int64_t bad = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    const bool gn = (g[i] & 0x7f) == 0x7f, wn = (w[i] & 0x7f) == 0x7f;
    if ((gn || wn) ? gn != wn : g[i] != w[i]) {
      if (bad++ < 5) ADD_FAILURE() << what << ": byte " << i << " is " << int(g[i]) << ", want " << int(w[i]);
    }
  }
  EXPECT_EQ(bad, 0) << what;
}

}  // namespace

TEST(GpuNormApplyFp8Transpose, EqualsCpuAndUnfusedCuda) {
  REQUIRE_GPU();
#if TESSERA_WITH_CUDA
  Context cpu = Context::cpu(), gpu = Context::cuda();
  uint64_t seed = 1;
  const std::vector<Shape> shapes{{64, 128}, {72, 200}, {8, 8}, {136, 1032}, {256, 2048}, {5, 3}, {12, 16}, {16, 12}};
  for (const Shape& shape : shapes) {
    for (const DType t : {DType::BF16, DType::F32}) {
      for (int kind = 0; kind < 3; ++kind) {  // LayerNorm with beta, LayerNorm without, RMSNorm
        const DType gamma_dtype = seed % 2 ? DType::F32 : DType::BF16;
        const bool nan_row = seed % 3 == 0;
        const std::string what = shape_to_string(shape) + " " + dtype_name(t) + " kind " + std::to_string(kind) +
                                 " gamma " + dtype_name(gamma_dtype) + (nan_row ? " NaN" : "");
        SCOPED_TRACE(what);
        const int64_t rows = shape[0], cols = shape[1];
        Tensor x = random_tensor(shape, t, ++seed, -3, 4);
        if (nan_row) x.set_item(cols + 1, NAN);
        const Tensor gamma = random_tensor({cols}, gamma_dtype, ++seed, 0.5f, 1.5f);
        const Tensor beta = kind == 0 ? random_tensor({cols}, gamma_dtype, ++seed) : Tensor();
        Tensor y = Tensor::empty(shape, t), mean = Tensor::empty({rows}, DType::F32),
               rstd = Tensor::empty({rows}, DType::F32);
        if (kind < 2) layernorm_forward(cpu, x, gamma, beta, 1e-5f, y, mean, rstd);
        else rmsnorm_forward(cpu, x, gamma, 1e-5f, y, rstd);
        const Tensor scale = Tensor::from_floats({60.0f}, {1});
        const Tensor mean_g = kind < 2 ? mean.to(kCuda) : Tensor();
        const Tensor xg = x.to(kCuda), gg = gamma.to(kCuda), bg = beta.defined() ? beta.to(kCuda) : Tensor();
        const Tensor rg = rstd.to(kCuda), sg = scale.to(kCuda);

        const fp8::QuantizedTensor want = kind < 2
                                              ? layernorm_apply_fp8_with_transpose(cpu, x, gamma, beta, mean, rstd, scale)
                                              : rmsnorm_apply_fp8_with_transpose(cpu, x, gamma, rstd, scale);
        Tensor q_unfused = Tensor::empty(shape, DType::E4M3, kCuda);
        if (kind < 2) layernorm_apply_fp8(gpu, xg, gg, bg, mean_g, rg, sg, q_unfused);
        else rmsnorm_apply_fp8(gpu, xg, gg, rg, sg, q_unfused);
        const fp8::QuantizedTensor unfused = fp8::quantized_from_codes(gpu, q_unfused, sg);

        Tensor q = poisoned_device(shape, DType::E4M3), qt = poisoned_device({cols, rows}, DType::E4M3);
        if (cuda::norm_apply_fp8_transpose_supported(xg, q, qt, gg, bg)) {
          cuda::norm_apply_fp8_transpose(gpu.stream, xg, gg, bg, mean_g, rg, sg, q, qt);
          expect_codes(q, unfused.data, "kernel q");
          expect_codes(qt, unfused.data_t, "kernel q_t");
          EXPECT_EQ(bytes_of(q), bytes_of(unfused.data)) << "kernel q, byte for byte";
          EXPECT_EQ(bytes_of(qt), bytes_of(unfused.data_t)) << "kernel q_t, byte for byte";
        } else {
          EXPECT_TRUE(t != DType::BF16 || rows % 8 != 0 || cols % 8 != 0) << "a vector shape refused";
        }
        const fp8::QuantizedTensor got = kind < 2
                                             ? layernorm_apply_fp8_with_transpose(gpu, xg, gg, bg, mean_g, rg, sg)
                                             : rmsnorm_apply_fp8_with_transpose(gpu, xg, gg, rg, sg);
        EXPECT_EQ(bytes_of(got.data), bytes_of(unfused.data)) << "data vs unfused CUDA";
        EXPECT_EQ(bytes_of(got.data_t), bytes_of(unfused.data_t)) << "data_t vs unfused CUDA";
        EXPECT_EQ(bytes_of(got.scale_inv), bytes_of(unfused.scale_inv)) << "scale_inv vs unfused CUDA";
        expect_codes(got.data, want.data, "data vs CPU");
        expect_codes(got.data_t, want.data_t, "data_t vs CPU");
        EXPECT_EQ(bytes_of(got.scale_inv), bytes_of(want.scale_inv)) << "scale_inv vs CPU";
      }
    }
  }
#endif
}
