// Tests of BlockQuantizedTensor on the CPU (the reference the CUDA path is checked against
// in tests/test_gpu_fp8_gemm.cpp): what each copy holds for 1x128 and 128x128 blocks, the
// GEMM in every orientation against the dequantized copies it must use and against the
// unquantized product, bias and beta, and the argument checks.
#include "tessera/fp8/block_quantized_tensor.h"

#include <gtest/gtest.h>

#include "quantize_testing.h"
#include "tessera/core/error.h"
#include "tessera/ops/elementwise.h"
#include "tessera/ops/gemm.h"
#include "tessera/ops/quantize.h"
#include "testing.h"

using namespace tessera;
using namespace tessera::fp8;
using namespace tessera::testing;

namespace {

Tensor transposed(const Tensor& x) {
  Context ctx = Context::cpu();
  Tensor t = Tensor::empty({x.size(1), x.size(0)}, x.dtype());
  transpose_2d(ctx, x, t);
  return t;
}

// The F32 matrix a copy stands for: its codes times its own block scales.
Tensor dequantized(const Tensor& data, const Tensor& scale_inv, const BlockScaling& blocks) {
  Context ctx = Context::cpu();
  Tensor out = Tensor::empty(data.shape(), DType::F32);
  dequantize_blockwise(ctx, data, scale_inv, out, blocks);
  return out;
}

const BlockScaling k1x128 = BlockScaling::tile_1x128(), k128x128 = BlockScaling::tile_128x128();

}  // namespace

TEST(Fp8BlockQuantizedTensor, CopiesAndScales) {
  Context ctx = Context::cpu();
  uint64_t seed = 1;
  for (DType fp8 : {DType::E4M3, DType::E5M2}) {
    for (const BlockScaling& blocks : {k1x128, k128x128}) {
      for (auto [m, k] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {3, 300}, {130, 257}, {256, 128}}) {
        const Tensor x = wide_range_tensor(m, k, seed++);
        const BlockQuantizedTensor q = quantize_blockwise_with_transpose(ctx, x, blocks, fp8);
        EXPECT_EQ(q.dtype, fp8);
        EXPECT_EQ(q.is_2d(), blocks.block_rows == 128);
        EXPECT_FALSE(q.gemm_scale_inv.defined());  // only CUDA keeps cuBLASLt's layout
        Tensor want = Tensor::empty({m, k}, fp8), want_s = Tensor::empty(block_scale_shape(m, k, blocks), DType::F32);
        quantize_blockwise(ctx, x, want, want_s, blocks);
        EXPECT_EQ(codes_of(q.data), codes_of(want));
        EXPECT_EQ(q.scale_inv.to_floats(), want_s.to_floats());
        // data_t is x^T quantized with the same block shape, for both recipes; for 128x128
        // it is also the byte transpose of data.
        const Tensor xt = transposed(x);
        Tensor want_t = Tensor::empty({k, m}, fp8), want_ts = Tensor::empty(block_scale_shape(k, m, blocks), DType::F32);
        quantize_blockwise(ctx, xt, want_t, want_ts, blocks);
        EXPECT_EQ(codes_of(q.data_t), codes_of(want_t)) << m << "x" << k;
        EXPECT_EQ(q.scale_inv_t.to_floats(), want_ts.to_floats());
        if (q.is_2d()) {
          EXPECT_EQ(codes_of(q.data_t), codes_of(transposed(q.data)));
          EXPECT_EQ(q.scale_inv_t.to_floats(), transposed(q.scale_inv).to_floats());
        }
        EXPECT_EQ(dequantize(ctx, q).to_floats(), dequantized(q.data, q.scale_inv, blocks).to_floats());
      }
    }
  }
}

TEST(Fp8BlockQuantizedTensor, GemmInEveryOrientation) {
  Context ctx = Context::cpu();
  struct Dims { int64_t m, k, n; };
  const Dims dims[] = {{4, 16, 4}, {20, 200, 36}, {130, 300, 8}};
  uint64_t seed = 100;
  // (a blocks, b blocks): activation x weight, weight x activation, activation x activation.
  const std::pair<BlockScaling, BlockScaling> pairs[] = {{k1x128, k128x128}, {k128x128, k1x128}, {k1x128, k1x128}};
  for (const auto& [ba, bb] : pairs) {
    for (const Dims& d : dims) {
      for (int ta = 0; ta < 2; ++ta) {
        for (int tb = 0; tb < 2; ++tb) {
          const Tensor xa = random_tensor(ta ? Shape{d.k, d.m} : Shape{d.m, d.k}, DType::F32, seed++, -3, 3);
          const Tensor xb = random_tensor(tb ? Shape{d.n, d.k} : Shape{d.k, d.n}, DType::F32, seed++, -0.01f, 0.01f);
          const BlockQuantizedTensor qa = quantize_blockwise_with_transpose(ctx, xa, ba, DType::E4M3);
          const BlockQuantizedTensor qb = quantize_blockwise_with_transpose(ctx, xb, bb, DType::E4M3);
          Tensor c = Tensor::empty({d.m, d.n}, DType::F32);
          poison(c);
          fp8_gemm_blockwise(ctx, qa, ta != 0, qb, tb != 0, c);
          const std::string what = std::to_string(d.m) + "x" + std::to_string(d.k) + "x" + std::to_string(d.n) +
                                   " ta=" + std::to_string(ta) + " tb=" + std::to_string(tb) + " a " +
                                   std::to_string(ba.block_rows) + "x128, b " + std::to_string(bb.block_rows) + "x128";
          // The copies a TN product must use: op(A) = A -> a.data, A^T -> a.data_t (already
          // [M, K]); op(B) = B -> b.data_t ([N, K]), B^T -> b.data.
          const Tensor a_mk = ta ? dequantized(qa.data_t, qa.scale_inv_t, ba) : dequantized(qa.data, qa.scale_inv, ba);
          const Tensor b_nk = tb ? dequantized(qb.data, qb.scale_inv, bb) : dequantized(qb.data_t, qb.scale_inv_t, bb);
          Tensor want = Tensor::empty({d.m, d.n}, DType::F32);
          gemm(ctx, a_mk, b_nk, want, {.transpose_b = true});
          EXPECT_EQ(c.to_floats(), want.to_floats()) << what;
          // And it is the product of the unquantized matrices up to FP8 rounding.
          Tensor exact = Tensor::empty({d.m, d.n}, DType::F32);
          gemm(ctx, xa, xb, exact, {.transpose_a = ta != 0, .transpose_b = tb != 0});
          EXPECT_LT(relative_error(c, exact), 0.08) << what;
        }
      }
    }
  }
}

TEST(Fp8BlockQuantizedTensor, BiasBetaAndBf16Output) {
  Context ctx = Context::cpu();
  const BlockQuantizedTensor qx = quantize_blockwise_with_transpose(ctx, random_tensor({12, 256}, DType::F32, 5), k1x128, DType::E4M3);
  const BlockQuantizedTensor qw = quantize_blockwise_with_transpose(ctx, random_tensor({40, 256}, DType::F32, 6), k128x128, DType::E4M3);
  Fp8GemmOptions o;
  o.alpha = 0.5f;
  o.beta = 1.0f;
  o.bias = random_tensor({40}, DType::BF16, 7);
  for (DType out : {DType::F32, DType::BF16}) {
    Tensor c = random_tensor({12, 40}, out, 8), want = c.clone();
    fp8_gemm_blockwise(ctx, qx, false, qw, true, c, o);
    gemm(ctx, dequantized(qx.data, qx.scale_inv, k1x128), dequantized(qw.data, qw.scale_inv, k128x128), want,
         {.transpose_b = true, .alpha = 0.5f, .beta = 1.0f}, o.bias);
    EXPECT_EQ(c.to_floats(), want.to_floats()) << dtype_name(out);
  }
}

TEST(Fp8BlockQuantizedTensor, ZeroAndNan) {
  Context ctx = Context::cpu();
  const BlockQuantizedTensor z = quantize_blockwise_with_transpose(ctx, Tensor::zeros({8, 128}, DType::F32), k1x128, DType::E4M3);
  for (float s : z.scale_inv.to_floats()) EXPECT_EQ(s, 1.0f);
  Tensor xw = random_tensor({16, 128}, DType::F32, 9);
  const BlockQuantizedTensor w = quantize_blockwise_with_transpose(ctx, xw, k128x128, DType::E4M3);
  Tensor c = Tensor::empty({8, 16}, DType::F32);
  poison(c);
  fp8_gemm_blockwise(ctx, z, false, w, true, c);
  for (float v : c.to_floats()) EXPECT_EQ(v, 0.0f);
  // A NaN in x spoils its block (and the product rows that read it), nothing else.
  Tensor x = random_tensor({8, 256}, DType::F32, 10);
  x.set_item(2 * 256 + 5, NAN);
  const BlockQuantizedTensor qn = quantize_blockwise_with_transpose(ctx, x, k1x128, DType::E4M3);
  const BlockQuantizedTensor w2 = quantize_blockwise_with_transpose(ctx, random_tensor({16, 256}, DType::F32, 11), k128x128, DType::E4M3);
  fp8_gemm_blockwise(ctx, qn, false, w2, true, c);
  const std::vector<float> v = c.to_floats();
  for (int64_t i = 0; i < 8; ++i)
    for (int64_t j = 0; j < 16; ++j) EXPECT_EQ(std::isnan(v[i * 16 + j]), i == 2) << i << ", " << j;
}

TEST(Fp8BlockQuantizedTensor, RejectsBadArguments) {
  Context ctx = Context::cpu();
  const Tensor x = random_tensor({8, 128}, DType::F32, 1);
  EXPECT_THROW(quantize_blockwise_with_transpose(ctx, x, BlockScaling{1, 32, true}, DType::E4M3), Error);
  EXPECT_THROW(quantize_blockwise_with_transpose(ctx, x, k1x128, DType::BF16), Error);
  EXPECT_THROW(quantize_blockwise_with_transpose(ctx, random_tensor({2, 3, 4}, DType::F32, 2), k1x128, DType::E4M3), Error);
  const BlockQuantizedTensor w = quantize_blockwise_with_transpose(ctx, x, k128x128, DType::E4M3);
  const BlockQuantizedTensor a = quantize_blockwise_with_transpose(ctx, x, k1x128, DType::E4M3);
  Tensor c = Tensor::empty({8, 8}, DType::F32);
  EXPECT_THROW(fp8_gemm_blockwise(ctx, w, false, w, true, c), Error);  // 2-D x 2-D
  Tensor q = Tensor::empty({8, 8}, DType::E4M3);
  EXPECT_THROW(fp8_gemm_blockwise(ctx, a, false, w, true, q), Error);  // no FP8 output
  Tensor wrong = Tensor::empty({8, 9}, DType::F32);
  EXPECT_THROW(fp8_gemm_blockwise(ctx, a, false, w, true, wrong), Error);
  EXPECT_THROW(fp8_gemm_blockwise(ctx, a, false, w, false, c), Error);  // K = 128 against 8
  BlockQuantizedTensor broken = a;
  broken.scale_inv_t = Tensor();
  EXPECT_THROW(fp8_gemm_blockwise(ctx, broken, false, w, true, c), Error);
}
