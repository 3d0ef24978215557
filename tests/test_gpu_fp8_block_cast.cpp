// The fused 1x128 block-scaled FP8 cast with transpose on CUDA (cuda::block_cast_transpose,
// used by fp8::quantize_blockwise_with_transpose) against the CPU reference and the GPU's
// two-pass path (quantize_blockwise, transpose_2d, quantize_blockwise, to_gemm_block_scales),
// byte for byte: data, data_t, scale_inv, scale_inv_t and both GEMM-ready scale grids.
// F32 and BF16 in, E4M3 and E5M2 out, power-of-two scales on and off; shapes tile-aligned
// (128x128, 256x384, 4096x1024), ragged multiples of 16 (272x320, 16x16, 144x48), empty, and
// ones the kernel does not take (18x128, 130x257, a misaligned view: the two-pass fallback must
// give the same bytes); random data with outliers, zero tensors, NaN and infinities.
// Outputs poisoned first. Skipped (saying so) where no GPU is present.
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "gpu_testing.h"
#include "tessera/fp8/block_quantized_tensor.h"
#include "tessera/ops/elementwise.h"
#include "tessera/ops/quantize.h"
#if TESSERA_WITH_CUDA
#include "backend/cuda/block_cast_transpose.h"
#endif

using namespace tessera;
using namespace tessera::testing;
using tessera::fp8::BlockQuantizedTensor;

namespace {

// Uniform values with a few outliers (single large elements, a large row and a large column),
// so that row and column blocks get very different scales.
Tensor outlier_tensor(int64_t m, int64_t k, DType t, uint64_t seed) {
  Tensor x = random_tensor({m, k}, DType::F32, seed, -2, 2);
  if (m > 0 && k > 0) {
    x.set_item(0, 3000.0f);
    x.set_item(m * k - 1, -1e-3f);
    x.set_item((m / 2) * k + k / 3, -45000.0f);
    x.slice(0, m / 3, m / 3 + 1).copy_from(random_tensor({1, k}, DType::F32, seed + 1, -900, 900));
    for (int64_t r = 0; r < m; r += 3) x.set_item(r * k + (k - 1) / 2, 1e-6f * float(r + 1));  // a tiny column
  }
  if (t == DType::F32) return x;
  Tensor out = Tensor::empty({m, k}, t);
  Context cpu = Context::cpu();
  cast(cpu, x, out);  // copy_from keeps dtypes; the BF16 inputs are rounded from the F32 ones
  return out;
}

std::string describe(int64_t m, int64_t k, DType in, DType fp8, bool pow2) {
  return std::to_string(m) + "x" + std::to_string(k) + " " + dtype_name(in) + " -> " + dtype_name(fp8) +
         (pow2 ? " pow2" : " plain");
}

// Every copy and scale grid of a (GPU) result against the CPU's, and the GEMM-ready grids
// against the GPU two-pass path's.
void expect_same(const BlockQuantizedTensor& got, const BlockQuantizedTensor& cpu, const BlockQuantizedTensor& two_pass) {
  EXPECT_EQ(bytes_of(got.data), bytes_of(cpu.data)) << "data";
  EXPECT_EQ(bytes_of(got.data_t), bytes_of(cpu.data_t)) << "data_t";
  EXPECT_EQ(bytes_of(got.scale_inv), bytes_of(cpu.scale_inv)) << "scale_inv";
  EXPECT_EQ(bytes_of(got.scale_inv_t), bytes_of(cpu.scale_inv_t)) << "scale_inv_t";
  ASSERT_TRUE(got.gemm_scale_inv.defined() && got.gemm_scale_inv_t.defined());
  EXPECT_EQ(bytes_of(got.gemm_scale_inv), bytes_of(two_pass.gemm_scale_inv)) << "gemm_scale_inv";
  EXPECT_EQ(bytes_of(got.gemm_scale_inv_t), bytes_of(two_pass.gemm_scale_inv_t)) << "gemm_scale_inv_t";
  EXPECT_EQ(bytes_of(two_pass.data), bytes_of(cpu.data)) << "two-pass data";
  EXPECT_EQ(bytes_of(two_pass.data_t), bytes_of(cpu.data_t)) << "two-pass data_t";
}

void check_shape_case(int64_t m, int64_t k, DType in, DType fp8, bool pow2, const Tensor& x, bool misaligned = false) {
  SCOPED_TRACE(describe(m, k, in, fp8, pow2) + (misaligned ? " misaligned" : ""));
  Context cpu = Context::cpu(), gpu = Context::cuda();
  const BlockScaling blocks = BlockScaling::tile_1x128(pow2);
  const Tensor xd = to_device(x, misaligned);
  const BlockQuantizedTensor want = fp8::quantize_blockwise_with_transpose(cpu, x, blocks, fp8);
  const BlockQuantizedTensor two = fp8::quantize_blockwise_with_transpose_two_pass(gpu, xd, blocks, fp8);
  const BlockQuantizedTensor got = fp8::quantize_blockwise_with_transpose(gpu, xd, blocks, fp8);
  expect_same(got, want, two);
#if TESSERA_WITH_CUDA
  // The kernel itself into poisoned outputs (the front end allocates fresh ones, which may
  // hold anything): every byte must be written.
  if (cuda::block_cast_transpose_supported(xd)) {
    const Shape gs = two.gemm_scale_inv.shape(), gst = two.gemm_scale_inv_t.shape();
    BlockQuantizedTensor p;
    p.data = poisoned_device({m, k}, fp8);
    p.data_t = poisoned_device({k, m}, fp8);
    p.scale_inv = poisoned_device(want.scale_inv.shape(), DType::F32);
    p.scale_inv_t = poisoned_device(want.scale_inv_t.shape(), DType::F32);
    p.gemm_scale_inv = poisoned_device(gs, DType::F32);
    p.gemm_scale_inv_t = poisoned_device(gst, DType::F32);
    cuda::block_cast_transpose(gpu.stream, xd, p.data, p.scale_inv, p.data_t, p.scale_inv_t, p.gemm_scale_inv,
                               p.gemm_scale_inv_t, pow2);
    expect_same(p, want, two);
    // Without the GEMM-ready grids.
    Tensor none, none_t;
    Tensor q = poisoned_device({m, k}, fp8), qt = poisoned_device({k, m}, fp8);
    Tensor s = poisoned_device(want.scale_inv.shape(), DType::F32), st = poisoned_device(want.scale_inv_t.shape(), DType::F32);
    cuda::block_cast_transpose(gpu.stream, xd, q, s, qt, st, none, none_t, pow2);
    EXPECT_EQ(bytes_of(q), bytes_of(want.data));
    EXPECT_EQ(bytes_of(qt), bytes_of(want.data_t));
    EXPECT_EQ(bytes_of(s), bytes_of(want.scale_inv));
    EXPECT_EQ(bytes_of(st), bytes_of(want.scale_inv_t));
  }
#endif
}

}  // namespace

TEST(GpuFp8BlockCast, FusedKernelTakesTheUsualShapes) {
  REQUIRE_GPU();
#if TESSERA_WITH_CUDA
  for (DType in : {DType::BF16, DType::F32}) {
    EXPECT_TRUE(cuda::block_cast_transpose_supported(Tensor::empty({272, 320}, in, kCuda)));
    EXPECT_TRUE(cuda::block_cast_transpose_supported(Tensor::empty({4096, 1024}, in, kCuda)));
    EXPECT_FALSE(cuda::block_cast_transpose_supported(Tensor::empty({18, 128}, in, kCuda)));
    EXPECT_FALSE(cuda::block_cast_transpose_supported(Tensor::empty({128, 40}, in, kCuda)));
  }
  EXPECT_FALSE(cuda::block_cast_transpose_supported(Tensor::empty({128, 128}, DType::F16, kCuda)));
#endif
}

TEST(GpuFp8BlockCast, MatchesTheCpuAndTheTwoPassPath) {
  REQUIRE_GPU();
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{128, 128}, {256, 384}, {4096, 1024}, {272, 320},
                                                           {16, 16},   {144, 48},  {0, 128},     {128, 0},
                                                           {18, 128},  {130, 257}};
  uint64_t seed = 1;
  for (auto [m, k] : shapes)
    for (DType in : {DType::BF16, DType::F32})
      for (DType fp8 : {DType::E4M3, DType::E5M2})
        for (bool pow2 : {true, false}) {
          if (m * k > 1000000 && (in == DType::F32 || fp8 == DType::E5M2)) continue;  // the large one: BF16 -> E4M3 only
          check_shape_case(m, k, in, fp8, pow2, outlier_tensor(m, k, in, seed++));
        }
  // A view whose rows are not 16-byte aligned: the two-pass path, the same bytes.
  check_shape_case(64, 256, DType::BF16, DType::E4M3, true, outlier_tensor(64, 256, DType::BF16, 99), true);
}

TEST(GpuFp8BlockCast, ZerosNanAndInfinities) {
  REQUIRE_GPU();
  for (DType in : {DType::BF16, DType::F32})
    for (DType fp8 : {DType::E4M3, DType::E5M2})
      for (bool pow2 : {true, false}) {
        check_shape_case(256, 384, in, fp8, pow2, Tensor::zeros({256, 384}, in));
        Tensor x = outlier_tensor(256, 384, in, 7);
        x.set_item(5 * 384 + 7, NAN);           // NaN amax: its row and column blocks get scale 1
        x.set_item(200 * 384 + 300, -NAN);      // a negative NaN: its sign must survive
        x.set_item(130 * 384 + 129, INFINITY);  // an infinite amax: scale 1, saturating codes
        x.set_item(10 * 384 + 250, -INFINITY);
        x.set_item(140 * 384 + 20, 1e38f);      // a huge amax: a tiny scale, the rest of its blocks underflow
        check_shape_case(256, 384, in, fp8, pow2, x);
      }
}

// The whole path through the front end is deterministic (no atomics): two runs, same bytes.
TEST(GpuFp8BlockCast, RunToRunIdentical) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  const Tensor x = outlier_tensor(512, 256, DType::BF16, 5).to(kCuda);
  const BlockQuantizedTensor a = fp8::quantize_blockwise_with_transpose(gpu, x, BlockScaling::tile_1x128(), DType::E4M3);
  const BlockQuantizedTensor b = fp8::quantize_blockwise_with_transpose(gpu, x, BlockScaling::tile_1x128(), DType::E4M3);
  EXPECT_EQ(bytes_of(a.data), bytes_of(b.data));
  EXPECT_EQ(bytes_of(a.data_t), bytes_of(b.data_t));
  EXPECT_EQ(bytes_of(a.gemm_scale_inv_t), bytes_of(b.gemm_scale_inv_t));
}
