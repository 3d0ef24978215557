// tessera's own grouped FP8 weight-gradient kernel (backend/cuda/grouped_wgrad_fp8.cu), through
// grouped_linear_backward_weight_fp8 with set_moe_fp8_own_wgrad(true), against the same op on
// the CPU (the dequantized reference, on copies of the very codes) and against the cuBLASLt
// per-expert loop (set_moe_fp8_own_wgrad(false)). Random BF16 dy and x cast by the real row
// casts (padded transposed codes), split sizes with an expert without rows, a one-row expert
// (one k-block, 15 columns of padding), experts whose last k-block is partial (so the TMA
// zero fill past an expert's block is what keeps the next expert's codes out), and more
// tiles than SMs. Both FP8 pairings (E5M2 dy with E4M3 x, and E4M3 both), overwrite (experts
// without rows zeroed, dw poisoned first so an unwritten element fails) and accumulate (dw
// starts random and must become dw + the product).
// Tolerance: both sides add exact FP8 products in FP32, in different orders, so they agree to
// FP32 rounding of the sums: relative Frobenius error < 1e-5, and every element within 1e-4 of
// the largest |dw|. Skipped without a GPU; on a GPU other than Hopper the op falls back to
// cuBLASLt and the test says so.
#include <cmath>
#include <numeric>

#include "gpu_testing.h"
#include "tessera/ops/moe.h"

using namespace tessera;
using namespace tessera::testing;

#if TESSERA_WITH_CUDA
#include "backend/cuda/grouped_wgrad_fp8.h"
#endif

namespace {

struct OwnWgrad {
  bool was = moe_fp8_own_wgrad();
  ~OwnWgrad() { set_moe_fp8_own_wgrad(was); }
};

MoEFp8Rows to_cpu(const MoEFp8Rows& q) {
  MoEFp8Rows c = q;
  c.data = q.data.defined() ? q.data.to(Device::cpu()) : Tensor();
  c.data_t = q.data_t.to(Device::cpu());
  c.scale_inv = q.scale_inv.to(Device::cpu());
  return c;
}

struct Compared {
  double rel = 0, worst = 0, largest = 0;
};

Compared compare(const Tensor& got, const Tensor& want) {
  const std::vector<double> g = got.to(Device::cpu()).to_doubles(), w = want.to(Device::cpu()).to_doubles();
  Compared c;
  double d2 = 0, r2 = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    const double d = std::isnan(g[i]) ? INFINITY : std::fabs(g[i] - w[i]);
    d2 += d * d;
    r2 += w[i] * w[i];
    c.worst = std::max(c.worst, d);
    c.largest = std::max(c.largest, std::fabs(w[i]));
  }
  c.rel = std::sqrt(d2 / std::max(r2, 1e-30));
  return c;
}

void expect_close(const Tensor& got, const Tensor& want, const std::string& what) {
  const Compared c = compare(got, want);
  EXPECT_LT(c.rel, 1e-5) << what << ": relative error " << c.rel;
  EXPECT_LE(c.worst, 1e-4 * c.largest) << what << ": worst element off by " << c.worst << " (largest |dw| "
                                       << c.largest << ")";
}

struct Case {
  int64_t out, in;
  std::vector<int64_t> splits;
};

}  // namespace

TEST(GpuMoeWgradFp8, OwnKernelMatchesCpuAndCublas) {
  REQUIRE_GPU();
  OwnWgrad restore;
  Context cpu = Context::cpu(), gpu = Context::cuda();
  const Case cases[] = {
      {256, 512, {0, 130, 1, 300, 16}},
      // 8 x 4 tiles an expert, 6 experts: more tiles than SMs; 2048 rows = 16 whole k-blocks.
      {1024, 1024, {2048, 0, 700, 2048, 333, 129, 1}},
  };
  MoEFp8Options o;  // current scaling, hybrid format
  bool ran_own = false;
  uint64_t seed = 9700;
  for (const Case& cs : cases) {
    const int64_t rows = std::accumulate(cs.splits.begin(), cs.splits.end(), int64_t{0}) + 3;  // + rows past the splits
    const int64_t experts = static_cast<int64_t>(cs.splits.size());
    for (const bool hybrid : {true, false}) {
      const DType dy_type = hybrid ? DType::E5M2 : DType::E4M3;
      const Tensor dy = random_tensor({rows, cs.out}, DType::BF16, seed++).to(kCuda);
      const Tensor x = random_tensor({rows, cs.in}, DType::BF16, seed++).to(kCuda);
      const MoEFp8Rows qdy = moe_fp8_quantize_rows(gpu, dy, cs.splits, dy_type, o);
      const MoEFp8Rows qx = moe_fp8_quantize_rows(gpu, x, cs.splits, DType::E4M3, o);
      const MoEFp8Rows cdy = to_cpu(qdy), cx = to_cpu(qx);
#if TESSERA_WITH_CUDA
      int64_t with_rows = 0;
      for (int64_t n : cs.splits) with_rows += n > 0;
      Tensor probe = Tensor::empty({experts, cs.out, cs.in}, DType::F32, kCuda);
      ran_own = ran_own || cuda::grouped_wgrad_fp8_supported(qdy.data_t, qx.data_t, probe, with_rows);
#endif
      for (const bool accumulate : {false, true}) {
        const std::string what = std::string(hybrid ? "E5M2 x E4M3" : "E4M3 x E4M3") + ", out " +
                                 std::to_string(cs.out) + ", in " + std::to_string(cs.in) +
                                 (accumulate ? ", accumulating" : ", overwriting");
        const Tensor start = accumulate ? random_tensor({experts, cs.out, cs.in}, DType::F32, seed++)
                                        : poisoned_device({experts, cs.out, cs.in}, DType::F32).to(Device::cpu());
        Tensor want = accumulate ? start.clone() : Tensor::zeros({experts, cs.out, cs.in}, DType::F32);
        grouped_linear_backward_weight_fp8(cpu, cdy, cx, want, accumulate);
        set_moe_fp8_own_wgrad(true);
        Tensor own = start.to(kCuda);
        grouped_linear_backward_weight_fp8(gpu, qdy, qx, own, accumulate);
        set_moe_fp8_own_wgrad(false);
        Tensor lt = start.to(kCuda);
        grouped_linear_backward_weight_fp8(gpu, qdy, qx, lt, accumulate);
        expect_close(own, want, what + ", own kernel against the CPU");
        expect_close(own, lt, what + ", own kernel against cuBLASLt");
        expect_close(lt, want, what + ", cuBLASLt against the CPU");
      }
    }
  }
  if (!ran_own) GTEST_SKIP() << "not a Hopper GPU: the own kernel did not run (the cuBLASLt checks passed)";
}

// Running it twice gives the same bits (a fixed tile order and per-tile sums; no atomics).
TEST(GpuMoeWgradFp8, OwnKernelIsDeterministic) {
  REQUIRE_GPU();
  OwnWgrad restore;
  set_moe_fp8_own_wgrad(true);
  Context gpu = Context::cuda();
  const std::vector<int64_t> splits = {500, 0, 1000, 37};
  const int64_t rows = 1537;
  MoEFp8Options o;
  const MoEFp8Rows qdy =
      moe_fp8_quantize_rows(gpu, random_tensor({rows, 512}, DType::BF16, 9800).to(kCuda), splits, DType::E5M2, o);
  const MoEFp8Rows qx =
      moe_fp8_quantize_rows(gpu, random_tensor({rows, 768}, DType::BF16, 9801).to(kCuda), splits, DType::E4M3, o);
  Tensor a = Tensor::empty({4, 512, 768}, DType::F32, kCuda), b = Tensor::empty({4, 512, 768}, DType::F32, kCuda);
  grouped_linear_backward_weight_fp8(gpu, qdy, qx, a, false);
  grouped_linear_backward_weight_fp8(gpu, qdy, qx, b, false);
  EXPECT_EQ(bytes_of(a), bytes_of(b));
}
