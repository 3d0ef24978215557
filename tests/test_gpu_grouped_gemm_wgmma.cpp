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
#include <cstring>
#include <numeric>
#include <sstream>

#if TESSERA_WITH_CUDA
#include "backend/cuda/grouped_gemm_wgmma.h"
#endif
#include "gpu_testing.h"
#include "tessera/core/numeric.h"
#include "tessera/ops/moe.h"

using namespace tessera;
using namespace tessera::testing;

// Everything below calls the CUDA backend directly: a build without it has nothing to test.
#if TESSERA_WITH_CUDA

namespace {

// A device BF16 tensor whose every bit is set (0xFFFF is a NaN).
Tensor poisoned_bf16(const Shape& shape) {
  Tensor host = Tensor::empty(shape, DType::BF16);
  std::memset(host.raw_data(), 0xFF, host.nbytes());
  return host.to(kCuda);
}

struct Check {
  double rel = 0;            // relative Frobenius error over the checked rows
  int64_t nan = 0;           // NaN in got where want is finite
  int64_t bad = 0;           // elements off by more than the loose per-element bound
  int64_t first_bad = -1;    // flat index of the first NaN or bad element
  float want_at = 0, got_at = 0;
  int64_t poison_written = 0;  // rows >= `rows` that are no longer all-ones bits
  std::string describe(int64_t n) const {
    std::ostringstream s;
    s << "relative error " << rel << ", " << nan << " NaN, " << bad << " elements off";
    if (first_bad >= 0)
      s << "; first at row " << first_bad / n << " column " << first_bad % n << ": expected " << want_at << ", got "
        << got_at;
    if (poison_written) s << "; " << poison_written << " elements written past the experts' rows";
    return s.str();
  }
};

// got and want [R, n] BF16 (any device): rows [0, rows) compared; with poison_tail, rows
// [rows, R) of got must still hold the poison bits. skip_row (>= 0) is left out.
Check compare(const Tensor& got_any, const Tensor& want_any, int64_t rows, bool poison_tail, int64_t skip_row = -1) {
  const Tensor got = got_any.to(Device::cpu()).contiguous(), want = want_any.to(Device::cpu()).contiguous();
  const int64_t n = got.size(1);
  const bf16* g = got.data<bf16>();
  const bf16* w = want.data<bf16>();
  double ss_want = 0;
  for (int64_t i = 0; i < rows * n; ++i) {
    if (i / n == skip_row) continue;
    const double v = w[i].to_float();
    ss_want += v * v;
  }
  const double rms = std::sqrt(ss_want / std::max<double>(1.0, static_cast<double>(rows * n)));
  Check c;
  double ss_diff = 0;
  for (int64_t i = 0; i < rows * n; ++i) {
    if (i / n == skip_row) continue;
    const float gv = g[i].to_float(), wv = w[i].to_float();
    const bool is_nan = std::isnan(gv) && !std::isnan(wv);
    const double d = static_cast<double>(gv) - wv;
    const bool off = !is_nan && std::fabs(d) > 0.1 * rms + 0.05 * std::fabs(wv);
    if (is_nan) ++c.nan;
    if (off) ++c.bad;
    if ((is_nan || off) && c.first_bad < 0) {
      c.first_bad = i;
      c.want_at = wv;
      c.got_at = gv;
    }
    if (!is_nan) ss_diff += d * d;
  }
  c.rel = c.nan ? INFINITY : std::sqrt(ss_diff / std::max(ss_want, 1e-30));
  if (poison_tail)
    for (int64_t i = rows * n; i < got.numel(); ++i) c.poison_written += g[i].bits != 0xFFFF;
  return c;
}

bool passed(const Check& c) { return c.rel < 1e-2 && c.nan == 0 && c.bad == 0 && c.poison_written == 0; }

std::string splits_string(const std::vector<int64_t>& splits) {
  std::ostringstream s;
  for (size_t i = 0; i < splits.size(); ++i) s << (i ? "," : "{") << splits[i];
  s << "}";
  return s.str();
}

Tensor device_offsets(const std::vector<int64_t>& splits) {
  std::vector<int64_t> off(splits.size() + 1, 0);
  for (size_t e = 0; e < splits.size(); ++e) off[e + 1] = off[e] + splits[e];
  return Tensor::from_ints(off, {static_cast<int64_t>(off.size())}, DType::I64).to(kCuda);
}

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

}  // namespace

TEST(GpuGroupedGemmWgmma, SmallShapesMatchTheCpuReference) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  struct Case {
    int64_t k, n;
    std::vector<int64_t> splits;
    int64_t extra_rows;  // rows of x / y past the splits
  };
  const std::vector<Case> cases = {
      {256, 256, {130, 0, 77}, 5},      {128, 192, {1, 129}, 0},          {512, 320, {0, 0, 333, 0}, 0},
      {256, 256, {100, 0, 57, 200}, 3}, {64, 64, {128, 256, 1, 127, 0}, 0}, {256, 384, {0, 0, 0, 0}, 4},
      // More tiles than SMs, not a multiple of two per CTA: ping-pong's second warpgroup works.
      {256, 1024, {1500, 0, 1333, 211}, 7},
  };
  uint64_t seed = 9100;
  for (const Case& cs : cases) {
    const int64_t e = static_cast<int64_t>(cs.splits.size());
    const int64_t used = std::accumulate(cs.splits.begin(), cs.splits.end(), int64_t{0});
    const int64_t rows = used + cs.extra_rows;
    const Tensor x = random_tensor({rows, cs.k}, DType::BF16, seed++);
    const Tensor w = random_tensor({e, cs.n, cs.k}, DType::BF16, seed++, -0.1f, 0.1f);
    Tensor ref = Tensor::empty({rows, cs.n}, DType::BF16);
    grouped_linear_forward(cpu, x, w, cs.splits, ref);
    const Tensor xd = x.to(kCuda), wd = w.to(kCuda);
    for (cuda::GroupedGemmVariant v : cuda::kGroupedGemmVariants) {
      Tensor y = poisoned_bf16({rows, cs.n});
      if (!cuda::grouped_gemm_wgmma_supported(xd, wd, y)) GTEST_SKIP() << "not a Hopper GPU: the kernel does not run";
      cuda::grouped_gemm_wgmma_forward(gpu.stream, xd, wd, device_offsets(cs.splits), y, v);
      const Check c = compare(y, ref, used, true);
      EXPECT_TRUE(passed(c)) << "direct call, K " << cs.k << " N " << cs.n << " splits " << splits_string(cs.splits)
                             << " extra rows " << cs.extra_rows << " variant " << name(v) << ": " << c.describe(cs.n);
    }
  }
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
    if (!cuda::grouped_gemm_wgmma_supported(xd, wd, y)) GTEST_SKIP() << "not a Hopper GPU: the kernel does not run";
    cuda::grouped_gemm_wgmma_forward(gpu.stream, xd, wd, device_offsets(splits), y, v);
    const Check c = compare(y, ref, rows, false, nan_row);
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
    Tensor want = poisoned_bf16({rows, n});
    cuda::set_grouped_gemm_backend(cuda::GroupedGemmBackend::Cublas);
    grouped_linear_forward(gpu, x, w, splits, want);
    for (cuda::GroupedGemmVariant v : cuda::kGroupedGemmVariants) {
      Tensor got = poisoned_bf16({rows, n});
      if (!cuda::grouped_gemm_wgmma_supported(x, w, got)) GTEST_SKIP() << "not a Hopper GPU: the kernel does not run";
      cuda::set_grouped_gemm_backend(cuda::GroupedGemmBackend::Own);
      cuda::set_grouped_gemm_variant(v);
      grouped_linear_forward(gpu, x, w, splits, got);
      cuda::set_grouped_gemm_backend(cuda::GroupedGemmBackend::Cublas);
      const Check c = compare(got, want, rows, false);
      EXPECT_TRUE(passed(c)) << "front end, splits " << splits_string(splits) << " variant " << name(v) << ": "
                             << c.describe(n);
    }
  }
}

// The shapes: 16384 expert rows, hidden 4096, ffn 14336, 8 experts.
TEST(GpuGroupedGemmWgmma, MixtralShapesMatchTheCublasLoop) {
  REQUIRE_GPU();
  Restore restore;
  Context gpu = Context::cuda();
  const int64_t e = 8, k = 4096, n = 14336, rows = 16384;
  Tensor x = Tensor::empty({rows, k}, DType::BF16, kCuda);
  Tensor w = Tensor::empty({e, n, k}, DType::BF16, kCuda);
  fill_uniform(gpu, x, -1, 1, 9400);
  fill_uniform(gpu, w, -0.02f, 0.02f, 9401);
  const std::vector<std::vector<int64_t>> all = {
      std::vector<int64_t>(8, 2048),
      {4096, 3072, 2048, 2048, 1536, 1536, 1024, 1024},
      {3001, 2500, 1999, 2100, 1701, 1555, 1099, 2429},  // no split a multiple of 128
      {0, 16384, 0, 0, 0, 0, 0, 0},
  };
  for (const auto& splits : all) {
    ASSERT_EQ(std::accumulate(splits.begin(), splits.end(), int64_t{0}), rows);
    Tensor want = poisoned_bf16({rows, n});
    cuda::set_grouped_gemm_backend(cuda::GroupedGemmBackend::Cublas);
    grouped_linear_forward(gpu, x, w, splits, want);
    for (cuda::GroupedGemmVariant v : kNewVariants) {
      Tensor got = poisoned_bf16({rows, n});
      if (!cuda::grouped_gemm_wgmma_supported(x, w, got)) GTEST_SKIP() << "not a Hopper GPU: the kernel does not run";
      cuda::grouped_gemm_wgmma_forward(gpu.stream, x, w, device_offsets(splits), got, v);
      const Check c = compare(got, want, rows, false);
      EXPECT_TRUE(passed(c)) << "Mixtral E 8 K 4096 N 14336, splits " << splits_string(splits) << " variant "
                             << name(v) << ": " << c.describe(n);
    }
  }
}

// The input gradient (dx = dy * w[e], w read N-major through wgmma's transpose bit), small
// shapes against the CPU reference; output widths that leave a partial last tile included.
TEST(GpuGroupedGemmWgmma, DgradSmallShapesMatchTheCpuReference) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  struct Case {
    int64_t n, k;  // w [E, n, k]: dy [rows, n] -> dx [rows, k]
    std::vector<int64_t> splits;
    int64_t extra_rows;
  };
  const std::vector<Case> cases = {
      {256, 256, {130, 0, 77}, 5},  {128, 192, {1, 129}, 0},          {512, 320, {0, 0, 333, 0}, 0},
      {64, 448, {100, 0, 57, 200}, 3}, {192, 64, {128, 256, 1, 127, 0}, 0},
      {256, 1088, {1500, 0, 1333, 211}, 7},  // many tiles, a partial last 256-wide tile
  };
  uint64_t seed = 9500;
  for (const Case& cs : cases) {
    const int64_t e = static_cast<int64_t>(cs.splits.size());
    const int64_t used = std::accumulate(cs.splits.begin(), cs.splits.end(), int64_t{0});
    const int64_t rows = used + cs.extra_rows;
    const Tensor dy = random_tensor({rows, cs.n}, DType::BF16, seed++);
    const Tensor w = random_tensor({e, cs.n, cs.k}, DType::BF16, seed++, -0.1f, 0.1f);
    Tensor ref = Tensor::empty({rows, cs.k}, DType::BF16);
    grouped_linear_backward_input(cpu, dy, w, cs.splits, ref);
    const Tensor dyd = dy.to(kCuda), wd = w.to(kCuda);
    for (cuda::GroupedGemmVariant v : cuda::kGroupedGemmVariants) {
      Tensor dx = poisoned_bf16({rows, cs.k});
      if (!cuda::grouped_gemm_wgmma_backward_input_supported(dyd, wd, dx))
        GTEST_SKIP() << "not a Hopper GPU: the kernel does not run";
      cuda::grouped_gemm_wgmma_backward_input(gpu.stream, dyd, wd, device_offsets(cs.splits), dx, v);
      const Check c = compare(dx, ref, used, true);
      EXPECT_TRUE(passed(c)) << "dgrad, N " << cs.n << " K " << cs.k << " splits " << splits_string(cs.splits)
                             << " extra rows " << cs.extra_rows << " variant " << name(v) << ": " << c.describe(cs.k);
    }
  }
}

// dx of the Mixtral up projection (w [8, 14336, 4096]): 16384 rows of dy [., 14336].
TEST(GpuGroupedGemmWgmma, DgradMixtralShapesMatchTheCublasLoop) {
  REQUIRE_GPU();
  Restore restore;
  Context gpu = Context::cuda();
  const int64_t e = 8, n = 14336, k = 4096, rows = 16384;
  Tensor dy = Tensor::empty({rows, n}, DType::BF16, kCuda);
  Tensor w = Tensor::empty({e, n, k}, DType::BF16, kCuda);
  fill_uniform(gpu, dy, -1, 1, 9600);
  fill_uniform(gpu, w, -0.02f, 0.02f, 9601);
  const std::vector<std::vector<int64_t>> all = {
      std::vector<int64_t>(8, 2048),
      {3001, 2500, 1999, 2100, 1701, 1555, 1099, 2429},
  };
  for (const auto& splits : all) {
    Tensor want = poisoned_bf16({rows, k});
    cuda::set_grouped_gemm_backend(cuda::GroupedGemmBackend::Cublas);
    grouped_linear_backward_input(gpu, dy, w, splits, want);
    for (cuda::GroupedGemmVariant v : cuda::kGroupedGemmVariants) {
      Tensor got = poisoned_bf16({rows, k});
      if (!cuda::grouped_gemm_wgmma_backward_input_supported(dy, w, got))
        GTEST_SKIP() << "not a Hopper GPU: the kernel does not run";
      cuda::grouped_gemm_wgmma_backward_input(gpu.stream, dy, w, device_offsets(splits), got, v);
      const Check c = compare(got, want, rows, false);
      EXPECT_TRUE(passed(c)) << "dgrad Mixtral E 8 N 14336 K 4096, splits " << splits_string(splits) << " variant "
                             << name(v) << ": " << c.describe(k);
    }
  }
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
    Tensor want = poisoned_bf16({rows, k});
    cuda::set_grouped_gemm_backend(cuda::GroupedGemmBackend::Cublas);
    grouped_linear_backward_input(gpu, dy, w, splits, want);
    for (cuda::GroupedGemmVariant v : cuda::kGroupedGemmVariants) {
      Tensor got = poisoned_bf16({rows, k});
      if (!cuda::grouped_gemm_wgmma_backward_input_supported(dy, w, got))
        GTEST_SKIP() << "not a Hopper GPU: the kernel does not run";
      cuda::set_grouped_gemm_backend(cuda::GroupedGemmBackend::Own);
      cuda::set_grouped_gemm_variant(v);
      grouped_linear_backward_input(gpu, dy, w, splits, got);
      cuda::set_grouped_gemm_backend(cuda::GroupedGemmBackend::Cublas);
      const Check c = compare(got, want, rows, false);
      EXPECT_TRUE(passed(c)) << "backward_input front end, splits " << splits_string(splits) << " variant " << name(v)
                             << ": " << c.describe(k);
    }
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
    const int64_t e = static_cast<int64_t>(cs.splits.size());
    const int64_t used = std::accumulate(cs.splits.begin(), cs.splits.end(), int64_t{0});
    const int64_t rows = used + cs.extra_rows;
    const Tensor x = random_tensor({rows, cs.k}, DType::BF16, seed++);
    const Tensor w = random_tensor({e, cs.n, cs.k}, DType::BF16, seed++, -0.1f, 0.1f);
    const Tensor wt = random_tensor({e, cs.k, cs.n}, DType::BF16, seed++, -0.1f, 0.1f);  // dgrad: N = k here
    Tensor ref = Tensor::empty({rows, cs.n}, DType::BF16), ref_dx = Tensor::empty({rows, cs.n}, DType::BF16);
    grouped_linear_forward(cpu, x, w, cs.splits, ref);
    grouped_linear_backward_input(cpu, x, wt, cs.splits, ref_dx);
    const Tensor xd = x.to(kCuda), wd = w.to(kCuda), wtd = wt.to(kCuda);
    for (cuda::GroupedGemmVariant v : cuda::kGroupedGemmClusterVariants) {
      Tensor y = poisoned_bf16({rows, cs.n}), dx = poisoned_bf16({rows, cs.n});
      if (!cuda::grouped_gemm_wgmma_supported(xd, wd, y)) GTEST_SKIP() << "not a Hopper GPU: the kernel does not run";
      cuda::grouped_gemm_wgmma_forward(gpu.stream, xd, wd, device_offsets(cs.splits), y, v);
      const Check c = compare(y, ref, used, true);
      EXPECT_TRUE(passed(c)) << "forward, K " << cs.k << " N " << cs.n << " splits " << splits_string(cs.splits)
                             << " variant " << name(v) << ": " << c.describe(cs.n);
      cuda::grouped_gemm_wgmma_backward_input(gpu.stream, xd, wtd, device_offsets(cs.splits), dx, v);
      const Check d = compare(dx, ref_dx, used, true);
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
      if (!cuda::grouped_gemm_wgmma_supported(x, w, got)) GTEST_SKIP() << "not a Hopper GPU: the kernel does not run";
      cuda::grouped_gemm_wgmma_forward(gpu.stream, x, w, device_offsets(splits), got, v);
      const Check c = compare(got, want, rows, false);
      EXPECT_TRUE(passed(c)) << "Mixtral forward, splits " << splits_string(splits) << " variant " << name(v) << ": "
                             << c.describe(n);
      cuda::grouped_gemm_wgmma_backward_input(gpu.stream, dy, w, device_offsets(splits), got_dx, v);
      const Check d = compare(got_dx, want_dx, rows, false);
      EXPECT_TRUE(passed(d)) << "Mixtral dgrad, splits " << splits_string(splits) << " variant " << name(v) << ": "
                             << d.describe(k);
    }
  }
}

#else

TEST(GpuGroupedGemmWgmma, NeedsTheCudaBackend) { GTEST_SKIP() << "tessera was built without CUDA"; }

#endif  // TESSERA_WITH_CUDA
