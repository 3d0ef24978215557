// FP8 GEMMs on the GPU (cuBLASLt, backend/cuda/gemm_fp8.cu) against an FP64 GEMM of the
// dequantized operands: the FP8 codes times their scales are exact in double, so the only
// difference is how the GPU accumulates (and the output's rounding). Per-tensor scaling in
// all four orientations (data / data_t), E4M3 x E4M3, E5M2 x E4M3 and E4M3 x E5M2, fast
// accumulation on and off, beta = 1, bias, F32 / BF16 / E4M3 outputs (with amax), odd but
// legal sizes, illegal sizes (clear errors), NaN and zero inputs; block scaling (1x128 and
// 128x128) against its CPU reference; the device-side quantization against the CPU's.
// Measured errors are printed, so the log shows how far below the tolerances they are.
// Skipped (saying so) where no GPU is present.
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>

#include "gpu_testing.h"
#include "quantize_testing.h"
#include "tessera/core/error.h"
#include "tessera/fp8/block_quantized_tensor.h"
#include "tessera/fp8/quantized_tensor.h"
#include "tessera/ops/gemm.h"
#include "tessera/ops/quantize.h"

using namespace tessera;
using namespace tessera::fp8;
using namespace tessera::testing;

namespace {

const Device kCpu = Device::cpu();

// Tolerances, relative (norm-wise) to the FP64 reference. Hopper's FP8 tensor cores add
// with a reduced-precision aligner (about 14 bits kept, as DeepSeek-V3's report measured),
// so even with promotion to FP32 (no fast accumulation) the error is ~1e-4, not FP32's
// ~1e-7: measured on the H200 2.5e-5 (K = 16) to 1.14e-4 (K >= 272) for F32 outputs, the
// same for block scaling; fast accumulation keeps whole K-loops in that adder (measured up
// to 4.7e-4 at K = 1024); BF16 output adds its rounding (measured 1.7e-3 to 2.4e-3).
constexpr double kTolF32 = 3e-4, kTolFast = 2e-3, kTolBf16 = 8e-3;

void check_error(double err, double tol, const std::string& what) {
  std::printf("  %-70s rel err %.3g (tol %.1g)\n", what.c_str(), err, tol);
  EXPECT_LT(err, tol) << what;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

float current_scale(const Tensor& x_cpu, DType fp8) {
  Context cpu = Context::cpu();
  Tensor a = Tensor::empty({1}, DType::F32);
  amax(cpu, x_cpu, a);
  return fp8_scale_from_amax(a.to_floats()[0], fp8);
}

// The exact values an FP8 copy stands for, in F64 on the CPU: code * scale_inv of its block
// (blocks = {rows, cols} of one scale; a per-tensor scale is one block covering everything).
Tensor exact_values(const Tensor& data, const Tensor& scale_inv, int64_t block_rows, int64_t block_cols) {
  const std::vector<double> codes = data.to(kCpu).to_doubles(), s = scale_inv.to(kCpu).to_doubles();
  const int64_t rows = data.size(0), cols = data.size(1);
  const int64_t grid_cols = block_cols >= cols ? 1 : (cols + block_cols - 1) / block_cols;
  std::vector<double> v(codes.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      v[r * cols + c] = codes[r * cols + c] * s[(r / block_rows) * grid_cols + c / block_cols];
  return Tensor::from_doubles(v, {rows, cols});
}

Tensor exact_values(const Tensor& data, const Tensor& scale_inv) {
  return exact_values(data, scale_inv, INT64_MAX / 2, INT64_MAX / 2);
}

// alpha * A' B'^T + beta * c0 + bias in double, A' [M, K] and B' [N, K] F64.
Tensor reference_tn(const Tensor& a, const Tensor& b, float alpha, float beta, const Tensor& c0, const Tensor& bias) {
  Context cpu = Context::cpu();
  Tensor c = c0.defined() ? Tensor::from_doubles(c0.to(kCpu).to_doubles(), c0.shape())
                          : Tensor::zeros({a.size(0), b.size(0)}, DType::F64);
  gemm(cpu, a, b, c, {.transpose_b = true, .alpha = alpha, .beta = c0.defined() ? beta : 0.0f},
       bias.defined() ? bias.to(kCpu) : Tensor());
  return c;
}

QuantizedTensor quantize_on(Context& ctx, const Tensor& x_cpu, DType fp8, float scale) {
  return quantize_with_transpose(ctx, x_cpu.to(ctx.device), Tensor::from_floats({scale}, {1}).to(ctx.device), fp8);
}

BlockQuantizedTensor host_copy(const BlockQuantizedTensor& q) {
  BlockQuantizedTensor h;
  h.data = q.data.to(kCpu);
  h.data_t = q.data_t.to(kCpu);
  h.scale_inv = q.scale_inv.to(kCpu);
  h.scale_inv_t = q.scale_inv_t.to(kCpu);
  h.blocks = q.blocks;
  h.dtype = q.dtype;
  return h;  // no GEMM-ready scales: a device copy of this makes fp8_gemm_blockwise rearrange them
}

BlockQuantizedTensor device_copy(const BlockQuantizedTensor& h) {
  BlockQuantizedTensor d = h;
  d.data = h.data.to(kCuda);
  d.data_t = h.data_t.to(kCuda);
  d.scale_inv = h.scale_inv.to(kCuda);
  d.scale_inv_t = h.scale_inv_t.to(kCuda);
  return d;
}

std::string dims_string(int64_t m, int64_t k, int64_t n) {
  return std::to_string(m) + "x" + std::to_string(k) + "x" + std::to_string(n);
}

}  // namespace

TEST(GpuFp8Gemm, QuantizeWithTransposeMatchesTheCpu) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  uint64_t seed = 1;
  for (DType fp8 : {DType::E4M3, DType::E5M2}) {
    for (auto [m, k] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {17, 80}, {130, 257}}) {
      const Tensor x = wide_range_tensor(m, k, seed++);
      const float s = current_scale(x, fp8) * 0.7f;  // not a power of two
      Tensor amax_gpu = poisoned_device({1}, DType::F32), amax_cpu = Tensor::empty({1}, DType::F32);
      const QuantizedTensor g = quantize_with_transpose(gpu, x.to(kCuda), Tensor::from_floats({s}, {1}).to(kCuda), fp8, &amax_gpu);
      const QuantizedTensor c = quantize_with_transpose(cpu, x, Tensor::from_floats({s}, {1}), fp8, &amax_cpu);
      EXPECT_EQ(bytes_of(g.data), bytes_of(c.data));
      EXPECT_EQ(bytes_of(g.data_t), bytes_of(c.data_t));
      EXPECT_EQ(bytes_of(g.scale_inv), bytes_of(c.scale_inv)) << "scale_inv must be the same float division";
      EXPECT_EQ(bytes_of(amax_gpu), bytes_of(amax_cpu));
    }
  }
  // On the device a bad scale is not checked (that would read it back) but poisons scale_inv.
  for (float bad : {0.0f, -2.0f, INFINITY, NAN}) {
    const QuantizedTensor g = quantize_on(gpu, random_tensor({4, 16}, DType::F32, 9), DType::E4M3, bad);
    EXPECT_TRUE(std::isnan(g.scale_inv.to(kCpu).to_floats()[0])) << bad;
  }
}

TEST(GpuFp8Gemm, PerTensorEveryOrientationAndDtype) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  struct Dims { int64_t m, k, n; };
  // Odd M (any M is legal), K and N multiples of 16, one K of several MMA k-blocks.
  const Dims dims[] = {{1, 16, 16}, {17, 80, 48}, {33, 272, 24}, {256, 1024, 512}};
  const std::pair<DType, DType> pairs[] = {{DType::E4M3, DType::E4M3}, {DType::E5M2, DType::E4M3}, {DType::E4M3, DType::E5M2}};
  uint64_t seed = 100;
  for (const auto& [da, db] : pairs) {
    for (const Dims& d : dims) {
      for (int ta = 0; ta < 2; ++ta) {
        for (int tb = 0; tb < 2; ++tb) {
          const Tensor xa = random_tensor(ta ? Shape{d.k, d.m} : Shape{d.m, d.k}, DType::F32, seed++, -3, 3);
          const Tensor xb = random_tensor(tb ? Shape{d.n, d.k} : Shape{d.k, d.n}, DType::F32, seed++, -0.02f, 0.02f);
          const QuantizedTensor qa = quantize_on(gpu, xa, da, current_scale(xa, da));
          const QuantizedTensor qb = quantize_on(gpu, xb, db, current_scale(xb, db));
          const Tensor a_mk = exact_values(ta ? qa.data_t : qa.data, qa.scale_inv);
          const Tensor b_nk = exact_values(tb ? qb.data : qb.data_t, qb.scale_inv);
          const Tensor want = reference_tn(a_mk, b_nk, 1.0f, 0.0f, Tensor(), Tensor());
          const std::string what = std::string(dtype_name(da)) + "x" + dtype_name(db) + " " + dims_string(d.m, d.k, d.n) +
                                   " ta=" + std::to_string(ta) + " tb=" + std::to_string(tb);
          for (DType out : {DType::F32, DType::BF16}) {
            for (bool fast : {false, true}) {
              Tensor c = poisoned_device({d.m, d.n}, out);
              Fp8GemmOptions o;
              o.fast_accumulate = fast;
              const std::string msg = error_of([&] { fp8_gemm(gpu, qa, ta != 0, qb, tb != 0, c, o); });
              if (!msg.empty()) {
                ADD_FAILURE() << what << " " << dtype_name(out) << ": " << msg;
                continue;
              }
              const double tol = out == DType::BF16 ? kTolBf16 : fast ? kTolFast : kTolF32;
              const double err = relative_error(c.to(kCpu), want);
              if (d.m == 256 || (ta == tb && out == DType::F32))  // print a sample, check all
                check_error(err, tol, what + " " + dtype_name(out) + (fast ? " fast" : ""));
              else
                EXPECT_LT(err, tol) << what << " " << dtype_name(out) << (fast ? " fast" : "");
            }
          }
        }
      }
    }
  }
}

TEST(GpuFp8Gemm, BetaBiasAndRowStride) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  const int64_t m = 48, k = 320, n = 64;
  const Tensor x = random_tensor({m, k}, DType::F32, 1), w = random_tensor({n, k}, DType::F32, 2);
  const QuantizedTensor qx = quantize_on(gpu, x, DType::E4M3, current_scale(x, DType::E4M3));
  const QuantizedTensor qw = quantize_on(gpu, w, DType::E4M3, current_scale(w, DType::E4M3));
  const Tensor a_mk = exact_values(qx.data, qx.scale_inv), b_nk = exact_values(qw.data, qw.scale_inv);
  const Tensor bias = random_tensor({n}, DType::BF16, 3);
  for (DType out : {DType::F32, DType::BF16}) {
    // beta = 1 accumulates (weight gradients): c = 0.5 * product + c0.
    const Tensor c0 = random_tensor({m, n}, out, 4);
    Tensor c = c0.to(kCuda);
    fp8_gemm(gpu, qx, false, qw, true, c, 0.5f, 1.0f);
    check_error(relative_error(c.to(kCpu), reference_tn(a_mk, b_nk, 0.5f, 1.0f, c0, Tensor())),
                out == DType::BF16 ? kTolBf16 : kTolF32, std::string("beta=1 alpha=0.5 ") + dtype_name(out));
    // Bias (BF16 for every output dtype, as cuBLASLt's FP8 kernels take it).
    Fp8GemmOptions o;
    o.bias = bias.to(kCuda);
    Tensor cb = poisoned_device({m, n}, out);
    fp8_gemm(gpu, qx, false, qw, true, cb, o);
    check_error(relative_error(cb.to(kCpu), reference_tn(a_mk, b_nk, 1.0f, 0.0f, Tensor(), bias)),
                out == DType::BF16 ? kTolBf16 : kTolF32, std::string("bias ") + dtype_name(out));
  }
  // c a column slice of a wider buffer: row stride 96, N = 64 (the padded-LM-head layout).
  Tensor wide = poisoned_device({m, 96}, DType::F32);
  Tensor view = wide.slice(1, 0, n);
  fp8_gemm(gpu, qx, false, qw, true, view);
  check_error(relative_error(view.to(kCpu), reference_tn(a_mk, b_nk, 1.0f, 0.0f, Tensor(), Tensor())), kTolF32,
              "c with row stride 96");
  const std::vector<float> all = wide.to(kCpu).to_floats();
  for (int64_t r = 0; r < m; ++r)
    for (int64_t col = n; col < 96; ++col) ASSERT_TRUE(std::isnan(all[r * 96 + col])) << "wrote outside c";
}

TEST(GpuFp8Gemm, Fp8OutputWithAmax) {
  REQUIRE_GPU();
  Context gpu = Context::cuda(), cpu = Context::cpu();
  const int64_t m = 64, k = 256, n = 96;
  const Tensor x = random_tensor({m, k}, DType::F32, 11), w = random_tensor({n, k}, DType::F32, 12);
  const QuantizedTensor qx = quantize_on(gpu, x, DType::E4M3, current_scale(x, DType::E4M3));
  const QuantizedTensor qw = quantize_on(gpu, w, DType::E4M3, current_scale(w, DType::E4M3));
  for (bool with_bias : {false, true}) {
    const Tensor bias = with_bias ? random_tensor({n}, DType::BF16, 13) : Tensor();
    const Tensor want = reference_tn(exact_values(qx.data, qx.scale_inv), exact_values(qw.data, qw.scale_inv), 1.0f,
                                     0.0f, Tensor(), bias);
    double amax_want = 0;
    for (double v : want.to_doubles()) amax_want = std::max(amax_want, std::fabs(v));
    const float out_scale = static_cast<float>(448.0 / amax_want) * 0.9f;
    Fp8GemmOptions o;
    o.bias = with_bias ? bias.to(kCuda) : Tensor();
    o.out_scale = Tensor::from_floats({out_scale}, {1}).to(kCuda);
    o.amax_out = poisoned_device({1}, DType::F32);
    Tensor q = poisoned_device({m, n}, DType::E4M3);
    fp8_gemm(gpu, qx, false, qw, true, q, o);
    const double amax_got = o.amax_out.to(kCpu).to_floats()[0];
    check_error(std::fabs(amax_got - amax_want) / amax_want, kTolF32, with_bias ? "amax of D (bias)" : "amax of D");
    // Codes: those of quantizing the exact product, except where the GPU's accumulation
    // error (~1e-4 of the output's scale, see kTolF32) moves a value across a rounding
    // boundary: a few codes, one or a few FP8 quanta apart (measured: 22 and 34 of 6144).
    const Tensor want_f = Tensor::from_floats(want.to_floats(), {m, n});
    Tensor want_q = Tensor::empty({m, n}, DType::E4M3);
    quantize_per_tensor(cpu, want_f, Tensor::from_floats({out_scale}, {1}), want_q);
    const Tensor got_q = q.to(kCpu);
    const std::vector<float> got_v = got_q.to_floats(), want_v = want_q.to_floats();
    const double slack = 1e-3 * amax_want * out_scale;  // 10x the accumulation error, absolute
    int64_t off = 0;
    for (size_t i = 0; i < got_v.size(); ++i) {
      if (got_v[i] == want_v[i]) continue;
      ++off;
      EXPECT_LE(std::fabs(got_v[i] - want_v[i]), 0.126 * std::fabs(want_v[i]) + slack) << "element " << i;
    }
    std::printf("  E4M3 output%s: %lld of %lld codes differ from the exact product's\n", with_bias ? " (bias)" : "",
                static_cast<long long>(off), static_cast<long long>(m * n));
    // Norm-wise, those few steps (mostly at small values, where the quanta are small) stay
    // well below what a wrong scale or a lost bias would give (the bias is ~10% here).
    check_error(relative_error(got_q, want_q), 1e-2,
                with_bias ? "E4M3 codes vs exact product's (bias)" : "E4M3 codes vs exact product's");
    EXPECT_LE(off, m * n / 50);
  }
}

TEST(GpuFp8Gemm, IllegalArgumentsGiveClearErrors) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  const QuantizedTensor a40 = quantize_on(gpu, random_tensor({8, 40}, DType::F32, 1), DType::E4M3, 1.0f);
  Tensor c = poisoned_device({8, 8}, DType::F32);
  std::string msg = error_of([&] { fp8_gemm(gpu, a40, false, a40, true, c); });
  std::printf("  K = 40: %s\n", msg.c_str());
  EXPECT_NE(msg.find("multiple of 16"), std::string::npos) << msg;
  EXPECT_NE(msg.find("40"), std::string::npos) << msg;

  const QuantizedTensor e5 = quantize_on(gpu, random_tensor({16, 32}, DType::F32, 2), DType::E5M2, 1.0f);
  Tensor c16 = poisoned_device({16, 16}, DType::F32);
  msg = error_of([&] { fp8_gemm(gpu, e5, false, e5, true, c16); });
  std::printf("  E5M2 x E5M2: %s\n", msg.c_str());
  EXPECT_NE(msg.find("E5M2 x E5M2"), std::string::npos) << msg;

  const QuantizedTensor a = quantize_on(gpu, random_tensor({16, 32}, DType::F32, 3), DType::E4M3, 1.0f);
  const QuantizedTensor b20 = quantize_on(gpu, random_tensor({20, 32}, DType::F32, 4), DType::E4M3, 1.0f);
  Tensor c_bf16 = poisoned_device({16, 20}, DType::BF16);  // rows of 40 bytes
  msg = error_of([&] { fp8_gemm(gpu, a, false, b20, true, c_bf16); });
  std::printf("  BF16 c with N = 20: %s\n", msg.c_str());
  EXPECT_NE(msg.find("16 bytes"), std::string::npos) << msg;

  Fp8GemmOptions o;
  o.bias = random_tensor({16}, DType::F32, 5).to(kCuda);
  msg = error_of([&] { fp8_gemm(gpu, a, false, a, true, c16, o); });
  std::printf("  F32 bias: %s\n", msg.c_str());
  EXPECT_NE(msg.find("BF16"), std::string::npos) << msg;

  Tensor q = poisoned_device({16, 16}, DType::E4M3);
  msg = error_of([&] { fp8_gemm(gpu, a, false, a, true, q, 1.0f, 1.0f); });
  EXPECT_NE(msg.find("beta"), std::string::npos) << msg;

  // Block scaling needs M and N multiples of 4.
  const BlockQuantizedTensor x18 = quantize_blockwise_with_transpose(gpu, random_tensor({18, 128}, DType::F32, 6).to(kCuda),
                                                                      BlockScaling::tile_1x128(), DType::E4M3);
  const BlockQuantizedTensor w = quantize_blockwise_with_transpose(gpu, random_tensor({16, 128}, DType::F32, 7).to(kCuda),
                                                                    BlockScaling::tile_128x128(), DType::E4M3);
  Tensor c18 = poisoned_device({18, 16}, DType::F32);
  msg = error_of([&] { fp8_gemm_blockwise(gpu, x18, false, w, true, c18); });
  std::printf("  block-scaled M = 18: %s\n", msg.c_str());
  EXPECT_NE(msg.find("multiples of 4"), std::string::npos) << msg;
}

TEST(GpuFp8Gemm, NanPropagatesAndZerosStayZero) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  Tensor x = random_tensor({8, 64}, DType::F32, 1);
  x.set_item(3 * 64 + 10, NAN);
  const QuantizedTensor qx = quantize_on(gpu, x, DType::E4M3, 100.0f);
  const QuantizedTensor qw = quantize_on(gpu, random_tensor({16, 64}, DType::F32, 2), DType::E4M3, 100.0f);
  for (bool fast : {false, true}) {
    Fp8GemmOptions o;
    o.fast_accumulate = fast;
    Tensor c = poisoned_device({8, 16}, DType::F32);
    fp8_gemm(gpu, qx, false, qw, true, c, o);
    const std::vector<float> v = c.to(kCpu).to_floats();
    for (int64_t i = 0; i < 8; ++i)
      for (int64_t j = 0; j < 16; ++j) EXPECT_EQ(std::isnan(v[i * 16 + j]), i == 3) << i << ", " << j;
  }
  // Zeros: exact zeros out, amax 0.
  const QuantizedTensor z = quantize_on(gpu, Tensor::zeros({8, 64}, DType::F32), DType::E4M3, 1.0f);
  Fp8GemmOptions o;
  o.amax_out = poisoned_device({1}, DType::F32);
  Tensor q = poisoned_device({8, 16}, DType::E4M3);
  fp8_gemm(gpu, z, false, qw, true, q, o);
  for (float v : q.to(kCpu).to_floats()) EXPECT_EQ(v, 0.0f);
  EXPECT_EQ(o.amax_out.to(kCpu).to_floats()[0], 0.0f);
  const BlockQuantizedTensor zb = quantize_blockwise_with_transpose(gpu, Tensor::zeros({8, 128}, DType::F32, kCuda),
                                                                     BlockScaling::tile_1x128(), DType::E4M3);
  const BlockQuantizedTensor wb = quantize_blockwise_with_transpose(gpu, random_tensor({16, 128}, DType::F32, 3).to(kCuda),
                                                                     BlockScaling::tile_128x128(), DType::E4M3);
  Tensor cb = poisoned_device({8, 16}, DType::F32);
  fp8_gemm_blockwise(gpu, zb, false, wb, true, cb);
  for (float v : cb.to(kCpu).to_floats()) EXPECT_EQ(v, 0.0f);
}

TEST(GpuFp8Gemm, BlockScaledMatchesTheCpuReference) {
  REQUIRE_GPU();
  Context gpu = Context::cuda(), cpu = Context::cpu();
  const BlockScaling v = BlockScaling::tile_1x128(), t = BlockScaling::tile_128x128();
  struct Case { BlockScaling ba, bb; bool ta, tb; const char* name; };
  const Case cases[] = {{v, t, false, true, "y = x W^T"},
                        {v, t, false, false, "dx = dy W"},
                        {v, v, true, false, "dW = dy^T x"},
                        {t, v, false, true, "W first"}};
  struct Dims { int64_t m, k, n; };
  // K not a multiple of 128 (partial last block); K = 768 gives 6 K-blocks, padded to 8 for
  // the 128x128 scales; partial 128-row tiles.
  const Dims dims[] = {{20, 80, 48}, {128, 768, 256}, {260, 400, 132}};
  uint64_t seed = 500;
  for (const Case& cs : cases) {
    for (const Dims& d : dims) {
      const std::string what = std::string(cs.name) + " " + dims_string(d.m, d.k, d.n);
      const Tensor xa = random_tensor(cs.ta ? Shape{d.k, d.m} : Shape{d.m, d.k}, DType::F32, seed++, -3, 3);
      const Tensor xb = random_tensor(cs.tb ? Shape{d.n, d.k} : Shape{d.k, d.n}, DType::F32, seed++, -0.02f, 0.02f);
      const BlockQuantizedTensor ga = quantize_blockwise_with_transpose(gpu, xa.to(kCuda), cs.ba, DType::E4M3);
      const BlockQuantizedTensor gb = quantize_blockwise_with_transpose(gpu, xb.to(kCuda), cs.bb, DType::E4M3);
      const BlockQuantizedTensor ca = quantize_blockwise_with_transpose(cpu, xa, cs.ba, DType::E4M3);
      const BlockQuantizedTensor cb = quantize_blockwise_with_transpose(cpu, xb, cs.bb, DType::E4M3);
      EXPECT_EQ(bytes_of(ga.data_t), bytes_of(ca.data_t)) << what;
      EXPECT_EQ(bytes_of(ga.scale_inv_t), bytes_of(ca.scale_inv_t)) << what;
      EXPECT_EQ(bytes_of(gb.data), bytes_of(cb.data)) << what;
      EXPECT_EQ(bytes_of(gb.scale_inv), bytes_of(cb.scale_inv)) << what;
      // The copies the TN product uses, exactly, in F64.
      const int64_t ra = cs.ba.block_rows, rb = cs.bb.block_rows;
      const Tensor a_mk = cs.ta ? exact_values(ca.data_t, ca.scale_inv_t, ra, 128) : exact_values(ca.data, ca.scale_inv, ra, 128);
      const Tensor b_nk = cs.tb ? exact_values(cb.data, cb.scale_inv, rb, 128) : exact_values(cb.data_t, cb.scale_inv_t, rb, 128);
      const Tensor want = reference_tn(a_mk, b_nk, 1.0f, 0.0f, Tensor(), Tensor());
      Tensor c = poisoned_device({d.m, d.n}, DType::F32);
      const std::string msg = error_of([&] { fp8_gemm_blockwise(gpu, ga, cs.ta, gb, cs.tb, c); });
      if (!msg.empty()) {
        ADD_FAILURE() << what << ": " << msg;
        continue;
      }
      check_error(relative_error(c.to(kCpu), want), kTolF32, "blocks " + what);
      // The CPU reference op agrees with the exact product too.
      Tensor c_ref = Tensor::empty({d.m, d.n}, DType::F32);
      fp8_gemm_blockwise(cpu, ca, cs.ta, cb, cs.tb, c_ref);
      EXPECT_LT(relative_error(c_ref, want), 1e-6) << what;
      // Tensors without cached GEMM-ready scales (rearranged per call): the same bits.
      Tensor c2 = poisoned_device({d.m, d.n}, DType::F32);
      fp8_gemm_blockwise(gpu, device_copy(host_copy(ga)), cs.ta, device_copy(host_copy(gb)), cs.tb, c2);
      EXPECT_EQ(bytes_of(c2), bytes_of(c)) << what;
    }
  }
  // BF16 output, bias, beta = 1, alpha.
  const Tensor x = random_tensor({64, 384}, DType::F32, 900), w = random_tensor({96, 384}, DType::F32, 901);
  const BlockQuantizedTensor qx = quantize_blockwise_with_transpose(gpu, x.to(kCuda), v, DType::E4M3);
  const BlockQuantizedTensor qw = quantize_blockwise_with_transpose(gpu, w.to(kCuda), t, DType::E4M3);
  const Tensor a_mk = exact_values(qx.data, qx.scale_inv, 1, 128), b_nk = exact_values(qw.data, qw.scale_inv, 128, 128);
  const Tensor bias = random_tensor({96}, DType::BF16, 902);
  for (DType out : {DType::F32, DType::BF16}) {
    const Tensor c0 = random_tensor({64, 96}, out, 903);
    Tensor c = c0.to(kCuda);
    Fp8GemmOptions o;
    o.alpha = 0.5f;
    o.beta = 1.0f;
    o.bias = bias.to(kCuda);
    const std::string msg = error_of([&] { fp8_gemm_blockwise(gpu, qx, false, qw, true, c, o); });
    if (!msg.empty()) {
      ADD_FAILURE() << "blocks bias+beta " << dtype_name(out) << ": " << msg;
      continue;
    }
    check_error(relative_error(c.to(kCpu), reference_tn(a_mk, b_nk, 0.5f, 1.0f, c0, bias)),
                out == DType::BF16 ? kTolBf16 : kTolF32, std::string("blocks bias+beta=1 ") + dtype_name(out));
  }
}
