// tessera's own Hopper grouped GEMM (backend/cuda/grouped_gemm_wgmma.cu), forward and dgrad, against the CPU
// reference (small shapes) and against the cuBLASLt per-expert loop of grouped_linear_forward
// (Mixtral shapes: E = 8, K = 4096, N = 14336, balanced, skewed and odd splits), every kernel
// variant (cuda::kGroupedGemmVariants: the round-1 baseline, the pipelined cooperative ones,
// ping-pong). The front ends (forward and backward_input) with the backend switched to Own
// must match the cuBLASLt loop. The cluster variants (kGroupedGemmClusterVariants) have
// their own tests at the end of the file. Outputs are poisoned (all bits set: NaN) first; rows past the
// splits must stay poisoned when the kernel is called directly (it never writes them) and be
// zero through grouped_linear_forward. A NaN in one expert's row reaches exactly that output
// row, never a neighbour's (tiles that run past an expert's end load those rows but must not
// store them). Tolerance: DESIGN.md's BF16 GEMM bound, relative Frobenius error < 1e-2, plus
// a loose per-element check that reports the first mismatching (row, column). Skipped where
// no GPU is present; on a GPU other than Hopper the kernel reports "unsupported" and the
// test skips too.
#include <cmath>
#include <numeric>
#include <string>

#if TESSERA_WITH_CUDA
#include "grouped_gemm_testing.h"
#endif
#include "gpu_testing.h"
#include "tessera/ops/moe.h"

using namespace tessera;
using namespace tessera::testing;

// Everything below calls the CUDA backend directly: a build without it has nothing to test.
#if TESSERA_WITH_CUDA

namespace {

struct Restore {
  cuda::GroupedGemmVariant variant = cuda::grouped_gemm_variant();
  ~Restore() {
    cuda::set_grouped_gemm_backend(cuda::GroupedGemmBackend::Cublas);
    cuda::set_grouped_gemm_variant(variant);
  }
};

// The variants new in round 2 (the Mixtral-sized checks skip the round-1 baseline, which
// passed them before, to keep the GPU time down).
const cuda::GroupedGemmVariant kNewVariants[] = {cuda::GroupedGemmVariant::Coop256, cuda::GroupedGemmVariant::Coop128,
                                                 cuda::GroupedGemmVariant::PingPong128};

const char* name(cuda::GroupedGemmVariant v) { return cuda::grouped_gemm_variant_name(v); }

constexpr const char* kNotHopper = "not a Hopper GPU: the kernel does not run";

}  // namespace

TEST(GpuGroupedGemmWgmma, SmallShapesMatchTheCpuReference) {
  REQUIRE_GPU();
  const std::vector<SmallGemmCase> cases = {  // {K, N, splits, rows of x / y past the splits}
      {256, 256, {130, 0, 77}, 5},      {128, 192, {1, 129}, 0},          {512, 320, {0, 0, 333, 0}, 0},
      {256, 256, {100, 0, 57, 200}, 3}, {64, 64, {128, 256, 1, 127, 0}, 0}, {256, 384, {0, 0, 0, 0}, 4},
      // More tiles than SMs, not a multiple of two per CTA: ping-pong's second warpgroup works.
      {256, 1024, {1500, 0, 1333, 211}, 7},
  };
  if (!expect_small_cases_match(GemmOp{false}, cases, 9100, "direct call,")) GTEST_SKIP() << kNotHopper;
}

TEST(GpuGroupedGemmWgmma, NanStaysInItsRow) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  const std::vector<int64_t> splits = {130, 0, 77};
  const int64_t rows = 207, k = 256, n = 256, nan_row = 140;  // row 10 of expert 2
  Tensor x = random_tensor({rows, k}, DType::BF16, 9200);
  const Tensor w = random_tensor({3, n, k}, DType::BF16, 9201, -0.1f, 0.1f);
  x.set_item(nan_row * k + 17, NAN);
  Tensor ref = Tensor::empty({rows, n}, DType::BF16);
  grouped_linear_forward(cpu, x, w, splits, ref);
  const Tensor xd = x.to(kCuda), wd = w.to(kCuda);
  for (cuda::GroupedGemmVariant v : cuda::kGroupedGemmVariants) {
    Tensor y = poisoned_bf16({rows, n});
    if (!cuda::grouped_gemm_wgmma_supported(xd, wd, y)) GTEST_SKIP() << kNotHopper;
    cuda::grouped_gemm_wgmma_forward(gpu.stream, xd, wd, device_offsets(splits), y, v);
    const GemmCheck c = compare_gemm(y, ref, rows, false, nan_row);
    EXPECT_TRUE(passed(c)) << "rows other than the NaN row, variant " << name(v) << ": " << c.describe(n);
    const Tensor yh = y.to(Device::cpu());
    int64_t finite = 0;
    for (int64_t j = 0; j < n; ++j) finite += !std::isnan(yh.item(nan_row * n + j));
    EXPECT_EQ(finite, 0) << "variant " << name(v) << ": the NaN row has " << finite << " finite outputs";
  }
}

// Through the op front end with the backend switched to Own: the same result as the cuBLASLt
// loop (Cublas) on the same data, rows past the splits zero.
TEST(GpuGroupedGemmWgmma, FrontEndMatchesTheCublasLoop) {
  REQUIRE_GPU();
  Restore restore;
  Context gpu = Context::cuda();
  const std::vector<std::vector<int64_t>> all = {{0, 300, 0, 45}, {100, 0, 57, 190}, {0, 0, 0, 333}};
  uint64_t seed = 9300;
  for (const auto& splits : all) {
    const int64_t k = 512, n = 640, rows = 350;
    const Tensor x = random_tensor({rows, k}, DType::BF16, seed++).to(kCuda);
    const Tensor w = random_tensor({4, n, k}, DType::BF16, seed++, -0.1f, 0.1f).to(kCuda);
    if (!expect_own_matches_cublas(GemmOp{false}, cuda::kGroupedGemmVariants, gpu, x, w, splits, n, true,
                                   "front end, splits " + splits_string(splits)))
      GTEST_SKIP() << kNotHopper;
  }
}

// The shapes: 16384 expert rows, hidden 4096, ffn 14336, 8 experts.
TEST(GpuGroupedGemmWgmma, MixtralShapesMatchTheCublasLoop) {
  REQUIRE_GPU();
  Restore restore;
  Context gpu = Context::cuda();
  const auto [x, w] = mixtral_operands(GemmOp{false}, gpu, 9400);
  const int64_t n = MixtralOperands::kFfn, rows = MixtralOperands::kRows;
  const std::vector<std::vector<int64_t>> all = {
      std::vector<int64_t>(8, 2048),
      {4096, 3072, 2048, 2048, 1536, 1536, 1024, 1024},
      {3001, 2500, 1999, 2100, 1701, 1555, 1099, 2429},  // no split a multiple of 128
      {0, 16384, 0, 0, 0, 0, 0, 0},
  };
  for (const auto& splits : all) {
    ASSERT_EQ(std::accumulate(splits.begin(), splits.end(), int64_t{0}), rows);
    if (!expect_own_matches_cublas(GemmOp{false}, kNewVariants, gpu, x, w, splits, n, false,
                                   "Mixtral E 8 K 4096 N 14336, splits " + splits_string(splits)))
      GTEST_SKIP() << kNotHopper;
  }
}

// The input gradient (dx = dy * w[e], w read N-major through wgmma's transpose bit), small
// shapes against the CPU reference; output widths that leave a partial last tile included.
TEST(GpuGroupedGemmWgmma, DgradSmallShapesMatchTheCpuReference) {
  REQUIRE_GPU();
  // {N, K, splits, extra rows}: w [E, N, K], dy [rows, N] -> dx [rows, K].
  const std::vector<SmallGemmCase> cases = {
      {256, 256, {130, 0, 77}, 5},  {128, 192, {1, 129}, 0},          {512, 320, {0, 0, 333, 0}, 0},
      {64, 448, {100, 0, 57, 200}, 3}, {192, 64, {128, 256, 1, 127, 0}, 0},
      {256, 1088, {1500, 0, 1333, 211}, 7},  // many tiles, a partial last 256-wide tile
  };
  if (!expect_small_cases_match(GemmOp{true}, cases, 9500, "dgrad,")) GTEST_SKIP() << kNotHopper;
}

// dx of the Mixtral up projection (w [8, 14336, 4096]): 16384 rows of dy [., 14336].
TEST(GpuGroupedGemmWgmma, DgradMixtralShapesMatchTheCublasLoop) {
  REQUIRE_GPU();
  Restore restore;
  Context gpu = Context::cuda();
  const auto [dy, w] = mixtral_operands(GemmOp{true}, gpu, 9600);
  const int64_t k = MixtralOperands::kHidden;
  const std::vector<std::vector<int64_t>> all = {
      std::vector<int64_t>(8, 2048),
      {3001, 2500, 1999, 2100, 1701, 1555, 1099, 2429},
  };
  for (const auto& splits : all)
    if (!expect_own_matches_cublas(GemmOp{true}, cuda::kGroupedGemmVariants, gpu, dy, w, splits, k, false,
                                   "dgrad Mixtral E 8 N 14336 K 4096, splits " + splits_string(splits)))
      GTEST_SKIP() << kNotHopper;
}

// grouped_linear_backward_input with the backend switched to Own (every variant as the
// process-wide choice): the same result as the cuBLASLt loop, rows past the splits zero.
TEST(GpuGroupedGemmWgmma, BackwardInputFrontEndMatchesTheCublasLoop) {
  REQUIRE_GPU();
  Restore restore;
  Context gpu = Context::cuda();
  const std::vector<std::vector<int64_t>> all = {{0, 300, 0, 45}, {100, 0, 57, 190}, {0, 0, 0, 333}};
  uint64_t seed = 9700;
  for (const auto& splits : all) {
    const int64_t n = 640, k = 512, rows = 350;  // w [4, n, k]: dy [rows, n] -> dx [rows, k]
    const Tensor dy = random_tensor({rows, n}, DType::BF16, seed++).to(kCuda);
    const Tensor w = random_tensor({4, n, k}, DType::BF16, seed++, -0.1f, 0.1f).to(kCuda);
    if (!expect_own_matches_cublas(GemmOp{true}, cuda::kGroupedGemmVariants, gpu, dy, w, splits, k, true,
                                   "backward_input front end, splits " + splits_string(splits)))
      GTEST_SKIP() << kNotHopper;
  }
}

// The cluster variants (TMA multicast of the w tile to a pair of CTAs), last in this file:
// a hang (the barrier guard traps after ~10 s) or fault would end the process. Pairs of M
// tiles where an expert has an odd number of them (the second CTA computes rows it never
// stores), a partial last N tile, empty experts; forward and dgrad; CPU reference and the
// cuBLASLt loop at the Mixtral shapes.
TEST(GpuGroupedGemmWgmmaCluster, SmallShapesMatchTheCpuReference) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  struct Case {
    int64_t k, n;  // forward: w [E, n, k]; dgrad: w [E, k, n], dy [rows, k] -> dx [rows, n]
    std::vector<int64_t> splits;
    int64_t extra_rows;
  };
  const std::vector<Case> cases = {
      {256, 256, {130, 0, 77}, 5},  {128, 192, {1, 129}, 0},         {512, 320, {0, 0, 333, 0}, 0},
      {64, 448, {100, 0, 57, 200}, 3}, {256, 1088, {1500, 0, 1333, 211}, 7},
  };
  uint64_t seed = 9800;
  for (const Case& cs : cases) {
    const auto [e, used, rows] = split_rows(cs.splits, cs.extra_rows);
    const Tensor x = random_tensor({rows, cs.k}, DType::BF16, seed++);
    const Tensor w = random_tensor({e, cs.n, cs.k}, DType::BF16, seed++, -0.1f, 0.1f);
    const Tensor wt = random_tensor({e, cs.k, cs.n}, DType::BF16, seed++, -0.1f, 0.1f);  // dgrad: N = k here
    Tensor ref = Tensor::empty({rows, cs.n}, DType::BF16), ref_dx = Tensor::empty({rows, cs.n}, DType::BF16);
    grouped_linear_forward(cpu, x, w, cs.splits, ref);
    grouped_linear_backward_input(cpu, x, wt, cs.splits, ref_dx);
    const Tensor xd = x.to(kCuda), wd = w.to(kCuda), wtd = wt.to(kCuda);
    for (cuda::GroupedGemmVariant v : cuda::kGroupedGemmClusterVariants) {
      Tensor y = poisoned_bf16({rows, cs.n}), dx = poisoned_bf16({rows, cs.n});
      if (!cuda::grouped_gemm_wgmma_supported(xd, wd, y)) GTEST_SKIP() << kNotHopper;
      cuda::grouped_gemm_wgmma_forward(gpu.stream, xd, wd, device_offsets(cs.splits), y, v);
      const GemmCheck c = compare_gemm(y, ref, used, true);
      EXPECT_TRUE(passed(c)) << "forward, K " << cs.k << " N " << cs.n << " splits " << splits_string(cs.splits)
                             << " variant " << name(v) << ": " << c.describe(cs.n);
      cuda::grouped_gemm_wgmma_backward_input(gpu.stream, xd, wtd, device_offsets(cs.splits), dx, v);
      const GemmCheck d = compare_gemm(dx, ref_dx, used, true);
      EXPECT_TRUE(passed(d)) << "dgrad, N " << cs.k << " K " << cs.n << " splits " << splits_string(cs.splits)
                             << " variant " << name(v) << ": " << d.describe(cs.n);
    }
  }
}

TEST(GpuGroupedGemmWgmmaCluster, MixtralShapesMatchTheCublasLoop) {
  REQUIRE_GPU();
  Restore restore;
  Context gpu = Context::cuda();
  const int64_t e = 8, k = 4096, n = 14336, rows = 16384;
  Tensor x = Tensor::empty({rows, k}, DType::BF16, kCuda);
  Tensor w = Tensor::empty({e, n, k}, DType::BF16, kCuda);
  Tensor dy = Tensor::empty({rows, n}, DType::BF16, kCuda);
  fill_uniform(gpu, x, -1, 1, 9900);
  fill_uniform(gpu, w, -0.02f, 0.02f, 9901);
  fill_uniform(gpu, dy, -1, 1, 9902);
  const std::vector<std::vector<int64_t>> all = {
      std::vector<int64_t>(8, 2048),
      {3001, 2500, 1999, 2100, 1701, 1555, 1099, 2429},
      {0, 16384, 0, 0, 0, 0, 0, 0},
  };
  for (const auto& splits : all) {
    Tensor want = poisoned_bf16({rows, n}), want_dx = poisoned_bf16({rows, k});
    cuda::set_grouped_gemm_backend(cuda::GroupedGemmBackend::Cublas);
    grouped_linear_forward(gpu, x, w, splits, want);
    grouped_linear_backward_input(gpu, dy, w, splits, want_dx);
    for (cuda::GroupedGemmVariant v : cuda::kGroupedGemmClusterVariants) {
      Tensor got = poisoned_bf16({rows, n}), got_dx = poisoned_bf16({rows, k});
      if (!cuda::grouped_gemm_wgmma_supported(x, w, got)) GTEST_SKIP() << kNotHopper;
      cuda::grouped_gemm_wgmma_forward(gpu.stream, x, w, device_offsets(splits), got, v);
      const GemmCheck c = compare_gemm(got, want, rows, false);
      EXPECT_TRUE(passed(c)) << "Mixtral forward, splits " << splits_string(splits) << " variant " << name(v) << ": "
                             << c.describe(n);
      cuda::grouped_gemm_wgmma_backward_input(gpu.stream, dy, w, device_offsets(splits), got_dx, v);
      const GemmCheck d = compare_gemm(got_dx, want_dx, rows, false);
      EXPECT_TRUE(passed(d)) << "Mixtral dgrad, splits " << splits_string(splits) << " variant " << name(v) << ": "
                             << d.describe(k);
    }
  }
}

#else

TEST(GpuGroupedGemmWgmma, NeedsTheCudaBackend) { GTEST_SKIP() << "tessera was built without CUDA"; }

#endif  // TESSERA_WITH_CUDA
