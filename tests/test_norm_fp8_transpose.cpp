// The norm apply pass with the transposed FP8 copy (ops/norm.h's
// layernorm_apply_fp8_with_transpose / rmsnorm_apply_fp8_with_transpose) on the CPU: the
// QuantizedTensor equals the plain apply followed by fp8::quantized_from_codes byte for byte
// (codes, transposed codes, scale_inv), LayerNorm with and without beta and RMSNorm, F32 and
// BF16, odd shapes, a NaN row; bad arguments are named.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "testing.h"
#include "tessera/fp8/quantized_tensor.h"
#include "tessera/ops/norm.h"

using namespace tessera;
using namespace tessera::testing;

namespace {


}  // namespace

TEST(NormApplyFp8Transpose, EqualsApplyThenQuantizedFromCodes) {
  Context ctx = Context::cpu();
  uint64_t seed = 1;
  for (const Shape& shape : std::vector<Shape>{{16, 32}, {5, 3}, {1, 1}, {33, 24}, {0, 8}}) {
    for (DType t : {DType::BF16, DType::F32}) {
      for (int kind = 0; kind < 3; ++kind) {  // LayerNorm with beta, LayerNorm without, RMSNorm
        for (const bool nan_row : {false, true}) {
          const std::string what = shape_to_string(shape) + " " + dtype_name(t) + " kind " + std::to_string(kind) +
                                   (nan_row ? " NaN" : "");
          SCOPED_TRACE(what);
          const int64_t rows = shape[0], cols = shape[1];
          Tensor x = random_tensor(shape, t, ++seed, -3, 4);
          if (nan_row && rows > 0) x.set_item(cols / 2, NAN);
          const Tensor gamma = random_tensor({cols}, t, ++seed, 0.5f, 1.5f);
          const Tensor beta = kind == 0 ? random_tensor({cols}, DType::F32, ++seed) : Tensor();
          Tensor y = Tensor::empty(shape, t), mean = Tensor::empty({rows}, DType::F32),
                 rstd = Tensor::empty({rows}, DType::F32);
          if (kind < 2) layernorm_forward(ctx, x, gamma, beta, 1e-5f, y, mean, rstd);
          else rmsnorm_forward(ctx, x, gamma, 1e-5f, y, rstd);
          const Tensor scale = Tensor::from_floats({60.0f}, {1});  // some values saturate
          Tensor q = Tensor::empty(shape, DType::E4M3);
          if (kind < 2) layernorm_apply_fp8(ctx, x, gamma, beta, mean, rstd, scale, q);
          else rmsnorm_apply_fp8(ctx, x, gamma, rstd, scale, q);
          const fp8::QuantizedTensor want = fp8::quantized_from_codes(ctx, q, scale);
          const fp8::QuantizedTensor got =
              kind < 2 ? layernorm_apply_fp8_with_transpose(ctx, x, gamma, beta, mean, rstd, scale)
                       : rmsnorm_apply_fp8_with_transpose(ctx, x, gamma, rstd, scale);
          EXPECT_EQ(got.dtype, DType::E4M3);
          EXPECT_TRUE(same_bits(got.data, want.data)) << "data";
          EXPECT_TRUE(same_bits(got.data_t, want.data_t)) << "data_t";
          EXPECT_TRUE(same_bits(got.scale_inv, want.scale_inv)) << "scale_inv";
        }
      }
    }
  }
}

TEST(NormApplyFp8Transpose, BadArgumentsAreNamed) {
  Context ctx = Context::cpu();
  const Tensor x = Tensor::zeros({4, 8}, DType::BF16), gamma = Tensor::zeros({8}, DType::BF16);
  const Tensor rstd = Tensor::zeros({4}, DType::F32), scale = Tensor::from_floats({1.0f}, {1});
  EXPECT_THROW(rmsnorm_apply_fp8_with_transpose(ctx, x, Tensor::zeros({7}, DType::BF16), rstd, scale), Error);
  EXPECT_THROW(rmsnorm_apply_fp8_with_transpose(ctx, x, gamma, Tensor::zeros({3}, DType::F32), scale), Error);
  EXPECT_THROW(rmsnorm_apply_fp8_with_transpose(ctx, x, gamma, rstd, Tensor::zeros({2}, DType::F32)), Error);
  EXPECT_THROW(layernorm_apply_fp8_with_transpose(ctx, x, gamma, Tensor(), Tensor(), rstd, scale), Error);  // mean
  EXPECT_NO_THROW(rmsnorm_apply_fp8_with_transpose(ctx, x, gamma, rstd, scale));
}
